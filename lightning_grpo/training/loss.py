"""The GRPO family of policy losses on packed rows: per-term log-probabilities from one forward (the tree forward, or
the padded one for models that cannot take tree attention: `lightning_grpo.training.forward`), and TRL 1.16
GRPOTrainer's objectives with an exact normalisation over ranks and micro-batches.

One micro-batch is one rank's packed row (`lightning_grpo.pipeline.batch`): `M` loss terms, each a trained token of
one sample, scored at packed position `token_index` against label `shift_labels[token_index]`; `segment_id` maps each
term to its sample, so sequence-level quantities (GSPO's ratio, LUSPO's length, VESPO's weights, the off-policy and
sequence masks) are computed per completion inside the packed tree. Each loss type's normaliser is the step's (over
all ranks and micro-batches, carried in every micro-batch): trained tokens, sequences, or sequences times
`max_completion_length`, so the loss and its gradient are the same whatever the number of ranks and micro-batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .forward import packed_logprobs, term_logprobs
from .loss_options import TOKEN_MEAN_LOSSES, LossOptions
from .loss_stats import LossStats
from .packing_choice import PackingPath

__all__ = [
    "LossContext",
    "LossOptions",
    "LossStats",
    "LossTerms",
    "Normalizers",
    "grpo_loss",
    "high_entropy_mask",
    "micro_batch_loss",
    "packed_logprobs",
    "policy_loss",
    "term_logprobs",
]


@dataclass
class LossTerms:
    """One micro-batch's `M` loss terms, as `policy_loss` takes them.

    Attributes:
        logprobs: `(M,)` log-probabilities under the policy being trained, with grad.
        sampling_logprobs: `(M,)` the generator's log-probabilities of the same tokens (what sampled them).
        advantages: `(M,)` each term's sample advantage; NaN = left out (not scored, or masked).
        segment_id: `(M,)` the sample of each term (index into the row's samples).
        entropy: `(M,)` each term's entropy (with grad for an entropy bonus); None: no entropy metric.
        proximal_logprobs: `(M,)` the policy's log-probabilities at the step's first pass, detached: the PPO anchor
            under `vllm_importance_sampling_correction` (None: the first pass itself).
        ref_logprobs: `(M,)` the reference model's, for `beta > 0`.
        entropy_mask: `(M,)` bool, the terms `top_entropy_quantile` keeps (None: all).
    """

    logprobs: torch.Tensor
    sampling_logprobs: torch.Tensor
    advantages: torch.Tensor
    segment_id: torch.Tensor
    entropy: torch.Tensor | None = None
    proximal_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    entropy_mask: torch.Tensor | None = None


@dataclass(frozen=True)
class Normalizers:
    """The optimizer step's normalisers, over every rank and micro-batch (`lightning_grpo.pipeline.batch`).

    Attributes:
        tokens: the step's loss terms (`step_trained_tokens`).
        sequences: the step's samples with a loss term (`step_sequences`).
        max_completion_length: the Dr. GRPO constant per sequence.
        entropy_tokens: the entropy bonus's token count (default `tokens`; with `top_entropy_quantile < 1`, the
            micro-batch's kept terms over ranks times its micro-batches, as GRPOTrainer takes it per micro-batch).
        world_size: ranks whose gradients DDP averages (each rank's loss is scaled by it).
    """

    tokens: float | torch.Tensor
    sequences: float | torch.Tensor = 1.0
    max_completion_length: int = 1
    entropy_tokens: float | torch.Tensor | None = None
    world_size: int = 1


def policy_loss(terms: LossTerms, options: LossOptions, norms: Normalizers) -> tuple[torch.Tensor, LossStats]:
    """One micro-batch's GRPO-family loss on one rank, scaled so that the step's gradient is the loss type's mean.

    Term by term this is GRPOTrainer's `_compute_loss` (TRL 1.16): the importance ratio (token, or GSPO's sequence
    mean of log-ratios per sample), the loss type's objective (PPO's clip with `epsilon`/`epsilon_high` and `delta`;
    CISPO's detached capped weight; SAPO's soft gate; VESPO's gamma weights), the off-policy sequence mask, the
    entropy mask, the generator-mismatch weight, and `beta` times the k3 KL to the reference. The ratio's anchor is
    the generator's log-probabilities (TRL's async GRPO); with `vllm_importance_sampling_correction` it is the
    policy at the step's first pass, and `exp(first pass - generator)` under `vllm_importance_sampling_mode` and the
    clip bounds weights each term, as GRPOTrainer does with vLLM (its recomputed old log-probabilities are the
    first pass here: the staleness of asynchronous samples is then in that weight).

    Normalised by the step (`norms`), times `world_size` since DDP averages the ranks' gradients: the token mean
    (`dapo`, `bnpo`, `cispo`, `vespo`), the mean over sequences of each sequence's token mean (`grpo`, `sapo`), of
    each sequence's sum (`luspo`), or the sum over `sequences * max_completion_length` (`dr_grpo`). An entropy bonus
    (`entropy_coef`) subtracts `entropy_coef` times the mean entropy over `norms.entropy_tokens`.

    Returns:
        `(loss, stats)`: a 0-dim loss to backpropagate, and the micro-batch's `LossStats` (TRL's metric names).

    Example::

        import torch

        from lightning_grpo import LossOptions, policy_loss
        from lightning_grpo.training.loss import LossTerms, Normalizers

        terms = LossTerms(
            logprobs=torch.tensor([-1.0, -0.5, -2.0], requires_grad=True),
            sampling_logprobs=torch.tensor([-1.1, -0.5, -1.9]),
            advantages=torch.tensor([1.0, 1.0, -1.0]),
            segment_id=torch.tensor([0, 0, 1]),  # two samples: 2 tokens, then 1
        )
        norms = Normalizers(tokens=3, sequences=2)  # the whole step's
        loss, stats = policy_loss(terms, LossOptions(loss_type="grpo"), norms)
        loss.backward()
    """
    valid = ~torch.isnan(terms.advantages)
    # a NaN left in either branch of a where/min leaks into the gradient even where it is not selected
    adv = torch.where(valid, terms.advantages, 0.0)
    segments = _Segments(terms.segment_id, valid)
    anchor = terms.sampling_logprobs
    if options.vllm_importance_sampling_correction:
        anchor = terms.proximal_logprobs if terms.proximal_logprobs is not None else terms.logprobs.detach()
    log_ratio = torch.where(valid, terms.logprobs - anchor, 0.0)
    log_weight = segments.broadcast(segments.mean(log_ratio)) if options.sequence_ratio else log_ratio
    coef_1 = torch.exp(log_weight)
    stats = LossStats()
    is_ratio = _importance_weights(anchor, terms.sampling_logprobs, segments, options, stats)
    per_term = _objective(terms, options, adv, coef_1, log_ratio, is_ratio, segments, stats)
    per_term = per_term * _masks(terms, options, adv, segments, stats)
    if is_ratio is not None and options.loss_type != "vespo":
        per_term = per_term * is_ratio
    if options.beta != 0:
        per_term = per_term + options.beta * _kl(terms, options, coef_1, valid, stats)
    per_term = torch.where(valid, per_term, 0.0)
    loss = _normalised(per_term, segments, options, norms)
    if options.entropy_coef != 0:
        stats.add_total("policy_loss", loss.detach() / norms.world_size)
        loss = loss - options.entropy_coef * _entropy_bonus(terms, segments, norms)
    stats.add_total("loss", loss.detach() / norms.world_size)
    _common_stats(terms, options, coef_1, segments, stats)
    return loss, stats


class _Segments:
    """Per-sample reductions over a micro-batch's terms (`segment_id`), counting only the valid ones."""

    def __init__(self, segment_id: torch.Tensor, valid: torch.Tensor) -> None:
        self.index = segment_id.long()
        self.valid = valid
        self.size = int(self.index.max()) + 1 if self.index.numel() else 0
        self.lengths = self.sum(valid.float())  # (R,) valid terms per sample
        self.present = self.lengths > 0

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        values = torch.where(self.valid, values, 0.0)
        return values.new_zeros(self.size).index_add(0, self.index, values)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        return self.sum(values) / self.lengths.clamp(min=1.0)

    def broadcast(self, per_sample: torch.Tensor) -> torch.Tensor:
        return per_sample[self.index]

    def weights(self, sequence_level: bool) -> torch.Tensor:
        """Per-term weights of a mean: 1 per token, or 1 per sample (its terms share it)."""
        if not sequence_level:
            return self.valid.float()
        return torch.where(self.valid, 1.0 / self.broadcast(self.lengths).clamp(min=1.0), 0.0)


