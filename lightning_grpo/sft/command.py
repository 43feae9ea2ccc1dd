"""`lightning-grpo sft`: a supervised warm start on tool-use demonstrations, written as a Hugging Face folder that a
GRPO fit then loads as `model.model: <folder>`.

    lightning-grpo sft --config lightning_grpo/configs/calculator.yaml            # writes the config's model.model
    lightning-grpo sft --config lightning_grpo/configs/calculator.yaml --sft.num_demonstrations 64 --sft.epochs 2

From the GRPO config it reads what the warm start must share with the fit: `model.model` (the folder to write),
`data.dataset` (the task the demonstrations are drawn from, with `data.dataset_options`), `data.tools`,
`data.environment_factory` (each demonstration then plays against a fresh environment, reset with its row) and
`data.max_tool_calling_iterations`; it ignores everything else there. Its own options are `--sft.*`
(`WarmStartOptions`; `lightning-grpo sft --help` lists them). The demonstrations are drawn with their own seed
(`sft.seed`, 20,000), so they are neither the fit's training problems (seed 0) nor its held-out ones (10,000 up).
The folder holds the trained weights, the tokenizer with the chat template the demonstrations were rendered with
(for SmolLM2, the ChatML tool template that replaces its own), and `warm_start.json` (losses, steps, minutes).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEMONSTRATION_SEED = 20_000


@dataclass
class WarmStartOptions:
    """The warm start's own options (`--sft.*`).

    Args:
        base_model: the policy to start from (a `load_policy` name or a folder).
        output_dir: the folder to write; None: the config's `model.model`, the folder the GRPO fit loads.
        demonstration: import path of the function that turns a dataset row into the assistant's messages.
        num_demonstrations: demonstrations to draw from the task.
        seed: the task generator's seed for the demonstrations (other problems than the fit's).
        learning_rate: AdamW's peak learning rate.
        batch_size: demonstrations per optimizer step.
        epochs: passes over the demonstrations.
        warmup_steps: optimizer steps of linear warm-up; then a linear decay to 0.
        weight_decay: AdamW's weight decay.
        max_grad_norm: gradient-norm clipping (0: none).
        dtype: the policy's dtype while it trains and as written.
    """

    base_model: str = "smollm2-135m-instruct"
    output_dir: str | None = None
    demonstration: str = "lightning_grpo.data.calculator.demonstration"
    num_demonstrations: int = 32
    seed: int = DEMONSTRATION_SEED
    learning_rate: float = 1e-4
    batch_size: int = 4
    epochs: int = 1
    warmup_steps: int = 2
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    dtype: str = "float32"

    def check(self) -> None:
        """Raise one `ValueError` naming every bad option."""
        problems = [
            f"{name}={getattr(self, name)} (must be at least 1)"
            for name in ("num_demonstrations", "batch_size", "epochs")
            if getattr(self, name) < 1
        ]
        if self.max_grad_norm < 0:
            problems.append(f"max_grad_norm={self.max_grad_norm} (0 turns clipping off)")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            problems.append(f"dtype={self.dtype!r} (one of 'float32', 'bfloat16', 'float16')")
        if problems:
            raise ValueError(f"`lightning-grpo sft` options: {', '.join(problems)}.")


def warm_start(
    options: WarmStartOptions,
    *,
    dataset: str,
    tools: Sequence[str | Callable],
    output_dir: str | Path,
    dataset_options: dict[str, Any] | None = None,
    max_tool_calling_iterations: int | None = 8,
    environment_factory: str | Callable | None = None,
) -> dict[str, Any]:
    """Train `options.base_model` on `options.num_demonstrations` demonstrations of `dataset` and write it to
    `output_dir`; returns the summary also written there as `warm_start.json`.

    Raises:
        ValueError: a bad option, a dataset whose rows the demonstration function cannot read, a tool that does not
            import, a chat template that cannot render the demonstrations' tool calls.
    """
    import lightning.pytorch as pl
    import torch

    from .._imports import resolve_callable
    from ..data.sources import load_prompts
    from ..data.tooling import resolve_environment_factory, resolve_tools
    from ..models.loading import load_policy, load_tokenizer
    from .demonstrations import collate, render_rows
    from .module import WarmStartModule

    options.check()
    started = time.monotonic()
    demonstrate = resolve_callable(options.demonstration, "sft.demonstration")
    rows = load_prompts(dataset, size=options.num_demonstrations, seed=options.seed, dataset_options=dataset_options)
    tokenizer = load_tokenizer(options.base_model)
    try:
        demonstrations = render_rows(
            tokenizer,
            rows,
            demonstrate,
            tools=resolve_tools(tools),
            environment_factory=resolve_environment_factory(environment_factory),
            max_tool_calling_iterations=max_tool_calling_iterations,
        )
    except KeyError as error:
        raise ValueError(
            f"`sft.demonstration={options.demonstration!r}` needs the column {error} that the rows of "
            f"dataset={dataset!r} do not have (they have {rows.column_names})."
        ) from None
    failures = sum(row.tool_failures for row in demonstrations)
    if failures:
        raise ValueError(f"{failures} of the demonstrations' tool calls failed: check `sft.demonstration`'s calls.")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    loader = torch.utils.data.DataLoader(
        demonstrations,
        batch_size=options.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(options.seed),
        collate_fn=lambda batch: collate(batch, pad),
    )
    policy = load_policy(options.base_model, dtype=getattr(torch, options.dtype))
    policy.train()
    module = WarmStartModule(
        policy,
        learning_rate=options.learning_rate,
        warmup_steps=options.warmup_steps,
        weight_decay=options.weight_decay,
        print_every_n_steps=max(1, len(loader) * options.epochs // 8),
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=options.epochs,
        precision="32-true",
        gradient_clip_val=options.max_grad_norm or None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=loader)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    policy.eval()
    policy.save_pretrained(out)
    tokenizer.save_pretrained(out)
    summary = {
        "base_model": options.base_model,
        "output_dir": str(out),
        "demonstrations": len(demonstrations),
        "trained_tokens": sum(sum(row.completion_mask) for row in demonstrations) * options.epochs,
        "optimizer_steps": trainer.global_step,
        "loss_first": module.losses[0],
        "loss_last": module.losses[-1],
        "losses": module.losses,
        "minutes": round((time.monotonic() - started) / 60, 2),
        "options": asdict(options),
    }
    (out / "warm_start.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """`lightning-grpo sft [--config GRPO.yaml] [--sft.* ...]`; returns the exit code (2: a bad option or value)."""
    from jsonargparse import ArgumentParser

    parser = _parser()
    config = parser.parse_args(list(argv) if argv is not None else None)
    init = parser.instantiate_classes(config)
    options: WarmStartOptions = init.sft
    model, data = config.get("model") or {}, config.get("data") or {}
    output_dir = options.output_dir or (model.get("model") if isinstance(model.get("model"), str) else None)
    problems = []
    if output_dir is None:
        problems.append("no folder to write: set --sft.output_dir, or model.model in the --config")
    if not data.get("dataset"):
        problems.append("no task: set data.dataset in the --config (e.g. `calculator`)")
    if problems or output_dir is None:
        ArgumentParser.error(parser, "; ".join(problems))
    print(f"warm start: {options.num_demonstrations} demonstrations of {data['dataset']!r}, {options.base_model} "
          f"-> {output_dir}", flush=True)  # fmt: skip
    try:
        summary = warm_start(
            options,
            dataset=data["dataset"],
            tools=data.get("tools") or [],
            output_dir=output_dir,
            dataset_options=data.get("dataset_options"),
            max_tool_calling_iterations=data.get("max_tool_calling_iterations", 8),
            environment_factory=data.get("environment_factory"),
        )
    except (ValueError, FileNotFoundError) as error:
        parser.error(f"{type(error).__name__}: {error}")
    print(
        f"warm start done: loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f} in "
        f"{summary['optimizer_steps']} steps ({summary['minutes']:.1f} min); wrote {summary['output_dir']}",
        flush=True,
    )
    return 0


def _parser() -> Any:
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(
        prog="lightning-grpo sft",
        description="A supervised warm start on tool-use demonstrations (see `lightning_grpo.sft.command`).",
        exit_on_error=True,
    )
    parser.add_argument(
        "--config", action=ActionConfigFile, help="a GRPO config: its model.model and data sections are read"
    )
    parser.add_class_arguments(WarmStartOptions, "sft")
    # The GRPO fit's sections: `model` and `data` are read, the rest is accepted so one config serves both commands.
    for section in ("model", "data", "trainer", "optimizer", "lr_scheduler"):
        parser.add_argument(f"--{section}", type=dict | None, default=None, help="(from the GRPO config)")
    parser.add_argument("--seed_everything", type=bool | int | None, default=None, help="(from the GRPO config)")
    parser.add_argument("--ckpt_path", type=str | None, default=None, help="(from the GRPO config)")
    return parser
