"""`lightning-grpo fit` and `validate`: LightningCLI over `GRPOModule` and `GRPODataModule`.

Every option of the module (`model.*`), the data module (`data.*`), the trainer (`trainer.*`) and the callbacks can
be set in the YAML or on the command line. The policy is written once, as `model.model`; the data module takes the
same name for its tokenizer and generator. The optimizer and its schedule take either of LightningCLI's two forms:
its top-level `optimizer:` / `lr_scheduler:` (`--optimizer SGD --optimizer.lr 0.1`), or the module's own
`model.optimizer` / `model.lr_scheduler`; both build the same optimizer, over the policy's trainable parameters,
when the fit starts. A bad value fails before anything is started, with exit code 2 and one line naming the value
(a mistyped option or choice also names the closest one).
"""

from __future__ import annotations

import warnings
from typing import Any, NoReturn

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, LRSchedulerTypeTuple
from torch.optim import Optimizer

from ..datamodule import GRPODataModule
from ..module import GRPOModule
from ..serving.server_checks import check_vllm_servers
from .lightning_flags import move_lightning_flags
from .parsing import DESCRIPTION, suggestion

TRAINER_DEFAULTS: dict[str, Any] = {
    "max_epochs": -1,  # the data module ends the run when its prompt groups are consumed
    "log_every_n_steps": 1,  # one batch is one optimizer step
    "num_sanity_val_steps": 0,
    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "."}},
}
"""Trainer defaults of the command (Lightning's own otherwise); a config or a flag overrides each."""

# Errors a class's `__init__` raises for a bad value; anything else is a bug and keeps its traceback.
_CONFIG_ERRORS = (ValueError, TypeError, FileNotFoundError, MisconfigurationException)
# LightningCLI's top-level groups, moved into the module's arguments of the same name before the classes are built.
_TOP_LEVEL_FACTORIES = ("optimizer", "lr_scheduler")


