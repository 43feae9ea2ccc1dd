"""The chunked label log-probability and entropy (`selected_logprobs`): the plain autograd formula's values and
gradients on random logits (temperatures, bf16, empty, chunk boundaries, minus-infinite logits), `gradcheck`, and
`packed_logprobs` on the tiny model against the plain formula on the model's own logits; the C kernel against torch's
chunks (each vector build, 1 and 2 threads, strided rows), and its refusals."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny import micro_batch, shared_prompt_group
from helpers.vector_builds import BUILDS, vector_build

from lightning_grpo.models import tiny_llama
from lightning_grpo.training import selected_logprobs as selected_logprobs_module
from lightning_grpo.training.attention import tree_model_kwargs, use_tree_attention
from lightning_grpo.training.loss import packed_logprobs
from lightning_grpo.training.selected_logprobs import ENV_SWITCH, kernel_unavailable_reason, selected_logprobs

VOCAB = 1000


def plain(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused formula: log-softmax of the float32 scaled logits at the labels, and the entropy lse - sum(p * s)
    of the same scaled logits in float64 (float32's lse - sum(p * s) loses ~1e-5 to cancellation at large logits;
    `selected_logprobs`'s shifted form is closer to the exact value, see `assert_entropy_close`)."""
    scaled = logits.float() / temperature
    logprobs = torch.log_softmax(scaled, -1).gather(1, labels[:, None]).squeeze(1)
    return logprobs, _plain_entropy(scaled.detach().double())


