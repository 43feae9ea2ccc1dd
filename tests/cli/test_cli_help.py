"""`lightning-grpo` explains itself: `--help` lists every subcommand, each subcommand's `--help` lists every option,
`--version`, typos answered with the closest name, and LightningCLI's top-level `--optimizer` / `--lr_scheduler`
(also `optimizer:` in YAML) building the same optimizer as `--model.optimizer`, checked on real one-step fits of
the tiny model.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from importlib.metadata import version
from importlib.resources import files
from pathlib import Path

import pytest
import torch

from lightning_grpo.cli import SUBCOMMANDS, cli, main
from lightning_grpo.datamodule import GRPODataModule
from lightning_grpo.module import GRPOModule

SMOKE = str(files("lightning_grpo.configs") / "smoke.yaml")
COMMAND = str(Path(sys.executable).parent / "lightning-grpo")


def exits(capsys, args: list[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    return exit_info.value.code or 0, captured.out, captured.err


def test_help_lists_every_subcommand_with_one_line_and_imports_no_torch():
    """The installed console script, in its own process: `--help` names each subcommand with its line, and answers
    without importing torch (the process reports what it imported)."""
    script = (
        "import sys\nfrom lightning_grpo.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    code = e.code\n"
        "print('exit', code, 'torch' in sys.modules, 'lightning' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip().endswith("exit 0 False False"), done.stdout + done.stderr
    help_text = subprocess.run([COMMAND, "--help"], capture_output=True, text=True, timeout=60, check=True).stdout
    assert set(SUBCOMMANDS) == {"fit", "validate", "export", "vllm-serve", "sft"}
    for name, line in SUBCOMMANDS.items():
        assert re.search(rf"^\s+{re.escape(name)}\s+{re.escape(line)}$", help_text, re.MULTILINE), help_text
    assert "{fit,validate,export,vllm-serve,sft}" in help_text.split("\n\n")[0]  # the usage, wrapped


def test_version_prints_the_installed_version():
    done = subprocess.run([COMMAND, "--version"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, f"lightning-grpo {version('lightning-grpo')}")


@pytest.mark.timeout(120)
def test_fit_help_lists_every_module_data_module_and_optimizer_option(capsys, in_process):
    code, out, _ = exits(capsys, ["fit", "--help"])
    assert code == 0
    for prefix, cls in (("model", GRPOModule), ("data", GRPODataModule)):
        names = [name for name in inspect.signature(cls.__init__).parameters if name != "self"]
        linked = {"data.model"}  # written once, as model.model
        missing = [f"--{prefix}.{n}" for n in names if f"{prefix}.{n}" not in linked and f"--{prefix}.{n}" not in out]
        assert not missing, missing
    for option in ("--optimizer", "--lr_scheduler", "--trainer.max_steps", "--ckpt_path", "--print_config"):
        assert option in out
    code, out, _ = exits(capsys, ["validate", "--help"])
    assert code == 0 and "--ckpt_path" in out and "--model.val_max_tokens" in out


def test_export_and_vllm_serve_help_describe_every_option(capsys):
    code, out, _ = exits(capsys, ["export", "--help"])
    assert code == 0 and out.startswith("usage: lightning-grpo export")
    assert all(word in out for word in ("checkpoint", "output", "--merged", "--model"))
    code, out, _ = exits(capsys, ["vllm-serve", "--help"])
    assert code == 0 and out.startswith("usage: lightning-grpo vllm-serve")
    options = out[out.index("options:") :].splitlines()[1:]
    # each option's line has a description after it, or the next line does (argparse wraps long names)
    undescribed = [
        line.split()[0]
        for line, after in zip(options, [*options[1:], ""], strict=True)
        if re.match(r"^  --?\S+( [A-Z_{},0-9]+)?$", line) and not re.match(r"^\s{10,}\S", after)
    ]
    assert not undescribed, out
    assert "passed to `vllm serve`" in out


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (["fitt"], "Did you mean 'fit'?"),
        (["fti"], "Did you mean 'fit'?"),  # a swap is one mistake: 'sft' is as similar to difflib
        (["vllm_serve"], "Did you mean 'vllm-serve'?"),
        (["export", "a.ckpt", "out", "--mergd"], "Did you mean --merged?"),
        (["fit", "--config", SMOKE, "--model.learnin_rate", "1"], "Did you mean --model.learning_rate?"),
        (["fit", "--config", SMOKE, "--data.prompt_format", "chatt"], "Did you mean 'chat'?"),
        (["--print_confg", "fit", "--config", SMOKE], "Did you mean --print_config?"),
    ],
    ids=["subcommand", "subcommand_swap", "subcommand_dash", "export_option", "option", "choice", "top_level_option"],
)
@pytest.mark.timeout(120)
def test_a_typo_exits_2_naming_the_closest(args, hint, capsys, in_process):
    code, _, err = exits(capsys, args)
    message = err[err.rindex("error: ") :]
    assert code == 2 and hint in message and "Traceback" not in err, err[-1500:]


@pytest.mark.timeout(120)
def test_a_mistyped_yaml_key_names_the_closest(tmp_path, capsys, in_process):
    (tmp_path / "typo.yaml").write_text("model:\n  learnin_rate: 0.1\n")
    code, _, err = exits(capsys, ["fit", "--config", SMOKE, "--config", str(tmp_path / "typo.yaml")])
    assert code == 2 and "'model.learnin_rate'. Did you mean 'model.learning_rate'?" in err, err[-1500:]


def optimizer_yaml(tmp_path: Path) -> str:
    path = tmp_path / "optimizer.yaml"
    path.write_text(
        "optimizer:\n  class_path: torch.optim.SGD\n  init_args:\n    lr: 0.05\n    momentum: 0.5\n"
        "lr_scheduler:\n  class_path: torch.optim.lr_scheduler.StepLR\n  init_args:\n    step_size: 3\n"
    )
    return str(path)


FORMS = {
    "top_level_flags": lambda tmp: [
        *("--optimizer", "SGD", "--optimizer.lr", "0.05", "--optimizer.momentum", "0.5"),
        *("--lr_scheduler", "StepLR", "--lr_scheduler.step_size", "3"),
    ],
    "top_level_yaml": lambda tmp: ["--config", optimizer_yaml(tmp)],
    "model_flags": lambda tmp: [
        *("--model.optimizer", "torch.optim.SGD", "--model.optimizer.lr", "0.05"),
        *("--model.optimizer.momentum", "0.5"),
        *("--model.lr_scheduler", "torch.optim.lr_scheduler.StepLR", "--model.lr_scheduler.step_size", "3"),
    ],
}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.timeout(240)
def test_each_optimizer_form_trains_one_step_with_that_optimizer_over_the_policy(
    form, tmp_path, in_process, no_leaked_processes
):
    """`--optimizer` (LightningCLI's form, flags or YAML) and `--model.optimizer` (the module's) build the same SGD
    with the same StepLR, over the loaded policy's parameters, and train a real step of the tiny model with it."""
    # the smoke config sets AdamW's learning_rate, which an optimizer of its own would ignore (with a warning)
    fixed_lr = ["--model.learning_rate", "1e-6"]
    args = ["fit", "--config", SMOKE, *fixed_lr, *FORMS[form](tmp_path), "--trainer.max_steps", "1"]
    done = cli([*args, "--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "0"])
    assert done.trainer.global_step == 1
    (optimizer,) = done.trainer.optimizers
    assert type(optimizer) is torch.optim.SGD
    group = optimizer.param_groups[0]
    assert (group["initial_lr"], group["momentum"]) == (0.05, 0.5)
    trained = [p for p in done.model.policy.parameters() if p.requires_grad]
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(trained) > 0
    schedule = done.trainer.lr_scheduler_configs[0].scheduler
    assert type(schedule) is torch.optim.lr_scheduler.StepLR and schedule.step_size == 3


@pytest.mark.timeout(120)
def test_optimizer_given_at_the_top_level_and_in_the_module_exits_2_naming_both(tmp_path, capsys, in_process):
    args = ["fit", "--config", SMOKE, "--config", optimizer_yaml(tmp_path), "--model.optimizer", "torch.optim.Adam"]
    code, _, err = exits(capsys, args)
    message = err[err.rindex("error: ") :]
    assert code == 2 and "`optimizer: torch.optim.SGD`" in message and "`model.optimizer: torch.optim.Adam`" in message
    assert "not both" in message
