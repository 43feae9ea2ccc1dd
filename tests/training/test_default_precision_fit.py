"""The default paths: `lightning-grpo fit` with no precision given, as the probe decides on the CPU it runs on.

On a CPU with fast bf16 it trains in bf16-mixed (`AutoPrecision`) beside a bf16 embedded generator
(`generator_dtype="auto"`). The rest of the suite pins fp32 (`LIGHTNING_GRPO_PRECISION=float32`, tests/conftest.py) so
that what it asserts holds on every CPU; these tests unpin it and run real fits at what a user gets. The bf16 one is
skipped, with the probe's reason, on a CPU where bf16 products are not faster (AVX2 only). The AVX2-only path runs on
every x86 CPU with AVX2: in a process whose torch and oneDNN are capped to their AVX2 code (`ATEN_CPU_CAPABILITY`,
`ONEDNN_MAX_CPU_ISA`), which multiplies bf16 through fp32 conversions as an AVX2-only CPU does.

Every trained sample's logprobs are checked against a bf16 teacher-forced forward of the weights that sampled it: its
version's, or, where a push landed while it was being sampled, its version's up to that token and the pushed version's
after, over the cache the older weights computed (what the embedded generator does, `rollout/batching.py`).
"""

from __future__ import annotations

import copy
import os
import platform
import subprocess
import sys
from importlib.resources import files

import lightning.pytorch as pl
import pytest
import torch

from lightning_grpo.models.dtype_probe import probe_matmul_precision
from lightning_grpo.rollout.decode_linears import decode_product
from lightning_grpo.rollout.sampling import process_logits, teacher_forced_logprobs
from lightning_grpo.training.precision_plugin import AutoPrecision

SMOKE = str(files("lightning_grpo.configs") / "smoke.yaml")
#: The generator (bf16 weights and KV cache, one decode step at a time) against a teacher-forced bf16 forward of the
#: same weights (one product over the whole sequence). Each bf16 product rounds its output to 8 significant bits, a
#: relative error of up to 2**-9 (0.2%), and the two round in different places and orders, so their logprobs differ
#: by a few units of bf16's last place through the model's two layers: measured on this fit, at most 8e-3 (mean 9e-4)
#: over ~500 tokens. 2e-2 leaves that room and stays far below what the wrong weights give: a sample checked against
#: the version before the one that sampled it (one optimizer step apart) is off by 0.5-0.9.
BF16_TOLERANCE = 2e-2


class SampledByVersion(pl.Callback):
    """Keeps a bf16 copy of the policy under each version the generator received, every trained sample, and the
    autocast state of each training forward."""

    def __init__(self) -> None:
        self.policies: dict[int, torch.nn.Module] = {}
        self.samples: list = []
        self.autocast: set[tuple[bool, torch.dtype]] = set()

    def on_train_start(self, trainer, pl_module) -> None:
        def record(module, inputs) -> None:
            if module.training:
                self.autocast.add((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))

        pl_module.policy.register_forward_pre_hook(record)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # The version the generator holds now (pushed after the last step), cast as the weight sync casts it.
        policy = copy.deepcopy(pl_module.policy).to(torch.bfloat16).eval()
        policy.set_attn_implementation("sdpa")  # training switched it to tree attention over packed rows
        self.policies[trainer.datamodule.weight_sync.version] = policy
        self.samples.extend(batch.samples)


def bf16_default_or_skip() -> None:
    verdict = probe_matmul_precision(decode_product=decode_product)
    if verdict.dtype != "bfloat16":
        pytest.skip(f"the defaults are fp32 on this CPU, as the rest of the suite runs: {verdict.reason}")


def switched_logprobs(old, new, ids: torch.Tensor, prompt_len: int, switch: int, temperature: float) -> torch.Tensor:
    """Logprobs of the completion in `ids` (1, prompt + completion) when `old` sampled its first `switch` tokens and
    `new` the rest over the cache `old` computed, as the generator samples when a push lands mid-completion: the
    forward that samples token `switch` feeds token `switch - 1` and is the first to run on the new weights."""
    cut = prompt_len + switch - 1
    with torch.inference_mode():
        head = old(input_ids=ids[:, :cut], use_cache=True)
        tail = new(input_ids=ids[:, cut:], past_key_values=head.past_key_values)
    logits = torch.cat([head.logits, tail.logits], dim=1)[0, prompt_len - 1 : -1]
    return process_logits(logits, temperature).gather(-1, ids[0, prompt_len:, None]).squeeze(-1)