def logsumexp_form(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> tuple[torch.Tensor, None]:
    """The label log-probability as `packed_logprobs` computes it for truncated distributions (`gather - logsumexp`):
    `selected_logprobs` takes the same steps, so its values and gradient are this formula's to the last bit."""
    scaled = logits.float() / temperature
    return scaled.gather(1, labels[:, None]).squeeze(1) - torch.logsumexp(scaled, -1), None


def _plain_entropy(scaled: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(scaled, -1)
    return torch.logsumexp(scaled, -1) - (probs * torch.where(torch.isfinite(scaled), scaled, 0.0)).sum(-1)


def assert_entropy_close(entropy: torch.Tensor, exact: torch.Tensor, scaled: torch.Tensor) -> None:
    """Within float32 rounding of the exact entropy, and no further from it than the plain float32 formula."""
    assert entropy.dtype == torch.float32
    error = (entropy.double() - exact).abs()
    assert (error <= 5e-6 + 1e-6 * exact.abs()).all(), error.max()
    plain_error = (_plain_entropy(scaled.detach().float()).double() - exact).abs()
    assert error.sum() <= plain_error.sum() + 1e-6 * error.numel()


def random_case(rows: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits with a spread like a model's, labels that include the first and last token ids, an upstream grad."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, VOCAB, generator=gen) * 4).to(dtype)
    labels = torch.randint(0, VOCAB, (rows,), generator=gen)
    labels[: min(rows, 2)] = torch.tensor([0, VOCAB - 1])[: min(rows, 2)]
    return logits, labels, torch.randn(rows, generator=gen)


def values_and_grad(fn, logits, labels, upstream, temperature):
    x = logits.clone().requires_grad_()
    logprobs, entropy = fn(x, labels, temperature)
    (logprobs * upstream).sum().backward()
    return logprobs.detach(), entropy, x.grad


@pytest.mark.parametrize(
    ("rows", "chunk_rows", "temperature"),
    [
        (37, 16, 1.0),  # not a multiple of the chunk
        (37, 16, 0.7),
        (32, 16, 1.3),  # a multiple
        (5, 16, 0.7),  # smaller than one chunk
        (9, 1, 0.7),  # one row a chunk
        (0, 16, 0.7),  # no terms
    ],
)
def test_float32_values_and_gradient_equal_the_plain_formula(rows, chunk_rows, temperature):
    logits, labels, upstream = random_case(rows, torch.float32)
    got = values_and_grad(
        lambda x, y, t: selected_logprobs(x, y, t, chunk_rows=chunk_rows, kernel=False),
        logits,
        labels,
        upstream,
        temperature,
    )
    expected = values_and_grad(plain, logits, labels, upstream, temperature)
    assert got[0].dtype == got[1].dtype == torch.float32 and got[0].shape == got[1].shape == (rows,)
    assert got[2].dtype == torch.float32 and got[2].shape == (rows, VOCAB)
    assert not got[1].requires_grad
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-6)
    assert_entropy_close(got[1], expected[1], logits / temperature)
    torch.testing.assert_close(got[2], expected[2], rtol=1e-6, atol=1e-6)
    same = values_and_grad(logsumexp_form, logits, labels, upstream, temperature)
    assert torch.equal(got[0], same[0]) and torch.equal(got[2], same[2])


def test_bfloat16_logits_are_computed_in_float32_and_get_a_bfloat16_gradient():
    logits, labels, upstream = random_case(37, torch.bfloat16, seed=1)
    got = values_and_grad(
        lambda x, y, t: selected_logprobs(x, y, t, chunk_rows=16, kernel=False), logits, labels, upstream, 0.7
    )
    expected = values_and_grad(plain, logits, labels, upstream, 0.7)
    assert got[0].dtype == got[1].dtype == torch.float32 and got[2].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-6)
    assert_entropy_close(got[1], expected[1], logits.float() / 0.7)
    # both round a float32 gradient to bfloat16; they may differ by the last bit where it sits on a rounding boundary
    torch.testing.assert_close(got[2].float(), expected[2].float(), rtol=2**-7, atol=1e-6)
    same = values_and_grad(logsumexp_form, logits, labels, upstream, 0.7)
    assert torch.equal(got[0], same[0]) and torch.equal(got[2], same[2])


def test_without_grad_and_in_inference_mode_the_values_are_the_same():
    logits, labels, _ = random_case(21, torch.float32, seed=2)
    expected = plain(logits, labels, 0.7)
    with torch.no_grad():
        no_grad = selected_logprobs(logits.clone().requires_grad_(), labels, 0.7, chunk_rows=8)
    with torch.inference_mode():
        inference = selected_logprobs(logits, labels, 0.7, chunk_rows=8)
    for logprobs, entropy in (no_grad, inference, selected_logprobs(logits, labels, 0.7, chunk_rows=8)):
        assert not logprobs.requires_grad and not entropy.requires_grad
        torch.testing.assert_close(logprobs, expected[0], rtol=1e-6, atol=1e-6)
        assert_entropy_close(entropy, expected[1], logits / 0.7)


def test_under_autocast_the_arithmetic_stays_in_float32():
    """Lightning's `precision="bf16-mixed"` runs the loss under CPU autocast, which would run the entropy's batched
    product in bf16: the function's arithmetic is the same with and without it."""
    logits, labels, upstream = random_case(37, torch.float32, seed=5)
    expected = values_and_grad(lambda x, y, t: selected_logprobs(x, y, t, chunk_rows=16), logits, labels, upstream, 0.7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = values_and_grad(lambda x, y, t: selected_logprobs(x, y, t, chunk_rows=16), logits, labels, upstream, 0.7)
    for value, reference in zip(got, expected, strict=True):
        assert value.dtype == reference.dtype and torch.equal(value, reference)


def test_a_minus_infinite_logit_has_probability_zero_and_no_entropy_term():
    logits, labels, upstream = random_case(6, torch.float32, seed=3)
    logits[1, 5] = logits[4, :10] = float("-inf")
    labels[4] = 20
    got = values_and_grad(
        lambda x, y, t: selected_logprobs(x, y, t, chunk_rows=4, kernel=False), logits, labels, upstream, 0.7
    )
    expected = values_and_grad(plain, logits, labels, upstream, 0.7)
    assert torch.isfinite(got[1]).all()
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-6)
    assert_entropy_close(got[1], expected[1], logits / 0.7)
    torch.testing.assert_close(got[2], expected[2], rtol=1e-6, atol=1e-6)


def test_gradcheck_in_float64():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 7, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.tensor([0, 6, 3, 3, 1])
    assert torch.autograd.gradcheck(lambda x: selected_logprobs(x, labels, 0.7, chunk_rows=2)[0], (logits,))
    logprobs, entropy = selected_logprobs(logits, labels, 0.7, chunk_rows=2)
    assert logprobs.dtype == entropy.dtype == torch.float64


def test_bad_arguments_are_rejected():
    logits, labels, _ = random_case(3, torch.float32)
    with pytest.raises(ValueError, match="temperature=0"):
        selected_logprobs(logits, labels, 0.0)
    with pytest.raises(ValueError, match="labels"):
        selected_logprobs(logits, labels[:2])
    with pytest.raises(ValueError, match="chunk_rows=0"):
        selected_logprobs(logits, labels, chunk_rows=0)


def test_packed_logprobs_equals_the_plain_formula_on_the_models_logits_with_the_same_parameter_gradients():
    samples = shared_prompt_group(9, [6, 4, 8], seed=4) + shared_prompt_group(5, [7, 7], group_id=1, uid0=3, seed=5)
    mb = micro_batch(samples)
    labels = mb["shift_labels"][mb["token_index"]]
    upstream = torch.randn(labels.numel(), generator=torch.Generator().manual_seed(0))
    fused_model, reference_model = tiny_llama(0), tiny_llama(0)

    logprobs, entropy = packed_logprobs(fused_model, mb, 0.7)
    (logprobs * upstream).sum().backward()

    use_tree_attention(reference_model)
    logits = reference_model(**tree_model_kwargs(mb), logits_to_keep=mb["token_index"], use_cache=False).logits[0]
    expected, expected_entropy = plain(logits, labels, 0.7)
    (expected * upstream).sum().backward()

    assert logprobs.shape == (labels.numel(),) and not entropy.requires_grad
    torch.testing.assert_close(logprobs, expected.detach(), rtol=1e-6, atol=1e-6)
    assert_entropy_close(entropy, expected_entropy, logits / 0.7)
    for (name, got), ref in zip(fused_model.named_parameters(), reference_model.parameters(), strict=True):
        # float32 rounding of the logits' gradient (log_softmax and logsumexp sum in other orders), carried through
        # the model: within 1e-6 of each gradient's scale
        scale = max(1.0, ref.grad.abs().max().item())
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-5, atol=1e-6 * scale, msg=name)


