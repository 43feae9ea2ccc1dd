"""The CPU precision probe: a real fp32 vs bf16 timing on this machine, a valid verdict, cached per CPU and torch."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_grpo.models import dtype_probe
from lightning_grpo.models.dtype_probe import MIN_SPEEDUP, probe_matmul_precision

pytestmark = pytest.mark.usefixtures("unpinned_precision")  # the probe itself, not the suite's fp32 pin


def test_the_probe_names_a_dtype_by_its_measured_speeds_and_says_why(tmp_path):
    threads = torch.get_num_threads()
    verdict = probe_matmul_precision(tmp_path)
    assert torch.get_num_threads() == threads  # timed on one thread, then restored
    assert verdict.dtype in ("float32", "bfloat16")
    assert verdict.torch_dtype in (torch.float32, torch.bfloat16)
    assert verdict.fp32_gflops > 0 and verdict.bf16_gflops > 0
    assert verdict.bf16_speedup == pytest.approx(verdict.bf16_gflops / verdict.fp32_gflops)
    assert (verdict.dtype == "bfloat16") == (verdict.bf16_speedup >= MIN_SPEEDUP)
    assert "bf16" in verdict.reason and "fp32" in verdict.reason
    assert (verdict.bf16_hardware or "no bf16 hardware") in verdict.reason
    assert verdict.train_fp32_gflops > 0 and verdict.train_bf16_gflops > 0
    assert verdict.train_bf16_speedup == pytest.approx(verdict.train_bf16_gflops / verdict.train_fp32_gflops)
    assert "at decode products" in verdict.reason and "at training products" in verdict.reason
    assert not verdict.from_cache


def test_each_shape_is_timed_on_the_path_that_runs_it_and_the_decode_product_on_the_faster_one(tmp_path, monkeypatch):
    """The generator runs a decode step through oneDNN's packed weights where it has them (bf16 on a CPU with bf16
    kernels, fp32 everywhere with oneDNN), the trainer through torch's `linear`: the probe times what each runs."""
    timed = []
    speeds = {
        ("float32", False): 100.0,
        ("float32", True): 150.0,
        ("bfloat16", False): 300.0,
        ("bfloat16", True): 600.0,
    }

    def fake_gflops(rows, inner, outer, dtype, *, min_seconds=0.02, min_reps=3, packed=False, product=None):
        timed.append(((rows, inner, outer), str(dtype).removeprefix("torch."), packed))
        return speeds[str(dtype).removeprefix("torch."), packed] * (2 if rows > 64 else 1)

    monkeypatch.setattr(dtype_probe, "matmul_gflops", fake_gflops)
    monkeypatch.setattr(dtype_probe, "packing_available", lambda dtype: True)
    verdict = probe_matmul_precision(tmp_path)
    decode, train = dtype_probe.PROBE_SHAPE, dtype_probe.TRAIN_SHAPE
    assert sorted(timed) == sorted([
        (decode, "float32", False), (decode, "float32", True), (decode, "bfloat16", False), (decode, "bfloat16", True),
        (train, "float32", False), (train, "bfloat16", False),
    ])  # fmt: skip
    assert (verdict.fp32_gflops, verdict.bf16_gflops, verdict.bf16_speedup) == (150.0, 600.0, 4.0)
    assert (verdict.train_fp32_gflops, verdict.train_bf16_gflops, verdict.train_bf16_speedup) == (200.0, 600.0, 3.0)
    assert verdict.reason.startswith("bf16 4.0x faster than fp32 here at decode products, 3.0x at training products")
    monkeypatch.setattr(dtype_probe, "packing_available", lambda dtype: False)  # a torch without oneDNN
    timed.clear()
    verdict = probe_matmul_precision(tmp_path, refresh=True)
    assert not any(packed for _, _, packed in timed) and verdict.bf16_speedup == 3.0


