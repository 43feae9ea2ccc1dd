"""Weight sync to a vLLM server over HTTP and a shared folder: TRL's weight-transfer protocol without NCCL.

TRL pushes weights to vLLM over NCCL, which needs a GPU on both sides. `VLLMHTTPWeightTransfer` needs neither: the
trainer writes the policy as one safetensors file into a fresh folder under `/dev/shm` (RAM), and the server loads it
through its development endpoints:

    POST /pause?mode=keep          in-flight requests are frozen, not dropped; they resume on the new weights
    POST /collective_rpc           {"method": "reload_from_path", "kwargs": {"path": <folder>}}: load the file and
                                   re-pack a tied output layer (the worker extension `serving/vllm_worker_ext.py`)
    POST /reset_prefix_cache       cached prefixes were computed with the old weights
    POST /resume
    remove the previous folder

The server must be on this machine (or see `shm_dir` at the same path), run with `VLLM_SERVER_DEV_MODE=1`, and load
the worker extension; `VLLMServer` (`serving/vllm_launcher.py`) starts it that way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import requests
import torch

log = logging.getLogger(__name__)

_RPC_METHOD = "reload_from_path"
_PROBE_METHOD = "lightning_grpo_extension"


class VLLMHTTPWeightTransfer:
    """Trainer side of the weight sync to a vLLM server without NCCL; TRL's `WeightTransferProtocol`.

    `pause()` pauses the server keeping in-flight requests (each token's logprob still matches the weights that
    sampled it), `send_weights()` writes the tensors to a new folder and has the server load them, `resume()` resumes
    it and `destroy()` removes the folders. Only rank 0 uses it. Tensors sharing storage (an `lm_head` tied to the
    embeddings) are written once, under the first name, as the server's checkpoint format expects.

    Without the worker extension on the server (a server you launched yourself), an untied model falls back to vLLM's
    stock `reload_weights`; a tied one raises, because vLLM's CPU backend would keep sampling with the old output
    layer.

    Args:
        server_url: the vLLM server, e.g. `"http://127.0.0.1:8000"`.
        model: the policy, only to know whether its output layer is tied to its embeddings (None: assume it may be).
        shm_dir: parent of the weight folders; default `/dev/shm` (RAM) when it exists, else the temp folder. The server
            must see it at the same path.
        server_timeout: seconds `init_weight_transfer()` waits for the server's `/health`.
        request_timeout: seconds one control request (pause, reload, resume) may take.

    Raises:
        RuntimeError: (from the methods) the server is unreachable, or an endpoint failed; the message has the
            server's answer.

    Example::

        transfer = VLLMHTTPWeightTransfer(server.url, model=policy)
        transfer.init_weight_transfer()
        transfer.pause()
        transfer.send_weights(policy.named_parameters(), version=1)
        transfer.resume()          # the next tokens sampled come from these weights
        transfer.destroy()
    """

    def __init__(
        self,
        server_url: str = "http://localhost:8000",
        *,
        model: torch.nn.Module | None = None,
        shm_dir: str | os.PathLike | None = None,
        server_timeout: float = 240.0,
        request_timeout: float = 600.0,
    ) -> None:
        self.server_url = server_url.rstrip("/")
        self.shm_dir = Path(shm_dir) if shm_dir is not None else _default_shm_dir()
        self.server_timeout = server_timeout
        self.request_timeout = request_timeout
        self.tied = _has_tied_head(model) if model is not None else None
        self._model = model  # its transformers conversion mapping names the pushed tensors as its checkpoint does
        self.version: int | None = None
        self.last_push_s: float | None = None  # seconds of the last send_weights (write + reload + cache reset)
        self._session = requests.Session()
        self._ready = False
        self._has_extension: bool | None = None
        self._paused = False
        self._folders: list[Path] = []
        self._pushes = 0
        self._prefix = f"lgrpo-vllm-weights-{os.getpid()}-{secrets.token_hex(3)}"

    @property
    def weight_folders(self) -> list[Path]:
        """Folders of pushed weights still on disk: the last push's (the previous one is removed after each push)."""
        return list(self._folders)

    # -- protocol --------------------------------------------------------------------------------------------------

    def init_weight_transfer(self) -> None:
        """Wait until the server answers `/health` and check that it can reload weights."""
        if self._ready:
            return
        self._wait_healthy()
        self._has_extension = self._probe_extension()
        if not self._has_extension and self.tied is not False:
            raise RuntimeError(
                f"The vLLM server at {self.server_url} does not load lightning_grpo's worker extension, and the "
                "policy's output layer is (or may be) tied to its embeddings: vLLM's CPU backend would keep sampling "
                "with the old output layer after a reload. Start the server with "
                "`python -m lightning_grpo.serving.vllm_launcher` (or pass "
                "`--worker-extension-cls lightning_grpo_vllm_ext.TiedHeadReloadExtension` with "
                "lightning_grpo/serving/vllm_worker_ext.py copied as lightning_grpo_vllm_ext.py onto its PYTHONPATH)."
            )
        self._ready = True

    def pause(self) -> None:
        """Pause generation; in-flight requests are kept and finish on the new weights after `resume()`."""
        self.init_weight_transfer()
        if not self._paused:
            self._post("/pause", params={"mode": "keep"})
            self._paused = True

    def send_weights(
        self, iterator: Iterable[tuple[str, torch.Tensor]], version: int | None = None, *, partial: bool = False
    ) -> None:
        """Write `(name, tensor)` pairs to a new folder and have the server load them.

        Call between `pause()` and `resume()` (it pauses itself otherwise). Names are the Hugging Face checkpoint names
        (`model.layers.0.self_attn.q_proj.weight`); the server may skip names it does not know. DTensors are gathered.

        Args:
            iterator: the policy's parameters, all of them, e.g. `model.named_parameters()`; with `partial`, whole
                modules only (every tensor of each vLLM layer it sends: q/k/v and gate/up are fused there).
            version: the model version of these weights (recorded in `self.version`).
            partial: the layers left out keep their weights on the server (vLLM logs a "Failed to load weights"
                warning for each of them, and reloads the rest).
        """
        from safetensors.torch import save_file

        tensors = checkpoint_format(self._model, _unique_tensors(iterator))
        if not tensors:
            raise ValueError(
                "`VLLMHTTPWeightTransfer.send_weights` got no tensors. Pass the policy's named parameters."
            )
        self.pause()
        started = time.monotonic()
        self._pushes += 1
        folder = self.shm_dir / f"{self._prefix}-{self._pushes}"
        folder.mkdir(parents=True, exist_ok=False)
        self._folders.append(folder)
        save_file(tensors, str(folder / "model.safetensors"))
        del tensors
        if self._has_extension:
            result = self._post("/collective_rpc", json={"method": _RPC_METHOD, "kwargs": {"path": str(folder)}})
            log.debug("vLLM reload from %s: %s", folder, result)
        else:
            self._post("/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})
        self._post("/reset_prefix_cache")
        self.version = version
        self.last_push_s = time.monotonic() - started
        self._remove_folders(keep_last=True)

    def resume(self) -> None:
        """Resume generation (a no-op when not paused)."""
        if self._paused:
            self._post("/resume")
            self._paused = False

    def destroy(self) -> None:
        """Resume a server left paused and remove every weight folder; idempotent."""
        with contextlib.suppress(RuntimeError):
            self.resume()
        self._paused = False
        self._remove_folders(keep_last=False)
        self._session.close()

    def abandon(self) -> None:
        """Forget a server that is gone: remove the weight folders without contacting it; idempotent."""
        self._paused = False
        self._remove_folders(keep_last=False)
        self._session.close()

    # -- helpers ---------------------------------------------------------------------------------------------------

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.server_timeout
        while True:
            try:
                if self._session.get(f"{self.server_url}/health", timeout=5.0).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{type(self).__name__}(server_url={self.server_url!r}): no vLLM server answered /health within "
                    f"server_timeout={self.server_timeout} s. Start one with "
                    "`python -m lightning_grpo.serving.vllm_launcher`."
                )
            time.sleep(0.5)

    def _probe_extension(self) -> bool:
        try:
            response = self._session.post(
                f"{self.server_url}/collective_rpc", json={"method": _PROBE_METHOD}, timeout=self.request_timeout
            )
        except requests.RequestException as error:
            raise RuntimeError(
                f"VLLMHTTPWeightTransfer: POST {self.server_url}/collective_rpc failed: {error}"
            ) from error
        if response.status_code == 404:
            raise RuntimeError(
                f"The vLLM server at {self.server_url} has no /collective_rpc endpoint: start it with "
                "VLLM_SERVER_DEV_MODE=1 (`python -m lightning_grpo.serving.vllm_launcher` does)."
            )
        return response.status_code == 200

    def _post(self, path: str, **kwargs: Any) -> Any:
        url = f"{self.server_url}{path}"
        try:
            response = self._session.post(url, timeout=self.request_timeout, **kwargs)
        except requests.RequestException as error:
            raise RuntimeError(f"VLLMHTTPWeightTransfer: POST {url} failed: {error}") from error
        if response.status_code != 200:
            raise RuntimeError(
                f"VLLMHTTPWeightTransfer: POST {url} answered {response.status_code}: {response.text[:2000]}"
            )
        try:
            return response.json()
        except ValueError:
            return None

    def _remove_folders(self, keep_last: bool) -> None:
        keep = self._folders[-1:] if keep_last else []
        for folder in self._folders[: len(self._folders) - len(keep)]:
            shutil.rmtree(folder, ignore_errors=True)
        self._folders = keep

    def __getstate__(self) -> None:
        raise TypeError("A `VLLMHTTPWeightTransfer` stays in the trainer process (rank 0); it cannot be pickled.")