# -- the C kernel ------------------------------------------------------------------------------------------------------


@pytest.fixture(params=BUILDS)
def kernel_build(request, monkeypatch):
    """The kernel as built for this CPU (AVX-512's 16 lanes where torch runs AVX-512), then its AVX2 build; a CPU
    where it cannot run fails the test (the suite's machines all run it)."""
    with vector_build(request.param, monkeypatch, selected_logprobs_module._load.cache_clear):
        assert kernel_unavailable_reason() is None
        yield request.param


def assert_kernel_matches_chunks(logits, labels, upstream, temperature):
    """The kernel's values and gradient against torch's chunks': within float32 rounding (a few units in the last
    place of the log-normaliser), the gradient within bf16 rounding where it is bf16."""
    got = values_and_grad(
        lambda x, y, t: selected_logprobs(x, y, t, kernel=True), logits, labels, upstream, temperature
    )
    chunks = values_and_grad(
        lambda x, y, t: selected_logprobs(x, y, t, kernel=False), logits, labels, upstream, temperature
    )
    assert [v.dtype for v in got] == [v.dtype for v in chunks] and [v.shape for v in got] == [v.shape for v in chunks]
    assert not got[1].requires_grad
    torch.testing.assert_close(got[0], chunks[0], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(got[1], chunks[1], rtol=1e-6, atol=1e-5)
    rtol = 2**-7 if logits.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got[2].float(), chunks[2].float(), rtol=rtol, atol=1e-7)
    return got


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("dtype", "temperature"), [(torch.float32, 1.0), (torch.float32, 0.7), (torch.bfloat16, 0.7)])
@pytest.mark.parametrize("rows", [37, 1, 0])
def test_the_kernel_gives_the_chunks_values_and_gradient_within_float32_rounding(
    kernel_build, threads, dtype, temperature, rows
):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        logits, labels, upstream = random_case(rows, dtype, seed=6)
        # a vocabulary that is no multiple of the vector width: the rows' tails run lane by lane
        logits, labels = logits[:, : VOCAB - 3], labels.clamp(max=VOCAB - 4)
        got = assert_kernel_matches_chunks(logits.contiguous(), labels, upstream, temperature)
        expected = values_and_grad(plain, logits, labels, upstream, temperature)
        assert_entropy_close(got[1], expected[1], logits.float() / temperature)
    finally:
        torch.set_num_threads(previous)


