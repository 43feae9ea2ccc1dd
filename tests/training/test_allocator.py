"""`cpu_allocator="reuse"`: glibc keeps freed memory, so a large tensor made again is not faulted in again."""

from __future__ import annotations

import logging
import platform
import subprocess
import sys

import pytest

from lightning_grpo import GRPODataModule, GRPOModule
from lightning_grpo.training import allocator

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# Page faults of a 64 MB tensor made and freed four times (the fewest after the first), before and after
# `reuse_freed_memory`; run in a child because the setting is process-wide and permanent.
FAULTS_SCRIPT = """
import resource, torch
from lightning_grpo.training.allocator import reuse_freed_memory

def faults_of_a_new_64_mb_tensor():
    counts = []
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(16 * 2**20)
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return min(counts[1:])

plain = faults_of_a_new_64_mb_tensor()
print(reuse_freed_memory())
print(plain, faults_of_a_new_64_mb_tensor())
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
@pytest.mark.timeout(120)
def test_a_large_tensor_made_again_reuses_its_pages_instead_of_faulting_them_in_again(no_leaked_processes):
    result = subprocess.run([sys.executable, "-c", FAULTS_SCRIPT], capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr
    said, counts = result.stdout.strip().splitlines()[-2:]
    plain, reused = map(int, counts.split())
    assert said.startswith("glibc keeps freed memory for reuse")
    assert plain >= 32  # a fresh mmap every time: at least one fault per 2 MB huge page, one per 4 kB page without
    assert reused * 10 < plain, (plain, reused)


def test_elsewhere_the_system_allocator_is_left_as_it_is(monkeypatch):
    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))  # musl, or macOS and Windows
    said = allocator.reuse_freed_memory()
    assert said.startswith("left the system allocator as it is")
    assert allocator.reuse_freed_memory() is said  # decided once per process


@pytest.mark.parametrize("bad", ["jemalloc", None, True])
def test_a_bad_value_is_named_at_construction(bad):
    with pytest.raises(ValueError, match=rf"cpu_allocator={bad!r} \(one of 'reuse', 'system'\)"):
        GRPODataModule(model="tiny-random", cpu_allocator=bad)


@pytest.mark.timeout(240)
def test_a_cpu_fit_keeps_freed_memory_by_default_and_leaves_the_allocator_alone_when_asked(
    monkeypatch, caplog, no_leaked_processes
):
    from helpers.tiny import cpu_trainer, tiny_datamodule

    monkeypatch.setattr(allocator, "_applied", None)  # as in a fresh process (an earlier fit here may have set it)
    with caplog.at_level(logging.INFO, logger="lightning_grpo.datamodule"):
        cpu_trainer().fit(GRPOModule("tiny-random"), datamodule=tiny_datamodule(2, cpu_allocator="system"))
        assert allocator._applied is None and "Memory:" not in caplog.text
        cpu_trainer().fit(GRPOModule("tiny-random"), datamodule=tiny_datamodule(2))
    assert f"Memory: {allocator._applied}." in caplog.text
    assert allocator._applied.startswith("glibc keeps" if GLIBC else "left the system allocator")
