"""Ends training on every rank at the same batch when the rollout stream stops, and records each trained step."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_grpo.contract import require_rollout_source
from lightning_grpo.pipeline.ledger import RolloutStop

from .preemption import preempting
from .weight_sync import WeightSyncCallback


class RolloutStreamError(RuntimeError):
    """The rollout stream ended with an error: the run stalled, or rank 0's pipeline (the rollout child) failed.

    Example::

        from lightning_grpo.callbacks import RolloutStallError, RolloutStreamError

        try:
            trainer.fit(module, datamodule=data)
        except RolloutStallError as error:
            print(error)  # counts the groups dropped by reason and names the option to change
        except RolloutStreamError as error:
            print(error)  # the rollout process failed; its traceback is in the message
    """


class RolloutStallError(RolloutStreamError):
    """The run stalled: `stall_groups` prompt groups in a row (by default a full pass) were consumed without one
    training, for the reasons the message counts (e.g. `no_signal`: every completion of each group scored the same,
    as when the policy already solves every prompt, or a reward is constant).

    Example::

        from lightning_grpo import GRPODataModule

        def constant(completions, **columns):
            return [1.0] * len(completions)


        # every group scores alike: none trains, and after a full pass over the
        # prompts `trainer.fit` raises RolloutStallError, counting the drops by reason
        data = GRPODataModule(reward_funcs=[constant])
    """


class RolloutStopCallback(Callback):
    """Ends `Trainer.fit` on every rank at the stop item that ends the rollout stream; the run's end has no other
    owner.

    After each optimizer step, on every rank, it tells the data module the step trained (rank 0 commits its groups to
    the progress ledger, so a checkpoint written now counts them and no collated but untrained step) and has it fetch
    the next step at once. The rollout stream ends with one stop item that every rank receives at that same fetch:

    - a clean stop (every prompt group consumed) sets `trainer.should_stop` on every rank, so the fit ends after this
      step, with Lightning's end-of-fit validation, also with `max_epochs=-1`;
    - a stop sent because the trainer received SIGTERM while it waited for rollouts ends the fit through Lightning's
      `SIGTERMException` (see `PreemptionCallback`); after SIGTERM no step is looked ahead;
    - a stop with an error (a full pass over the prompts trained nothing, or the rollout child died or hung) raises
      `RolloutStreamError` with that message on every rank at once, so no rank is left waiting in a collective
      (`RolloutStallError`, a subclass, for a stall).

    The stop item never reaches `training_step`, the optimizer or the other callbacks. A stream that stops at its
    first fetch (nothing left to train) ends the epoch with no batch and is handled at the epoch's end the same way.
    It must run after `WeightSyncCallback` (the next step is planned only once the generator has this step's
    weights); `GRPOModule` adds both, in that order.

    Raises:
        RolloutStreamError: on every rank, when the stream ends with an error; `RolloutStallError` for a stall.
        TypeError, ValueError: (in `setup`) no `RolloutSource` data module, or a `WeightSyncCallback` after it.

    Example::

        trainer = Trainer(callbacks=[WeightSyncCallback(), RolloutStopCallback()])
    """

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        require_rollout_source(trainer.datamodule, type(self).__name__)
        position = trainer.callbacks.index(self)
        late = [type(c).__name__ for c in trainer.callbacks[position:] if isinstance(c, WeightSyncCallback)]
        if late:
            raise ValueError(
                f"`RolloutStopCallback` comes before {late[0]} in `Trainer(callbacks=...)`: it plans the next step, "
                "which must wait for this step's weights. Put WeightSyncCallback first (or leave both out: "
                "GRPOModule adds them in order)."
            )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        look_ahead = not trainer.should_stop and not _max_steps_reached(trainer) and not preempting(trainer)
        self._end(trainer, trainer.datamodule.finish_step(batch, look_ahead=look_ahead))

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stop = trainer.datamodule.stream_stop()
        if stop is not None and stop.preempted:
            raise SIGTERMException()  # before Lightning counts the epoch done, so a resume goes on in this epoch
        self._end(trainer, stop)

    @staticmethod
    def _end(trainer: pl.Trainer, stop: RolloutStop | None) -> None:
        if stop is None or stop.preempted:  # Lightning raises SIGTERMException once this batch's hooks ran
            return
        if stop.error:
            raise (RolloutStallError if stop.stalled else RolloutStreamError)(stop.error)
        trainer.should_stop = True


def _max_steps_reached(trainer: pl.Trainer) -> bool:
    return trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps
