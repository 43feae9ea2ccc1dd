"""The policy's forward on a packed micro-batch: each loss term's log-probability and entropy under the sampling
distribution, on the tree forward (one pass over the packed prefix trie) or the padded one (the model's own forward on
right-padded sequences, `lightning_grpo.training.padded_forward`), with the same `(M,)` outputs in the same order.
`lightning_grpo.training.packing_choice` says which forward a model takes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import TREE_ATTENTION, TRL_TREE_ATTENTION, tree_model_kwargs, use_tree_attention
from .packing_choice import PackingPath, base_model
from .padded_forward import padded_forward
from .selected_logprobs import selected_logprobs

__all__ = ["TermLogprobs", "packed_logprobs", "term_logprobs"]


@dataclass(frozen=True, slots=True)
class TermLogprobs:
    """One forward's loss-term outputs.

    Attributes:
        logprobs: `(M,)` float32 log-probabilities of the terms' labels, with grad when the forward had it.
        entropy: `(M,)` float32 entropies (detached unless asked for with grad).
        aux_loss: the model's MoE load-balancing loss (0-dim), when asked for and returned; else None.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    aux_loss: torch.Tensor | None = None


def term_logprobs(
    model: torch.nn.Module,
    micro_batch: dict[str, torch.Tensor],
    temperature: float = 1.0,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float | None = None,
    entropy_grad: bool = False,
    packing: PackingPath = "tree",
    router_aux_loss: bool = False,
) -> TermLogprobs:
    """Log-probability and entropy of every loss term of one packed micro-batch, under the sampling distribution.

    `packing="tree"` runs one tree-attention forward (switching `model` to tree attention on first use);
    `packing="padded"` runs the model's own forward on the row's sequences, right-padded (switching a model left on
    tree attention back to SDPA). Either projects only the `M` scored positions to the vocabulary. The distribution is
    the one the generator sampled from: logits divided by `temperature`, then truncated to the tokens at least `min_p`
    times as likely as the most likely one, the `top_k` most likely and the smallest set reaching `top_p`
    (`lightning_grpo.rollout.sampling.process_logits`, vLLM's processed logprobs) and renormalised; the sampled token
    always stays in the set, so an update that pushes it out of the trainer's truncation gives it a small
    log-probability rather than minus infinity. Without truncation and with a detached entropy,
    `lightning_grpo.training.selected_logprobs` computes both a few rows at a time (the same values and gradient).

    Args:
        model: a causal LM that takes `logits_to_keep` (transformers' decoder models do), on the batch's device.
        micro_batch: one rank's unpadded packed row (`input_ids`, `position_ids`, `shift_labels`, `tree_*`,
            `token_index`, `segment_id`).
        temperature: the generator's sampling temperature.
        top_k: the generator's top-k (0 = off).
        top_p: the generator's nucleus mass (1 = off).
        min_p: the generator's min-p (None or 0 = off).
        entropy_grad: keep the entropy's graph (for an entropy bonus); otherwise it is detached (a metric).
        packing: `"tree"` or `"padded"` (see `lightning_grpo.training.packing_choice.choose_packing`).
        router_aux_loss: call the model with `output_router_logits=True` and return its `aux_loss` (MoE models).

    Returns:
        A `TermLogprobs`.
    """
    if temperature <= 0:
        raise ValueError(f"`temperature={temperature}` must be positive (it divides the logits).")
    extra = {"output_router_logits": True} if router_aux_loss else {}
    token_index = micro_batch["token_index"]
    if packing == "tree":
        use_tree_attention(base_model(model))
        out = model(**tree_model_kwargs(micro_batch), logits_to_keep=token_index, use_cache=False, **extra)
        # a view, not `[0]`: the backward of a select writes its gradient into a zeroed copy of the whole logits
        logits, aux_loss = out.logits.squeeze(0), getattr(out, "aux_loss", None)
    elif packing == "padded":
        _leave_tree_attention(base_model(model))
        logits, aux_loss = padded_forward(model, micro_batch, **extra)
    else:
        raise ValueError(f"`packing={packing!r}` must be 'tree' or 'padded'.")
    labels = micro_batch["shift_labels"][token_index]
    logprobs, entropy = _distribution(logits, labels, temperature, top_k, top_p, min_p, entropy_grad)
    return TermLogprobs(logprobs, entropy, aux_loss if router_aux_loss else None)


def packed_logprobs(
    model: torch.nn.Module,
    micro_batch: dict[str, torch.Tensor],
    temperature: float = 1.0,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float | None = None,
    entropy_grad: bool = False,
    packing: PackingPath = "tree",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(logprobs, entropy)`, each `(M,)` float32, of `term_logprobs` (see there for the arguments)."""
    out = term_logprobs(
        model,
        micro_batch,
        temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        entropy_grad=entropy_grad,
        packing=packing,
    )
    return out.logprobs, out.entropy


def _distribution(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float | None,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(logprobs, entropy)` of the `(M, V)` logits' sampling distribution (see `term_logprobs`)."""
    truncated = top_k > 0 or top_p < 1.0 or bool(min_p)
    if not truncated and not entropy_grad:
        # the full distribution with a detached entropy: chunked, without the (M, V) intermediates (float32 out, as
        # below, also for a float64 model)
        return selected_logprobs(logits.float() if logits.dtype == torch.float64 else logits, labels, temperature)
    logits = logits.float() / temperature  # (M, V)
    if truncated:
        logits = _truncated(logits, labels, top_k, top_p, min_p)
    log_norm = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(1, labels[:, None]).squeeze(1) - log_norm
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        probs = torch.softmax(logits, dim=-1)
        # truncated tokens have probability 0 and logit -inf: leave them out of the sum (and out of its gradient)
        entropy = log_norm - (probs * torch.where(torch.isfinite(logits), logits, 0.0)).sum(-1)
    return logprobs, entropy if entropy_grad else entropy.detach()


def _truncated(
    logits: torch.Tensor, labels: torch.Tensor, top_k: int, top_p: float, min_p: float | None
) -> torch.Tensor:
    """`logits` with the tokens outside the sampler's min-p/top-k/top-p set at minus infinity (each label kept)."""
    from ..rollout.sampling import process_logits

    with torch.no_grad():
        keep = torch.isfinite(process_logits(logits, 1.0, top_k, top_p, min_p=min_p))
        keep[torch.arange(labels.numel(), device=labels.device), labels] = True
    return logits.masked_fill(~keep, float("-inf"))


def _leave_tree_attention(model: torch.nn.Module) -> None:
    """Switch a model left on tree attention (by an earlier tree forward) back to SDPA, which takes padded batches."""
    config = getattr(model, "config", None)
    if config is not None and config._attn_implementation in (TREE_ATTENTION, TRL_TREE_ATTENTION):
        try:
            model.set_attn_implementation("sdpa")
        except (ValueError, ImportError):  # a model without SDPA support (e.g. gemma2, for its softcap)
            model.set_attn_implementation("eager")
