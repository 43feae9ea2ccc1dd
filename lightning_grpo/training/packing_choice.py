"""Which forward trains the policy (`GRPOModule(packing=...)`): the tree forward over the packed prefix trie where it
is exact, else the model's own forward on right-padded sequences (`lightning_grpo.training.padded_forward`).

The tree forward runs each shared token once and is exact when every layer mixes tokens only through attention that
goes through transformers' attention interface (which tree attention replaces) and positions come from
`position_ids`. `tree_unsupported_reason` checks that from the model itself: its `config.layer_types`, its modules
(a `Conv1d` over the sequence is a convolutional or state-space mixer), its class's `_supports_attention_backend`,
its forward's arguments; a small table holds what cannot be seen there.
"""

from __future__ import annotations

import inspect
import logging
from typing import Literal

import torch

log = logging.getLogger(__name__)

PackingMode = Literal["auto", "tree", "padded"]
PackingPath = Literal["tree", "padded"]

#: `config.layer_types` entries tree attention covers (a sliding window is applied from the trie depth).
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
#: Model types whose structure looks fit for the tree forward, but which are not: their decoder layers call the
#: attention function without the keyword arguments they are given (so the `tree_*` arguments never reach it).
_DENIED: dict[str, str] = {
    "stablelm": "its decoder layers do not pass their keyword arguments on to the attention function",
}


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside DDP/FSDP/compile wrappers and a PEFT model."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    model = getattr(model, "_orig_mod", model)
    get_base_model = getattr(model, "get_base_model", None)  # a peft.PeftModel
    return get_base_model() if callable(get_base_model) else model


def tree_unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the tree forward would not be exact for `model`, or None when it is (see the module doc)."""
    base = base_model(model)
    config = getattr(base, "config", None)
    if config is None:
        return f"{type(base).__name__} is not a transformers model (it has no config)"
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    other_layers = sorted(set(getattr(text_config, "layer_types", None) or ()) - _ATTENTION_LAYER_TYPES)
    if other_layers:
        return f"its config.layer_types has {other_layers} layers, which cannot attend over a prefix trie"
    if any(isinstance(module, torch.nn.Conv1d) for module in base.modules()):
        return "it has convolutions over the sequence (torch.nn.Conv1d: a convolutional or state-space mixer)"
    if not getattr(base, "_supports_attention_backend", False):
        return "its attention does not go through transformers' attention interface (_supports_attention_backend)"
    if "position_ids" not in inspect.signature(base.forward).parameters:
        return "its forward takes no position_ids (its positions would not follow the trie)"
    if getattr(text_config, "attention_chunk_size", None):
        return "it uses chunked attention, which tree attention does not implement"
    model_type = getattr(config, "model_type", None)
    if model_type in _DENIED:
        return _DENIED[model_type]
    return None


def choose_packing(model: torch.nn.Module, packing: PackingMode) -> PackingPath:
    """The forward `packing` asks for on `model`: `"auto"` takes the tree forward where it is exact, else the padded
    one, and logs the choice (one INFO line with the reason).

    Raises:
        ValueError: `packing` is not `"auto"`, `"tree"` or `"padded"`, or is `"tree"` for a model the tree forward is
            not exact for (the message names the model type, why, and `packing="padded"`).
    """
    if packing not in ("auto", "tree", "padded"):
        raise ValueError(f"`GRPOModule(packing={packing!r})` must be 'auto', 'tree' or 'padded'.")
    reason = tree_unsupported_reason(model)
    name = _model_name(model)
    if packing == "tree" and reason is not None:
        raise ValueError(
            f"`GRPOModule(packing='tree')` cannot train {name} exactly: {reason}. Use `packing='padded'` (or 'auto', "
            "which picks it)."
        )
    path: PackingPath = "padded" if packing == "padded" or reason is not None else "tree"
    if packing == "auto":
        why = f"padded: {reason}" if reason is not None else "tree: every layer is attention over position_ids"
        log.info("GRPOModule(packing='auto') trains %s on the %s forward (%s).", name, path, why)
    return path


def _model_name(model: torch.nn.Module) -> str:
    base = base_model(model)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    return f"{type(base).__name__} (model_type={model_type!r})" if model_type else type(base).__name__
