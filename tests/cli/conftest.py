"""Fixtures of the command's tests."""

from __future__ import annotations

import multiprocessing.process
import subprocess
import sys

import pytest


@pytest.fixture
def in_process(monkeypatch, tmp_path):
    """Run the command in this process from `tmp_path`, as `lightning-grpo` with no other argv (LightningCLI warns
    when both `args` and `sys.argv` carry arguments)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-grpo"])


@pytest.fixture
def started_processes(monkeypatch) -> list[str]:
    """Records every process started from now on (multiprocessing or subprocess), then starts it as usual."""
    started: list[str] = []
    process_start = multiprocessing.process.BaseProcess.start
    popen_init = subprocess.Popen.__init__

    def recording_start(self):
        started.append(f"multiprocessing: {self.name}")
        return process_start(self)

    def recording_popen(self, args, *rest, **kwargs):
        started.append(f"subprocess: {args}")
        return popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", recording_start)
    monkeypatch.setattr(subprocess.Popen, "__init__", recording_popen)
    return started
