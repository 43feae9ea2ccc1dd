"""Fixtures of the command's tests."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture
def in_process(monkeypatch, tmp_path):
    """Run the command in this process from `tmp_path`, as `lightning-grpo` with no other argv (LightningCLI warns
    when both `args` and `sys.argv` carry arguments)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-grpo"])
