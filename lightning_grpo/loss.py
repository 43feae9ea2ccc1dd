"""GRPO policy loss on packed rows: per-term log-probabilities from one tree forward, and the clipped objective.

One micro-batch is one rank's packed row (`lightning_grpo.pipeline.batch`): `M` loss terms, each a trained token of one sample,
scored at packed position `token_index` against label `shift_labels[token_index]`. The loss is TRL's async GRPO loss:
a PPO-clipped ratio against the generator's log-probabilities (no reference model, no KL penalty), a token mean over
the whole optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import tree_model_kwargs, use_tree_attention

#: Loss metrics as TRL's async GRPO trainer logs them.
METRIC_NAMES = (
    "ratio",
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
)


def packed_logprobs(
    model: torch.nn.Module, micro_batch: dict[str, torch.Tensor], temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability and entropy of every loss term of one packed micro-batch, under the sampling temperature.

    Runs one tree-attention forward (switching `model` to tree attention on first use) and projects only the `M`
    scored positions to the vocabulary, so the logits are `M x V`, not `N x V`. Entropy is detached (a metric).

    Args:
        model: a causal LM that takes `logits_to_keep` (transformers' decoder models do), on the batch's device.
        micro_batch: one rank's unpadded packed row (`input_ids`, `position_ids`, `shift_labels`, `tree_*`,
            `token_index`).
        temperature: the generator's sampling temperature; logits are divided by it, so the ratio compares the same
            distributions the generator's log-probabilities came from.

    Returns:
        `(logprobs, entropy)`, each `(M,)` float32.
    """
    if temperature <= 0:
        raise ValueError(f"`temperature={temperature}` must be positive (it divides the logits).")
    use_tree_attention(_unwrap(model))
    token_index = micro_batch["token_index"]
    logits = model(**tree_model_kwargs(micro_batch), logits_to_keep=token_index, use_cache=False).logits[0]
    logits = logits.float() / temperature  # (M, V)
    labels = micro_batch["shift_labels"][token_index]
    log_norm = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(1, labels[:, None]).squeeze(1) - log_norm
    with torch.no_grad():
        entropy = log_norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logprobs, entropy


@dataclass(slots=True)
class LossStats:
    """Sums and extremes behind TRL's loss metrics, so micro-batches and ranks aggregate exactly.

    Add the stats of a step's micro-batches (`+`), all-reduce `sums()` with SUM and `extremes()` with MAX across
    ranks (`from_reduced` rebuilds them), then read `metrics()`. Every field is a 0-dim float tensor; terms whose
    advantage is NaN are not counted. The extremes are over completions (per-completion clip fractions):
    `low_min_neg` holds minus the lowest low-clip fraction, so both extremes reduce with MAX; -inf = no completion.
    """

    ratio_sum: torch.Tensor
    kl_sum: torch.Tensor
    entropy_sum: torch.Tensor
    low_clip_sum: torch.Tensor
    high_clip_sum: torch.Tensor
    region_clip_sum: torch.Tensor
    count: torch.Tensor
    low_min_neg: torch.Tensor
    high_max: torch.Tensor

    _SUMS = ("ratio_sum", "kl_sum", "entropy_sum", "low_clip_sum", "high_clip_sum", "region_clip_sum", "count")

    def __add__(self, other: LossStats) -> LossStats:
        merged = {name: getattr(self, name) + getattr(other, name) for name in self._SUMS}
        merged["low_min_neg"] = torch.maximum(self.low_min_neg, other.low_min_neg)
        merged["high_max"] = torch.maximum(self.high_max, other.high_max)
        return LossStats(**merged)

    def sums(self) -> torch.Tensor:
        """(7,) the additive fields, for a SUM all-reduce."""
        return torch.stack([getattr(self, name) for name in self._SUMS])

    def extremes(self) -> torch.Tensor:
        """(2,) `[low_min_neg, high_max]`, for a MAX all-reduce."""
        return torch.stack([self.low_min_neg, self.high_max])

    @classmethod
    def from_reduced(cls, sums: torch.Tensor, extremes: torch.Tensor) -> LossStats:
        values = dict(zip(cls._SUMS, sums.unbind(0), strict=True))
        return cls(**values, low_min_neg=extremes[0], high_max=extremes[1])

    def metrics(self) -> dict[str, float]:
        """TRL's metric names (`METRIC_NAMES`) to values; NaN when no term was counted."""
        count = float(self.count)
        mean = (lambda x: float(x) / count) if count else (lambda x: float("nan"))
        low_min, high_max = -float(self.low_min_neg), float(self.high_max)
        return {
            "ratio": mean(self.ratio_sum),
            "kl": mean(self.kl_sum),
            "entropy": mean(self.entropy_sum),
            "clip_ratio/low_mean": mean(self.low_clip_sum),
            "clip_ratio/high_mean": mean(self.high_clip_sum),
            "clip_ratio/region_mean": mean(self.region_clip_sum),
            "clip_ratio/low_min": low_min if low_min != float("inf") else float("nan"),
            "clip_ratio/high_max": high_max if high_max != float("-inf") else float("nan"),
        }

    @classmethod
    def zeros(cls, device: torch.device | str | None = None) -> LossStats:
        """The empty stats (identity of `+`)."""
        # float32 whatever the default dtype (Lightning's "bf16-true" sets bfloat16 during a step)
        sums = {name: torch.zeros((), device=device, dtype=torch.float32) for name in cls._SUMS}
        lowest = torch.full((), float("-inf"), device=device, dtype=torch.float32)
        return cls(**sums, low_min_neg=lowest, high_max=lowest.clone())


