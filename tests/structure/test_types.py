"""The package type-checks: mypy, configured in pyproject.toml's [tool.mypy], passes on `lightning_grpo` and
`callbacks`, and it fails on a misspelled option (the typed option records are what make that an error)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: One cache per test (pytest-xdist may run both at once) and per configuration (a cache written under another
#: [tool.mypy] can hide an error); kept between runs, so a later run checks only what changed.
CACHE = (
    Path(tempfile.gettempdir())
    / "lightning_grpo_mypy_cache"
    / hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:12]
)


def run_mypy(*paths: str, cache: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    command += ["--cache-dir", str(CACHE / cache), "--no-error-summary", "--hide-error-context", *paths]
    env = {**os.environ, "MYPY_FORCE_COLOR": "0"}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)


def test_the_package_type_checks():
    result = run_mypy("lightning_grpo", "callbacks", cache="package")
    assert result.returncode == 0, f"mypy found type errors:\n{result.stdout}{result.stderr}"


def test_a_misspelled_option_is_a_type_error_naming_it():
    # One path for the probe: mypy's cache knows a module by its name and would report an earlier path's errors.
    probe = CACHE / "probe_source" / "misspelled_option.py"
    probe.parent.mkdir(parents=True, exist_ok=True)
    probe.write_text(
        "from lightning_grpo.options import DataModuleOptions\n\n\n"
        "def sampling_temperature(options: DataModuleOptions) -> float:\n"
        "    return options.sampling.temperatrue\n"
    )
    result = run_mypy("lightning_grpo", "callbacks", str(probe), cache="probe")
    assert result.returncode == 1, f"mypy accepted a misspelled option:\n{result.stdout}{result.stderr}"
    errors = [line.partition(probe.name)[2] for line in result.stdout.splitlines() if probe.name in line]
    assert errors == [
        ':5: error: "SamplingOptions" has no attribute "temperatrue"; maybe "temperature"?  [attr-defined]'
    ]
