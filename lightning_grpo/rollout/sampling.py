"""Sampling arithmetic shared by the embedded generator and the tests: processed logprobs, inverse-CDF draws, and
the teacher-forced reference."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


# Vocabulary entries per block of the two-level CDF inversion in `draw`: a row's block sums are one vectorised
# reduction, and the running sum is then taken over a few hundred blocks and one block's entries instead of the whole
# vocabulary (a running sum does not vectorise, and over 49k entries it cost more than the rest of sampling).
_CDF_BLOCK = 256


def process_logits(logits: torch.Tensor, *options: Any, **keywords: Any) -> torch.Tensor:
    """Log-probabilities of the distribution tokens are sampled from, as vLLM's `processed_logprobs`:
    `log_softmax(sampling_scores(logits, ...))`, with `sampling_scores`' arguments.

    Returns:
        (rows, vocab) float32 log-probabilities; -inf outside the kept set.
    """
    return torch.log_softmax(sampling_scores(logits, *options, **keywords), dim=-1)


def sampling_scores(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    *,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    seen: torch.Tensor | None = None,
    overwrite: bool = False,
) -> torch.Tensor:
    """Scores whose softmax is the distribution tokens are sampled from (`process_logits` normalises them, `draw`
    samples from them without normalising the whole vocabulary).

    In vLLM's order: the repetition penalty on the raw logits (a positive logit of a token in the prompt or the
    output so far is divided by it, a negative one multiplied), then `/ temperature`, then `min_p` (drop tokens whose
    probability is under `min_p` times the largest), then the `top_k` largest (0 = all), then the smallest set of
    those whose probability reaches `top_p`. With the defaults this is `logits / temperature`, whose `log_softmax` is
    what the trainer recomputes. `temperature=0` is greedy: only the penalty applies (vLLM's greedy logprobs are the
    `log_softmax` of the penalized logits).

    Args:
        logits: (rows, vocab).
        temperature: >= 0.
        top_k: tokens kept by rank; 0 or -1 keep all (ties with the k-th value are kept too).
        top_p: probability mass kept, in (0, 1].
        min_p: in [0, 1]; None or 0 keep all.
        repetition_penalty: > 0; 1 is off.
        seen: (rows, vocab) bool, the tokens of each row's prompt and output so far; needed when the penalty is on.
        overwrite: float32 `logits` the caller no longer needs may be scaled in place (a decode step then allocates
            no vocabulary-sized tensor for the temperature).

    Returns:
        (rows, vocab) float32 scores; -inf outside the kept set.
    """
    scores = logits.float()
    if repetition_penalty != 1.0:
        if seen is None:
            raise ValueError("`sampling_scores(repetition_penalty=...)` needs `seen`, the tokens each row has seen.")
        penalized = torch.where(scores > 0, scores / repetition_penalty, scores * repetition_penalty)
        scores = torch.where(seen, penalized, scores)
    if temperature == 0.0:
        return scores
    if temperature != 1.0:
        owned = overwrite or scores is not logits  # the caller's to overwrite, or a float32 copy of its logits
        scores = scores.div_(temperature) if owned else scores / temperature
    if min_p:
        probs = scores.softmax(dim=-1)
        scores = scores.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = scores.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # a token is dropped when the more likely tokens already reach top_p; the most likely one always stays
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def draw(scores: torch.Tensor, uniform: torch.Tensor, overwrite: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row drawn from `softmax(scores)` (rows, vocab) by inverting the row's CDF at `uniform` (rows,)
    in [0, 1), and its log-probability under that distribution (float32).

    A token of score -inf (outside the top-k/top-p set) is never drawn. One random number per row, instead of one
    per vocabulary entry (`torch.multinomial`, vLLM's exponential race), keeps a step over a 49k vocabulary cheap and
    lets each row draw from its own seeded generator. With `overwrite`, `scores` (the caller's to discard) are
    turned into the rows' unnormalised probabilities in place.
    """
    peak = scores.amax(dim=-1, keepdim=True)
    # exp(scores - max) are the softmax's numerators; the inversion divides by each row's total, so no row is divided
    weights = (scores.sub_(peak) if overwrite else scores - peak).exp_()
    token, total = _invert_cdf(weights, uniform)
    logprob = weights.gather(-1, token[:, None]).squeeze(-1).log_() - total.log()  # a drawn weight is never 0
    return token, logprob


