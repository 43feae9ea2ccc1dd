"""What differs between the decoder families the embedded generator runs: one table, `ARCHITECTURES`.

`decoder.SlotDecoder` runs every family with the same step (embed, then per layer: norm, q/k/v projections, optional
q/k norms, rotary embedding, attention over the slot cache, output projection, norm, MLP; then the final norm and
the LM head), calling the Hugging Face model's own modules. An `Architecture` says where a family departs from
Llama's layout:

- `norms`: the layer's norm modules before and after attention and before and after the MLP (None: none there).
  Gemma 2/3 put a norm on each branch's output before the residual add as well; OLMo 2/3 have only those two. The
  norms are the model's modules, so Gemma's `(1 + weight)` RMSNorm comes with them, as does its scaled embedding.
- `rotary_per_layer_type`: the model's rotary embedding is called with each layer's `config.layer_types` entry
  (Gemma 3: base 10,000 on sliding layers, 1,000,000 on global ones) instead of once for all layers.
- `sliding_window`: which layers attend to the last `config.sliding_window` positions only (`layer_windows`):
  `"every_layer"` (Mistral, Phi-3, Mixtral, Qwen3-MoE), `"layer_types"` (the layers typed `"sliding_attention"`
  in `config.layer_types`: Gemma 2/3, OLMo 3); None: a sliding window is refused.
- `qk_norm_over_projection`: the q/k norms normalise each token's whole q and k projection (OLMo 2/3), not each
  head (Qwen3, Gemma 3, Cohere with `use_qk_norm`, whose norms are found on the attention module itself).
- `parallel_branches`: attention and MLP both read the one pre-norm's output and add to the residual together
  (Cohere).
- `no_rope_layers`: a 0 in `config.no_rope_layers` marks a layer without rotary embedding (SmolLM3).
- `softcapping`: `"scores_and_logits"`: `config.attn_logit_softcapping` caps the attention scores
  (`cap * tanh(scores / cap)`) and `config.final_logit_softcapping` the logits (Gemma 2); `"logits"`: only the
  latter (Gemma 3, whose attention module in transformers passes no cap, so the trainer's forward ignores
  `attn_logit_softcapping` too); None: both options are refused.
- `multipliers`: Granite's `embedding_multiplier` (embeddings), `residual_multiplier` (each branch's output) and
  `logits_scaling` (logits divided by it); its `attention_multiplier` is the attention module's `scaling`.
- `logit_scale`: the logits are multiplied by `config.logit_scale` (Cohere).

Fused projections (Phi-3's `qkv_proj` and `gate_up_proj`) are split by the decoder, and an MLP without gate, up
and down projections (a mixture-of-experts block: Qwen3-MoE, Mixtral) is the model's own module called on the
step's tokens. Rotary embeddings whose frequencies depend on the longest position in the batch (`dynamic`,
`longrope`) are refused: a decode step batches rows of different lengths. Adding a family is one row here plus a
test against a teacher-forced forward (tests/rollout/test_architectures.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

#: Norm module names of a decoder layer: before attention, after it, before the MLP, after it (None: none there).
Norms = tuple[str | None, str | None, str | None, str | None]
_LLAMA_NORMS: Norms = ("input_layernorm", None, "post_attention_layernorm", None)
_GEMMA_NORMS: Norms = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
_OLMO2_NORMS: Norms = (None, "post_attention_layernorm", None, "post_feedforward_layernorm")
_PARALLEL_NORMS: Norms = ("input_layernorm", None, None, None)
SLIDING_LAYER = "sliding_attention"
#: Which layers slide (see the module docstring).
SlidingLayers = Literal["every_layer", "layer_types"]
#: What a family's softcapping caps (see the module docstring).
Softcapping = Literal["scores_and_logits", "logits"]


@dataclass(frozen=True, slots=True)
class Architecture:
    """Where one decoder family departs from the Llama layout (see the module docstring)."""

    norms: Norms = _LLAMA_NORMS
    rotary_per_layer_type: bool = False
    sliding_window: SlidingLayers | None = None
    qk_norm_over_projection: bool = False
    parallel_branches: bool = False
    no_rope_layers: bool = False
    softcapping: Softcapping | None = None
    multipliers: bool = False
    logit_scale: bool = False


#: `config.model_type` -> its `Architecture`.
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(),
    "mistral": Architecture(sliding_window="every_layer"),
    "qwen2": Architecture(),
    "qwen3": Architecture(),
    "gemma": Architecture(),
    "gemma2": Architecture(norms=_GEMMA_NORMS, sliding_window="layer_types", softcapping="scores_and_logits"),
    "gemma3_text": Architecture(
        norms=_GEMMA_NORMS, rotary_per_layer_type=True, sliding_window="layer_types", softcapping="logits"
    ),
    "phi3": Architecture(sliding_window="every_layer"),
    "olmo2": Architecture(norms=_OLMO2_NORMS, qk_norm_over_projection=True),
    "olmo3": Architecture(
        norms=_OLMO2_NORMS, qk_norm_over_projection=True, rotary_per_layer_type=True, sliding_window="layer_types"
    ),
    "granite": Architecture(multipliers=True),
    "smollm3": Architecture(no_rope_layers=True),
    "cohere": Architecture(norms=_PARALLEL_NORMS, parallel_branches=True, logit_scale=True),
    "qwen3_moe": Architecture(sliding_window="every_layer"),
    "mixtral": Architecture(sliding_window="every_layer"),
}
#: Config keys a family without `softcapping` does not implement; refused there when set.
_SOFTCAPPING_OPTIONS = ("attn_logit_softcapping", "final_logit_softcapping")
#: Config keys the decoder implements on no family, refused when set (and not False).
_UNSUPPORTED_OPTIONS = ("use_bidirectional_attention",)
#: Rotary types whose frequencies depend on the longest position of the forward: a decode step mixes lengths.
_UNSUPPORTED_ROPE_TYPES = ("dynamic", "longrope")


@dataclass(frozen=True, slots=True)
class Scalars:
    """The scalar factors a family applies outside its modules (None: not applied)."""

    embedding_multiplier: float | None = None  # embeddings times this
    residual_multiplier: float | None = None  # each branch's output times this before the residual add
    attention_softcap: float | None = None  # scores = cap * tanh(scores / cap), before the mask
    logits_divisor: float | None = None  # logits divided by this
    logits_multiplier: float | None = None  # logits times this
    logits_softcap: float | None = None  # logits = cap * tanh(logits / cap), after the divisor and multiplier


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """What one decoder layer does where it departs from Llama's, resolved once from the config."""

    norms: Norms
    window: int | None  # sliding attention window (None: full attention)
    rotary_type: str | None  # the rotary embedding's layer type (None: the one for all layers)
    rotates: bool  # False: no rotary embedding in this layer (NoPE)
    qk_norm_over_projection: bool
    attention_softcap: float | None
    residual_multiplier: float | None


