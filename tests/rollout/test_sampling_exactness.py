"""The embedded generator's sampler is exact: tokens drawn the way a decode step draws them (the fused
`cdf_draw.draw` with only a temperature, else `sampling_scores` then `draw`, both overwriting their input) follow the target distribution, computed here independently in float64 as vLLM
defines it, by a chi-square test over many draws; and the log-probability recorded for each drawn token is the log
of its target probability. Samplers with a known bias, written here as negative controls, fail the same checks.

Logits come in float32 and in bfloat16 (the target is computed from the same bfloat16 values), over 64 tokens and
over a 49,152-token vocabulary shaped like SmolLM2-135M's next-token logits (a few high tokens, a Zipf-like tail).
Every draw is seeded, so each test gives the same verdict on every run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_grpo.rollout import cdf_draw
from lightning_grpo.rollout.batching import SamplingOptions
from lightning_grpo.rollout.sampling import draw, sampling_scores

SMALL_VOCAB, LARGE_VOCAB = 64, 49152
SMALL_DRAWS, LARGE_DRAWS = 1 << 16, 1 << 12
# A sampler passes while the chi-square p-value is at least this; the seeds are fixed, so an exact sampler either
# passes every run or never (the draws below pass with p >= 0.19; the negative controls fail with p < 1e-38).
ALPHA = 1e-3
# Pooled bins hold at least this many expected draws (the chi-square approximation needs about 5).
MIN_EXPECTED = 10.0
# Largest error of a recorded log-probability, float32 or bfloat16 logits: the sampler works in float32 throughout.
LOGPROB_ATOL = 1e-4

Options = dict[str, Any]
Sampler = Callable[[torch.Tensor, Options, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

# Each filter alone and all combined, then the repetition penalty; each filter of a case drops tokens the ones before
# it kept, and no top-p cut falls inside a group of tied logits (both checked below).
SMALL_OPTIONS: dict[str, Options] = {
    "temperature": {"temperature": 0.7},
    "top_k": {"temperature": 0.7, "top_k": 12},
    "top_p": {"temperature": 0.7, "top_p": 0.8},
    "min_p": {"temperature": 0.7, "min_p": 0.1},
    "combined": {"temperature": 0.7, "min_p": 0.01, "top_k": 24, "top_p": 0.9},
    "repetition_penalty": {"temperature": 1.3, "repetition_penalty": 1.3},
    "penalty_and_filters": {"temperature": 0.7, "repetition_penalty": 1.2, "top_k": 30, "top_p": 0.9, "min_p": 0.005},
}
LARGE_OPTIONS: dict[str, Options] = {
    "temperature": {"temperature": 0.7},
    "combined": {"temperature": 1.0, "min_p": 3e-4, "top_k": 100, "top_p": 0.95},
    "repetition_penalty": {"temperature": 1.3, "repetition_penalty": 1.3},
}
FILTERS = ("min_p", "top_k", "top_p")  # in the order they apply, after the penalty and the temperature
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def small_logits() -> torch.Tensor:
    """(64,) float64 logits, roughly standard normal: positive and negative ones for the repetition penalty."""
    return torch.randn(SMALL_VOCAB, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def lm_like_logits() -> torch.Tensor:
    """(49152,) float64 logits with the shape of SmolLM2-135M-Instruct's on arithmetic prompts: the r-th largest
    about 26 - 1.55 ln r (at temperature 1 the top token has 0.45 of the mass and the tokens past the 100th 0.05).

    The most likely tokens sit where a block-by-block inversion could be off by one: at both ends of the vocabulary
    and at the edges of power-of-two blocks; the rest are placed at random.
    """
    generator = torch.Generator().manual_seed(0)
    rank = torch.arange(1, LARGE_VOCAB + 1, dtype=torch.float64)
    noise = 0.4 * torch.randn(LARGE_VOCAB, generator=generator, dtype=torch.float64)
    by_rank = 26.0 - 1.55 * rank.log() - 3e-4 * rank + noise
    edges = torch.tensor([0, 255, 256, 511, 512, 24575, 24576, 1023, 1024, LARGE_VOCAB - 1])
    rest = torch.ones(LARGE_VOCAB, dtype=torch.bool)
    rest[edges] = False
    rest_places = rest.nonzero().squeeze(-1)
    places = torch.cat([edges, rest_places[torch.randperm(rest_places.numel(), generator=generator)]])
    logits = torch.empty(LARGE_VOCAB, dtype=torch.float64)
    logits[places] = by_rank.sort(descending=True).values
    return logits


def seen_tokens(vocab: int) -> torch.Tensor:
    """(vocab,) bool: a quarter of the tokens, as a prompt and the completion so far."""
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[: vocab // 4]] = True
    return seen


def case(vocab: int, name: str, dtype: torch.dtype) -> tuple[torch.Tensor, Options]:
    """The logits (`dtype`) and the sampling options of one test case."""
    logits = (small_logits() if vocab == SMALL_VOCAB else lm_like_logits()).to(dtype)
    options = dict((SMALL_OPTIONS if vocab == SMALL_VOCAB else LARGE_OPTIONS)[name])
    if "repetition_penalty" in options:
        options["seen"] = seen_tokens(vocab)
    return logits, options


# -- the target, in float64 -------------------------------------------------------------------------------------------


def target_probabilities(logits: torch.Tensor, options: Options) -> torch.Tensor:
    """(vocab,) float64: the distribution `options` define over `logits` (vocab,), in vLLM's order: the repetition
    penalty (a seen token's positive logit divided by it, a negative one multiplied), `/ temperature`, min-p, top-k
    (ties with the k-th kept), then top-p as vLLM's `apply_top_k_top_p` cuts it: sorted ascending, a token is dropped
    while the running mass up to it is at most `1 - top_p`.

    Raises:
        AssertionError: the top-p cut is ambiguous (it falls inside a group of tied logits, or within 1e-5 of the
            running mass), so a sampler's set may differ by rounding or sort order; choose other options.
    """
    scores = logits.double()
    penalty = options.get("repetition_penalty", 1.0)
    if penalty != 1.0:
        penalized = torch.where(scores > 0, scores / penalty, scores * penalty)
        scores = torch.where(options["seen"], penalized, scores)
    scores = scores / options.get("temperature", 1.0)
    if options.get("min_p"):
        probs = scores.softmax(dim=-1)
        scores = scores.masked_fill(probs < options["min_p"] * probs.max(), -math.inf)
    if options.get("top_k"):
        kth = scores.sort(descending=True).values[options["top_k"] - 1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if options.get("top_p", 1.0) < 1.0:
        scores = _top_p_cut(scores, options["top_p"])
    return scores.softmax(dim=-1)


def _top_p_cut(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    ascending, order = scores.sort()
    running = ascending.softmax(dim=-1).cumsum(dim=-1)
    dropped = running <= 1 - top_p
    dropped[-1] = False
    kept_from = int(dropped.sum())  # the sorted position of the least likely kept token
    if kept_from == 0:
        return scores
    tied = ascending[kept_from] == ascending[kept_from - 1]
    near = (running[kept_from - 1 : kept_from + 1] - (1 - top_p)).abs().min() < 1e-5
    assert not (tied or near), f"top_p={top_p} cuts inside tied logits or within rounding of the running mass"
    return scores.index_fill(0, order[dropped], -math.inf)


# -- the samplers -----------------------------------------------------------------------------------------------------


def decode_step_sampler(logits: torch.Tensor, options: Options, uniform: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What `ContinuousBatch._sample` does for rows whose logits are all `logits`: with only a temperature (where the
    kernel runs), the fused `cdf_draw.draw` on the logits in their dtype; else `sampling_scores` on a batch of the
    rows, then `draw` with one uniform per row, both in place on buffers of their own. The scores are computed for a
    batch of 8 rows (each row's are its own) and copied to the drawn rows, which keeps the top-p sort off the many
    draws."""
    sampling = SamplingOptions(**{key: value for key, value in options.items() if key != "seen"})
    if sampling.temperature_only and cdf_draw.available():
        return _draw_in_chunks(logits, uniform, lambda chunk, u: cdf_draw.draw(chunk, u, sampling.temperature))
    rows = 8
    seen = options.get("seen")
    keywords = {key: value for key, value in options.items() if key != "seen"}
    batch = logits[None].expand(rows, -1).clone()
    seen_rows = None if seen is None else seen[None].expand(rows, -1)
    scores = sampling_scores(batch, seen=seen_rows, overwrite=True, **keywords)
    assert torch.equal(scores[0], scores[-1])
    return _draw_in_chunks(scores[0], uniform, lambda chunk, u: draw(chunk, u, overwrite=True))


def _draw_in_chunks(
    scores: torch.Tensor, uniform: torch.Tensor, draw_chunk: Callable[[torch.Tensor, torch.Tensor], Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`draw_chunk(rows of scores, their uniforms)` over all of `uniform`, a few MB of rows at a time, into one
    reused buffer (each chunk's draw overwrites it)."""
    chunk = max(1, (1 << 21) // scores.numel())
    buffer = torch.empty(chunk, scores.numel(), dtype=scores.dtype)
    tokens, logprobs = [], []
    for start in range(0, uniform.numel(), chunk):
        u = uniform[start : start + chunk]
        rows = buffer[: u.numel()]
        rows.copy_(scores.expand_as(rows))
        token, logprob = draw_chunk(rows, u)
        tokens.append(token)
        logprobs.append(logprob)
    return torch.cat(tokens), torch.cat(logprobs)


def uniforms(count: int, seed: int) -> torch.Tensor:
    """One uniform per draw, as the generator takes them: float32 from a seeded `torch.Generator`."""
    return torch.rand(count, generator=torch.Generator().manual_seed(seed))


# -- the checks -------------------------------------------------------------------------------------------------------


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """Pearson's chi-square of the drawn `tokens` against `probs` (vocab,): tokens taken from the most likely down,
    pooled until a bin expects `MIN_EXPECTED` draws (the last bin takes what is left). Tokens of probability 0 are
    left out (`exactness_failures` counts draws of them).

    Returns:
        `(statistic, degrees of freedom, p-value)`.
    """
    draws = tokens.numel()
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    order = probs.argsort(descending=True, stable=True)
    order = order[probs[order] > 0]
    expected, observed = (probs[order] * draws).tolist(), counts[order].tolist()
    bins: list[list[float]] = []
    pending = [0.0, 0.0]
    for e, o in zip(expected, observed, strict=True):
        pending = [pending[0] + e, pending[1] + o]
        if pending[0] >= MIN_EXPECTED:
            bins.append(pending)
            pending = [0.0, 0.0]
    if bins:
        bins[-1] = [bins[-1][0] + pending[0], bins[-1][1] + pending[1]]
    expected_bins, observed_bins = torch.tensor(bins, dtype=torch.float64).unbind(-1)
    statistic = float(((observed_bins - expected_bins) ** 2 / expected_bins).sum())
    dof = len(bins) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))
    return statistic, dof, p_value


def exactness_failures(tokens: torch.Tensor, logprobs: torch.Tensor, probs: torch.Tensor) -> list[str]:
    """What is wrong with draws `tokens` and their recorded `logprobs` against the target `probs`: draws of a token
    outside the kept set, a chi-square p-value under `ALPHA`, a log-probability off by more than `LOGPROB_ATOL`."""
    failures = []
    outside = int((probs[tokens] == 0).sum())
    if outside:
        failures.append(f"{outside} draws of tokens outside the kept set")
    statistic, dof, p_value = chi_square(tokens, probs)
    if p_value < ALPHA:
        failures.append(f"frequencies off the target: chi-square {statistic:.1f} on {dof} dof, p = {p_value:.2e}")
    error = (logprobs.double() - probs[tokens].log()).abs().max().item()
    if not error <= LOGPROB_ATOL:
        failures.append(f"recorded log-probabilities off by up to {error:.2e}")
    return failures


def check_case(sampler: Sampler, vocab: int, name: str, dtype: torch.dtype) -> list[str]:
    """`exactness_failures` of `sampler`'s draws in one case (each case has its own seed, the same for every
    sampler)."""
    logits, options = case(vocab, name, dtype)
    probs = target_probabilities(logits, options)
    draws, names = (SMALL_DRAWS, SMALL_OPTIONS) if vocab == SMALL_VOCAB else (LARGE_DRAWS, LARGE_OPTIONS)
    tokens, logprobs = sampler(logits, options, uniforms(draws, seed=list(names).index(name)))
    return exactness_failures(tokens, logprobs, probs)


# -- the generator's sampler ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("name", SMALL_OPTIONS)
def test_decode_step_sampler_is_exact_over_a_small_vocabulary(name, dtype):
    assert check_case(decode_step_sampler, SMALL_VOCAB, name, dtype) == []


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("name", LARGE_OPTIONS)
def test_decode_step_sampler_is_exact_over_an_lm_vocabulary(name, dtype):
    assert check_case(decode_step_sampler, LARGE_VOCAB, name, dtype) == []


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_each_filter_of_each_case_drops_tokens(dtype):
    """The cases test what they name: each filter removes tokens that the ones before it kept."""
    for vocab, names in ((SMALL_VOCAB, SMALL_OPTIONS), (LARGE_VOCAB, LARGE_OPTIONS)):
        for name in names:
            logits, options = case(vocab, name, dtype)
            applied = {key: value for key, value in options.items() if key not in FILTERS}
            kept = int((target_probabilities(logits, applied) > 0).sum())
            for key in (key for key in FILTERS if key in options):
                applied[key] = options[key]
                now = int((target_probabilities(logits, applied) > 0).sum())
                assert now < kept, f"case {name!r} over {vocab} tokens: {key} drops nothing"
                kept = now


# -- negative controls: the same checks fail a sampler with a known bias ----------------------------------------------


def _scores(logits: torch.Tensor, options: Options) -> torch.Tensor:
    seen = options.get("seen")
    keywords = {key: value for key, value in options.items() if key != "seen"}
    return sampling_scores(logits[None], seen=None if seen is None else seen[None], **keywords)[0]


def _invert_whole_cdf(cdf: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    token = torch.searchsorted(cdf, (uniform[:, None] * cdf[:, -1:]).to(cdf.dtype), right=True).squeeze(-1)
    return token.clamp_(max=cdf.shape[-1] - 1)


def cdf_in_bfloat16(logits: torch.Tensor, options: Options, uniform: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Inverts a CDF whose running sums are rounded to bfloat16; records the exact log-probabilities."""
    logprobs = _scores(logits, options).log_softmax(dim=-1)

    def draw_chunk(rows: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        token = _invert_whole_cdf(rows.exp().bfloat16().cumsum(dim=-1), u)
        return token, rows.gather(-1, token[:, None]).squeeze(-1)

    return _draw_in_chunks(logprobs, uniform, draw_chunk)


def tail_dropped(logits: torch.Tensor, options: Options, uniform: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Draws only among tokens of probability >= 1e-4 (a shortlist), recording their untruncated log-probabilities."""
    logprobs = _scores(logits, options).log_softmax(dim=-1)
    shortlist = logprobs.masked_fill(logprobs < math.log(1e-4), -math.inf)
    tokens, _ = _draw_in_chunks(shortlist, uniform, lambda rows, u: draw(rows, u))
    return tokens, logprobs[tokens]


def temperature_twice(logits: torch.Tensor, options: Options, uniform: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Divides by the temperature a second time before drawing; records the once-divided log-probabilities."""
    scores = _scores(logits, options)
    tokens, _ = _draw_in_chunks(scores / options["temperature"], uniform, lambda rows, u: draw(rows, u))
    return tokens, scores.log_softmax(dim=-1)[tokens]


def untruncated_logprobs(logits: torch.Tensor, options: Options, uniform: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Draws exactly, but records log-probabilities of the tempered distribution before min-p/top-k/top-p."""
    tokens, _ = decode_step_sampler(logits, options, uniform)
    untruncated = {key: options[key] for key in ("temperature", "repetition_penalty", "seen") if key in options}
    return tokens, _scores(logits, untruncated).log_softmax(dim=-1)[tokens]


@pytest.mark.parametrize(
    ("sampler", "vocab", "name", "failure"),
    [
        (cdf_in_bfloat16, SMALL_VOCAB, "temperature", "frequencies off the target"),
        (tail_dropped, LARGE_VOCAB, "repetition_penalty", "frequencies off the target"),
        (temperature_twice, SMALL_VOCAB, "penalty_and_filters", "frequencies off the target"),
        (untruncated_logprobs, SMALL_VOCAB, "combined", "recorded log-probabilities off"),
    ],
    ids=["cdf_in_bfloat16", "tail_dropped", "temperature_twice", "untruncated_logprobs"],
)
def test_a_biased_sampler_fails_the_checks(sampler, vocab, name, failure):
    failures = check_case(sampler, vocab, name, torch.float32)
    assert any(f.startswith(failure) for f in failures), failures
