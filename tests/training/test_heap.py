"""`FitHeap`: during a CPU fit glibc serves large blocks from its heap and keeps them when freed (instead of a mapping
of their own, unmapped when freed), and after the fit it maps them again. Each check runs in its own interpreter, so
that the suite's malloc is never changed. (What that saves a train step in page faults and time is measured by
`benchmarks/packed_step.py --section heap`.)"""

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

# How many bytes of a live tensor glibc serves from a mapping of its own (mallinfo2's hblkhd) rather than its heap:
# a mapped block is unmapped when freed and faulted in again next time; a heap block stays for the next step.
_PROBE = textwrap.dedent(
    """
    import ctypes, json, sys, torch
    from lightning_grpo.training.heap import FitHeap

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2

    def mapped_bytes_of(floats=16 * 2**20):
        before = libc.mallinfo2().hblkhd
        block = torch.ones(floats)
        return libc.mallinfo2().hblkhd - before

    heap = FitHeap()
    seen = {"before": mapped_bytes_of()}
    heap.apply(on_cpu=sys.argv[1] == "cpu")
    seen["applied"] = heap.applied
    seen["during"] = mapped_bytes_of()
    heap.restore()
    seen["after"] = mapped_bytes_of()
    seen["after_4mib"] = mapped_bytes_of(2**20)
    print(json.dumps(seen))
    """
)


def _mapped(device: str, env: dict[str, str] | None = None) -> dict:
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
def test_a_cpu_fit_serves_large_blocks_from_the_heap_and_maps_them_again_after():
    seen = _mapped("cpu")
    assert seen["before"] >= 64 * 2**20  # glibc's default: a 64 MiB block is a mapping of its own
    assert seen["applied"] and seen["during"] == 0  # from the heap, kept when freed
    assert seen["after"] >= 64 * 2**20  # blocks over 32 MiB are mapped again
    assert seen["after_4mib"] == 0  # a smaller one still comes from the heap


@needs_glibc
@pytest.mark.timeout(150)
def test_a_fit_off_the_cpu_and_the_switch_leave_malloc_alone():
    for seen in (_mapped("gpu"), _mapped("cpu", {ENV_SWITCH: "0"})):
        assert not seen["applied"]
        assert seen["during"] >= 64 * 2**20


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