def _default_shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _has_tied_head(model: torch.nn.Module) -> bool:
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return bool(getattr(getattr(model, "config", None), "tie_word_embeddings", True))
    embedding, head = get_in(), get_out()
    if embedding is None or head is None:
        return False
    return head.weight is embedding.weight or head.weight.data_ptr() == embedding.weight.data_ptr()


def checkpoint_format(model: torch.nn.Module | None, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (the policy's parameters by name) as its checkpoint on disk holds them, which is what the server's
    loader reads: transformers keeps some weights in another layout in memory than in the checkpoint (a mixture of
    experts' stacked `experts.gate_up_proj` is `experts.{i}.gate_proj.weight` and `up_proj.weight` on disk), and a
    server ignores names it does not know. The model's own conversion mapping is reverted, as `save_pretrained`
    does; without a model (or for a model with no mapping) the names stay as they are."""
    if model is None:
        return tensors
    from transformers.core_model_loading import revert_weight_conversion

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT policy streams base names
    return revert_weight_conversion(base, tensors) if hasattr(base, "config") else tensors


def _unique_tensors(iterator: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """`{name: contiguous CPU tensor}`, each storage once (safetensors rejects shared tensors), DTensors gathered."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for name, tensor in iterator:
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        tensor = tensor.detach()
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if tensor.numel() and key in seen:
            continue  # a tied weight: the server ties it again on load
        seen.add(key)
        tensors[name] = tensor.to("cpu").contiguous()
    return tensors
