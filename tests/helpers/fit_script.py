"""Runs `tests/scripts/fit_tiny.py` in its own process session, bounded by a timeout, and reads each rank's result."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from helpers.processes import run_in_session

SCRIPT = Path(__file__).parents[1] / "scripts" / "fit_tiny.py"


def run_fit(out: Path, *args: str, timeout: float = 200) -> tuple[int, dict[int, dict]]:
    """Run the script in its own session; return its exit code and each rank's result."""
    out.mkdir(parents=True, exist_ok=True)
    code, _ = run_in_session(
        [sys.executable, str(SCRIPT), "--out", str(out), *args], log=out / "log.txt", timeout=timeout
    )
    results = {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    return code, results


def all_groups(results: dict[int, dict]) -> list[int]:
    return sorted(g for step in results[0]["steps"] for g in step)