def test_the_kernel_reads_strided_rows_and_leaves_minus_infinite_logits_out(kernel_build):
    logits, labels, upstream = random_case(6, torch.float32, seed=7)
    wide = torch.cat([logits, torch.zeros(6, 5)], dim=1)
    wide[1, 5] = wide[4, :10] = float("-inf")
    labels[4] = 20
    strided = wide[:, :VOCAB]
    assert strided.stride(0) == VOCAB + 5
    got = assert_kernel_matches_chunks(strided, labels, upstream, 0.7)
    assert torch.isfinite(got[1]).all()
    assert (got[2][4, :10] == 0).all()  # probability 0: no gradient
    expected = values_and_grad(plain, strided, labels, upstream, 0.7)
    assert_entropy_close(got[1], expected[1], strided / 0.7)


def test_by_default_the_kernel_computes_cpu_logits_and_torch_the_rest():
    logits, labels, _ = random_case(9, torch.float32, seed=8)
    kernel = selected_logprobs(logits, labels, 0.7, kernel=True)
    assert all(torch.equal(a, b) for a, b in zip(selected_logprobs(logits, labels, 0.7), kernel, strict=True))
    chunks = selected_logprobs(logits.double(), labels, 0.7)  # float64: torch's chunks
    torch.testing.assert_close(chunks[0].float(), kernel[0], rtol=1e-6, atol=1e-5)
    column_strided = logits.t().contiguous().t()
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            selected_logprobs(column_strided, labels, 0.7),
            selected_logprobs(logits, labels, 0.7, kernel=False),
            strict=True,
        )
    )
    with pytest.raises(RuntimeError, match=r"rows are contiguous.*Pass kernel=None"):
        selected_logprobs(column_strided, labels, 0.7, kernel=True)
    with pytest.raises(RuntimeError, match=r"float32 or bf16 logits on a CPU, not torch.float64"):
        selected_logprobs(logits.double(), labels, 0.7, kernel=True)


def test_the_kernel_refuses_labels_outside_the_vocabulary_before_reading_any():
    logits, labels, _ = random_case(3, torch.float32)
    for bad in (VOCAB, -1):
        labels[1] = bad
        with pytest.raises(ValueError, match=rf"token ids in \[0, {VOCAB}\), got {min(bad, 0)} to"):
            selected_logprobs(logits, labels)


def test_switched_off_the_kernel_says_why_and_torch_computes(monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "0")
    selected_logprobs_module._load.cache_clear()
    try:
        assert kernel_unavailable_reason() == f"{ENV_SWITCH}=0"
        logits, labels, upstream = random_case(5, torch.float32, seed=9)
        default = values_and_grad(selected_logprobs, logits, labels, upstream, 0.7)
        chunks = values_and_grad(
            lambda x, y, t: selected_logprobs(x, y, t, kernel=False), logits, labels, upstream, 0.7
        )
        assert all(torch.equal(a, b) for a, b in zip(default, chunks, strict=True))
        with pytest.raises(RuntimeError, match=f"cannot run: {ENV_SWITCH}=0"):
            selected_logprobs(logits, labels, 0.7, kernel=True)
    finally:
        monkeypatch.undo()
        selected_logprobs_module._load.cache_clear()


def test_logits_the_kernel_does_not_take_never_build_it(monkeypatch):
    """float64 logits (as logits on an accelerator) go to torch's chunks without the kernel being built or loaded."""
    monkeypatch.setattr(selected_logprobs_module, "_load", lambda: pytest.fail("the kernel was loaded"))
    logits, labels, _ = random_case(3, torch.float64, seed=10)
    logprobs, _ = selected_logprobs(logits, labels, 0.7)
    torch.testing.assert_close(logprobs, plain(logits, labels, 0.7)[0].double(), rtol=1e-6, atol=1e-6)
