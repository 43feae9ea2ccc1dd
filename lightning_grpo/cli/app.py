"""The `lightning-grpo` command: LightningCLI over `GRPOModule` and `GRPODataModule`.

    lightning-grpo fit --config lightning_grpo/configs/smoke.yaml
    lightning-grpo fit --config lightning_grpo/configs/arithmetic.yaml --trainer.max_steps 50
    lightning-grpo validate --config lightning_grpo/configs/arithmetic.yaml --ckpt_path last.ckpt
    lightning-grpo fit --config lightning_grpo/configs/smoke.yaml --print_config   # every option, as YAML
    lightning-grpo export last.ckpt exported/ [--merged]    # the trained policy as a Hugging Face folder

Every option of the module (`model.*`, including AdamW's), the data module (`data.*`), the trainer (`trainer.*`) and
the callbacks can be set in the YAML or on the command line. The policy is written once, as `model.model`; the data
module takes the same name for its tokenizer and generator. Reward functions are import paths
(`data.reward_funcs: [lightning_grpo.rewards.accuracy, my_pkg.rewards:fmt]`). The optimizer and its schedule are
`model.optimizer` and `model.lr_scheduler` (a `class_path` and its `init_args`; see `GRPOModule`). A bad value (an
option of the wrong type, a reward path that does not import, a dataset file that does not exist or lacks a column
the run needs, a tokenizer that does not load, a group that can never fit one optimizer step) fails before anything
is started, with exit code 2 and one line naming the value.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from ..datamodule import GRPODataModule
from ..module import GRPOModule

DESCRIPTION = "Asynchronous GRPO with PyTorch Lightning: fit or validate a GRPOModule on a GRPODataModule."

TRAINER_DEFAULTS: dict[str, Any] = {
    "max_epochs": -1,  # the data module ends the run when its prompt groups are consumed
    "log_every_n_steps": 1,  # one batch is one optimizer step
    "num_sanity_val_steps": 0,
    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "."}},
}
"""Trainer defaults of the command (Lightning's own otherwise); a config or a flag overrides each."""

# Errors a class's `__init__` raises for a bad value; anything else is a bug and keeps its traceback.
_CONFIG_ERRORS = (ValueError, TypeError, FileNotFoundError, MisconfigurationException)


class GRPOLightningCLI(LightningCLI):
    """LightningCLI with the policy linked from the module to the data module and `GRPOProgressBar` by default.

    A value a class rejects when it is built (e.g. `GRPODataModule`'s check of reward import paths and dataset
    files), or that `GRPODataModule.check_data` rejects once the classes are built (the dataset's columns, the
    tokenizer, whether a group fits a step on the trainer's processes), ends the command with the parser's
    `error: ...` and exit code 2, like a value of the wrong type, instead of a traceback: nothing has been started
    yet at that point. Set `JSONARGPARSE_DEBUG=1` to get the traceback.
    """

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """`fit` and `validate` (GRPOModule has no test or predict step)."""
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name in ("fit", "validate")}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # `model.model` is a name or an nn.Module config; the data module only needs a name (None: ask the module).
        parser.link_arguments("model.model", "data.model", compute_fn=_policy_name)

    def instantiate_classes(self) -> None:
        try:
            with warnings.catch_warnings():
                # jsonargparse fills `LoraConfig(loftq_config=...)` with a default `LoftQConfig`, which PEFT drops
                # again (it is used only with `init_lora_weights="loftq"`), warning about a value nobody set.
                warnings.filterwarnings("ignore", message=r"`loftq_config` specified but will be ignored")
                super().instantiate_classes()
            world_size = self.trainer.world_size if self.subcommand in (None, "fit") else None
            self.datamodule.check_data(world_size=world_size)
        except _CONFIG_ERRORS as error:
            self.parser.error(f"{type(error).__name__}: {error}", ex=error)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The trainer, with `GRPOProgressBar` unless the config has a progress bar or turns it off."""
        if "callbacks" not in kwargs:
            config = self.config_init.get(self.subcommand, self.config_init) if self.subcommand else self.config_init
            trainer_config = config.get("trainer") or {}
            callbacks = trainer_config.get("callbacks") or []
            callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
            wants_bar = trainer_config.get("enable_progress_bar") is not False
            if wants_bar and not any(isinstance(c, ProgressBar) for c in callbacks):
                from ..callbacks import GRPOProgressBar

                kwargs["callbacks"] = [*callbacks, GRPOProgressBar()]
        return super().instantiate_trainer(**kwargs)


def _policy_name(model: Any) -> str | None:
    return model if isinstance(model, str) else None


def cli(args: list[str] | dict[str, Any] | None = None, *, run: bool = True) -> GRPOLightningCLI:
    """Build (and with `run`, run) the command; returns it, with its `model`, `datamodule` and `trainer`.

    Args:
        args: the command line without the program name (default `sys.argv[1:]`), or a config dict.
        run: run the subcommand (`fit` or `validate`) given first in `args`; without it `args` has no subcommand and
            only the classes are built.

    Raises:
        SystemExit: 2 for a bad option or value (the message names it); 0 after `--help` or `--print_config`.
    """
    return GRPOLightningCLI(
        GRPOModule,
        GRPODataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        save_config_kwargs={"overwrite": True},
        # LightningCLI's top-level `--optimizer` would be built over the module's parameters before `configure_model`
        # loads the policy; GRPOModule takes `model.optimizer` / `model.lr_scheduler` callables and builds them in
        # `configure_optimizers` instead.
        auto_configure_optimizers=False,
        parser_kwargs={"prog": "lightning-grpo", "description": DESCRIPTION},
        args=args,
        run=run,
    )


def main(args: list[str] | None = None) -> None:
    """The `lightning-grpo` console script (`args` instead of `sys.argv[1:]` when given); see `cli`.

    `lightning-grpo vllm-serve --model NAME [--port 8000 ...]` starts a vLLM server for `generator="vllm"` from its
    own environment (see `lightning_grpo.serving.vllm_server`) and serves until Ctrl-C.
    `lightning-grpo export CHECKPOINT OUTPUT [--merged]` writes a checkpoint's policy as a Hugging Face folder, a LoRA
    adapter alone or merged (see `lightning_grpo.cli.export`).
    """
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["vllm-serve"]:
        from ..serving.vllm_server import main as vllm_serve

        raise SystemExit(vllm_serve(argv[1:]))
    if argv[:1] == ["export"]:
        from .export import main as export

        raise SystemExit(export(argv[1:]))
    cli(args)


if __name__ == "__main__":
    main()
