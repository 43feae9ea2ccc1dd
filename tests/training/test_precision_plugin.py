"""`AutoPrecision` (`lightning_grpo.training.precision_plugin`): bf16-mixed where the probe says bf16 products are
faster, 32-true where not, decided under a real `Trainer.fit` (replayed steps, no rollout child).

The probe's verdict is replaced in two tests, so that both choices are exercised on any machine; the replacement is a
real `PrecisionVerdict`, as the probe returns it. One test checks the real probe's choice against the CPU's bf16 flags
and a timing of the trainer's own products.
"""

from __future__ import annotations

import platform
import time

import lightning.pytorch as pl
import pytest
import torch
from helpers.replay import fit_replay, replay_steps

import lightning_grpo
from lightning_grpo.models import dtype_probe as probe
from lightning_grpo.module import GRPOModule
from lightning_grpo.training.precision_plugin import AutoPrecision, choose_precision


def verdict(dtype: str) -> probe.PrecisionVerdict:
    faster = dtype == "bfloat16"
    return probe.PrecisionVerdict(
        dtype=dtype,
        bf16_speedup=3.0 if faster else 0.06,
        fp32_gflops=90.0,
        bf16_gflops=270.0 if faster else 5.4,
        bf16_hardware="AVX512_BF16" if faster else "",
        reason="bf16 3.0x faster than fp32 here (AVX512_BF16)" if faster else "bf16 16.7x slower than fp32 here",
        key="test",
    )


@pytest.fixture(params=["bfloat16", "float32"])
def probed(request, monkeypatch):
    monkeypatch.setattr(probe, "probe_matmul_precision", lambda *a, **k: verdict(request.param))
    return request.param


class AutocastRecorder(pl.Callback):
    """Whether the policy's forward ran under CPU autocast, and in which dtype, at each training forward."""

    def __init__(self) -> None:
        self.seen: list[tuple[bool, torch.dtype]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        def record(module, inputs) -> None:
            if module.training:
                self.seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))

        pl_module.policy.register_forward_pre_hook(record)


def test_choose_precision_follows_the_probe_on_cpu(probed):
    precision, reason = choose_precision("cpu")
    assert precision == ("bf16-mixed" if probed == "bfloat16" else "32-true")
    assert reason == verdict(probed).reason


def bf16_hardware_verdict() -> str | None:
    """The precision torch's own CPU feature checks imply, without timing anything: "bf16-mixed" with AMX or
    AVX512_BF16 that oneDNN uses (bf16 products several times faster than fp32), "32-true" on an x86 CPU where oneDNN
    has no bf16 kernels (AVX2 only, or capped to it by `ONEDNN_MAX_CPU_ISA`: bf16 emulated through fp32 conversions),
    None where the flags do not settle it (AVX512 without bf16, Arm)."""
    onednn_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # False under a cap below AVX-512, as on AVX2
    bf16_instructions = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()  # CPUID only
    if onednn_bf16 and bf16_instructions:
        return "bf16-mixed"
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return "32-true" if x86 and not onednn_bf16 else None


def trainer_matmul_speedup(reps: int = 15) -> float:
    """How many times faster bf16 autocast (bf16-mixed) runs a training step's product than fp32 (32-true): one
    linear layer's forward and weight gradient at a packed row of 1024 tokens through SmolLM2's 576 -> 1536 MLP
    projection (fp32 master weight). On one thread: a product split over threads waits for the slowest, so on a busy
    machine several threads time the load, not the kernel. The two are timed in turns and each keeps its fastest
    pass, so that another process's load, which only slows a pass, hits both alike."""
    tokens = torch.randn(1024, 576)
    weight = torch.randn(1536, 576, requires_grad=True)

    def seconds(bf16_autocast: bool) -> float:
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
            out = torch.nn.functional.linear(tokens, weight)
        out.float().sum().backward()
        return time.perf_counter() - started

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds(False), seconds(True)  # warm-up: oneDNN picks and caches its kernels
        fp32, bf16 = zip(*((seconds(False), seconds(True)) for _ in range(reps)), strict=True)
    finally:
        torch.set_num_threads(threads)
    return min(fp32) / min(bf16)


