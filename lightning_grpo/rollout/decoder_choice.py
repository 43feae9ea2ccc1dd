"""Which decoder the embedded generator runs a model with: the fast slot decoder or the model's own forward.

`decoder.SlotDecoder` ("fast") runs the families of `architectures.ARCHITECTURES` with its own attention over a slot
cache; `generic_decoder.GenericDecoder` ("generic") runs every other decoder-only causal LM through its own forward
and cache. A model that is not a decoder-only causal LM (an encoder such as BERT, an encoder-decoder such as T5) is
refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from .architectures import architecture_of

#: The decoder a generator may be asked for: "auto" lets `choose_decoder` pick.
DecoderName = Literal["auto", "fast", "generic"]
DECODER_NAMES: tuple[str, ...] = ("auto", "fast", "generic")


@dataclass(frozen=True, slots=True)
class DecoderChoice:
    """The decoder a model runs on and why (one line, for the start-up log)."""

    path: Literal["fast", "generic"]
    reason: str


def choose_decoder(config: Any, decoder: DecoderName = "auto") -> DecoderChoice:
    """The decoder for a model's config (a `PretrainedConfig` or its dict).

    Args:
        config: the model's config.
        decoder: "auto" (the fast decoder where `architectures.architecture_of` accepts the config, else the
            generic one), or "fast" / "generic" to force one.

    Raises:
        ValueError: a model that is not a decoder-only causal LM, `decoder="fast"` for a config the fast decoder
            does not run, or an unknown `decoder`; each in one line naming the value and what works.
    """
    check_decoder_name(decoder)
    config = config if isinstance(config, dict) else config.to_dict()
    _check_causal_lm(config)
    model_type = config.get("model_type")
    if decoder == "generic":
        return DecoderChoice("generic", f"model_type={model_type!r}: the generic decoder was asked for")
    try:
        architecture_of(config)
    except ValueError as error:
        if decoder == "fast":
            raise
        return DecoderChoice("generic", f"the fast decoder does not run {_refused(error)}")
    return DecoderChoice("fast", f"model_type={model_type!r} is in `architectures.ARCHITECTURES`")


def check_decoder_name(decoder: str) -> None:
    """Raise a `ValueError` naming `decoder` when it is not one of `DECODER_NAMES`."""
    if decoder not in DECODER_NAMES:
        raise ValueError(f"`decoder={decoder!r}` is not one of {', '.join(map(repr, DECODER_NAMES))}.")


def _check_causal_lm(config: dict) -> None:
    """Refuse, in one line, a config whose model is not a decoder-only causal LM."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = config.get("model_type")
    if config.get("is_encoder_decoder"):
        problem = "an encoder-decoder"
    elif model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        problem = "not a causal LM (no `AutoModelForCausalLM` class)"
    elif model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not config.get("is_decoder"):
        problem = "an encoder (a masked LM)"
    elif config.get("use_bidirectional_attention"):
        # every position would see the tokens after it: such a model scores text but cannot sample it left to right
        problem = "set to attend both ways (`use_bidirectional_attention=True`); set it to False to generate"
    else:
        return
    raise ValueError(
        f"The embedded generator runs decoder-only causal LMs (`AutoModelForCausalLM`: Llama, Qwen, Gemma, Phi, "
        f"GPT-2, Mixtral, ...); model_type={model_type!r} is {problem}."
    )


def _refused(error: ValueError) -> str:
    """What the fast decoder's refusal names (`architecture_of` says "... got <what>. Generate on ..."), without its
    way out: the generic decoder is the way out here."""
    message = str(error)
    named = re.search(r"got (.+?)\. Generate on", message)
    return named.group(1) if named else message
