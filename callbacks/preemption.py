"""Ends a fit that received SIGTERM or SIGUSR1 at a step boundary, with a resumable checkpoint and exit code 75."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

log = logging.getLogger(__name__)

#: The exit code of a preempted fit whose checkpoint was saved (sysexits' EX_TEMPFAIL: "try again later").
PREEMPTED_EXIT_CODE = 75


def preempting(trainer: pl.Trainer) -> bool:
    """Every rank: whether any rank received SIGTERM (Lightning's flag); with several ranks, one all-reduce, so every
    rank decides the same at the same step. A rank the signal missed then sets the flag too, so that Lightning ends
    every rank at this step's boundary, not only those that got the signal."""
    flag = bool(trainer.received_sigterm)
    if trainer.world_size > 1:
        flag = bool(trainer.strategy.reduce_boolean_decision(flag, all=False))
        if flag and not trainer.received_sigterm:
            trainer._signal_connector.received_sigterm = True
    return flag


def _notify_sigterm(trainer: pl.Trainer) -> Any:
    """Lightning's SIGTERM notifier without its collective: it sets the flag and sends the signal on to the ranks
    Lightning's launcher started, but does not broadcast from inside the signal handler, which pairs with whatever
    collective another rank is in unless every rank got the signal at the same point (gloo then fails on mismatched
    sizes). The ranks agree instead at the step boundary (`preempting`) and where Lightning's loop broadcasts rank
    0's flag before each batch."""
    connector = trainer._signal_connector

    def notify(signum: int, frame: Any) -> None:
        log.info(f"[rank: {trainer.global_rank}] Received SIGTERM: {signum}")
        if not connector.received_sigterm and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)
        connector.received_sigterm = True

    return notify


class PreemptionCallback(Callback):
    """Turns SIGTERM and SIGUSR1 into a clean stop: the step in flight finishes, a checkpoint is written, the process
    exits with code 75 (`PREEMPTED_EXIT_CODE`).

    Lightning's own SIGTERM handler stays in charge: it sets `trainer.received_sigterm` (and forwards the signal to
    the ranks its launcher started), but without the broadcast Lightning makes inside the handler, which desyncs
    ranks that did not all get the signal at the same point. The signal may reach every rank or only some (rank 0
    only, as from a scheduler that signals the main process): the ranks agree at the end of the step in flight. After
    that no step is looked ahead, a wait for rollouts ends within about a second, and Lightning raises
    `SIGTERMException` on every rank at that step boundary; this callback then saves the checkpoint (every rank:
    saving is a collective), prints `preempted: checkpoint saved to PATH` and sets the exception's exit code to 75, so a requeue script tells a preemption (75) from success (0), a failure (1) and a
    bad configuration (2). The checkpoint counts every step that trained and no step that did not: resuming from it
    (`--ckpt_path PATH`) trains each remaining prompt group exactly once.

    SIGUSR1 (the requeue signal: SLURM's `--signal=USR1@90`, or `SLURMEnvironment(requeue_signal=...)`) is handled
    the same way: it is sent on as SIGTERM. With `SLURMEnvironment(auto_requeue=True)` the checkpoint goes where
    Lightning's SLURM resume looks (`hpc_ckpt_N.ckpt` in `default_root_dir`, loaded by the requeued job without
    `--ckpt_path`) and the job is requeued with `scontrol requeue`, as Lightning does, but at the step boundary
    instead of inside the signal handler, where a save would catch the optimizer mid-update. Ctrl-C (SIGINT) prints
    one line naming the last checkpoint instead; it writes none (the interrupt lands anywhere in a step).

    `GRPOModule` adds this callback unless the trainer has one.

    Args:
        dirpath: folder of the preemption checkpoint; default the `ModelCheckpoint`'s folder, else
            `trainer.default_root_dir`.
        filename: its name without `.ckpt`.

    Example::

        trainer = Trainer(callbacks=[PreemptionCallback(dirpath="checkpoints")])
        # kill -TERM <pid>  ->  exit code 75 and
        # "preempted: checkpoint saved to checkpoints/preempted.ckpt"
    """

    def __init__(self, dirpath: str | Path | None = None, filename: str = "preempted") -> None:
        if not filename or os.sep in filename:
            raise ValueError(f"`PreemptionCallback(filename={filename!r})` must be a file name without a folder.")
        self.dirpath = dirpath
        self.filename = filename
        self.ckpt_path: str | None = None  # where the last preemption checkpoint went
        self._requeue_signal: int | None = None
        self._previous_handler: Any = None
        self._requeue_requested = False

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning registers its signal handlers after on_fit_start: its SIGTERM handler calls this notifier.
        trainer._signal_connector._sigterm_notifier_fn = _notify_sigterm(trainer)
        # Installed before Lightning registers its handlers, so Lightning leaves this signal to us instead of saving
        # from inside its own SLURM handler.
        self._requeue_requested = False
        if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGUSR1"):
            return
        environment = _slurm_environment(trainer)
        self._requeue_signal = int(environment.requeue_signal if environment is not None else signal.SIGUSR1)
        self._previous_handler = signal.signal(self._requeue_signal, self._on_requeue_signal)

    def _on_requeue_signal(self, signum: int, frame: Any) -> None:
        self._requeue_requested = True
        os.kill(os.getpid(), signal.SIGTERM)  # one path for both signals: Lightning's SIGTERM handling

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore_signal()
        if isinstance(exception, SIGTERMException):
            self._save(trainer)
            exception.code = PREEMPTED_EXIT_CODE
        elif isinstance(exception, KeyboardInterrupt):
            rank_zero_info(f"interrupted: {_last_checkpoint_line(trainer)}")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore_signal()

    def _restore_signal(self) -> None:
        if self._requeue_signal is not None and threading.current_thread() is threading.main_thread():
            signal.signal(self._requeue_signal, self._previous_handler or signal.SIG_DFL)
        self._requeue_signal = None

    def _save(self, trainer: pl.Trainer) -> None:
        environment = _slurm_environment(trainer)
        requeue = environment is not None and environment.auto_requeue
        path = _hpc_save_path(trainer.default_root_dir) if requeue else self._path(trainer)
        trainer.save_checkpoint(path)
        self.ckpt_path = str(path)
        rank_zero_info(f"preempted: checkpoint saved to {path}")
        if requeue and trainer.is_global_zero:
            _requeue_slurm_job()

    def _path(self, trainer: pl.Trainer) -> Path:
        folder = self.dirpath
        if folder is None:
            checkpoint = trainer.checkpoint_callback
            folder = checkpoint.dirpath if isinstance(checkpoint, ModelCheckpoint) and checkpoint.dirpath else None
        return Path(folder or trainer.default_root_dir) / f"{self.filename}.ckpt"


