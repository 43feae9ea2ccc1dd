"""Every code block of the docs site and the README that a reader might copy is checked.

Python blocks: each one is a snippet file that a named test runs (`SNIPPET_TESTS`), an inline block run here
(`RUN_HERE`: the tiny model stands in for real ones, a stub for what needs a server or a checkpoint), or a fragment
that cannot run alone (`FRAGMENTS`, with the reason; it must still parse). A block on no list fails
`test_every_python_block_is_run_or_listed`.

Shell blocks: every command of ours (`lightning-grpo ...`, `python -m lightning_grpo.cli ...`, `./scripts/main.sh
...`, `python -m lightning_grpo.cli.main_job ...`, also behind `srun`, `torchrun` or environment variables) is
parsed by the command's own parser without running it: `fit` and `validate` (and the main job) with `--print_config`
appended (LightningCLI checks every option, prints the config and exits 0), `export`, `vllm-serve` and `sft` with
the work they would start replaced by a recorder. All of them in one child process (`python
tests/docs/test_code_blocks.py` reads the commands as JSON on stdin), so torch and Lightning are imported once.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import json
import os
import re
import shlex
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SNIPPETS = DOCS / "snippets"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}

#: Every snippet file a page includes, and the test that runs it: (test file, test function).
SNIPPET_TESTS = {
    "first_reward.py": ("tests/docs/test_docs_site.py", "test_first_reward_page_runs_as_written"),
    "first_reward_output.txt": ("tests/docs/test_docs_site.py", "test_first_reward_page_runs_as_written"),
    "quickstart.py": ("tests/docs/test_results_pages.py", "test_the_home_page_example_trains"),
    "dataset_formats_example.py": (
        "tests/data/test_dataset_formats_doc.py",
        "test_the_guide_example_runs_and_prints_its_comments",
    ),
    "reward_from_column.py": ("tests/docs/test_reward_cookbook.py", "test_a_column_arrives_by_name"),
    "reward_abstain.py": (
        "tests/docs/test_reward_cookbook.py",
        "test_abstaining_returns_none_for_a_row_without_an_answer",
    ),
    "reward_async.py": (
        "tests/docs/test_reward_cookbook.py",
        "test_the_async_reward_awaits_every_completion_concurrently",
    ),
    "reward_format.py": ("tests/docs/test_reward_cookbook.py", "test_the_format_reward_gives_partial_credit"),
    "reward_length.py": ("tests/docs/test_reward_cookbook.py", "test_the_length_penalties_follow_trl_and_count_tokens"),
    "reward_judge.py": ("tests/docs/test_reward_cookbook.py", "test_the_judge_scores_with_a_local_model"),
}

#: Inline Python blocks run by a test of this file: (page, a text only that block of the page holds) -> the test.
RUN_HERE = {
    ("README.md", "import lightning.pytorch as pl"): "test_the_readme_example_trains_on_the_tiny_model",
    ("docs/guides/rewards.md", '"my_pkg.rewards:fmt"'): "test_rewards_guide_mixes_paths_and_callables",
    ("docs/guides/tools.md", "class Lookup:"): "test_tools_guide_environment_answers_and_rewards",
    ("docs/guides/embedded-generator.md", "AutoPrecision()"): "test_embedded_generator_precision_plugin",
    ("docs/guides/tool_use_recipe.md", "NumberGuessEnv"): "test_number_guess_recipe_loads_its_prompts",
    ("docs/guides/scorers.md", "RewardModelScorer(reward_model)"): "test_scorers_guide_builds_the_module",
    ("docs/guides/vllm.md", "vllm_failover=False"): "test_vllm_guide_names_two_servers",
    ("docs/guides/vllm.md", "VLLMServer("): "test_vllm_guide_servers_pin_one_core_each",
    ("docs/guides/models.md", "Architecture("): "test_models_guide_architecture_is_the_llama_row",
    ("docs/guides/reward-cookbook.md", "my_prompts.jsonl"): "test_cookbook_combines_the_recipes",
    ("docs/guides/reward-cookbook.md", "Judge()"): "test_cookbook_adds_the_judge",
    ("docs/guides/checkpoints.md", "ckpt_path="): "test_checkpoints_guide_resume_call_binds_trainer_fit",
}

#: Inline Python blocks that cannot run alone: (page, a text only that block holds) -> why. Each must parse.
FRAGMENTS: dict[tuple[str, str], str] = {}

#: Stand-ins for what a command names from the reader's own setup, so the rest of the command is still checked.
STAND_INS = {
    "my.yaml": "lightning_grpo/configs/arithmetic.yaml",  # the reader's config (distributed guide)
    "run.yaml": "lightning_grpo/configs/arithmetic.yaml",  # the reader's config (reliability guide)
    "$CKPT": "last.ckpt",  # a shell variable holding a checkpoint path (reliability guide)
}

#: Commands of ours that are not parsed here: (page, the logical line as written) -> why.
SKIPPED_COMMANDS: dict[tuple[str, str], str] = {}


# -- reading the pages -----------------------------------------------------------------------------------------------

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_INCLUDE = re.compile(r"""^-{2}8<-{2} +["']?(?P<name>[^"':]+)(?::\d+(?::\d+)?)?["']?\s*$""")


@dataclass(frozen=True)
class Block:
    """A fenced code block: its page (relative to the repository root), first code line, language and text."""

    page: str
    line: int
    language: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def included(self) -> list[str]:
        """The snippet files the block includes with `--8<--` (none: inline code)."""
        return [match["name"].strip() for match in map(_INCLUDE.match, self.text.splitlines()) if match]


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def blocks_of(text: str, page: str) -> list[Block]:
    """The fenced blocks of a page's text, each without its fence's indentation."""
    found: list[Block] = []
    fence: re.Match | None = None
    lines: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        opening = _FENCE.match(line)
        if fence is None:
            fence, lines = opening, []
            continue
        closes = opening is not None and opening["fence"][0] == fence["fence"][0] and not opening["info"].strip()
        if closes and len(opening["fence"]) >= len(fence["fence"]):
            language = fence["info"].strip().split(" ")[0].lower()
            found.append(Block(page, number - len(lines), language, "\n".join(lines) + "\n"))
            fence = None
            continue
        indent = len(fence["indent"])
        lines.append(line[indent:] if line[:indent].isspace() else line)
    return found


def all_blocks(language: str) -> list[Block]:
    return [
        block
        for page in pages()
        for block in blocks_of(page.read_text(), str(page.relative_to(ROOT)))
        if block.language == language
    ]


def block(page: str, marker: str) -> Block:
    """The one Python block of `page` that holds `marker`."""
    found = [b for b in all_blocks("python") if b.page == page and marker in b.text]
    assert len(found) == 1, f"{len(found)} Python blocks of {page} hold {marker!r} (expected one): update RUN_HERE"
    return found[0]


def run_block(code: Block, namespace: dict[str, Any], swaps: dict[str, str] | None = None) -> Any:
    """Execute a block in `namespace` (after the text `swaps`); returns the value of its last line if that is an
    expression (`GRPODataModule(...)` on its own returns the data module)."""
    source = code.text
    for old, new in (swaps or {}).items():
        assert source.count(old) == 1, f"{code.where} no longer holds {old!r} once: update this test"
        source = source.replace(old, new)
    tree = ast.parse(source, filename=code.where)
    last = tree.body[-1] if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    if last is not None:
        tree.body[-1] = ast.Assign(targets=[ast.Name("_last_value", ast.Store())], value=last.value)
        ast.fix_missing_locations(tree)
    exec(compile(tree, code.where, "exec"), namespace)
    return namespace.get("_last_value")


# -- every Python block is run or listed ------------------------------------------------------------------------------


def test_blocks_of_reads_languages_lines_and_indented_fences():
    text = "x\n```python\na = 1\n```\n- item\n\n    ```bash\n    ls \\\n      -l\n    ```\n````md\n```\n````\n"
    assert blocks_of(text, "p.md") == [
        Block("p.md", 3, "python", "a = 1\n"),
        Block("p.md", 8, "bash", "ls \\\n  -l\n"),
        Block("p.md", 12, "md", "```\n"),
    ]
    assert Block("p.md", 1, "python", '--8<-- "quickstart.py:6:26"\n').included == ["quickstart.py"]


def test_every_python_block_is_run_or_listed():
    """A snippet include names a test that runs it; an inline block is run here or listed as a fragment."""
    python = all_blocks("python")
    assert len(python) >= 20, f"only {len(python)} Python blocks found: is the fence reader broken?"
    unlisted, claimed = [], {}
    for code in python:
        for name in code.included:
            assert name in SNIPPET_TESTS, f"{code.where} includes {name}, which no test is listed to run"
        if code.included:
            continue
        keys = [key for key in (*RUN_HERE, *FRAGMENTS) if key[0] == code.page and key[1] in code.text]
        if len(keys) != 1:
            unlisted.append(f"{code.where} ({len(keys)} entries match: {keys})")
            continue
        claimed[keys[0]] = code
        if keys[0] in FRAGMENTS:
            ast.parse(code.text, filename=code.where)
    assert not unlisted, "Python blocks neither run nor listed (add them to RUN_HERE or FRAGMENTS):\n" + "\n".join(
        unlisted
    )
    stale = [key for key in (*RUN_HERE, *FRAGMENTS) if key not in claimed]
    assert not stale, f"entries that match no block any more: {stale}"
    missing = [name for name in RUN_HERE.values() if not callable(globals().get(name))]
    assert not missing, f"RUN_HERE names tests this file does not define: {missing}"


def test_each_included_snippet_is_run_by_the_test_named_for_it():
    included = {name for code in all_blocks("python") for name in code.included}
    for name, (test_file, function) in SNIPPET_TESTS.items():
        assert (SNIPPETS / name).is_file(), f"{name} is listed but is not in docs/snippets/"
        source = (ROOT / test_file).read_text()
        assert re.search(rf"^def {function}\(", source, flags=re.M), f"{test_file} defines no {function}"
        assert Path(name).stem in source, f"{test_file} does not name {name}"
    text_includes = {name for page in pages() for name in re.findall(r'--8<-- "([^":]+)', page.read_text())}
    assert included <= set(SNIPPET_TESTS) and text_includes <= set(SNIPPET_TESTS)


# -- the inline Python blocks, run ------------------------------------------------------------------------------------


def test_the_readme_example_trains_on_the_tiny_model(tmp_path, no_leaked_processes):
    """The README's "Use it" block as a script (the rollout process re-imports it), on the tiny model for two
    optimizer steps."""
    code = block("README.md", "import lightning.pytorch as pl")
    swaps = {
        '"smollm2-135m-instruct"': '"tiny-random"',
        "max_completion_length=64": "max_completion_length=8",
        "pl.Trainer(max_epochs=-1, log_every_n_steps=1)": "pl.Trainer(max_epochs=-1, log_every_n_steps=1, max_steps=2, "
        "accelerator='cpu', enable_checkpointing=False, logger=False, enable_progress_bar=False)",
        "trainer.fit(module, datamodule=datamodule)": "trainer.fit(module, datamodule=datamodule)\n"
        "    assert trainer.global_step == 2, trainer.global_step\n    print('trained', 2)",
    }
    from helpers.doc_scripts import run_swapped  # here: this file also runs as a script, without tests/ on its path

    assert "trained 2" in run_swapped(code.text, swaps, code.where, tmp_path, timeout=240)


def test_rewards_guide_mixes_paths_and_callables(monkeypatch):
    from lightning_grpo import GRPODataModule
    from lightning_grpo.rewards import accuracy

    def fmt(completions, **columns):
        return [0.0] * len(completions)

    def brevity(completions, **columns):
        return [1.0] * len(completions)

    package = types.ModuleType("my_pkg")
    package.rewards = types.ModuleType("my_pkg.rewards")
    package.rewards.fmt = fmt
    monkeypatch.setitem(sys.modules, "my_pkg", package)
    monkeypatch.setitem(sys.modules, "my_pkg.rewards", package.rewards)
    code = block("docs/guides/rewards.md", '"my_pkg.rewards:fmt"')
    data = run_block(code, {"GRPODataModule": GRPODataModule, "brevity": brevity})
    assert data.reward_funcs == [accuracy, fmt, brevity]


def test_tools_guide_environment_answers_and_rewards(monkeypatch):
    """The block's `dataset=...` is the reader's; a two-row dataset stands in for it."""
    from datasets import Dataset

    from lightning_grpo import GRPODataModule

    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Look k up."}]] * 2})

    def with_prompts(**options: Any) -> GRPODataModule:
        assert options["dataset"] is Ellipsis
        return GRPODataModule(model="tiny-random", **{**options, "dataset": prompts})

    namespace: dict[str, Any] = {"GRPODataModule": with_prompts}
    data = run_block(block("docs/guides/tools.md", "class Lookup:"), namespace)
    assert data.environment_factory is namespace["Lookup"]
    data.check_data()
    environment = namespace["Lookup"]()
    environment.reset(prompt="Look k up.")
    assert environment.get_reward() == 0.0
    assert environment.lookup("k") == "42" and environment.lookup("x") == "unknown"
    assert environment.get_reward() == 0.0  # two calls: the reward is for exactly one
    environment.reset()
    environment.lookup("k")
    assert environment.get_reward() == 1.0


def test_embedded_generator_precision_plugin(tmp_path, monkeypatch):
    from lightning.pytorch import Trainer

    from lightning_grpo.training.precision_plugin import AutoPrecision

    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"Trainer": Trainer, "AutoPrecision": AutoPrecision}
    run_block(block("docs/guides/embedded-generator.md", "AutoPrecision()"), namespace)
    assert isinstance(namespace["trainer"].precision_plugin, AutoPrecision)


def test_number_guess_recipe_loads_its_prompts():
    code = block("docs/guides/tool_use_recipe.md", "NumberGuessEnv")
    data = run_block(code, {}, swaps={'"smollm2-135m-instruct"': '"tiny-random"'})
    data.check_data()
    secrets = data.train_prompts["secret"]
    assert secrets and all(1 <= secret <= 16 for secret in secrets)
    assert len(data.reward_funcs) == 1 and data.options.rewards.reward_weights == [0.0, 1.0]


def test_scorers_guide_builds_the_module():
    from helpers.tiny import tiny_reward_model

    from lightning_grpo import RewardModelScorer

    code = block("docs/guides/scorers.md", "RewardModelScorer(reward_model)")
    module = run_block(code, {"reward_model": tiny_reward_model()}, swaps={'"smollm2-135m-instruct"': '"tiny-random"'})
    assert len(module.scorers) == 1 and isinstance(module.scorers[0], RewardModelScorer)


def test_vllm_guide_names_two_servers():
    """Building the data module contacts no server (`setup` and `lightning-grpo fit` do)."""
    from lightning_grpo import GRPODataModule

    data = run_block(block("docs/guides/vllm.md", "vllm_failover=False"), {"GRPODataModule": GRPODataModule})
    assert data.options.vllm.vllm_server_url == ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]
    assert data.options.vllm.vllm_failover is False and data.options.generation.generator == "vllm"


def test_vllm_guide_servers_pin_one_core_each(monkeypatch):
    """`start()` needs vLLM's environment: here it returns the server unstarted, so the constructor's options are
    what is checked."""
    from lightning_grpo.serving.vllm_launcher import VLLMServer

    monkeypatch.setattr(VLLMServer, "start", lambda self: self)
    namespace: dict[str, Any] = {}
    run_block(block("docs/guides/vllm.md", "VLLMServer("), namespace)
    assert [server.env for server in namespace["servers"]] == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0"},
        {"VLLM_CPU_OMP_THREADS_BIND": "1"},
    ]


def test_models_guide_architecture_is_the_llama_row():
    from lightning_grpo.rollout.architectures import ARCHITECTURES, Architecture

    shown = run_block(block("docs/guides/models.md", "Architecture("), {"Architecture": Architecture})
    assert shown == ARCHITECTURES["llama"]


def _recipes() -> dict[str, Any]:
    from test_reward_cookbook import recipe

    return {
        "keyword_coverage": recipe("reward_from_column").keyword_coverage,
        "exact_answer": recipe("reward_abstain").exact_answer,
        "answer_tags": recipe("reward_format").answer_tags,
        "soft_overlong": recipe("reward_length").soft_overlong,
        "Judge": recipe("reward_judge").Judge,
    }


def test_cookbook_combines_the_recipes(tmp_path, monkeypatch):
    from lightning_grpo import GRPODataModule

    monkeypatch.chdir(tmp_path)
    row = {"prompt": "Name the capital of France.", "keywords": ["Paris"], "answer": "Paris"}
    (tmp_path / "my_prompts.jsonl").write_text(json.dumps(row) + "\n")
    recipes = _recipes()
    code = block("docs/guides/reward-cookbook.md", "my_prompts.jsonl")
    data = run_block(code, {"GRPODataModule": GRPODataModule, **recipes})
    names = ["keyword_coverage", "exact_answer", "answer_tags", "soft_overlong"]
    assert data.reward_funcs == [recipes[name] for name in names]


def test_cookbook_adds_the_judge():
    from lightning_grpo import GRPODataModule

    code = block("docs/guides/reward-cookbook.md", "Judge()")
    data = run_block(code, {"GRPODataModule": GRPODataModule, **_recipes()})
    assert [getattr(f, "__name__", None) for f in data.reward_funcs] == ["exact_answer", "judge"]


def test_checkpoints_guide_resume_call_binds_trainer_fit():
    """The call needs a run's checkpoint: here a stub trainer binds it to `Trainer.fit`'s signature."""
    from lightning.pytorch import Trainer

    calls = []
    trainer = types.SimpleNamespace(
        fit=lambda *a, **k: calls.append(inspect.signature(Trainer.fit).bind(None, *a, **k))
    )
    run_block(block("docs/guides/checkpoints.md", "ckpt_path="), {"trainer": trainer, "module": 1, "datamodule": 2})
    assert calls[0].arguments["ckpt_path"] == "last.ckpt" and calls[0].arguments["datamodule"] == 2


# -- shell commands, parsed ---------------------------------------------------------------------------------------


def logical_lines(text: str) -> list[str]:
    """A shell block's commands: `\\`-continued lines joined, blank and comment-only lines left out."""
    joined = re.sub(r"\s*\\\n\s*", " ", text)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def our_command(line: str) -> tuple[str, list[str]] | None:
    """("lightning-grpo", args) or ("main-job", args) for a command of ours (after `VAR=value`, `srun` or
    `torchrun ... -m`), with the stand-ins for the reader's files; None for any other command."""
    words = [STAND_INS.get(word, word) for word in shlex.split(line, comments=True)]
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words.pop(0)
    if words and words[-1] == "&":
        words.pop()
    if words and words[0] == "srun":
        words.pop(0)
    if words and Path(words[0]).name in ("python", "python3", "torchrun") and "-m" in words:
        module_at = words.index("-m") + 1
        words = [f"-m {words[module_at]}", *words[module_at + 1 :]]
    if not words:
        return None
    if words[0] in ("lightning-grpo", "-m lightning_grpo.cli"):
        return "lightning-grpo", words[1:]
    if words[0] in ("./scripts/main.sh", "-m lightning_grpo.cli.main_job"):
        return "main-job", words[1:]
    return None


def test_our_command_reads_prefixes_continuations_and_stand_ins():
    assert logical_lines("# a\nlightning-grpo fit \\\n    --x 1\n\nls\n") == ["lightning-grpo fit --x 1", "ls"]
    assert our_command("NODE_RANK=0 A=b lightning-grpo fit --config my.yaml  # note") == (
        "lightning-grpo",
        ["fit", "--config", "lightning_grpo/configs/arithmetic.yaml"],
    )
    assert our_command("torchrun --nnodes 2 -m lightning_grpo.cli fit --c 'a b'") == (
        "lightning-grpo",
        ["fit", "--c", "a b"],
    )
    assert our_command("srun lightning-grpo vllm-serve --port 1 &") == ("lightning-grpo", ["vllm-serve", "--port", "1"])
    assert our_command("./scripts/main.sh --trainer.max_steps 10") == ("main-job", ["--trainer.max_steps", "10"])
    assert our_command(".venv/bin/python -m lightning_grpo.cli.main_job") == ("main-job", [])
    assert our_command("pip install -e .") is None and our_command("tensorboard --logdir runs") is None


def documented_commands() -> list[tuple[str, str, str, list[str]]]:
    """(where, the line as written, kind, args) of every command of ours in a bash block, skipped ones left out."""
    found = []
    for code in all_blocks("bash"):
        for line in logical_lines(code.text):
            command = our_command(line)
            if command is None or (code.page, line) in SKIPPED_COMMANDS:
                continue
            kind, args = command
            assert not any(re.search(r"<[^>]*>|\$", word) for word in args), (
                f"{code.where}: `{line}` names a placeholder or variable: add a STAND_INS entry or SKIPPED_COMMANDS"
            )
            found.append((code.where, line, kind, args))
    return found