def sample_from_logprobs(logprobs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row drawn from `exp(logprobs)`, as `draw` draws it (a token of probability 0 never)."""
    return _invert_cdf(logprobs.exp(), uniform)[0]


def _invert_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first entry of each row whose running sum of `weights` (rows, vocab; >= 0) passes `uniform` x the row's
    total, found block by block (`_CDF_BLOCK`), and the totals. Exactly the inversion of the whole row's CDF up to
    rounding, where a draw that would land on a weight of 0 is moved to the nearest earlier entry with weight."""
    rows, vocab = weights.shape
    pad = -vocab % _CDF_BLOCK
    blocked = torch.nn.functional.pad(weights, (0, pad)) if pad else weights
    blocked = blocked.view(rows, -1, _CDF_BLOCK)
    block_mass = blocked.sum(dim=-1)  # (rows, blocks)
    block_cdf = block_mass.cumsum(dim=-1)
    total = block_cdf[:, -1]
    target = (uniform * total)[:, None]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[-1] - 1)
    before = (block_cdf.gather(-1, block) - block_mass.gather(-1, block)).squeeze(-1)
    inner = blocked[torch.arange(rows), block.squeeze(-1)]  # (rows, _CDF_BLOCK)
    inner_cdf = inner.cumsum(dim=-1)
    offset = torch.searchsorted(inner_cdf, (target.squeeze(-1) - before)[:, None], right=True).squeeze(-1)
    token = block.squeeze(-1) * _CDF_BLOCK + offset.clamp_(max=_CDF_BLOCK - 1)
    token = token.clamp_(max=vocab - 1)
    empty = weights.gather(-1, token[:, None]).squeeze(-1) == 0  # rounding at a block's or the row's end
    if empty.any():
        token[empty] = _last_positive_at_or_before(weights[empty], token[empty])
    return token, total


def _last_positive_at_or_before(weights: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Per row, the last index <= `token` with a positive weight (else the first positive one)."""
    index = torch.arange(weights.shape[-1])
    positive = weights > 0
    at_or_before = torch.where(positive & (index <= token[:, None]), index, -1).amax(dim=-1)
    first = torch.where(positive, index, weights.shape[-1]).amin(dim=-1)
    return torch.where(at_or_before >= 0, at_or_before, first)


def seen_tokens(prompt_ids: list[int], completion_ids: list[int], vocab_size: int) -> torch.Tensor:
    """(len(completion_ids), vocab) bool: row t marks the prompt's tokens and the first t completion tokens, the set
    `repetition_penalty` applies to when completion token t is sampled."""
    steps = len(completion_ids)
    seen = torch.zeros(steps, vocab_size, dtype=torch.bool)
    seen[:, torch.tensor(list(prompt_ids), dtype=torch.long)] = True
    if steps > 1:
        earlier = torch.zeros(steps, vocab_size, dtype=torch.int32)
        earlier[torch.arange(1, steps), torch.tensor(completion_ids[:-1], dtype=torch.long)] = 1
        seen |= earlier.cumsum(dim=0) > 0
    return seen


def teacher_forced_logprobs(
    model: PreTrainedModel,
    prompt_ids: list[int],
    completion_ids: list[int],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    *,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
) -> torch.Tensor:
    """Logprobs of `completion_ids` after `prompt_ids` under `model` in one full forward (no cache, no padding).

    The reference a generator's logprobs are checked against: (len(completion_ids),) float32, -inf for a token
    outside the kept set; each position processed as `process_logits` does it (the penalty over the prompt and the
    completion tokens before it).
    """
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]
    seen = seen_tokens(prompt_ids, completion_ids, logits.shape[-1]) if repetition_penalty != 1.0 else None
    logprobs = process_logits(
        logits, temperature, top_k, top_p, min_p=min_p, repetition_penalty=repetition_penalty, seen=seen
    )
    return logprobs.gather(-1, torch.tensor(completion_ids)[:, None]).squeeze(-1)
