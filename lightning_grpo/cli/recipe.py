"""A warm-start recipe in one command: the base model's held-out score, a supervised warm start, GRPO from it.

    python -m lightning_grpo.cli.recipe --config lightning_grpo/configs/calculator.yaml --baseline_without_tools
    ./scripts/calculator.sh                  # the same, after setting up .venv
    ./scripts/number_guess.sh --sft.num_demonstrations 32 --trainer.max_steps 8

1. Baseline: the config's held-out validation of the base model (`sft.base_model`); with `--baseline_without_tools`,
   with the config's tools taken away (the base model's own chat template: what it does without a tool).
2. Warm start: `lightning-grpo sft --config <config>` with the `--sft.*` arguments, writing the config's `model.model`
   (with `--reuse_warm_start`, skipped when that folder already holds one: to run GRPO again from it).
3. GRPO: the main job (`lightning_grpo.cli.main_job`) from the warm start, validating before and after. A stall
   (a full pass whose groups all scored alike, as when the warm start already solves every training problem) ends
   this step instead of the recipe: the table then says so, and "after GRPO" is the policy the stall left.

Every other argument goes to steps 1 and 3 (`lightning-grpo fit` arguments). It ends with one table: the held-out
score (`--held_out`, default `val/rewards/accuracy`), tool calls per conversation, the failed-call rate and turns per
conversation for the three models, and training's `tools/call_frequency`, `tools/failure_frequency` and
`rollout/turns_mean` over the first and last steps (from `metrics.csv`); it writes them to `recipe.json` beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TypeVar

Default = TypeVar("Default", bound=str | None)

ACCURACY = "val/rewards/accuracy"
#: The validation metrics the table shows per model, beside the held-out score.
TOOL_METRICS = {
    "tool calls": "val/tools/call_frequency",
    "failed calls": "val/tools/failure_frequency",
    "turns": "val/turns_mean",
}
#: Training's per-step rollout metrics, over the first and last steps.
TRAINING_METRICS = ("tools/call_frequency", "tools/failure_frequency", "rollout/turns_mean")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the recipe with command-line `argv` (default `sys.argv[1:]`); returns what `recipe.json` holds."""
    own, sft_args, fit_args = split_arguments(list(sys.argv[1:] if argv is None else argv))
    started = time.monotonic()
    baseline = _baseline(own, sft_args, fit_args)
    output_dir = _option(fit_args, "--model.model", None)  # a folder other than the config's, on the command line
    sft_args = sft_args if output_dir is None else [*sft_args, "--sft.output_dir", output_dir]
    if own.reuse_warm_start and _warm_start_done(own.config, output_dir):
        print(f"warm start: reusing {output_dir or 'model.model of the config'} (--reuse_warm_start)", flush=True)
    else:
        _warm_start(own.config, sft_args)
    from .main_job import main as main_job

    summary = main_job(["--config", own.config, *fit_args], held_out=own.held_out, allow_stall=True)
    metrics_csv = Path(summary["metrics_csv"])
    before, after = validation_rows(metrics_csv)
    result = {
        "held_out": own.held_out,
        "models": {"base model": baseline, "after the warm start": before, "after GRPO": after},
        "training": training_means(metrics_csv, own.steps),
        "optimizer_steps": summary["optimizer_steps"],
        "stall": summary["stall"],
        "fit_minutes": summary["fit_minutes"],
        "minutes": round((time.monotonic() - started) / 60, 2),
    }
    (metrics_csv.parent / "recipe.json").write_text(json.dumps(result, indent=2))
    print(format_table(result, without_tools=own.baseline_without_tools), flush=True)
    print(f"{'recipe summary:':<19}{metrics_csv.parent / 'recipe.json'}", flush=True)
    return result