def grpo_loss(
    logprobs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    normalizer: float | torch.Tensor,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    world_size: int = 1,
    segment_id: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The clipped GRPO loss of one micro-batch on one rank, scaled so the step's gradient is a token mean.

    `loss_t = -min(r_t A_t, clip(r_t, 1 - epsilon, 1 + epsilon_high) A_t)` with `r_t = exp(logp_t - old_logp_t)`, and
    the micro-batch's loss is `sum_t loss_t * world_size / normalizer`. With `normalizer` = the step's trained tokens
    over all ranks and micro-batches (`step_trained_tokens`), summing the backward passes of a step's micro-batches
    and averaging gradients over ranks, as DDP does, gives the gradient of the token mean over the whole step. Terms
    with a NaN advantage (not scored, or masked) contribute nothing, and are not in the stats.

    Args:
        logprobs: `(M,)` log-probabilities under the policy (`packed_logprobs`), with grad.
        old_log_probs: `(M,)` the generator's log-probabilities of the same tokens.
        advantages: `(M,)` each term's sample advantage; NaN = left out.
        normalizer: loss terms in the whole optimizer step over all ranks; clamped to at least 1.
        epsilon: lower clip range (`1 - epsilon`).
        epsilon_high: upper clip range (`1 + epsilon_high`); defaults to `epsilon`.
        world_size: ranks whose gradients DDP averages.
        segment_id: `(M,)` sample of each term, for the per-completion clip extremes (none without it).
        entropy: `(M,)` per-term entropy, for the entropy metric (0 without it).

    Returns:
        `(loss, stats)`: a 0-dim loss to backpropagate, and the micro-batch's `LossStats`.
    """
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    valid = ~torch.isnan(advantages)
    # a NaN left in either branch of the min would leak into the gradient even where it is not selected
    adv = torch.where(valid, advantages, 0.0)
    log_ratio = torch.where(valid, logprobs - old_log_probs, 0.0)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    per_term = -torch.minimum(ratio * adv, clipped * adv)
    normalizer = torch.as_tensor(normalizer, dtype=torch.float32, device=logprobs.device).clamp(min=1.0)
    loss = per_term.sum() * world_size / normalizer
    with torch.no_grad():
        stats = _stats(ratio, log_ratio, adv, valid, epsilon, epsilon_high, segment_id, entropy)
    return loss, stats


def _stats(
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    adv: torch.Tensor,
    valid: torch.Tensor,
    epsilon: float,
    epsilon_high: float,
    segment_id: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> LossStats:
    weight = valid.float()
    low = (ratio < 1 - epsilon) & (adv < 0) & valid
    high = (ratio > 1 + epsilon_high) & (adv > 0) & valid
    stats = LossStats.zeros(ratio.device)
    stats.ratio_sum = (ratio * weight).sum()
    stats.kl_sum = ((ratio - 1 - log_ratio) * weight).sum()  # k3 estimator of KL(generator || policy)
    stats.entropy_sum = (entropy.float() * weight).sum() if entropy is not None else stats.entropy_sum
    stats.low_clip_sum = low.float().sum()
    stats.high_clip_sum = high.float().sum()
    stats.region_clip_sum = (low | high).float().sum()
    stats.count = weight.sum()
    if segment_id is not None and bool(valid.any()):
        low_frac, high_frac = _per_completion_fractions(segment_id[valid], low[valid], high[valid])
        stats.low_min_neg = -low_frac.min()
        stats.high_max = high_frac.max()
    return stats


def _per_completion_fractions(
    segment_id: torch.Tensor, low: torch.Tensor, high: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Low- and high-clipped fractions of each completion's terms, for completions that have terms."""
    size = int(segment_id.max()) + 1

    def per_completion(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(size, device=values.device, dtype=torch.float32).index_add_(0, segment_id, values.float())

    terms = per_completion(torch.ones_like(low))
    present = terms > 0
    return per_completion(low)[present] / terms[present], per_completion(high)[present] / terms[present]


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a DDP/FSDP/compile wrapper."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return getattr(model, "_orig_mod", model)
