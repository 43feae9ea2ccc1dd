"""Checkpoint files from the user's side: a kill during a save leaves the previous file whole, a damaged or foreign
`--ckpt_path` exits 2 naming the file, and a resume that changes what the ledger depends on is refused."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.processes import run_in_session, session_env
from preemption_helpers import rank_zero

from lightning_grpo.training.checkpoint_io import AtomicCheckpointIO, read_checkpoint, use_atomic_checkpoints

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SMOKE = str(REPO / "lightning_grpo/configs/smoke.yaml")
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "0"]
QUIET += ["--trainer.val_check_interval", "null", "--trainer.logger", "false"]


def _fit(cwd: Path, *extra: str, timeout: float = 300) -> tuple[int, str]:
    """`lightning-grpo fit` on the smoke config in its own session (a hang or a process left behind fails)."""
    command = [sys.executable, "-m", "lightning_grpo.cli", "fit", "--config", SMOKE, *QUIET, *extra]
    return run_in_session(command, log=cwd / "fit.log", timeout=timeout, cwd=cwd, paths=[HERE])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """`last.ckpt` of a real 2-step smoke fit (4 of its 8 groups trained)."""
    folder = tmp_path_factory.mktemp("fit")
    code, output = _fit(
        folder,
        "--trainer.enable_checkpointing=true",
        "--trainer.callbacks+=ModelCheckpoint",
        "--trainer.callbacks.dirpath=ckpts",
        "--trainer.callbacks.save_last=true",
        "--trainer.max_steps=2",
    )
    assert code == 0, output[-3000:]
    return folder / "ckpts" / "last.ckpt"


def _cli_error(capsys, monkeypatch, *args: str) -> str:
    """Run `lightning-grpo fit` in this process; it must exit 2 before the fit; returns its error line."""
    from lightning_grpo.cli.app import main

    monkeypatch.setattr(sys, "argv", ["lightning-grpo"])
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", SMOKE, *QUIET, *args])
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, lines
    return lines[0]


def _damage(checkpoint: Path, tmp_path: Path, kind: str) -> Path:
    data = checkpoint.read_bytes()
    bad = tmp_path / f"{kind}.ckpt"
    if kind == "truncated":
        bad.write_bytes(data[: len(data) * 2 // 3])
    elif kind == "corrupt":
        middle = bytearray(data)
        middle[len(data) // 2 : len(data) // 2 + 4096] = bytes(4096)
        bad.write_bytes(bytes(middle))
    elif kind == "foreign":
        torch.save({"weights": torch.zeros(3)}, bad)
    elif kind == "text":
        bad.write_text("model: tiny-random\n")
    else:
        bad = tmp_path / "missing.ckpt"
    return bad


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("truncated", "is truncated"),
        ("corrupt", "fails its checksum"),
        ("foreign", "not a Lightning checkpoint"),
        ("text", "not a PyTorch checkpoint"),
        ("missing", "no such file"),
    ],
)
def test_damaged_or_foreign_ckpt_path_exits_2_naming_the_file(checkpoint, tmp_path, capsys, monkeypatch, kind, reason):
    bad = _damage(checkpoint, tmp_path, kind)
    line = _cli_error(capsys, monkeypatch, "--ckpt_path", str(bad))
    assert str(bad) in line and reason in line, line


@pytest.mark.timeout(400)
def test_resume_that_changes_the_ledger_inputs_is_refused_naming_each(checkpoint, capsys, monkeypatch):
    line = _cli_error(
        capsys, monkeypatch, "--ckpt_path", str(checkpoint), "--data.seed", "1", "--data.dataset_size", "6"
    )
    assert "seed: 0 in the checkpoint, 1 now" in line, line
    assert "dataset_size: 8 in the checkpoint, 6 now" in line and "dataset (a hash of its prompts" in line, line
    assert "--data.allow_changed_data true" in line
    line = _cli_error(capsys, monkeypatch, "--ckpt_path", str(checkpoint), "--data.num_generations", "2")
    assert "num_generations: 4 in the checkpoint, 2 now" in line and "groups_per_step: 2 in the checkpoint" in line


@pytest.mark.timeout(400)
def test_harmless_changes_resume_and_allow_changed_data_starts_a_new_ledger(checkpoint, tmp_path, monkeypatch):
    from lightning_grpo.cli.lightning_cli import cli
    from lightning_grpo.cli.resume import check_resume

    monkeypatch.setattr(sys, "argv", ["lightning-grpo"])
    harmless = ["--model.learning_rate", "0.1", "--trainer.max_steps", "9", "--trainer.log_every_n_steps", "5"]
    built = cli(["--config", SMOKE, *harmless, "--data.epochs", "2"], run=False)
    check_resume(str(checkpoint), built.datamodule, built.trainer.world_size)  # the ledger's ids keep their prompts

    out = tmp_path / "recorded"
    code, output = _fit(
        tmp_path,
        "--ckpt_path",
        str(checkpoint),
        "--data.seed",
        "1",
        "--data.allow_changed_data",
        "true",
        "--trainer.callbacks+=helpers.fit_probe.StepRecorder",
        f"--trainer.callbacks.out={out}",
    )
    assert code == 0, output[-3000:]
    assert "its prompt-group ledger is dropped and a new one starts, so all 8 groups" in output
    record = rank_zero(out)
    trained = [g for step in record["steps"] for g in step]
    assert len(trained) == len(set(trained))
    assert len(trained) + record["summary"]["groups_dropped"] == 8, record  # every group of the new ledger, not 4 left


def test_atomic_checkpoint_io_replaces_only_lightnings_default():
    from lightning.pytorch.plugins.io import TorchCheckpointIO
    from lightning.pytorch.strategies import SingleDeviceStrategy

    strategy = SingleDeviceStrategy("cpu")
    use_atomic_checkpoints(strategy)
    assert isinstance(strategy.checkpoint_io, AtomicCheckpointIO)

    class Mine(TorchCheckpointIO):
        pass

    mine = Mine()  # a checkpoint IO of the user's own is kept
    strategy.checkpoint_io = mine
    use_atomic_checkpoints(strategy)
    assert strategy.checkpoint_io is mine


_SAVER = """
import sys, torch
from lightning_grpo.training.checkpoint_io import AtomicCheckpointIO
checkpoint = torch.load(sys.argv[1], weights_only=False)
checkpoint["padding"] = torch.randn(12_000_000)  # ~48 MB: a save takes long enough to be cut
io = AtomicCheckpointIO()
for version in range(1, 10_000):
    checkpoint["global_step"] = version
    print("saving", version, flush=True)
    io.save_checkpoint(checkpoint, sys.argv[2])
"""


@pytest.mark.timeout(300)
def test_kill_at_any_moment_of_a_save_leaves_the_previous_checkpoint_loadable(checkpoint, tmp_path):
    target = tmp_path / "last.ckpt"
    for attempt, delay in enumerate((0.0, 0.2, 0.45)):
        saver = subprocess.Popen(
            [sys.executable, "-c", _SAVER, str(checkpoint), str(target)],
            stdout=subprocess.PIPE,
            text=True,
            env=session_env(paths=[HERE]),
        )
        try:
            started = [saver.stdout.readline() for _ in range(2 + attempt % 2)]  # at least one save finished
            time.sleep(delay)
            saver.send_signal(signal.SIGKILL)
            saver.wait(timeout=30)
        finally:
            saver.kill()
        saved = read_checkpoint(target)  # whole, whatever the kill interrupted
        finished = int(started[-1].split()[1]) - 1
        assert saved["global_step"] >= finished, (saved["global_step"], started)
        assert saved["padding"].numel() == 12_000_000