def architecture_of(config: Any) -> Architecture:
    """The `Architecture` of a model's config (a `PretrainedConfig` or its dict).

    Raises:
        ValueError: for a model type not in `ARCHITECTURES`, a sliding window on a family without one, or an option
            the decoder does not implement (softcapping outside Gemma 2/3, bidirectional attention, a
            `dynamic` or `longrope` rotary embedding); the message names the value and the way out (a vLLM server).
    """
    config = config if isinstance(config, dict) else config.to_dict()
    model_type = config.get("model_type")
    architecture = ARCHITECTURES.get(model_type)
    problem = f"model_type={model_type!r}"
    if architecture is None:
        pass
    elif architecture.sliding_window is None and _has_sliding_window(config):
        problem += " with a sliding attention window"
    else:
        unsupported = [f"{key}={config[key]!r}" for key in _unsupported_keys(architecture) if _is_set(config, key)]
        unsupported += [f"rope_type={kind!r}" for kind in _rope_types(config) if kind in _UNSUPPORTED_ROPE_TYPES]
        if not unsupported:
            return architecture
        problem += f" with {', '.join(unsupported)}"
    raise ValueError(
        f"The embedded generator runs the decoder families of `ARCHITECTURES` ({', '.join(ARCHITECTURES)}); got "
        f"{problem}. Generate on a vLLM server instead: `GRPODataModule(generator='vllm', ...)`."
    )


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding attention window (None: full attention), from `config.sliding_window` and, on a family
    whose sliding layers are typed, `config.layer_types`."""
    layers = config.num_hidden_layers
    sliding = architecture_of(config).sliding_window
    window = getattr(config, "sliding_window", None)
    if sliding is None or window is None:
        return [None] * layers
    if sliding == "every_layer":
        return [window] * layers
    types = getattr(config, "layer_types", None) or ["full_attention"] * layers
    return [window if kind == SLIDING_LAYER else None for kind in types[:layers]]


def layer_rotary_types(config: Any) -> list[str | None]:
    """The `layer_type` each layer's rotary embedding is called with (None: one rotary embedding for all layers)."""
    layers = config.num_hidden_layers
    if not architecture_of(config).rotary_per_layer_type:
        return [None] * layers
    return list(config.layer_types[:layers])


