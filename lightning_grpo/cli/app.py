"""The `lightning-grpo` command: `fit` and `validate` (LightningCLI), `export`, `vllm-serve` and `sft`.

    lightning-grpo --help                                                  # the subcommands, one line each
    lightning-grpo fit --config lightning_grpo/configs/smoke.yaml
    lightning-grpo fit --config lightning_grpo/configs/arithmetic.yaml --trainer.max_steps 50
    lightning-grpo fit --config lightning_grpo/configs/smoke.yaml --optimizer SGD --optimizer.lr 0.1
    lightning-grpo validate --config lightning_grpo/configs/arithmetic.yaml --ckpt_path last.ckpt
    lightning-grpo fit --config lightning_grpo/configs/smoke.yaml --print_config   # every option, as YAML
    lightning-grpo export last.ckpt exported/ [--merged]    # the trained policy as a Hugging Face folder
    lightning-grpo vllm-serve --model smollm2-135m-instruct   # a vLLM server for `--data.generator vllm`
    lightning-grpo sft --config lightning_grpo/configs/calculator.yaml   # the tool-use warm start, a HF folder

`fit` and `validate` are LightningCLI (`lightning_grpo.cli.lightning_cli`): every option of the module (`model.*`),
the data module (`data.*`), the trainer (`trainer.*`) and the callbacks can be set in the YAML or on the command
line, and `lightning-grpo fit --help` lists them all. Reward functions are import paths (`data.reward_funcs:
[lightning_grpo.rewards.accuracy, my_pkg.rewards:fmt]`). A bad value fails before anything is started, with exit
code 2 and one line naming the value; a mistyped subcommand, option or choice also names the closest valid one.
`--help` and `--version` answer without importing torch.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from .parsing import DESCRIPTION, SuggestingParser

if TYPE_CHECKING:
    from .lightning_cli import GRPOLightningCLI

#: Every subcommand of `lightning-grpo`, with its line in `lightning-grpo --help`.
SUBCOMMANDS = {
    "fit": "train a GRPOModule on a GRPODataModule (LightningCLI)",
    "validate": "held-out scores of the policy, or of --ckpt_path",
    "export": "write a checkpoint's policy as a Hugging Face folder",
    "vllm-serve": "serve a policy with vLLM for --data.generator vllm",
    "sft": "warm-start a policy on tool-use demonstrations",
}
_LIGHTNING_SUBCOMMANDS = ("fit", "validate")
_EPILOG = (
    "`lightning-grpo SUBCOMMAND --help` lists a subcommand's options. LightningCLI's own top-level options "
    "(-c/--config with a section per subcommand, --print_config) come before the subcommand."
)


def main(args: list[str] | None = None) -> None:
    """The `lightning-grpo` console script (`args` instead of `sys.argv[1:]` when given).

    Raises:
        SystemExit: the subcommand's exit code; 2 for a bad subcommand, option or value (the message names it and
            the closest valid one); 0 after `--help`, `--version` or `--print_config`.
    """
    argv = sys.argv[1:] if args is None else list(args)
    first = argv[0] if argv else ""
    if first == "vllm-serve":
        from ..serving.vllm_launcher import main as vllm_serve

        raise SystemExit(vllm_serve(argv[1:]))
    if first == "sft":
        from ..sft.command import main as sft

        raise SystemExit(sft(argv[1:]))
    if first == "export":
        from .export import main as export

        raise SystemExit(export(argv[1:]))
    if first in _LIGHTNING_SUBCOMMANDS or (first.startswith("-") and first not in ("-h", "--help", "--version")):
        from .exiting import skip_final_collection

        skip_final_collection()  # a preempted fit's exit stays within seconds of its checkpoint
        cli(args)
        return
    _top_level_parser().parse_args(argv)  # --help and --version exit 0; anything else exits 2 naming it


def package_version() -> str:
    """The installed `lightning-grpo` distribution's version."""
    try:
        return version("lightning-grpo")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _top_level_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(prog="lightning-grpo", description=DESCRIPTION, epilog=_EPILOG)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    names = "{" + ",".join(SUBCOMMANDS) + "}"
    subcommands = parser.add_subparsers(title="subcommands", dest="subcommand", metavar=names, required=True)
    for name, line in SUBCOMMANDS.items():
        subcommands.add_parser(name, help=line, add_help=False)
    return parser


def cli(args: list[str] | dict[str, Any] | None = None, *, run: bool = True) -> GRPOLightningCLI:
    """`fit` / `validate`: see `lightning_grpo.cli.lightning_cli.cli` (imported on first use: torch, Lightning)."""
    from .lightning_cli import cli as lightning_cli

    return lightning_cli(args, run=run)


if __name__ == "__main__":
    main()