def test_the_generators_own_product_is_timed_at_the_decode_shape_and_keys_its_own_verdict(tmp_path, monkeypatch):
    """With `decode_product` (the generator's AMX tiles or small-batch kernel) the decode shape is also timed through
    it, in both dtypes, and the verdict takes the fastest; the verdict is cached apart from one without it."""
    from lightning_grpo.rollout.decode_linears import decode_product

    timed = []

    def fake_gflops(rows, inner, outer, dtype, *, min_seconds=0.02, min_reps=3, packed=False, product=None):
        timed.append(((rows, inner, outer), str(dtype).removeprefix("torch."), product))
        own = {"float32": 180.0, "bfloat16": 900.0}[str(dtype).removeprefix("torch.")]
        return own if product is not None else 100.0

    monkeypatch.setattr(dtype_probe, "matmul_gflops", fake_gflops)
    verdict = probe_matmul_precision(tmp_path, decode_product=decode_product)
    own = [(shape, dtype) for shape, dtype, product in timed if product is decode_product]
    assert own == [(dtype_probe.PROBE_SHAPE, "float32"), (dtype_probe.PROBE_SHAPE, "bfloat16")]
    assert (verdict.fp32_gflops, verdict.bf16_gflops, verdict.bf16_speedup) == (180.0, 900.0, 5.0)
    assert probe_matmul_precision(tmp_path).key != verdict.key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_generators_own_product_multiplies_as_its_layers_do(dtype):
    from lightning_grpo.rollout.decode_linears import decode_product

    weight, x = torch.randn(96, 64).to(dtype), torch.randn(5, 64).to(dtype)
    expected = torch.nn.functional.linear(x.double(), weight.double())
    got = decode_product(weight)(x)
    assert got.dtype == dtype and torch.allclose(got.double(), expected, rtol=2**-7, atol=1e-2)


