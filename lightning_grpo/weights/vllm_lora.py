"""Adapter-only weight sync to a vLLM server with LoRA enabled: each push loads the adapter as a new model name.

A vLLM server started with `--enable-lora` (and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`) serves a LoRA adapter loaded
at run time under a name of its own. `VLLMLoRAWeightTransfer` follows TRL's async trainer (`_sync_weight_lora`, TRL
PR #7017): each push writes the adapter (PEFT's format) to a new folder under `/dev/shm` and loads it as
`<lora_name>-v<version>`; the rollout loop requests that name for the version it was told about (TRL's `lora_name`
loop argument), so a new name is also a new prefix-cache namespace. Adapters more than `max_staleness + 1` versions
old are unloaded (requests may still name that many), and their files removed one push later (vLLM reads them
lazily). No base weight moves: a push is a few megabytes instead of the whole model.
"""

from __future__ import annotations

import contextlib
import copy
import os
import secrets
import shutil
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from .._trl import round_lora_rank, select_adapter_sync, validate_lora_for_vllm_sync
from .adapters import adapter_config
from .vllm_http import VLLMHTTPWeightTransfer, _unique_tensors

ADAPTER_FILE = "adapter_model.safetensors"


class VLLMLoRAWeightTransfer(VLLMHTTPWeightTransfer):
    """Trainer side of the adapter-only sync to a vLLM server with LoRA; TRL's `WeightTransferProtocol`.

    `WeightSync(adapter_only=True)` streams it the adapter's tensors (`adapters.adapter_tensors`). Only rank 0 uses
    it. The server must see `shm_dir` at the same path, run with `VLLM_SERVER_DEV_MODE=1` (for `/pause` and
    `/server_info`), `--enable-lora --max-lora-rank R --max-loras M` with `R` at least the adapter's rank (rounded up
    to one vLLM accepts) and `M >= max_staleness + 2`, and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`:
    `VLLMServer(model, max_lora_rank=R)` starts it that way.

    Args:
        server_url: the vLLM server, e.g. `"http://127.0.0.1:8000"`.
        model: the LoRA policy (a `peft.PeftModel`); its active adapter is what each push sends.
        max_staleness: policy versions a request may lag (`GRPODataModule(max_staleness=...)`): that many older
            adapters stay loaded.
        lora_name: the prefix of the served adapter names; default a name unique to this transfer, so a resumed run
            never reuses a name a running server already holds.
        shm_dir, server_timeout, request_timeout: as for `VLLMHTTPWeightTransfer`.

    Raises:
        ValueError: the policy is not a LoRA policy, or its adapter cannot be served by vLLM (TRL's
            `validate_lora_for_vllm_sync`: DoRA, `modules_to_save`, trained biases, the head or embeddings targeted).
        RuntimeError: (from `init_weight_transfer`) the server has no LoRA support, or too low a `--max-lora-rank`
            or `--max-loras`; the message names the flags to restart it with.

    Example::

        transfer = VLLMLoRAWeightTransfer(server.url, model=peft_policy)
        sync = WeightSync(transfer, adapter_only=True)
        sync.push(peft_policy)   # the server serves "<transfer.lora_name>-v0"
    """

    def __init__(
        self,
        server_url: str = "http://localhost:8000",
        *,
        model: torch.nn.Module,
        max_staleness: int = 2,
        lora_name: str | None = None,
        shm_dir: str | os.PathLike | None = None,
        server_timeout: float = 240.0,
        request_timeout: float = 600.0,
    ) -> None:
        from ..models.lora import is_peft_model

        if not is_peft_model(model):
            raise ValueError(
                "`vllm_transfer='lora'` pushes a LoRA adapter, but the policy has none: train it with "
                "`GRPOModule(peft_config=LoraConfig(...))`, or use vllm_transfer='http' for merged weights."
            )
        validate_lora_for_vllm_sync(model)
        super().__init__(
            server_url, model=None, shm_dir=shm_dir, server_timeout=server_timeout, request_timeout=request_timeout
        )
        self.policy = model
        self.max_staleness = max_staleness
        self.lora_name = lora_name or f"lgrpo-lora-{os.getpid()}-{secrets.token_hex(3)}"
        self._config = copy.deepcopy(adapter_config(model))
        self._config.inference_mode = True
        self._loaded: deque[int] = deque()  # versions loaded on the server, oldest first
        self._unloaded: deque[int] = deque()  # versions unloaded whose files are still on disk
        self._adapter_folders: dict[int, Path] = {}

    def served_name(self, version: int) -> str:
        """The model name requests send for the adapter of `version`."""
        return f"{self.lora_name}-v{version}"

    # -- protocol --------------------------------------------------------------------------------------------------

    def init_weight_transfer(self) -> None:
        """Wait for the server's `/health` and check that it can serve this adapter with `max_staleness` in flight."""
        if self._ready:
            return
        self._wait_healthy()
        response = self._session.get(
            f"{self.server_url}/server_info", params={"config_format": "json"}, timeout=self.request_timeout
        )
        if response.status_code != 200:
            raise RuntimeError(
                f"VLLMLoRAWeightTransfer: GET {self.server_url}/server_info answered {response.status_code}; start "
                "the server with VLLM_SERVER_DEV_MODE=1 (`python -m lightning_grpo.serving.vllm_launcher` does)."
            )
        try:
            servable = select_adapter_sync(response.json()["vllm_config"], self.policy, self.max_staleness)
        except ValueError as error:
            raise RuntimeError(f"VLLMLoRAWeightTransfer: {error}") from error
        if not servable:
            rank = round_lora_rank(max([self._config.r, *self._config.rank_pattern.values()]))
            raise RuntimeError(
                f"The vLLM server at {self.server_url} cannot load LoRA adapters at run time. Restart it with "
                f"`--enable-lora --max-lora-rank {rank} --max-loras {self.max_staleness + 2}` and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (`python -m lightning_grpo.serving.vllm_launcher --max-lora-rank "
                f"{rank}` does), or push merged weights with vllm_transfer='http'."
            )
        self._ready = True

    def send_weights(
        self, iterator: Iterable[tuple[str, torch.Tensor]], version: int | None = None, *, partial: bool = False
    ) -> None:
        """Write the adapter `(name, tensor)` pairs (PEFT's saved names) to a new folder and load it on the server as
        `served_name(version)`; call between `pause()` and `resume()`. An adapter is always sent whole.

        Raises:
            ValueError: no tensors, or `partial` (an adapter push has nothing to leave out).
            RuntimeError: the server refused the adapter (its answer is in the message).
        """
        from safetensors.torch import save_file

        if partial:
            raise ValueError("`VLLMLoRAWeightTransfer` sends the whole adapter each time: leave `changed_only` unset.")
        tensors = _unique_tensors(iterator)
        if not tensors:
            raise ValueError("`VLLMLoRAWeightTransfer.send_weights` got no tensors. Pass the adapter's tensors.")
        version = (self._loaded[-1] + 1 if self._loaded else 0) if version is None else int(version)
        self.pause()
        started = time.monotonic()
        self._pushes += 1
        folder = self.shm_dir / f"{self._prefix}-{self._pushes}" / self.served_name(version)
        folder.mkdir(parents=True, exist_ok=False)
        self._adapter_folders[version] = folder
        save_file(tensors, str(folder / ADAPTER_FILE))
        self._config.save_pretrained(str(folder))
        self._post("/v1/load_lora_adapter", json={"lora_name": self.served_name(version), "lora_path": str(folder)})
        self._loaded.append(version)
        self.version = version
        self.last_push_s = time.monotonic() - started

    def resume(self) -> None:
        """Resume generation, then unload adapters older than `max_staleness + 1` versions (files: one push later)."""
        super().resume()
        while len(self._loaded) > self.max_staleness + 1:
            stale = self._loaded.popleft()
            self._unload(stale)
            self._unloaded.append(stale)
        while len(self._unloaded) > 1:
            self._remove(self._unloaded.popleft())

    def destroy(self) -> None:
        """Unload every adapter this transfer loaded, remove their files, resume a paused server; idempotent."""
        with contextlib.suppress(RuntimeError):
            super().resume()
        while self._loaded:
            self._unload(self._loaded.popleft())
        for version in list(self._adapter_folders):
            self._remove(version)
        self._unloaded.clear()
        super().destroy()

    def abandon(self) -> None:
        """Forget a server that is gone: remove the adapters' files without contacting it; idempotent."""
        self._loaded.clear()
        self._unloaded.clear()
        for version in list(self._adapter_folders):
            self._remove(version)
        super().abandon()

    # -- helpers ---------------------------------------------------------------------------------------------------

    def _unload(self, version: int) -> None:
        with contextlib.suppress(RuntimeError):  # already gone (a restarted server) is not an error
            self._post("/v1/unload_lora_adapter", json={"lora_name": self.served_name(version)})

    def _remove(self, version: int) -> None:
        folder = self._adapter_folders.pop(version, None)
        if folder is not None:
            shutil.rmtree(folder.parent, ignore_errors=True)

    def __getstate__(self) -> Any:
        raise TypeError("A `VLLMLoRAWeightTransfer` stays in the trainer process (rank 0); it cannot be pickled.")
