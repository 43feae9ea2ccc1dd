"""`draw`, the embedded generator's sampler, and `cdf_draw.draw`, its fused form for a temperature alone: the
block-by-block inversion of each row's CDF against the whole row's inversion in float64, the log-probabilities
against `log_softmax`, and the tokens they must never draw."""

from __future__ import annotations

import pytest
import torch

from lightning_grpo.rollout import cdf_draw
from lightning_grpo.rollout.sampling import draw, process_logits, sample_from_logprobs, sampling_scores


def torch_draw(logits: torch.Tensor, uniform: torch.Tensor, temperature: float = 1.0):
    return draw(sampling_scores(logits, temperature), uniform)


def fused_draw(logits: torch.Tensor, uniform: torch.Tensor, temperature: float = 1.0):
    if not cdf_draw.available():
        pytest.skip(f"{cdf_draw.unavailable_reason()}")
    return cdf_draw.draw(logits, uniform, temperature)


DRAWS = pytest.mark.parametrize("drawer", [torch_draw, fused_draw], ids=["torch", "fused"])


def whole_row_inversion(scores: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first entry whose running sum of softmax(scores) passes `uniform`, in float64; and the distance of
    `uniform` from the nearest CDF step (draws that close to a step may differ by rounding)."""
    cdf = torch.softmax(scores.double(), dim=-1).cumsum(dim=-1)
    cdf = cdf / cdf[:, -1:]
    token = torch.searchsorted(cdf, uniform.double()[:, None], right=True).squeeze(-1)
    margin = (cdf - uniform.double()[:, None]).abs().amin(dim=-1)
    return token, margin


@DRAWS
@pytest.mark.parametrize("vocab", [49152, 1000, 6])
def test_draw_inverts_each_rows_cdf_as_a_whole_row_inversion_does(vocab, drawer):
    generator = torch.Generator().manual_seed(vocab)
    rows = 512
    scores = torch.randn(rows, vocab, generator=generator) * 4
    uniform = torch.rand(rows, generator=generator)
    token, _ = drawer(scores, uniform)
    expected, margin = whole_row_inversion(scores, uniform)
    clear = margin > 2e-6  # not within float32 rounding of a step of the CDF
    assert clear.float().mean() > 0.8
    assert torch.equal(token[clear], expected[clear])


def test_draw_gives_the_log_probability_log_softmax_gives_the_drawn_token():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 49152, generator=generator) * 3
    token, logprob = draw(sampling_scores(logits, 0.7, top_k=500, top_p=0.9), torch.rand(64, generator=generator))
    expected = process_logits(logits, 0.7, top_k=500, top_p=0.9).gather(-1, token[:, None]).squeeze(-1)
    assert torch.isfinite(expected).all()  # a kept token
    torch.testing.assert_close(logprob, expected, atol=1e-5, rtol=0)


@DRAWS
def test_draw_never_lands_on_a_dropped_token_at_the_ends_or_past_an_empty_block(drawer):
    """Only tokens 300 and 700 kept: whole blocks of the inversion hold no mass, and the padding past the last entry
    (vocabulary 1000 is not a multiple of the block) holds none either."""
    scores = torch.full((4, 1000), float("-inf"))
    scores[:, 300] = 0.0
    scores[:, 700] = 1.0
    uniform = torch.tensor([0.0, 0.2, 1.0 - 2**-24, 1.0])  # 1.0 stands for a product rounded up to the total
    token, logprob = drawer(scores, uniform)
    assert token.tolist() == [300, 300, 700, 700]
    assert torch.isfinite(logprob).all()
    assert sample_from_logprobs(torch.log_softmax(scores, dim=-1), uniform).tolist() == [300, 300, 700, 700]


@DRAWS
def test_draw_is_unbiased_over_many_draws(drawer):
    logits = torch.tensor([[-3.0, 2.0, 1.0, 0.5, -1.0, 0.0]]).expand(40000, -1)
    token, _ = drawer(logits, torch.rand(40000, generator=torch.Generator().manual_seed(0)), 0.8)
    counts = torch.bincount(token, minlength=6).float() / 40000
    torch.testing.assert_close(counts, torch.softmax(logits[0] / 0.8, dim=-1), atol=0.01, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_fused_draw_is_draw_of_the_scaled_scores_and_their_log_softmax(dtype, temperature, vector_build):
    """Strided bf16 or float32 logits, read as they are: the same tokens as `draw` on `sampling_scores` (but where a
    uniform falls within float32 rounding of a CDF step) and the log-probability `log_softmax` gives them (to 1e-5,
    well inside the generator's 1e-4)."""
    if not cdf_draw.available():
        pytest.skip(f"{cdf_draw.unavailable_reason()}")
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 5000 + 7, generator=generator) * 3).to(dtype)[:, 7:]
    uniform = torch.rand(64, generator=generator)
    token, logprob = cdf_draw.draw(logits, uniform, temperature)
    expected, _ = draw(sampling_scores(logits, temperature), uniform)
    assert (token == expected).float().mean() >= 0.95
    log_softmax = process_logits(logits, temperature).gather(-1, token[:, None]).squeeze(-1)
    torch.testing.assert_close(logprob, log_softmax, atol=1e-5, rtol=0)  # float32 sums of 5000 in another order
    with pytest.raises(ValueError, match="temperature > 0; got .* temperature 0.0. Use sampling.draw"):
        cdf_draw.draw(logits, uniform, 0.0)


def test_overwriting_draw_gives_what_a_copying_draw_gives_and_only_overwrites_when_asked():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 4096, generator=generator) * 3
    uniform = torch.rand(16, generator=generator)
    kept = logits.clone()
    token, logprob = draw(sampling_scores(logits, 0.7), uniform)
    assert torch.equal(logits, kept)  # neither the scaling nor the draw wrote into the caller's logits
    owned = logits.clone()
    owned_token, owned_logprob = draw(sampling_scores(owned, 0.7, overwrite=True), uniform, overwrite=True)
    assert not torch.equal(owned, kept)  # scaled and exponentiated in place
    assert torch.equal(owned_token, token)
    torch.testing.assert_close(owned_logprob, logprob, atol=1e-6, rtol=0)


def test_switched_off_the_fused_draw_refuses_and_says_why(fresh_kernel_state):
    fresh_kernel_state.setenv(cdf_draw.ENV_SWITCH, "0")
    assert not cdf_draw.available() and cdf_draw.unavailable_reason() == f"{cdf_draw.ENV_SWITCH}=0"
    with pytest.raises(RuntimeError, match="cannot run here: LIGHTNING_GRPO_CDF_DRAW=0"):
        cdf_draw.draw(torch.zeros(1, 8), torch.zeros(1))