def test_the_real_choice_agrees_with_the_cpus_bf16_flags_and_a_timing_of_the_trainers_products(unpinned_precision):
    """The real probe's choice, checked against what it does not read: torch's CPU feature checks, and the speed of
    the products the trainer runs (a training row's forward and backward under autocast, which casts the fp32 master
    weight at each pass; the probe times one decode-sized product of tensors already in bf16)."""
    precision, reason = choose_precision(torch.device("cpu"))
    expected = bf16_hardware_verdict()
    flags = f"capability {torch.backends.cpu.get_cpu_capability()}, implied {expected}"
    assert expected is None or precision == expected, f"chose {precision} ({reason}); {flags}"
    speedup = trainer_matmul_speedup()
    if precision == "bf16-mixed":
        assert speedup > 1.0, f"bf16-mixed chosen ({reason}), yet the trainer's products run {1 / speedup:.2f}x slower"
    else:  # 2x: above the probe's threshold with room for a shape that favours bf16 a little more than the probe's
        assert speedup < 2.0, f"32-true chosen ({reason}), yet the trainer's products run {speedup:.1f}x faster in bf16"


@pytest.mark.timeout(120)
def test_a_fit_trains_under_autocast_exactly_when_bf16_was_chosen(probed, caplog):
    plugin, recorder = AutoPrecision(), AutocastRecorder()
    assert plugin.precision == "32-true"  # until the fit decides
    with caplog.at_level("INFO", logger="lightning.pytorch.utilities.rank_zero"):
        fit_replay(
            GRPOModule("tiny-random", learning_rate=1e-2), replay_steps(2), plugins=[plugin], callbacks=[recorder]
        )
    chosen = "bf16-mixed" if probed == "bfloat16" else "32-true"
    assert plugin.precision == chosen and plugin.reason == verdict(probed).reason
    assert recorder.seen and set(recorder.seen) == (
        {(True, torch.bfloat16)} if probed == "bfloat16" else {(False, torch.bfloat16)}
    )
    assert f"AutoPrecision: training in {chosen} ({verdict(probed).reason})" in caplog.text


@pytest.mark.timeout(120)
def test_bf16_chosen_trains_exactly_as_lightnings_bf16_mixed(monkeypatch):
    """The same replayed steps give bit-identical weights under `AutoPrecision` (bf16 chosen) and under
    `precision="bf16-mixed"`: the plugin is Lightning's mixed precision, not a variant of it."""
    monkeypatch.setattr(probe, "probe_matmul_precision", lambda *a, **k: verdict("bfloat16"))
    trained = []
    for options in ({"plugins": [AutoPrecision()]}, {"precision": "bf16-mixed"}):
        module = GRPOModule("tiny-random", learning_rate=1e-2)
        fit_replay(module, replay_steps(2), **options)
        trained.append({name: p.detach().clone() for name, p in module.policy.named_parameters()})
    for name, value in trained[0].items():
        assert value.dtype == torch.float32, name  # master weights stay fp32
        torch.testing.assert_close(value, trained[1][name], rtol=0, atol=0, msg=name)


def test_the_plugin_is_exported_and_cannot_be_combined_with_a_precision_flag():
    assert lightning_grpo.AutoPrecision is AutoPrecision
    with pytest.raises(ValueError, match="Received both `precision=bf16-mixed`"):
        pl.Trainer(accelerator="cpu", precision="bf16-mixed", plugins=[AutoPrecision()], logger=False)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pinned", ["bfloat16", "float32"])
def test_the_command_trains_in_the_machines_precision_unless_the_config_chooses_one(pinned, monkeypatch, tmp_path):
    """`lightning-grpo` adds `AutoPrecision` when neither `trainer.precision` nor a precision plugin is given (the
    verdict pinned by `LIGHTNING_GRPO_PRECISION`, so both choices run on any machine); a precision given wins."""
    from lightning_grpo.cli import cli

    monkeypatch.setenv("LIGHTNING_GRPO_PRECISION", pinned)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["lightning-grpo"])  # LightningCLI warns when it gets both args and argv
    base = ["--model.model", "tiny-random", "--trainer.logger", "false", "--trainer.accelerator", "cpu"]
    command = cli(base, run=False)
    (plugin,) = [p for p in [command.trainer.precision_plugin] if isinstance(p, AutoPrecision)]
    assert plugin.decide("cpu") == ("bf16-mixed" if pinned == "bfloat16" else "32-true")
    assert "LIGHTNING_GRPO_PRECISION=" + pinned in plugin.reason
    chosen = cli([*base, "--trainer.precision", "32-true"], run=False).trainer.precision_plugin
    assert not isinstance(chosen, AutoPrecision) and type(chosen).__name__ == "Precision"