def _objective(
    terms: LossTerms,
    options: LossOptions,
    adv: torch.Tensor,
    coef_1: torch.Tensor,
    log_ratio: torch.Tensor,
    is_ratio: torch.Tensor | None,
    segments: _Segments,
    stats: LossStats,
) -> torch.Tensor:
    """Each term's policy loss for the loss type (before masks, the mismatch weight and the KL term)."""
    eps_low, eps_high = options.epsilon, options.epsilon_upper
    weights = segments.weights(options.sequence_ratio)
    logprobs = torch.where(segments.valid, terms.logprobs, 0.0)
    if options.loss_type == "cispo":
        stats.add_mean("cispo_clip_ratio", ((coef_1 > eps_high) & (adv > 0)).float(), weights)
        return -torch.clamp(coef_1, max=eps_high).detach() * adv * logprobs
    if options.loss_type == "sapo":
        temperature = torch.where(adv > 0, options.sapo_temperature_pos, options.sapo_temperature_neg)
        return -torch.sigmoid(temperature * (coef_1 - 1)) * 4 / temperature * adv
    if options.loss_type == "vespo":
        phi = _gamma_weights(adv, log_ratio, is_ratio, segments, options)
        stats.add_mean("vespo/phi_seq_mean", phi, segments.weights(True))
        return -phi * adv * logprobs
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    if options.delta is not None:
        coef_1 = torch.clamp(coef_1, max=options.delta)
    _clip_stats(coef_1.detach(), adv, options, segments, weights, stats)
    return -torch.minimum(coef_1 * adv, coef_2 * adv)