def _slurm_environment(trainer: pl.Trainer) -> SLURMEnvironment | None:
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if environment is None:  # a single-device strategy has none; Lightning's signal handling reads the same one
        environment = getattr(getattr(trainer, "_accelerator_connector", None), "cluster_environment", None)
    return environment if isinstance(environment, SLURMEnvironment) else None


def _last_checkpoint_line(trainer: pl.Trainer) -> str:
    checkpoint = trainer.checkpoint_callback
    last = getattr(checkpoint, "last_model_path", "") or getattr(checkpoint, "best_model_path", "")
    if last and os.path.exists(last):
        return f"the last checkpoint is {last} (resume with --ckpt_path {last})"
    return "no checkpoint was saved in this run (SIGTERM instead of Ctrl-C saves one at the next step)"


def _hpc_save_path(folder: str | Path) -> Path:
    """Lightning's SLURM checkpoint name, one above the highest `hpc_ckpt_N.ckpt` in `folder`."""
    numbers = [
        int(m.group(1)) for p in Path(folder).glob("hpc_ckpt_*.ckpt") if (m := re.fullmatch(r"hpc_ckpt_(\d+)", p.stem))
    ]
    return Path(folder) / f"hpc_ckpt_{max(numbers, default=0) + 1}.ckpt"


def _requeue_slurm_job() -> None:
    """`scontrol requeue` this job (an array task as `JOB_TASK`), as Lightning's SLURM handler does."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job_id = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job_id):
        rank_zero_warn(f"Not requeued: SLURM_JOB_ID={job_id!r} is not a job id.")
        return
    try:
        result = subprocess.run(["scontrol", "requeue", job_id], check=False).returncode
    except FileNotFoundError:
        rank_zero_warn("Not requeued: `scontrol` is not on PATH.")
        return
    if result == 0:
        rank_zero_info(f"requeued SLURM job {job_id}")
    else:
        rank_zero_warn(f"Requeuing SLURM job {job_id} failed: scontrol exited with {result}.")