def test_the_second_call_reads_the_cached_verdict_without_timing_again(tmp_path, monkeypatch):
    first = probe_matmul_precision(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [f"{first.key}.json"]

    def no_timing(*args, **kwargs):
        raise AssertionError("the cached verdict was timed again")

    monkeypatch.setattr(dtype_probe, "matmul_gflops", no_timing)
    second = probe_matmul_precision(tmp_path)
    assert second.from_cache
    assert (second.dtype, second.bf16_speedup, second.reason, second.key) == (
        first.dtype,
        first.bf16_speedup,
        first.reason,
        first.key,
    )


def test_another_cpu_or_torch_probes_again_under_its_own_key(tmp_path, monkeypatch):
    here = probe_matmul_precision(tmp_path)
    real_signature = dtype_probe.cpu_signature

    for change in ({"flags": "avx avx2 fma"}, {"torch": "9.9.9"}, {"cpu": "Another CPU"}):
        monkeypatch.setattr(dtype_probe, "cpu_signature", lambda change=change: real_signature() | change)
        other = probe_matmul_precision(tmp_path)
        assert not other.from_cache and other.key != here.key
        assert probe_matmul_precision(tmp_path).from_cache  # and is cached under that key
    monkeypatch.setattr(dtype_probe, "cpu_signature", real_signature)
    assert probe_matmul_precision(tmp_path).key == here.key
    assert len(list(tmp_path.glob("*.json"))) == 4


def test_a_cap_on_the_instructions_keys_its_own_verdict_and_is_named_in_the_reason(tmp_path, monkeypatch):
    """A verdict measured under `ONEDNN_MAX_CPU_ISA=AVX2` (bf16 emulated, as on an AVX2-only CPU) is not read back
    without the cap, nor the other way round. The speeds are faked: the cap only acts when the process starts (the
    real one is measured in tests/training/test_default_precision_fit.py)."""
    for name in dtype_probe.ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    uncapped = probe_matmul_precision(tmp_path)
    assert "under" not in uncapped.reason and "isa_caps" not in dtype_probe.cpu_signature()

    def emulated_bf16(rows, inner, outer, dtype, *, min_seconds=0.02, min_reps=3, packed=False, product=None):
        return 100.0 if dtype == torch.float32 else 20.0

    monkeypatch.setattr(dtype_probe, "matmul_gflops", emulated_bf16)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    capped = probe_matmul_precision(tmp_path)
    assert not capped.from_cache and capped.key != uncapped.key and capped.dtype == "float32"
    assert capped.reason.startswith("bf16 5.0x slower than fp32 here at decode products, 5.0x slower at training")
    assert capped.reason.endswith(", under ONEDNN_MAX_CPU_ISA=AVX2)")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert probe_matmul_precision(tmp_path).key == uncapped.key


def test_a_damaged_cache_file_or_refresh_probes_again(tmp_path):
    verdict = probe_matmul_precision(tmp_path)
    path = tmp_path / f"{verdict.key}.json"
    path.write_text("{not json")
    assert not probe_matmul_precision(tmp_path).from_cache
    path.write_text(json.dumps({**json.loads(path.read_text()), "dtype": "float16"}))
    assert not probe_matmul_precision(tmp_path).from_cache  # a dtype the probe never chooses
    assert not probe_matmul_precision(tmp_path, refresh=True).from_cache
    assert probe_matmul_precision(tmp_path).from_cache


def test_the_default_cache_is_the_package_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_GRPO_CACHE", str(tmp_path))
    verdict = probe_matmul_precision()
    assert (tmp_path / "precision" / f"{verdict.key}.json").is_file()


@pytest.mark.parametrize(
    ("speedup", "train_speedup", "hardware", "reason"),
    [
        (4.4, 7.3, "AMX_BF16", "bf16 4.4x faster than fp32 here at decode products, 7.3x at training products (AMX_BF16)"),
        (1 / 17, 1 / 15, "", "bf16 17.0x slower than fp32 here at decode products, 15.0x slower at training products "
         "(no bf16 hardware)"),
        (1.1, 1.3, "BF16", "bf16 only 1.10x faster than fp32 here at decode products, 1.3x at training products (BF16), "
         "under the 1.2x worth its precision"),
    ],
)  # fmt: skip
def test_the_reason_says_how_much_at_each_shape_and_why(speedup, train_speedup, hardware, reason):
    assert dtype_probe._reason(speedup, hardware, train_speedup) == reason


def test_the_generator_dtype_is_the_policys_the_one_named_or_the_probes_verdict(tmp_path, monkeypatch):
    from lightning_grpo.models.dtype_probe import resolve_generator_dtype

    monkeypatch.setenv("LIGHTNING_GRPO_CACHE", str(tmp_path))
    assert resolve_generator_dtype(None, torch.float32) == ("float32", "the policy's dtype (generator_dtype=None)")
    assert resolve_generator_dtype(None, torch.bfloat16)[0] == "bfloat16"
    assert resolve_generator_dtype("bfloat16", torch.float32) == ("bfloat16", "generator_dtype='bfloat16'")
    verdict = probe_matmul_precision()
    assert resolve_generator_dtype("auto", torch.float32) == (
        verdict.dtype,
        f"generator_dtype='auto': {verdict.reason}",
    )
    # where bf16 is not faster, "auto" keeps the policy's dtype (a bf16 policy is not widened to fp32)
    monkeypatch.setenv("LIGHTNING_GRPO_PRECISION", "float32")
    assert resolve_generator_dtype("auto", torch.bfloat16)[0] == "bfloat16"
    assert resolve_generator_dtype("auto", torch.float32)[0] == "float32"
    with pytest.raises(ValueError, match=r"generator_dtype='fp16' is not one of \('auto', 'float32', 'bfloat16'\)"):
        resolve_generator_dtype("fp16", torch.float32)


@pytest.mark.parametrize("pinned", ["float32", "bfloat16"])
def test_the_environment_pins_the_verdict_without_timing(pinned, tmp_path, monkeypatch):
    def no_timing(*args, **kwargs):
        raise AssertionError("a pinned verdict was timed")

    monkeypatch.setattr(dtype_probe, "matmul_gflops", no_timing)
    monkeypatch.setenv("LIGHTNING_GRPO_PRECISION", pinned)
    verdict = probe_matmul_precision(tmp_path)
    assert (verdict.dtype, verdict.key, verdict.reason) == (
        pinned,
        "environment",
        f"LIGHTNING_GRPO_PRECISION={pinned} in the environment",
    )
    assert list(tmp_path.iterdir()) == []  # nothing cached: unset, the probe runs


def test_a_bad_pinned_value_names_it_and_the_choices(monkeypatch):
    monkeypatch.setenv("LIGHTNING_GRPO_PRECISION", "fp16")
    with pytest.raises(ValueError, match=r"LIGHTNING_GRPO_PRECISION='fp16': set it to 'float32' or 'bfloat16'"):
        probe_matmul_precision()