def split_arguments(argv: list[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    """The recipe's own options, the `--sft.*` arguments (each with its value) and the rest (fit arguments).

    Raises:
        SystemExit: no `--config` (exit code 2, as any bad option).
    """
    parser = argparse.ArgumentParser(prog="python -m lightning_grpo.cli.recipe", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the recipe's GRPO config (its model.model: the warm start)")
    parser.add_argument("--held_out", default=ACCURACY, help="the held-out score shown (a `val/*` metric)")
    parser.add_argument("--baseline_without_tools", action="store_true", help="validate the base model without tools")
    parser.add_argument("--steps", type=int, default=4, help="training steps averaged at the start and at the end")
    parser.add_argument(
        "--reuse_warm_start", action="store_true", help="skip the warm start when its folder is already written"
    )
    own, rest = parser.parse_known_args(argv)
    sft: list[str] = []
    fit: list[str] = []
    i = 0
    while i < len(rest):
        token = rest[i]
        target = sft if token.startswith("--sft.") else fit
        target.append(token)
        if token.startswith("--sft.") and "=" not in token and i + 1 < len(rest):
            target.append(rest[i + 1])
            i += 1
        i += 1
    return own, sft, fit


def _baseline(own: argparse.Namespace, sft_args: list[str], fit_args: list[str]) -> dict[str, float]:
    """Held-out `val/*` metrics of the base model under the config (no tools with `--baseline_without_tools`)."""
    from ..sft.command import WarmStartOptions
    from .app import cli

    base = _option(sft_args, "--sft.base_model", WarmStartOptions.base_model)
    scratch = tempfile.mkdtemp(prefix="lightning-grpo-baseline-")  # LightningCLI's config.yaml, not in the cwd
    overrides = ["--model.model", base, "--trainer.logger", "false", "--trainer.default_root_dir", scratch]
    if own.baseline_without_tools:
        overrides += ["--data.tools", "null"]
    program, sys.argv = sys.argv, [sys.argv[0]]  # LightningCLI warns when it gets both arguments and a command line
    try:
        command = cli(["--config", own.config, *fit_args, *overrides], run=False)
        results = command.trainer.validate(command.model, datamodule=command.datamodule, verbose=False)
    finally:
        sys.argv = program
        shutil.rmtree(scratch, ignore_errors=True)
    metrics = {key: float(value) for key, value in (results[0] if results else {}).items()}
    print(f"held-out {own.held_out} of the base model {base}: {metrics.get(own.held_out, math.nan):.3f}", flush=True)
    command.datamodule.teardown("validate")
    return metrics


def _warm_start(config: str, sft_args: list[str]) -> None:
    from ..sft.command import main as sft

    code = sft(["--config", config, *sft_args])
    if code:
        raise SystemExit(code)


def _warm_start_done(config: str, output_dir: str | None) -> bool:
    """Whether the warm start's folder (`output_dir`, else the config's `model.model`) holds a finished warm start."""
    if output_dir is None:
        import yaml

        output_dir = (yaml.safe_load(Path(config).read_text()).get("model") or {}).get("model")
    return output_dir is not None and (Path(output_dir) / "warm_start.json").exists()


def _option(args: list[str], name: str, default: Default) -> str | Default:
    """The last value of `name` in `args` (`--name value` or `--name=value`), else `default`."""
    value: str | Default = default
    for i, token in enumerate(args):
        if token == name and i + 1 < len(args):
            value = args[i + 1]
        elif token.startswith(f"{name}="):
            value = token.split("=", 1)[1]
    return value


def validation_rows(metrics_csv: Path) -> tuple[dict[str, float], dict[str, float]]:
    """The `val/*` metrics of a `metrics.csv`'s first and last validation (before and after the fit)."""
    import pandas as pd

    metrics = pd.read_csv(metrics_csv)
    val = metrics[[column for column in metrics.columns if column.startswith("val/")]].dropna(how="all")
    if val.empty:
        return {}, {}
    return _row(val.iloc[0]), _row(val.iloc[-1])


def training_means(metrics_csv: Path, steps: int) -> dict[str, dict[str, float]]:
    """`{metric: {"first": mean, "last": mean}}` over the first and last `steps` training rows that logged it."""
    import pandas as pd

    metrics = pd.read_csv(metrics_csv)
    means = {}
    for name in TRAINING_METRICS:
        logged = metrics[name].dropna() if name in metrics else pd.Series(dtype=float)
        means[name] = {
            "first": float(logged.head(steps).mean()) if len(logged) else math.nan,
            "last": float(logged.tail(steps).mean()) if len(logged) else math.nan,
        }
    return means


def format_table(result: dict[str, Any], *, without_tools: bool = False) -> str:
    """The recipe's result as the lines it prints."""
    held_out = result["held_out"]
    name = held_out.removeprefix("val/rewards/").removeprefix("val/")
    lines = [f"{'held-out, greedy':<28}{name:>10}" + "".join(f"{label:>14}" for label in TOOL_METRICS)]
    for model, metrics in result["models"].items():
        label = f"{model} (no tools)" if without_tools and model == "base model" else model
        values = [metrics.get(held_out, math.nan), *(metrics.get(key, math.nan) for key in TOOL_METRICS.values())]
        if without_tools and model == "base model":
            values[1:] = [0.0, 0.0, 1.0]  # no tools: no calls, one turn
        lines.append(f"{label:<28}{values[0]:>10.3f}" + "".join(f"{value:>14.3f}" for value in values[1:]))
    training = ", ".join(
        f"{metric} {values['first']:.2f} -> {values['last']:.2f}" for metric, values in result["training"].items()
    )
    lines.append(f"training rollouts (first -> last steps): {training}")
    lines.append(
        f"{result['optimizer_steps']} optimizer steps, fit {result['fit_minutes']:.1f} min, "
        f"whole recipe {result['minutes']:.1f} min"
    )
    if result.get("stall"):
        lines.append(f"GRPO stalled (its groups taught nothing): {result['stall'].split(' HINT: ')[0]}")
    return "\n".join(lines)


def _row(row: Any) -> dict[str, float]:
    return {key: float(value) for key, value in row.items() if not math.isnan(value)}


if __name__ == "__main__":
    main()
