"""`make_weight_transfer`: the weight-transfer backend a generator needs, and whether it takes every parameter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, get_args

import torch

from .._trl import nccl_weight_transfer_client
from ..options import DataModuleOptions, Generator, VLLMTransfer
from ..serving.server_urls import server_stale_after_s, server_urls
from .parameters import ChangedScope, generator_manifest

VLLM_TRANSFERS: tuple[VLLMTransfer, ...] = get_args(VLLMTransfer)


def make_weight_transfer(
    generator: Generator,
    model: torch.nn.Module,
    *,
    vllm_server_url: str | Sequence[str] = "http://localhost:8000",
    vllm_server_timeout: float = 240.0,
    weight_sync_timeout: int = 1800,
    vllm_transfer: VLLMTransfer = "auto",
    max_staleness: int = 2,
    request_timeout: float = 600.0,
    vllm_failover: bool = False,
) -> Any:
    """The weight-transfer backend for a generator: shared memory for "embedded", HTTP or NCCL for "vllm".

    For "vllm", `vllm_transfer` picks how weights reach the server:

    - `"http"`: `VLLMHTTPWeightTransfer` writes safetensors to `/dev/shm` and has the server reload them through its
      development endpoints. It needs no GPU and no vllm in this environment, only a server on this machine started
      by `python -m lightning_grpo.serving.vllm_launcher` (or with its worker extension and `VLLM_SERVER_DEV_MODE=1`).
    - `"nccl"`: TRL's `WeightTransferClient`, which streams the weights over NCCL into a server started with
      `VLLM_SERVER_DEV_MODE=1` and `--weight-transfer-config '{"backend":"nccl"}'`. Its manifest is TRL's
      (`uses_trainable_only` is then True: `WeightSync` must stream the same parameters). It needs vllm installed
      here and a GPU; this path cannot run on a CPU machine and is wired up as TRL's trainer wires it.
    - `"lora"`: `VLLMLoRAWeightTransfer` loads a LoRA policy's adapter on a server started with `--enable-lora`
      (`VLLMServer(max_lora_rank=...)`), a new adapter name per push; no base weight moves. `WeightSync` then streams
      the adapter (`uses_adapter_only`).
    - `"auto"` (default): NCCL when CUDA is available, else HTTP.

    A LoRA policy reaches the embedded generator and the "http"/"nccl" paths as merged weights under the base model's
    names; after the first push, shared memory and "http" receive only the layers the adapters change
    (`changed_scope`).

    With several servers in `vllm_server_url`, a `VLLMFanOutWeightTransfer` pushes to all of them (see
    `weights/vllm_fanout.py`; "nccl" is refused: start one server with data parallelism instead).

    Args:
        generator: "embedded" or "vllm".
        model: the unwrapped policy; its parameters are the manifest (names, dtypes, shapes; no gather needed).
        vllm_server_url: the vLLM server, or a list of them ("vllm" only).
        vllm_server_timeout: seconds to wait for the server to be reachable ("vllm" only).
        weight_sync_timeout: seconds allowed for the NCCL handshake and each transfer ("nccl" only).
        vllm_transfer: "auto", "http", "nccl" or "lora" ("vllm" only).
        max_staleness: policy versions a request may lag, so how many adapters stay loaded ("lora" only).
        request_timeout: seconds one control request (pause, reload, resume) may take ("http", "lora").
        vllm_failover: with several servers, go on with the others when one fails a push.

    Raises:
        ValueError: an unknown generator or `vllm_transfer`; several servers over NCCL.
        ImportError: "nccl" without vllm installed.

    Example::

        from lightning_grpo import make_weight_transfer
        from lightning_grpo.models import load_policy

        transfer = make_weight_transfer("embedded", load_policy("tiny-random"))  # shared memory
        transfer.destroy()
    """
    kind = transfer_kind(generator, vllm_transfer)
    if kind == "shared_memory":
        from .shared_memory import SharedMemoryWeightTransfer

        return SharedMemoryWeightTransfer(model)
    urls = server_urls(vllm_server_url)
    if len(urls) > 1:
        from .vllm_fanout import fan_out

        return fan_out(
            kind, urls, model, server_timeout=vllm_server_timeout, request_timeout=request_timeout,
            max_staleness=max_staleness, failover=vllm_failover,
        )  # fmt: skip
    url = urls[0]
    if kind == "http":
        from .vllm_http import VLLMHTTPWeightTransfer

        return VLLMHTTPWeightTransfer(
            url, model=model, server_timeout=vllm_server_timeout, request_timeout=request_timeout
        )
    if kind == "vllm_lora":
        from .vllm_lora import VLLMLoRAWeightTransfer

        return VLLMLoRAWeightTransfer(
            url, model=model, max_staleness=max_staleness, server_timeout=vllm_server_timeout,
            request_timeout=request_timeout,
        )  # fmt: skip
    return nccl_weight_transfer_client(url, vllm_server_timeout, nccl_manifest(model), weight_sync_timeout)


def transfer_kind(generator: Generator, vllm_transfer: VLLMTransfer = "auto") -> str:
    """`"shared_memory"`, `"http"`, `"nccl"` or `"vllm_lora"`: the backend `make_weight_transfer` builds (every rank
    can ask).

    Raises:
        ValueError: an unknown generator or `vllm_transfer`.
    """
    if generator == "embedded":
        return "shared_memory"
    if generator != "vllm":
        raise ValueError(
            f"`make_weight_transfer(generator={generator!r})` is not a generator. Use 'embedded' or 'vllm'."
        )
    if vllm_transfer not in VLLM_TRANSFERS:
        raise ValueError(
            f"`make_weight_transfer(vllm_transfer={vllm_transfer!r})`: use one of {', '.join(map(repr, VLLM_TRANSFERS))}."
        )
    if vllm_transfer == "lora":
        return "vllm_lora"
    if vllm_transfer == "http" or (vllm_transfer == "auto" and not torch.cuda.is_available()):
        return "http"
    return "nccl"


def uses_trainable_only(kind: str) -> bool:
    """Whether a backend of `kind` takes TRL's vLLM manifest (trainable parameters only) rather than all of them."""
    return kind == "nccl"


