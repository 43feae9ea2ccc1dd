"""`WarmStartModule`: supervised fine-tuning of a causal LM on demonstration rows, as a small LightningModule.

Why a Lightning module over our own collator rather than TRL's `SFTTrainer`: `SFTTrainer(assistant_only_loss=True)`
masks with the chat template's `{% generation %}` markers, and for templates it does not know (the ChatML tool
template SmolLM2 gets here, `rollout/chat.py`) it has none to swap in; its prompt-completion format would train the
tool results too. Our rows come from the rollout's own path (`lightning_grpo.sft.demonstrations`), so the warm start
trains exactly the tokens, with exactly the mask, that GRPO's rollouts later sample and train; and the fit is a plain
`Trainer.fit`, with the same devices, precision and loggers as the GRPO fit after it. The loss is the Hugging Face
model's own causal-LM loss (`forward(labels=...)`: the mean over the batch's trained tokens).
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info


class WarmStartModule(pl.LightningModule):
    """Trains `policy` on batches from `demonstrations.collate`: the mean cross-entropy of the assistant's tokens.

    AdamW with `learning_rate`, a linear warm-up over `warmup_steps` and a linear decay to 0 at the fit's last
    step (TRL's `SFTConfig` defaults' schedule). Logs `sft/loss` and `sft/lr` every step; `losses` keeps each step's
    loss, so a caller can say whether it went down.

    Args:
        policy: a Hugging Face causal LM (its `forward` takes `labels`).
        learning_rate: AdamW's peak learning rate.
        warmup_steps: optimizer steps of linear warm-up from 0.
        weight_decay: AdamW's weight decay.
        print_every_n_steps: print the step's loss every this many steps (0: never), for runs without a progress bar.

    Raises:
        ValueError: a learning rate that is not positive, or negative steps.
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        learning_rate: float = 1e-4,
        warmup_steps: int = 0,
        weight_decay: float = 0.0,
        print_every_n_steps: int = 0,
    ) -> None:
        super().__init__()
        problems = []
        if not (learning_rate > 0 and math.isfinite(learning_rate)):
            problems.append(f"learning_rate={learning_rate} (must be positive)")
        if warmup_steps < 0:
            problems.append(f"warmup_steps={warmup_steps} (must be at least 0)")
        if print_every_n_steps < 0:
            problems.append(f"print_every_n_steps={print_every_n_steps} (0 turns it off)")
        if problems:
            raise ValueError(f"`WarmStartModule({', '.join(problems)})`.")
        self.policy = policy
        self.learning_rate = learning_rate
        self.warmup_steps = warmup_steps
        self.weight_decay = weight_decay
        self.print_every_n_steps = print_every_n_steps
        self.losses: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.policy(**batch, use_cache=False).loss
        self.losses.append(float(loss.detach()))
        self.log("sft/loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        self.log("sft/lr", self.optimizers().param_groups[0]["lr"], on_step=True, on_epoch=False)
        step = len(self.losses)
        if self.print_every_n_steps and (step % self.print_every_n_steps == 0 or step == 1):
            total = self.trainer.estimated_stepping_batches
            rank_zero_info(f"warm start step {step}/{total}: loss {self.losses[-1]:.4f}")
        return loss

    def configure_optimizers(self) -> Any:
        trainable = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=self.learning_rate, weight_decay=self.weight_decay)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = min(self.warmup_steps, total - 1)

        def scale(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            return max(0.0, (total - step) / max(1, total - warmup))

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, scale)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
