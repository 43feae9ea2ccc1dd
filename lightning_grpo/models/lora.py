"""A LoRA (PEFT) policy as the rest of the package recognises it, without importing `peft` until asked."""

from __future__ import annotations

from typing import Any


def is_peft_model(model: Any) -> bool:
    """Whether `model` is a PEFT model (a `peft.PeftModel`): its adapters train, its base weights stay as loaded."""
    from peft import PeftModel

    return isinstance(model, PeftModel)
