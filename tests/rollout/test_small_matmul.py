"""The embedded generator's small-batch linear kernel: its products against float64, every shape's leftovers, rows
independent of their batch, the tensors it refuses, the build and its fallbacks, and the decoder's use of it."""

from __future__ import annotations

import platform
import shutil

import pytest
import torch
import torch.nn.functional as F

from lightning_grpo.models import tiny_llama
from lightning_grpo.rollout import native_build, small_matmul
from lightning_grpo.rollout.decoder import SlotDecoder

x86_with_avx2 = platform.machine().lower() in {"x86_64", "amd64"} and torch.backends.cpu.get_cpu_capability() in {
    "AVX2",
    "AVX512",
}
needs_kernel = pytest.mark.skipif(not small_matmul.available(), reason=f"{small_matmul.unavailable_reason()}")


def test_the_kernel_runs_on_an_x86_cpu_with_avx2_and_a_c_compiler():
    if not (x86_with_avx2 and (shutil.which("cc") or shutil.which("gcc"))):
        pytest.skip("not an x86 CPU with AVX2 and a C compiler: the kernel is not expected here")
    assert small_matmul.available(), small_matmul.unavailable_reason()
    assert small_matmul.unavailable_reason() is None


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 20, 64])
def test_products_match_float64_for_every_leftover_of_rows_columns_and_features(rows, threads, kernel_threads):
    """Columns not a multiple of 4 and features not a multiple of 8 run the kernel's leftover paths; with `threads`
    2 every weight is split between two threads."""
    kernel_threads(threads, small_matmul)
    generator = torch.Generator().manual_seed(rows)
    for columns in (1, 3, 4, 5, 13, 100):
        for features in (1, 3, 8, 9, 17, 64, 576):
            x = torch.randn(rows, features, generator=generator)
            weight = torch.randn(columns, features, generator=generator)
            bias = torch.randn(columns, generator=generator)
            for b in (None, bias):
                expected = F.linear(x.double(), weight.double(), None if b is None else b.double()).float()
                got = small_matmul.linear(x, weight, b)
                assert got.shape == (rows, columns) and got.dtype == torch.float32
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * features**0.5)


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_batch_or_the_threads(two_threads):
    """What makes a seeded completion the same alone or in a batch: each output is summed in one order."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(20, 576, generator=generator)
    weight = torch.randn(1536, 576, generator=generator)
    whole = small_matmul.linear(x, weight)
    for start, stop in ((0, 1), (7, 8), (3, 11), (18, 20), (0, 19)):
        assert torch.equal(small_matmul.linear(x[start:stop].contiguous(), weight), whole[start:stop])
    two_threads(small_matmul)
    assert torch.equal(small_matmul.linear(x, weight), whole)


@needs_kernel
def test_tensors_it_does_not_take_are_refused_with_their_shapes_and_types():
    x, weight = torch.randn(4, 8), torch.randn(6, 8)
    refused = {
        "float64": (x.double(), weight.double(), None),
        "transposed x": (torch.randn(8, 4).t(), weight, None),
        "transposed weight": (x, torch.randn(8, 6).t(), None),
        "too many rows": (torch.randn(small_matmul.MAX_ROWS + 1, 8), weight, None),
        "no rows": (torch.randn(0, 8), weight, None),
        "features differ": (torch.randn(4, 9), weight, None),
        "bias of another size": (x, weight, torch.randn(5)),
        "a batch dimension": (torch.randn(2, 4, 8), weight, None),
    }
    assert small_matmul.applies(x, weight, torch.randn(6))
    for what, (a, w, b) in refused.items():
        assert not small_matmul.applies(a, w, b), what
        with pytest.raises(ValueError, match=r"small_matmul.linear takes contiguous float32.*Use torch.nn.functional"):
            small_matmul.linear(a, w, b)


def test_the_off_switch_leaves_torchs_layers_and_says_so(fresh_kernel_state):
    fresh_kernel_state.setenv(small_matmul.ENV_SWITCH, "0")
    assert not small_matmul.available()
    assert small_matmul.unavailable_reason() == f"{small_matmul.ENV_SWITCH}=0"
    with pytest.raises(RuntimeError, match="cannot run here: LIGHTNING_GRPO_SMALL_MATMUL=0"):
        small_matmul.linear(torch.randn(2, 8), torch.randn(4, 8))


@pytest.mark.skipif(not x86_with_avx2, reason="the build is only tried on x86 CPUs with AVX2")
def test_a_failing_compiler_leaves_torchs_layers_and_the_decoder_exact(fresh_kernel_state, tmp_path, caplog):
    fresh_kernel_state.setenv("LIGHTNING_GRPO_CACHE", str(tmp_path))
    fresh_kernel_state.setenv("CC", shutil.which("false"))
    assert not small_matmul.available()
    assert "failed" in small_matmul.unavailable_reason() and "exited 1" in small_matmul.unavailable_reason()
    assert "small-batch kernel is off" in caplog.text
    assert not list((tmp_path / "kernels").iterdir())  # no half-written library left behind
    model = tiny_llama(seed=0).eval()
    step_logits = _one_decode_step(SlotDecoder(model))
    torch.testing.assert_close(step_logits, _full_forward_logits(model), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not (x86_with_avx2 and shutil.which("cc")), reason="needs an x86 CPU with AVX2 and cc")
def test_a_build_goes_into_the_cache_folder_once_per_source(fresh_kernel_state, tmp_path):
    fresh_kernel_state.setenv("LIGHTNING_GRPO_CACHE", str(tmp_path))
    first = native_build.build(small_matmul._SOURCE)
    assert first.parent == tmp_path / "kernels" and first.name.startswith("small_matmul-")
    stamp = first.stat().st_mtime_ns
    assert (
        native_build.build(small_matmul._SOURCE) == first and first.stat().st_mtime_ns == stamp
    )  # reused, not rebuilt
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [first.name]


PROMPT = [2, 40, 41, 42, 43]


def _one_decode_step(decoder: SlotDecoder, rows: int = 5) -> torch.Tensor:
    """Prefill `PROMPT` into `rows` slots, then one decode step in which row i feeds token 10 + i; its logits."""
    _, (prefix,) = decoder.step(torch.zeros(0, dtype=torch.long), [PROMPT])
    decoder.reserve(rows, len(PROMPT) + 1)
    decoder.load(prefix, list(range(rows)))
    logits, _ = decoder.step(torch.arange(rows) + 10, [])
    return logits


def _full_forward_logits(model, rows: int = 5) -> torch.Tensor:
    """What `_one_decode_step` must give: the model's own forward over `PROMPT` + [10 + i], last position."""
    ids = torch.tensor([[*PROMPT, 10 + i] for i in range(rows)])
    with torch.no_grad():
        return model(ids).logits[:, -1]


@needs_kernel
def test_the_decoder_runs_every_linear_layer_of_a_decode_step_through_the_kernel(monkeypatch):
    model = tiny_llama(seed=0).eval()
    reference = _one_decode_step(SlotDecoder(model, packed=False))  # built while the kernel is on
    calls = []
    linear = small_matmul.linear
    monkeypatch.setattr(small_matmul, "linear", lambda *args: calls.append(args[1].shape) or linear(*args))
    logits = _one_decode_step(SlotDecoder(model))
    layers = model.config.num_hidden_layers
    assert len(calls) == 2 * (7 * layers + 1)  # prefill and decode: q, k, v, o, gate, up, down per layer; the head
    torch.testing.assert_close(logits, reference, rtol=0, atol=0)
    torch.testing.assert_close(logits, _full_forward_logits(model), rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(small_matmul, "available", lambda: False)
    without = _one_decode_step(SlotDecoder(model))  # torch's layers
    torch.testing.assert_close(without, reference, rtol=1e-5, atol=1e-5)