class GRPOArgumentParser(LightningArgumentParser):
    """LightningCLI's parser; an unrecognized option or an invalid choice is answered with the closest valid one, and
    every error is one line (jsonargparse puts the expected type on lines of its own)."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:  # type: ignore[misc]  # super() exits
        parser = getattr(ex, "subcommand_parser", None) or self
        one_line = " ".join(line.strip() for line in message.splitlines() if line.strip())
        super().error(one_line + suggestion(message, list(parser._option_string_actions)), ex)


class GRPOLightningCLI(LightningCLI):
    """LightningCLI with the policy linked from the module to the data module and `GRPOProgressBar` by default.

    LightningCLI's top-level `optimizer` and `lr_scheduler` are accepted and become the module's `optimizer` and
    `lr_scheduler`: LightningCLI would build them over the module's parameters before `configure_model` has loaded
    the policy (there are none yet), `GRPOModule.configure_optimizers` builds them over the policy's trainable ones.
    Giving one both ways is an error.

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
        parser.add_optimizer_args((Optimizer,))
        parser.add_lr_scheduler_args(LRSchedulerTypeTuple)
        # One config serves a recipe's two commands: its `sft` section is `lightning-grpo sft`'s, unused by the fit.
        parser.add_argument(
            "--sft", type=dict | None, default=None, help="the warm start's options (`lightning-grpo sft --help`)"
        )

    def _parse_ckpt_path(self) -> None:
        # LightningCLI loads `--ckpt_path` here, first of all, for its hyper-parameters: a damaged file would end the
        # command with torch's traceback, so it is checked before (exit 2, one line).
        subcommand = self.config.get("subcommand")
        if subcommand:
            from .resume import check_checkpoint_file

            try:
                check_checkpoint_file(self.config[subcommand].get("ckpt_path"))
            except ValueError as error:
                self.parser.error(f"ValueError: {error}")
        super()._parse_ckpt_path()

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        both = [key for key in _TOP_LEVEL_FACTORIES if config.get(key) and config.get(f"model.{key}")]
        if both:
            given = "; ".join(
                f"`{key}: {_class_path(config[key])}` and `model.{key}: {_class_path(config[f'model.{key}'])}`"
                for key in both
            )
            self.parser.error(
                f"{given}: give the {' and the '.join(both)} once, either at the top level (--{both[0]}) or as "
                f"`model.{both[0]}` (--model.{both[0]}), not both."
            )
        for key in _TOP_LEVEL_FACTORIES:
            if config.get(key):
                config[f"model.{key}"], config[key] = config[key], None
        move_lightning_flags(config, self.parser)  # Lightning refuses them for manual optimization: ours instead

    def instantiate_classes(self) -> None:
        try:
            with warnings.catch_warnings():
                # jsonargparse fills `LoraConfig(loftq_config=...)` with a default `LoftQConfig`, which PEFT drops
                # again (it is used only with `init_lora_weights="loftq"`), warning about a value nobody set.
                warnings.filterwarnings("ignore", message=r"`loftq_config` specified but will be ignored")
                super().instantiate_classes()
            world_size = self.trainer.world_size if self.subcommand in (None, "fit") else None
            self.datamodule.check_data(world_size=world_size)
            if self.subcommand == "fit":
                from .resume import check_resume

                check_resume(self.config[self.subcommand].get("ckpt_path"), self.datamodule, world_size)
                self._check_servers()
        except _CONFIG_ERRORS as error:
            self.parser.error(f"{type(error).__name__}: {error}", ex=error)

    def _check_servers(self) -> None:
        # The data module checks its vLLM servers at set-up too, inside `Trainer.fit`, where a failure is a traceback;
        # here, before the fit, a server that is not there is one line (exit 2) like any other bad value.
        if self.trainer.is_global_zero:
            try:
                check_vllm_servers(self.datamodule.options, self.datamodule.model_name)
            except RuntimeError as error:
                raise ValueError(str(error)) from error

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The trainer, with `GRPOProgressBar` unless the config has a progress bar or turns it off, and
        `AutoPrecision` unless it sets `trainer.precision` or a precision plugin (or a sharded strategy)."""
        config = self.config_init.get(self.subcommand, self.config_init) if self.subcommand else self.config_init
        trainer_config = config.get("trainer") or {}
        if "plugins" not in kwargs and _chooses_no_precision(trainer_config):
            from ..training.precision_plugin import AutoPrecision

            kwargs["plugins"] = [*_as_list(trainer_config.get("plugins")), AutoPrecision()]
        if "callbacks" not in kwargs:
            callbacks = trainer_config.get("callbacks") or []
            callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
            wants_bar = trainer_config.get("enable_progress_bar") is not False
            if wants_bar and not any(isinstance(c, ProgressBar) for c in callbacks):
                from ..callbacks import GRPOProgressBar

                kwargs["callbacks"] = [*callbacks, GRPOProgressBar()]
        return super().instantiate_trainer(**kwargs)


def _chooses_no_precision(trainer_config: dict[str, Any]) -> bool:
    """No precision given, and a strategy `AutoPrecision` serves (sharded ones need their own precision plugin)."""
    from lightning.pytorch.plugins.precision import Precision

    plugins = _as_list(trainer_config.get("plugins"))
    strategy = trainer_config.get("strategy")
    name = (strategy if isinstance(strategy, str) else type(strategy).__name__).lower().replace("_", "")
    sharded = any(word in name for word in ("fsdp", "deepspeed", "modelparallel"))
    return (
        trainer_config.get("precision") is None and not sharded and not any(isinstance(p, Precision) for p in plugins)
    )


def _as_list(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, list | tuple) else [value]


def _policy_name(model: Any) -> str | None:
    return model if isinstance(model, str) else None


def _class_path(value: Any) -> str:
    return str(value.get("class_path", value)) if hasattr(value, "get") else str(value)


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
        # The top-level optimizer groups are handed to the module instead (see GRPOLightningCLI).
        auto_configure_optimizers=False,
        parser_class=GRPOArgumentParser,
        parser_kwargs={"prog": "lightning-grpo", "description": DESCRIPTION},
        args=args,
        run=run,
    )
