"""vLLM worker extension that reloads weights from a folder and re-packs what vLLM's CPU backend packed at load (a
tied output layer, the experts of a mixture of experts) (runs inside vLLM).

This file is imported by the vLLM server's worker process, in vLLM's own environment, not by `lightning_grpo`:
`VLLMServer` copies it into the server's run folder as `lightning_grpo_vllm_ext.py`, puts that folder on the server's
PYTHONPATH and passes `--worker-extension-cls lightning_grpo_vllm_ext.TiedHeadReloadExtension`. It must therefore
import nothing from this package and nothing beyond the standard library and what vLLM itself has.

To use it with a server you launch yourself, copy this file under that name onto the server's PYTHONPATH and pass
the same flag (plus `VLLM_SERVER_DEV_MODE=1`, which enables `/collective_rpc`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

#: Bumped when the RPC methods change, so the trainer can tell an outdated copy from a missing one.
EXTENSION_VERSION = 2


class TiedHeadReloadExtension:
    """Mixed into vLLM's worker class; its methods are called with `POST /collective_rpc`.

    The CPU backend computes logits with a copy of `lm_head.weight` packed for its GEMM at load time. vLLM's
    `reload_weights` updates a tied head's tensor in place (it is the embedding) but never re-packs it, so without this
    the server would keep sampling with the old output layer.
    """

    if TYPE_CHECKING:  # what vLLM's worker, which this class is mixed into, provides
        model_runner: Any

        def reload_weights(self, weights_path: str) -> None: ...

    def lightning_grpo_extension(self) -> dict[str, Any]:
        """Probe used by the trainer to check that this extension is loaded."""
        return {"version": EXTENSION_VERSION}

    def reload_from_path(self, path: str) -> dict[str, Any]:
        """Load every `*.safetensors` file in folder `path` into the served model, then re-pack a tied output layer.

        Returns:
            `{"tied_head_repacked": bool, "cpu_experts_repacked": int}`.
        """
        self.reload_weights(weights_path=path)
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        embedding = _input_embedding(model)
        tied = (
            head is not None
            and embedding is not None
            and getattr(head, "weight", None) is not None
            and head.weight.data_ptr() == embedding.weight.data_ptr()
        )
        if tied and head is not None and getattr(head, "quant_method", None) is not None:
            head.quant_method.process_weights_after_loading(head)
        return {"tied_head_repacked": bool(tied), "cpu_experts_repacked": _repack_cpu_experts(model)}


def _repack_cpu_experts(model: Any) -> int:
    """Re-pack the expert weights of every mixture-of-experts layer that vLLM's CPU kernel runs; the number re-packed.

    The CPU kernel lays the expert weights out for its grouped GEMM once, at load; a reload writes the new weights
    into those tensors in checkpoint layout and does not lay them out again, so the server would sample with scrambled
    experts. Laying them out again from what the reload wrote fixes that.
    """
    repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__module__.endswith(".cpu_moe"):
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


def _input_embedding(model: Any) -> Any:
    """The token embedding of a vLLM decoder (`model.model.embed_tokens` in Llama-family models).

    vLLM's Llama has no `get_input_embeddings()`, so look the module up by its usual names.
    """
    inner = getattr(model, "model", model)
    for name in ("embed_tokens", "wte", "word_embeddings", "embed_in"):
        module = getattr(inner, name, None)
        if module is not None and getattr(module, "weight", None) is not None:
            return module
    return None