def sampling_error(sample, policies: dict[int, torch.nn.Module], temperature: float) -> tuple[float, str]:
    """How far a sample's logprobs are from the bf16 weights that sampled it, and which those were: its version's
    (a teacher-forced forward), else its version's up to some token and a later pushed version's from there on (one
    push; two landing within one completion of at most 16 tokens, not seen in this fit, would fail the check)."""
    prompt_len = int((sample.completion_mask == 0).sum())
    ids = torch.from_numpy(sample.input_ids)[None]
    generated = torch.from_numpy(sample.old_log_probs[prompt_len:])
    prompt, completion = ids[0, :prompt_len].tolist(), ids[0, prompt_len:].tolist()
    version = sample.model_version
    alone = (teacher_forced_logprobs(policies[version], prompt, completion, temperature) - generated).abs()
    if alone.max() <= BF16_TOLERANCE:
        return float(alone.max()), f"version {version}"
    # The new weights sampled the first token off: the switch is at it or before it (earlier tokens may match both).
    first_off = int((alone > BF16_TOLERANCE).long().argmax())
    candidates = [
        (float((switched_logprobs(policies[version], policies[new], ids, prompt_len, switch, temperature) - generated)
               .abs().max()), f"version {version}, then {new} from token {switch}")
        for new in sorted(v for v in policies if v > version)
        for switch in range(1, first_off + 1)
    ]  # fmt: skip
    return min(candidates, default=(float(alone.max()), f"version {version}"))


@pytest.mark.timeout(300)
def test_the_default_fit_on_a_fast_bf16_cpu_trains_bf16_mixed_and_samples_by_bf16_weights(
    unpinned_precision, tmp_path, monkeypatch, caplog, no_leaked_processes
):
    from lightning_grpo.cli import cli

    bf16_default_or_skip()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["lightning-grpo"])  # LightningCLI warns when it gets both args and argv
    overrides = {"logger": "false", "limit_val_batches": "0", "enable_progress_bar": "false"}
    command = cli(["--config", SMOKE, *(f"--trainer.{key}={value}" for key, value in overrides.items())], run=False)
    trainer, module, datamodule = command.trainer, command.model, command.datamodule
    assert datamodule.hparams.generator_dtype == "auto" and isinstance(trainer.precision_plugin, AutoPrecision)
    recorder = SampledByVersion()
    trainer.callbacks.append(recorder)
    with caplog.at_level("INFO"):
        trainer.fit(module, datamodule=datamodule)

    reason = probe_matmul_precision(decode_product=decode_product).reason
    assert trainer.precision_plugin.precision == "bf16-mixed"
    assert f"AutoPrecision: training in bf16-mixed ({reason})" in caplog.text
    assert f"The embedded generator samples in bfloat16: generator_dtype='auto': {reason}." in caplog.text
    assert recorder.autocast == {(True, torch.bfloat16)}  # every training forward under bf16 autocast
    assert all(p.dtype == torch.float32 for p in module.policy.parameters())  # master weights stay fp32
    assert trainer.global_step >= 1
    assert max(sample.model_version for sample in recorder.samples) >= 1  # pushed weights, cast to bf16, sampled too
    progress = datamodule.progress
    assert sorted(progress.consumed) == list(range(8)) and progress.trained_total + sum(progress.dropped.values()) == 8

    temperature = datamodule.hparams.temperature
    errors = [sampling_error(sample, recorder.policies, temperature) for sample in recorder.samples]
    worst, explanation = max(errors)
    assert worst <= BF16_TOLERANCE, f"bf16 generator vs bf16 forward: {worst:.3g} > {BF16_TOLERANCE} ({explanation})"


#: What the AVX2-only fit runs in its own process: the CLI's fit, with the start-up log on stdout, then what it chose.
AVX2_FIT = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
from lightning_grpo.cli import cli
command = cli(sys.argv[1:], run=False)
command.trainer.fit(command.model, datamodule=command.datamodule)
progress = command.datamodule.progress
print("CHOSEN", command.trainer.precision_plugin.precision, command.trainer.global_step)
print("CONSUMED", len(progress.consumed), progress.trained_total + sum(progress.dropped.values()))
"""
#: The caps that make torch (ATen's kernels) and oneDNN run the code they run on an AVX2-only CPU.
AVX2_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64") or torch.backends.cpu.get_cpu_capability() == "DEFAULT",
    reason="the AVX2-only path runs on an x86 CPU with AVX2",
)
@pytest.mark.timeout(300)
def test_the_default_fit_on_an_avx2_only_cpu_trains_32_true_beside_a_float32_generator(tmp_path, no_leaked_processes):
    """Emulated: torch and oneDNN capped to their AVX2 code on this CPU (on an AVX2-only CPU the caps change nothing).
    The real probe then measures bf16 products slower than fp32, so the defaults train in 32-true beside a float32
    generator, the reason naming the caps, and the fit runs every group on AVX2 kernels (the native ones built so)."""
    env = {key: value for key, value in os.environ.items() if key != "LIGHTNING_GRPO_PRECISION"}
    env |= AVX2_CAPS | {"LIGHTNING_GRPO_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    overrides = {"logger": "false", "limit_val_batches": "0", "enable_progress_bar": "false"}
    args = ["--config", SMOKE, *(f"--trainer.{key}={value}" for key, value in overrides.items())]
    run = subprocess.run(
        [sys.executable, "-c", AVX2_FIT, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    caps = "under ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2"
    assert "AutoPrecision: training in 32-true (bf16 " in output and f"{caps})" in output, output[-3000:]
    assert "x slower than fp32 here at decode products" in output
    assert "The embedded generator samples in float32: generator_dtype='auto': bf16 " in output
    chosen = next(line.split() for line in output.splitlines() if line.startswith("CHOSEN"))
    assert chosen[1] == "32-true" and int(chosen[2]) >= 1
    assert "CONSUMED 8 8" in output
