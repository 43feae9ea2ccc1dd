"""`FitHeap`: during a CPU fit a freed large block is kept for the next step (no page faults to get it again), and
after the fit glibc's defaults come back. Each check runs in its own interpreter, so that the suite's malloc is never
changed."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from lightning_grpo.training.heap import ENV_SWITCH, FitHeap

needs_glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="FitHeap changes only glibc's malloc"
)

# Page faults of getting a 64 MiB tensor again after freeing one: with glibc's defaults its own mapping each time,
# so every one of its 16,384 pages faults in again.
_PROBE = textwrap.dedent(
    """
    import json, resource, sys, torch
    from lightning_grpo.training.heap import FitHeap

    def faults_of_a_fresh_block():
        torch.ones(16 * 2**20)  # allocated, written and freed once before
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(16 * 2**20)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    heap = FitHeap()
    seen = {"before": faults_of_a_fresh_block()}
    heap.apply(on_cpu=sys.argv[1] == "cpu")
    seen["applied"] = heap.applied
    seen["during"] = faults_of_a_fresh_block()
    heap.restore()
    seen["after"] = faults_of_a_fresh_block()
    print(json.dumps(seen))
    """
)


def _faults(device: str, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, device],
        capture_output=True,
        text=True,
        timeout=120,
        env=None if env is None else {**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_glibc
@pytest.mark.timeout(150)
def test_a_cpu_fit_keeps_a_freed_block_for_the_next_step_and_gives_it_back_after():
    seen = _faults("cpu")
    assert seen["before"] > 10_000  # glibc's default: every page faults in again
    assert seen["applied"] and seen["during"] < 100
    assert seen["after"] > 10_000  # the defaults are back


@needs_glibc
@pytest.mark.timeout(150)
def test_a_fit_off_the_cpu_and_the_switch_leave_malloc_alone():
    for seen in (_faults("gpu"), _faults("cpu", {ENV_SWITCH: "0"})):
        assert not seen["applied"]
        assert seen["during"] > 10_000


def test_restore_without_apply_does_nothing():
    heap = FitHeap()
    heap.restore()
    assert not heap.applied


@needs_glibc
@pytest.mark.timeout(240)
def test_a_cpu_fit_keeps_freed_memory_while_it_trains_and_not_after(no_leaked_processes):
    import lightning.pytorch as pl
    from helpers.tiny import cpu_trainer, tiny_datamodule

    from lightning_grpo import GRPOModule

    class RecordHeap(pl.Callback):
        seen: list[bool] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.seen.append(trainer.datamodule._threads.heap.applied)

    recorder, datamodule = RecordHeap(), tiny_datamodule(4)
    cpu_trainer(callbacks=[recorder]).fit(GRPOModule("tiny-random", learning_rate=1e-3), datamodule=datamodule)
    assert recorder.seen and all(recorder.seen)
    assert not datamodule._threads.heap.applied
