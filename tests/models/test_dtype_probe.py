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
    assert not verdict.from_cache


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
    ("speedup", "hardware", "reason"),
    [
        (4.4, "AVX512_BF16", "bf16 4.4x faster than fp32 here (AVX512_BF16)"),
        (1 / 17, "", "bf16 17.0x slower than fp32 here (no bf16 hardware)"),
        (1.1, "BF16", "bf16 only 1.10x faster than fp32 here (BF16), under the 1.2x worth its precision"),
    ],
)
def test_the_reason_says_how_much_and_why(speedup, hardware, reason):
    assert dtype_probe._reason(speedup, hardware) == reason


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
