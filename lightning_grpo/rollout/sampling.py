"""Sampling arithmetic shared by the embedded generator and the tests: processed logprobs, inverse-CDF draws, and
the teacher-forced reference."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def process_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    *,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probabilities of the distribution tokens are sampled from, as vLLM's `processed_logprobs`.

    In vLLM's order: the repetition penalty on the raw logits (a positive logit of a token in the prompt or the
    output so far is divided by it, a negative one multiplied), then `/ temperature`, then `min_p` (drop tokens whose
    probability is under `min_p` times the largest), then the `top_k` largest (0 = all), then the smallest set of
    those whose probability reaches `top_p`, renormalized. With the defaults this is `log_softmax(logits /
    temperature)`, which is what the trainer recomputes. `temperature=0` is greedy: only the penalty applies, and the
    result is `log_softmax` of the penalized logits (vLLM's greedy logprobs).

    Args:
        logits: (rows, vocab).
        temperature: >= 0.
        top_k: tokens kept by rank; 0 or -1 keep all (ties with the k-th value are kept too).
        top_p: probability mass kept, in (0, 1].
        min_p: in [0, 1]; None or 0 keep all.
        repetition_penalty: > 0; 1 is off.
        seen: (rows, vocab) bool, the tokens of each row's prompt and output so far; needed when the penalty is on.

    Returns:
        (rows, vocab) float32 log-probabilities; -inf outside the kept set.
    """
    scores = logits.float()
    if repetition_penalty != 1.0:
        if seen is None:
            raise ValueError("`process_logits(repetition_penalty=...)` needs `seen`, the tokens each row has seen.")
        penalized = torch.where(scores > 0, scores / repetition_penalty, scores * repetition_penalty)
        scores = torch.where(seen, penalized, scores)
    if temperature == 0.0:
        return torch.log_softmax(scores, dim=-1)
    if temperature != 1.0:
        scores = scores / temperature
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
    return torch.log_softmax(scores, dim=-1)


def sample_from_logprobs(logprobs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row drawn from `exp(logprobs)`, by inverting the row's CDF at `uniform` (rows,) in [0, 1).

    A token of probability 0 (outside the top-k/top-p set) is never drawn. One random number per row, instead of one
    per vocabulary entry (`torch.multinomial`, vLLM's exponential race), makes a step over a 49k vocabulary about 3x
    cheaper and lets each row draw from its own seeded generator.
    """
    cdf = logprobs.exp().cumsum(dim=-1)
    total = cdf[:, -1:]
    token = torch.searchsorted(cdf, uniform[:, None] * total, right=True).squeeze(-1)
    past_end = token >= cdf.shape[-1]  # uniform * total rounded up to the total
    if past_end.any():
        token[past_end] = (cdf[past_end] < total[past_end]).sum(dim=-1)  # the last token of probability > 0
    return token


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