def layer_rotates(config: Any) -> list[bool]:
    """Whether each layer applies the rotary embedding (SmolLM3's `no_rope_layers`: 0 marks a layer without)."""
    layers = config.num_hidden_layers
    if not architecture_of(config).no_rope_layers:
        return [True] * layers
    return [bool(flag) for flag in config.no_rope_layers[:layers]]


def layer_plans(config: Any) -> list[LayerPlan]:
    """Each layer's `LayerPlan` (a `PretrainedConfig`)."""
    architecture, scalars = architecture_of(config), scalars_of(config)
    per_layer = zip(layer_windows(config), layer_rotary_types(config), layer_rotates(config), strict=True)
    return [
        LayerPlan(
            norms=architecture.norms,
            window=window,
            rotary_type=rotary_type,
            rotates=rotates,
            qk_norm_over_projection=architecture.qk_norm_over_projection,
            attention_softcap=scalars.attention_softcap,
            residual_multiplier=scalars.residual_multiplier,
        )
        for window, rotary_type, rotates in per_layer
    ]


def scalars_of(config: Any) -> Scalars:
    """The `Scalars` of a model's config, as its family applies them."""
    architecture = architecture_of(config)
    options: dict[str, float | None] = {}
    if architecture.softcapping == "scores_and_logits":
        options["attention_softcap"] = getattr(config, "attn_logit_softcapping", None)
    if architecture.softcapping is not None:
        options["logits_softcap"] = getattr(config, "final_logit_softcapping", None)
    if architecture.multipliers:
        options["embedding_multiplier"] = config.embedding_multiplier
        options["residual_multiplier"] = config.residual_multiplier
        options["logits_divisor"] = config.logits_scaling
    if architecture.logit_scale:
        options["logits_multiplier"] = config.logit_scale
    return Scalars(**options)


def _unsupported_keys(architecture: Architecture) -> tuple[str, ...]:
    return _UNSUPPORTED_OPTIONS if architecture.softcapping is not None else _UNSUPPORTED_OPTIONS + _SOFTCAPPING_OPTIONS


def _is_set(config: dict, key: str) -> bool:
    value = config.get(key)
    return value is not None and value is not False


def _has_sliding_window(config: dict) -> bool:
    """Whether the model attends through a sliding window anywhere (Qwen2/3 and SmolLM3 only with
    `use_sliding_window`, whatever `sliding_window` holds)."""
    if not config.get("use_sliding_window", True):
        return False
    return config.get("sliding_window") is not None or SLIDING_LAYER in (config.get("layer_types") or ())


def _rope_types(config: dict) -> list[str]:
    """The rotary embedding types a config names (`rope_parameters`, per layer type or not, or `rope_scaling`)."""
    kinds = []
    for key in ("rope_parameters", "rope_scaling"):
        parameters = config.get(key) or {}
        for entry in (parameters, *(value for value in parameters.values() if isinstance(value, dict))):
            kind = entry.get("rope_type", entry.get("type"))
            if isinstance(kind, str) and kind not in kinds:
                kinds.append(kind)
    return kinds
