"""`AutoPrecision`: a Lightning precision plugin that trains in bf16-mixed where this machine is faster at it.

Lightning's `precision` is a fixed string, but which one is fastest depends on the machine: on a CPU with bf16
instructions (AVX512_BF16, AMX, Arm's BF16) autocast to bf16 runs the matrix products several times faster than
fp32, and on one without (AVX2) it runs them many times slower. `AutoPrecision` decides when the fit's device is
known (`connect`, once the strategy has placed the model):

- CPU: `probe_matmul_precision()`'s verdict (measured once per machine and torch, then cached, with the embedded
  generator's own products): bf16-mixed where bf16 products beat fp32, else 32-true;
- CUDA: bf16-mixed where the GPU supports bf16 (`torch.cuda.is_bf16_supported()`), else 32-true;
- anything else: 32-true.

bf16-mixed is Lightning's `MixedPrecision("bf16-mixed")`: the weights, gradients and optimizer state stay fp32 and
the forward and backward run under `torch.autocast`; the loss's log-probabilities are computed with autocast off
(`selected_logprobs`), so they stay in the compute dtype. Rank 0 logs the choice and why.

    Trainer(plugins=[AutoPrecision()])                              # not together with `precision=`
    # YAML: trainer: {plugins: [{class_path: lightning_grpo.AutoPrecision}]}

It is for the single-device and DDP strategies; under FSDP or `ModelParallelStrategy` choose `precision=` yourself.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import rank_zero_info

__all__ = ["AutoPrecision", "choose_precision"]


def choose_precision(device: torch.device | str) -> tuple[str, str]:
    """Lightning's precision for training on `device` ("bf16-mixed" or "32-true"), and why, in words for the log."""
    device = torch.device(device)
    if device.type == "cpu":
        from ..models.dtype_probe import probe_matmul_precision
        from ..rollout.decode_linears import decode_product

        verdict = probe_matmul_precision(decode_product=decode_product)
        return ("bf16-mixed" if verdict.dtype == "bfloat16" else "32-true"), verdict.reason
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16-mixed", f"{torch.cuda.get_device_name(device)} supports bf16"
        return "32-true", f"{torch.cuda.get_device_name(device)} has no bf16"
    return "32-true", f"no bf16 choice is made for {device.type!r} devices"


class AutoPrecision(MixedPrecision):
    """bf16-mixed where this machine trains faster in it, else 32-true; decided once the model is on its device.

    Attributes:
        precision: "bf16-mixed" or "32-true" once decided ("32-true" before).
        reason: why, in words ("" before).

    Example::

        import lightning.pytorch as pl

        from lightning_grpo import AutoPrecision

        trainer = pl.Trainer(plugins=[AutoPrecision()])  # instead of precision=...
    """

    def __init__(self) -> None:
        super().__init__("bf16-mixed", "cpu")
        self.precision = "32-true"  # what Lightning reports until `connect` decides
        self.reason = ""
        self._decided = False

    def connect(self, model: Any, optimizers: Any, lr_schedulers: Any) -> Any:
        """Decide from the device the strategy placed `model` on (the first fit, validate or test decides)."""
        if not self._decided:
            parameter = next(model.parameters(), None)
            self.decide(parameter.device if parameter is not None else torch.device("cpu"))
        return super().connect(model, optimizers, lr_schedulers)

    def decide(self, device: torch.device | str) -> str:
        """Choose the precision for training on `device` and log it; returns the choice."""
        self.precision, self.reason = choose_precision(device)
        self.device = torch.device(device).type
        self._decided = True
        rank_zero_info(f"AutoPrecision: training in {self.precision} ({self.reason})")
        return self.precision

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Autocast to bf16 when bf16-mixed was chosen; nothing otherwise."""
        context = self.autocast_context_manager() if self.precision == "bf16-mixed" else nullcontext()
        with context:
            yield