#: Commands with one mistake each, parsed with the documented ones: each must fail, or the check proves nothing.
BROKEN_COMMANDS = [
    ("lightning-grpo", ["fit", "--config", "lightning_grpo/configs/smoke.yaml", "--trainer.max_stepz", "2"]),
    ("lightning-grpo", ["validate", "--config", "lightning_grpo/configs/smoke.yaml", "--data.generator", "vlm"]),
    ("main-job", ["--config", "lightning_grpo/configs/nonexistent.yaml"]),
    ("lightning-grpo", ["export", "last.ckpt"]),
    ("lightning-grpo", ["vllm-serve", "--model", "tiny-random", "--portt", "8000"]),
    ("lightning-grpo", ["sft", "--config", "lightning_grpo/configs/calculator.yaml", "--sft.num_demonstrationz", "1"]),
    ("lightning-grpo", ["fitt", "--help"]),
]


def test_every_documented_command_parses():
    commands = documented_commands()
    kinds = {(kind, args[0] if args and kind == "lightning-grpo" else "") for _, _, kind, args in commands}
    expected = {("lightning-grpo", name) for name in ("fit", "validate", "export", "vllm-serve", "sft", "--help")}
    assert expected | {("main-job", "")} <= kinds, f"the pages no longer show every subcommand: {kinds}"
    payload = json.dumps([[kind, args] for _, _, kind, args in commands] + [list(bad) for bad in BROKEN_COMMANDS])
    done = subprocess.run(
        [sys.executable, __file__], input=payload, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=170
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.splitlines()[-1])
    documented, broken = results[: len(commands)], results[len(commands) :]
    failed = [
        f"{where}: `{line}` -> exit {result['code']}: {result['message']}"
        for (where, line, _, _), result in zip(commands, documented, strict=True)
        if result["code"] != 0
    ]
    assert not failed, "documented commands that do not parse:\n" + "\n".join(failed)
    accepted = [
        " ".join(args) for (_, args), result in zip(BROKEN_COMMANDS, broken, strict=True) if result["code"] == 0
    ]
    assert not accepted, f"commands with a mistake that parsed (the check is broken): {accepted}"