def _clip_stats(
    coef_1: torch.Tensor,
    adv: torch.Tensor,
    options: LossOptions,
    segments: _Segments,
    weights: torch.Tensor,
    stats: LossStats,
) -> None:
    low = ((coef_1 < 1 - options.epsilon) & (adv < 0) & segments.valid).float()
    high = ((coef_1 > 1 + options.epsilon_upper) & (adv > 0) & segments.valid).float()
    stats.add_mean("clip_ratio/low_mean", low, weights)
    stats.add_mean("clip_ratio/high_mean", high, weights)
    stats.add_mean("clip_ratio/region_mean", torch.maximum(low, high), weights)
    present = segments.present
    stats.add_min("clip_ratio/low_min", segments.mean(low)[present])
    stats.add_max("clip_ratio/high_max", segments.mean(high)[present])


def _gamma_weights(
    adv: torch.Tensor,
    log_ratio: torch.Tensor,
    is_ratio: torch.Tensor | None,
    segments: _Segments,
    options: LossOptions,
) -> torch.Tensor:
    """VESPO's detached per-sequence weight `phi(w) = exp(lambda + k log w - lambda w)`, broadcast to the terms, with
    `w` the sequence's importance ratio (the product over its tokens, times the mismatch weights); as GRPOTrainer's
    `get_gamma_weights`."""
    lower = math.log(1e-8)
    with torch.no_grad():
        log_w = segments.sum(torch.clamp(log_ratio, -20.0, 20.0))
        if is_ratio is not None:
            log_w = log_w + segments.sum(torch.clamp(torch.log(is_ratio), lower, 20.0))
        log_w = segments.broadcast(torch.clamp(log_w, lower, 20.0))
        positive = adv >= 0
        k = torch.where(positive, options.vespo_k_pos, options.vespo_k_neg)
        lam = torch.where(positive, options.vespo_lambda_pos, options.vespo_lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _importance_weights(
    proximal: torch.Tensor,
    sampling: torch.Tensor,
    segments: _Segments,
    options: LossOptions,
    stats: LossStats,
) -> torch.Tensor | None:
    """The generator-mismatch weight of each term (`exp(proximal - sampling)`, per token or per sequence, truncated
    or masked to the clip bounds), or None without `vllm_importance_sampling_correction`."""
    if not options.vllm_importance_sampling_correction:
        return None
    low, high = options.vllm_importance_sampling_clip_min, options.vllm_importance_sampling_clip_max
    with torch.no_grad():
        diff = torch.nan_to_num(torch.where(segments.valid, proximal - sampling, 0.0), nan=0.0)
        ratio = torch.exp(segments.sum(diff)) if options.sequence_correction else torch.exp(diff)
        if options.vllm_importance_sampling_mode.endswith("_truncate"):
            ratio = torch.clamp(ratio, min=low, max=high)
        else:
            lowest, highest = -math.inf if low is None else low, math.inf if high is None else high
            ratio = ratio.masked_fill((ratio < lowest) | (ratio > highest), 0.0)
        per_term = segments.broadcast(ratio) if options.sequence_correction else ratio
    flat = ratio[segments.present] if options.sequence_correction else ratio[segments.valid]
    stats.add_min("sampling/importance_sampling_ratio/min", flat)
    stats.add_mean("sampling/importance_sampling_ratio/mean", flat, torch.ones_like(flat))
    stats.add_max("sampling/importance_sampling_ratio/max", flat)
    if options.vllm_importance_sampling_mode.endswith("_mask"):
        stats.add_mean("sampling/is_masked_frac", (per_term == 0).float(), segments.valid.float())
    return per_term


def _masks(
    terms: LossTerms, options: LossOptions, adv: torch.Tensor, segments: _Segments, stats: LossStats
) -> torch.Tensor:
    """The off-policy sequence mask (DeepSeek-V3.2: a negative-advantage sequence whose mean KL from the generator
    exceeds `off_policy_mask_threshold` is dropped) times the entropy mask, per term."""
    keep = torch.ones_like(adv)
    valid = segments.valid.float()
    if options.off_policy_mask_threshold is not None:
        kl = torch.nan_to_num(terms.sampling_logprobs - terms.logprobs.detach(), nan=0.0)
        low_kl = segments.broadcast(segments.mean(kl)) <= options.off_policy_mask_threshold
        off_policy = ((adv >= 0) | low_kl).float()
        stats.add_mean("off_policy/masked_frac", 1 - off_policy, valid)
        keep = keep * off_policy
    if terms.entropy_mask is not None:
        stats.add_mean("entropy/masked_frac", (~terms.entropy_mask).float(), valid)
        keep = keep * terms.entropy_mask.float()
    return keep


def _kl(
    terms: LossTerms, options: LossOptions, coef_1: torch.Tensor, valid: torch.Tensor, stats: LossStats
) -> torch.Tensor:
    """Schulman's k3 estimate of KL(policy || reference) per term, times the ratio with `use_bias_correction_kl`."""
    if terms.ref_logprobs is None:
        raise ValueError("`beta > 0` needs the reference model's log-probabilities (`ref_logprobs`).")
    delta = torch.where(valid, terms.ref_logprobs - terms.logprobs, 0.0)
    kl = torch.exp(delta) - delta - 1
    if options.use_bias_correction_kl:
        kl = kl * coef_1
    stats.add_mean("kl", kl.detach(), valid.float())
    return kl


def _normalised(per_term: torch.Tensor, segments: _Segments, options: LossOptions, norms: Normalizers) -> torch.Tensor:
    """The micro-batch's share of the step's loss (see `policy_loss`)."""
    device = per_term.device
    if options.loss_type in TOKEN_MEAN_LOSSES:
        total, denominator = per_term.sum(), norms.tokens
    elif options.loss_type in ("grpo", "sapo"):
        total, denominator = (segments.sum(per_term) / segments.lengths.clamp(min=1.0)).sum(), norms.sequences
    elif options.loss_type == "luspo":
        total, denominator = per_term.sum(), norms.sequences
    else:  # dr_grpo
        total = per_term.sum()
        denominator = torch.as_tensor(norms.sequences, dtype=torch.float32) * norms.max_completion_length
    denominator = torch.as_tensor(denominator, dtype=torch.float32, device=device).clamp(min=1.0)
    return total * norms.world_size / denominator


def _entropy_bonus(terms: LossTerms, segments: _Segments, norms: Normalizers) -> torch.Tensor:
    if terms.entropy is None:
        raise ValueError("`entropy_coef` needs each term's entropy, with grad (`packed_logprobs(entropy_grad=True)`).")
    kept = segments.valid if terms.entropy_mask is None else segments.valid & terms.entropy_mask
    total = torch.where(kept, terms.entropy, 0.0).sum()
    count = norms.tokens if norms.entropy_tokens is None else norms.entropy_tokens
    count = torch.as_tensor(count, dtype=torch.float32, device=total.device).clamp(min=1.0)
    return total * norms.world_size / count


def _common_stats(
    terms: LossTerms,
    options: LossOptions,
    coef_1: torch.Tensor,
    segments: _Segments,
    stats: LossStats,
) -> None:
    valid = segments.valid.float()
    stats.add_mean("ratio", coef_1.detach(), segments.weights(options.sequence_ratio))
    if terms.entropy is not None:
        stats.add_mean("entropy", terms.entropy.detach(), valid)
    # the trainer-generator mismatch, at the step's first pass (GRPOTrainer measures it at generation time)
    first = terms.proximal_logprobs if terms.proximal_logprobs is not None else terms.logprobs.detach()
    difference = torch.where(segments.valid, (first - terms.sampling_logprobs).abs(), 0.0)
    stats.add_mean("sampling/sampling_logp_difference/mean", difference, valid)
    stats.add_max("sampling/sampling_logp_difference/max", difference[segments.valid])


def high_entropy_mask(
    entropy: torch.Tensor, valid: torch.Tensor, top_entropy_quantile: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The terms whose entropy is in the top `top_entropy_quantile` of this micro-batch's, over every rank.

    As GRPOTrainer's `get_high_entropy_mask`: the threshold is the `1 - top_entropy_quantile` quantile of the valid
    terms' entropies gathered from every rank (the same micro-batch index on each), so it is a collective when
    torch.distributed is initialised: every rank calls it for each of its micro-batches.

    Returns:
        `(mask, kept)`: `(M,)` bool, and the number of kept terms over every rank (a 0-dim float tensor).
    """
    local = entropy.detach()[valid].float()
    gathered = _all_gather_varlen(local)
    if gathered.numel() == 0:
        return torch.zeros_like(valid), torch.zeros((), device=entropy.device)
    threshold = torch.quantile(gathered, 1 - top_entropy_quantile)
    return (entropy.detach() >= threshold) & valid, (gathered >= threshold).sum().float()


def _all_gather_varlen(local: torch.Tensor) -> torch.Tensor:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    world = dist.get_world_size()
    size = torch.tensor([local.numel()], device=local.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    padded = local.new_zeros(longest)
    padded[: local.numel()] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([part[: int(s.item())] for part, s in zip(parts, sizes, strict=True)])


@dataclass(frozen=True)
class LossContext:
    """What a micro-batch's loss needs besides the micro-batch and the options.

    Attributes:
        temperature, top_k, top_p, min_p: the generator's sampling distribution (`RolloutContract`).
        max_completion_length: the Dr. GRPO constant.
        world_size: ranks.
        num_micro_batches: micro-batches per rank in the step (the entropy bonus's and the MoE loss's weight).
        packing: the forward, `"tree"` or `"padded"` (`lightning_grpo.training.packing_choice.choose_packing`).
        router_aux_loss_coef: the MoE load-balancing loss's weight (0: the model is not asked for it; see
            `lightning_grpo.training.router_aux_loss`).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float | None = None
    max_completion_length: int = 1
    world_size: int = 1
    num_micro_batches: int = 1
    packing: PackingPath = "tree"
    router_aux_loss_coef: float = 0.0

    @classmethod
    def for_step(
        cls,
        contract: Any,
        world_size: int,
        num_micro_batches: int,
        *,
        packing: PackingPath = "tree",
        router_aux_loss_coef: float = 0.0,
    ) -> LossContext:
        """The context of one optimizer step under a `RolloutContract`."""
        return cls(
            temperature=contract.temperature,
            top_k=contract.top_k,
            top_p=contract.top_p,
            min_p=contract.min_p,
            max_completion_length=contract.max_completion_length,
            world_size=world_size,
            num_micro_batches=num_micro_batches,
            packing=packing,
            router_aux_loss_coef=router_aux_loss_coef,
        )


def micro_batch_loss(
    policy: torch.nn.Module, micro_batch: dict[str, torch.Tensor], options: LossOptions, context: LossContext
) -> tuple[torch.Tensor, LossStats, torch.Tensor]:
    """The forward and the loss of one packed micro-batch (see `policy_loss`); call it on every rank for each
    micro-batch (the entropy mask and a sharded policy's forward are collectives).

    Reads the micro-batch's `old_log_probs`, `advantages`, `segment_id`, `step_trained_tokens`, `step_sequences`,
    and when present `proximal_log_probs` (the first pass's log-probabilities, for later updates on the same step)
    and `ref_log_probs` (the reference model's). With `context.router_aux_loss_coef`, adds GRPOTrainer's MoE term:
    `router_aux_loss_coef * aux_loss / num_micro_batches` (the model's load-balancing loss over the tokens this
    forward ran; DDP's average over ranks makes it the step's mean), logged as `aux_loss`.

    Returns:
        `(loss, stats, logprobs)`: the loss to backpropagate, its stats, and the `(M,)` log-probabilities, detached.
    """
    forward = term_logprobs(
        policy,
        micro_batch,
        context.temperature,
        top_k=context.top_k,
        top_p=context.top_p,
        min_p=context.min_p,
        entropy_grad=options.entropy_coef != 0,
        packing=context.packing,
        router_aux_loss=context.router_aux_loss_coef != 0,
    )
    logprobs, entropy = forward.logprobs, forward.entropy
    advantages = micro_batch["advantages"]
    terms = LossTerms(
        logprobs=logprobs,
        sampling_logprobs=micro_batch["old_log_probs"],
        advantages=advantages,
        segment_id=micro_batch["segment_id"],
        entropy=entropy,
        proximal_logprobs=micro_batch.get("proximal_log_probs"),
        ref_logprobs=micro_batch.get("ref_log_probs"),
    )
    entropy_tokens = None
    if options.top_entropy_quantile < 1:
        terms.entropy_mask, kept = high_entropy_mask(entropy, ~torch.isnan(advantages), options.top_entropy_quantile)
        entropy_tokens = kept * context.num_micro_batches
    needs_sequences = options.loss_type not in TOKEN_MEAN_LOSSES
    if needs_sequences and "step_sequences" not in micro_batch:
        raise ValueError(
            f"`loss_type={options.loss_type!r}` is normalised by the step's sequence count, but the micro-batch has "
            "no `step_sequences` (see lightning_grpo.pipeline.batch.set_step_normalizers)."
        )
    norms = Normalizers(
        tokens=micro_batch["step_trained_tokens"],
        sequences=micro_batch.get("step_sequences", 1.0),
        max_completion_length=context.max_completion_length,
        entropy_tokens=entropy_tokens,
        world_size=context.world_size,
    )
    loss, stats = policy_loss(terms, options, norms)
    if context.router_aux_loss_coef != 0:
        loss = loss + _router_aux_term(forward.aux_loss, context, stats)
    return loss, stats, logprobs.detach()


def _router_aux_term(aux_loss: torch.Tensor | None, context: LossContext, stats: LossStats) -> torch.Tensor:
    """This micro-batch's share of `router_aux_loss_coef * aux_loss`, counted in the `loss` total too."""
    if aux_loss is None:
        raise ValueError(
            f"`router_aux_loss_coef={context.router_aux_loss_coef}`, but the policy returned no `aux_loss` when called "
            "with `output_router_logits=True`; set `router_aux_loss_coef=0`."
        )
    term = context.router_aux_loss_coef * aux_loss.float() / context.num_micro_batches
    stats.add_mean("aux_loss", aux_loss.detach().float(), torch.ones((), device=aux_loss.device))
    stats.add_total("loss", term.detach() / context.world_size)
    return term


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
    """The default loss (`loss_type="dapo"`): PPO's clipped ratio against the generator's log-probabilities, a token
    mean over the step (`normalizer` = the step's trained tokens over all ranks and micro-batches).

    `loss_t = -min(r_t A_t, clip(r_t, 1 - epsilon, 1 + epsilon_high) A_t)`, `r_t = exp(logp_t - old_logp_t)`, and
    the micro-batch's loss is `sum_t loss_t * world_size / normalizer`: summing a step's backward passes and
    averaging gradients over ranks, as DDP does, gives the gradient of the token mean over the whole step. Terms with
    a NaN advantage contribute nothing. `policy_loss` takes every other option.

    Example::

        import torch

        from lightning_grpo import grpo_loss

        # the policy's log-probabilities of 3 trained tokens, and the generator's
        logprobs = torch.tensor([-1.0, -0.5, -2.0], requires_grad=True)
        old_log_probs = torch.tensor([-1.1, -0.5, -1.9])
        advantages = torch.tensor([1.0, 1.0, -1.0])  # each token's sample advantage
        loss, stats = grpo_loss(logprobs, old_log_probs, advantages, normalizer=3)
        loss.backward()
    """
    terms = LossTerms(
        logprobs=logprobs,
        sampling_logprobs=old_log_probs,
        advantages=advantages,
        segment_id=segment_id if segment_id is not None else torch.arange(logprobs.numel(), device=logprobs.device),
        entropy=entropy,
    )
    options = LossOptions(epsilon=epsilon, epsilon_high=epsilon_high)
    return policy_loss(terms, options, Normalizers(tokens=normalizer, world_size=world_size))
