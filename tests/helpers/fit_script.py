"""Runs `tests/scripts/fit_tiny.py` in its own process session, bounded by a timeout, and reads each rank's result."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from helpers.processes import Session, run_in_session, start_session

SCRIPT = Path(__file__).parents[1] / "scripts" / "fit_tiny.py"


def fit_command(out: Path, *args: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--out", str(out), *args]


def run_fit(out: Path, *args: str, timeout: float = 200) -> tuple[int, dict[int, dict]]:
    """Run the script in its own session; return its exit code and each rank's result."""
    out.mkdir(parents=True, exist_ok=True)
    code, _ = run_in_session(fit_command(out, *args), log=out / "log.txt", timeout=timeout)
    return code, rank_results(out)


def start_fit(out: Path, *args: str) -> Session:
    """Start the script in its own session (for a test that signals it); `finish_sessions` ends it."""
    out.mkdir(parents=True, exist_ok=True)
    return start_session(fit_command(out, *args), log=out / "log.txt")


def rank_results(out: Path) -> dict[int, dict]:
    """Each rank's `rank<r>.json` (written by `helpers.fit_probe.StepRecorder`), by global rank."""
    return {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def all_groups(results: dict[int, dict]) -> list[int]:
    return sorted(g for step in results[0]["steps"] for g in step)
