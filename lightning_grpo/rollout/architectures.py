"""What differs between the decoder families the embedded generator runs: one table, `ARCHITECTURES`.

`decoder.SlotDecoder` runs every family with the same step (embed, then per layer: norm, q/k/v projections, optional
q/k norms, rotary embedding, attention over the slot cache, output projection, norm, MLP; then the final norm and
the LM head), calling the Hugging Face model's own modules. An `Architecture` says where a family departs from
Llama's layout:

- `norms`: the layer's norm modules before and after attention and before and after the MLP (Gemma 2/3 put a norm
  on each branch's output before the residual add; Llama has only the two pre-norms). The norms themselves are the
  model's modules, so Gemma's `(1 + weight)` RMSNorm comes with them, as does its scaled embedding.
- `rotary_per_layer_type`: the model's rotary embedding is called with each layer's `config.layer_types` entry
  (Gemma 3: base 10,000 on sliding layers, 1,000,000 on global ones) instead of once for all layers.
- `sliding_window`: layers typed `"sliding_attention"` in `config.layer_types` attend to the last
  `config.sliding_window` positions only (`layer_windows`); without it a sliding window is refused.

Adding a family whose layers hold `q_proj`/`k_proj`/`v_proj`/`o_proj` and `gate_proj`/`up_proj`/`down_proj` (Qwen2,
Qwen3, Mistral, Gemma 3, Llama 3, ...) is one row here plus a test against a teacher-forced forward
(tests/rollout/test_architectures.py). A family with fused projections (Phi-3's `qkv_proj` and `gate_up_proj`) needs
the decoder's `_Layer` to split them as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Norm module names of a decoder layer: before attention, after it (None: none), before the MLP, after it.
Norms = tuple[str, str | None, str, str | None]
_LLAMA_NORMS: Norms = ("input_layernorm", None, "post_attention_layernorm", None)
_GEMMA_NORMS: Norms = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
SLIDING_LAYER = "sliding_attention"


@dataclass(frozen=True, slots=True)
class Architecture:
    """Where one decoder family departs from the Llama layout (see the module docstring)."""

    norms: Norms = _LLAMA_NORMS
    rotary_per_layer_type: bool = False
    sliding_window: bool = False


#: `config.model_type` -> its `Architecture`. q/k norms (Qwen3, Gemma 3) are found on the attention module itself.
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(),
    "mistral": Architecture(),
    "qwen2": Architecture(),
    "qwen3": Architecture(),
    "gemma3_text": Architecture(norms=_GEMMA_NORMS, rotary_per_layer_type=True, sliding_window=True),
}
#: The config keys the decoder has no implementation of, refused when set.
_UNSUPPORTED_OPTIONS = ("attn_logit_softcapping", "final_logit_softcapping")


def architecture_of(config: Any) -> Architecture:
    """The `Architecture` of a model's config (a `PretrainedConfig` or its dict).

    Raises:
        ValueError: for a model type not in `ARCHITECTURES`, a sliding window on a family without one, or an option
            the decoder does not implement (logit softcapping); the message names the value and the way out
            (a vLLM server).
    """
    config = config if isinstance(config, dict) else config.to_dict()
    model_type = config.get("model_type")
    architecture = ARCHITECTURES.get(model_type)
    if architecture is None:
        problem = f"model_type={model_type!r}"
    elif not architecture.sliding_window and _has_sliding_window(config):
        problem = f"model_type={model_type!r} with a sliding attention window"
    else:
        unsupported = [f"{key}={config[key]!r}" for key in _UNSUPPORTED_OPTIONS if config.get(key) is not None]
        if not unsupported:
            return architecture
        problem = f"model_type={model_type!r} with {', '.join(unsupported)}"
    raise ValueError(
        f"The embedded generator runs the decoder families of `ARCHITECTURES` ({', '.join(ARCHITECTURES)}; a "
        f"sliding window only on gemma3_text); got {problem}. Generate on a vLLM server instead: "
        "`GRPODataModule(generator='vllm', ...)`."
    )


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding attention window (None: full attention), from `config.layer_types` and `sliding_window`."""
    layers = config.num_hidden_layers
    if not architecture_of(config).sliding_window or config.sliding_window is None:
        return [None] * layers
    types = getattr(config, "layer_types", None) or ["full_attention"] * layers
    return [config.sliding_window if kind == SLIDING_LAYER else None for kind in types[:layers]]


def layer_rotary_types(config: Any) -> list[str | None]:
    """The `layer_type` each layer's rotary embedding is called with (None: one rotary embedding for all layers)."""
    layers = config.num_hidden_layers
    if not architecture_of(config).rotary_per_layer_type:
        return [None] * layers
    return list(config.layer_types[:layers])


def _has_sliding_window(config: dict) -> bool:
    if config.get("model_type") == "mistral":
        return config.get("sliding_window") is not None
    return bool(config.get("use_sliding_window", False))