class _Parsed(Exception):
    """Raised by a stub in place of the work a command would start, once its parser has accepted the arguments."""


def _stub_the_work() -> dict[str, list[Any]]:
    """Replace what `export`, `vllm-serve` and `sft` would start by recorders; returns the record."""
    from lightning_grpo.cli import export
    from lightning_grpo.serving import vllm_launcher
    from lightning_grpo.sft import command as sft

    record: dict[str, list[Any]] = {"export": [], "vllm-serve": [], "sft": []}

    def export_policy(checkpoint: str, output: str, **options: Any) -> str:
        record["export"].append((checkpoint, output, options))
        return output

    def server(model: str, **options: Any) -> None:
        if options["extra_args"]:
            raise SystemExit(f"options that go to `vllm serve` unchecked: {options['extra_args']}")
        record["vllm-serve"].append((model, options))
        raise _Parsed

    def warm_start(options: Any, **data: Any) -> None:
        record["sft"].append((options, data))
        raise _Parsed

    export.export_policy, vllm_launcher.VLLMServer, sft.warm_start = export_policy, server, warm_start
    return record


def _parse_command(kind: str, args: list[str]) -> tuple[int, str]:
    """The exit code and the last output lines of one command, parsed in this process; 0 for `_Parsed`."""
    from lightning_grpo.cli import main_job
    from lightning_grpo.cli.app import main

    lightning = kind == "main-job" or (args and args[0] in ("fit", "validate"))
    if lightning and not {"--help", "--print_config"} & set(args):
        args = [*args, "--print_config"]  # LightningCLI checks every option, prints the config and exits 0
    out = io.StringIO()
    code: int | str | None = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main_job.main(args) if kind == "main-job" else main(args)
        except _Parsed:
            code = 0
        except SystemExit as exit:
            code = exit.code
    if not isinstance(code, int):
        out.write(str(code))
        code = 0 if code is None else 1
    return code, "\n".join(out.getvalue().strip().splitlines()[-4:])


def _parse_commands_from_stdin() -> None:
    """The child process of `test_every_documented_command_parses`: JSON [[kind, args], ...] in, one JSON line out."""
    commands = json.loads(sys.stdin.read())
    _stub_the_work()
    results = [dict(zip(("code", "message"), _parse_command(kind, args), strict=True)) for kind, args in commands]
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    _parse_commands_from_stdin()