def uses_adapter_only(kind: str) -> bool:
    """Whether a backend of `kind` takes a LoRA policy's adapter rather than its (merged) weights."""
    return kind == "vllm_lora"


def changed_scope(kind: str) -> ChangedScope | None:
    """How a backend of `kind` takes partial pushes after the first one: `"tensors"` (shared memory: exactly the
    tensors that changed), `"modules"` (vLLM over HTTP: whole fused layers), or None (every push is whole: TRL's NCCL
    manifest is fixed, and an adapter push has nothing to leave out)."""
    scopes: dict[str, ChangedScope] = {"shared_memory": "tensors", "http": "modules"}
    return scopes.get(kind)


def nccl_manifest(model: torch.nn.Module) -> dict[str, list]:
    """TRL's NCCL manifest: names, dtypes and (global) shapes of the parameters `WeightSync(trainable_only=True)`
    streams, in its order (a LoRA policy's base parameters, which it streams merged)."""
    names, dtype_names, shapes = [], [], []
    for name, param in generator_manifest(model, trainable_only=True):
        names.append(name)
        dtype_names.append(str(param.dtype).removeprefix("torch."))
        shapes.append(list(param.shape))
    return {"names": names, "dtype_names": dtype_names, "shapes": shapes}


def build_weight_sync(options: DataModuleOptions, weight_transfer: Any, *, is_global_zero: bool) -> Any:
    """The data module's `WeightSync`: on rank 0 with `weight_transfer` (yours) or the backend that `generator` and
    `vllm_transfer` name; elsewhere with none (only rank 0 talks to the generator)."""
    import functools

    from .sync import WeightSync

    generator, vllm = options.generation.generator, options.vllm
    kind = transfer_kind(generator, vllm.vllm_transfer)
    transfer = None
    if is_global_zero:
        transfer = weight_transfer or functools.partial(
            make_weight_transfer,
            generator,
            vllm_server_url=vllm.vllm_server_url,
            vllm_transfer=vllm.vllm_transfer,
            max_staleness=options.steps.max_staleness,
            vllm_server_timeout=vllm.vllm_server_timeout,
            # a server that stops answering fails within the heartbeat limit
            request_timeout=server_stale_after_s(options.generation),
            vllm_failover=vllm.vllm_failover,
        )
    return WeightSync(
        transfer,
        trainable_only=uses_trainable_only(kind),
        changed_only=changed_scope(kind) if weight_transfer is None else None,  # yours may want every tensor
        adapter_only=uses_adapter_only(kind),
    )
