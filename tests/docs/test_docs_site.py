"""The docs site: the strict build, the generated reference, the README's length and links, and the get-started code.

The strict build is a real `mkdocs build --strict` in a subprocess (skipped, saying why, only where mkdocs is not
installed: `.ci/run` installs the `docs` extra, so CI runs it). The get-started script is the very file the page
includes, run as a user would run it.
"""

from __future__ import annotations

import html
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _load_options():
    if "docs_gen_options" not in sys.modules:
        spec = importlib.util.spec_from_file_location("docs_gen_options", DOCS / "_gen" / "options.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclass looks its module up while it is built
        spec.loader.exec_module(module)
    return sys.modules["docs_gen_options"]


def _load_gen(name: str):
    """A module of docs/_gen (the site's generators), imported as the build imports it."""
    if str(DOCS / "_gen") not in sys.path:
        sys.path.insert(0, str(DOCS / "_gen"))
    return importlib.import_module(name)


def _configurable():
    from lightning_grpo import GRPODataModule, GRPOModule

    return [GRPOModule, GRPODataModule]


def _parameters(cls):
    return [(name, p) for name, p in inspect.signature(cls.__init__).parameters.items() if name != "self"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once with `mkdocs build --strict` (every warning fails it)."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.skip("mkdocs is not installed: pip install -e '.[docs]' (.ci/run does) to build the docs site")
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env={**ENV, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-6000:]}"
    return out


@pytest.mark.timeout(300)
def test_strict_build_writes_every_page_of_the_nav(site):
    import yaml

    def pages(nav):
        for entry in nav:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            yield from pages(value) if isinstance(value, list) else [value]

    # mkdocs.yml has no Python tags, so the safe loader reads it
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    for page in pages(config["nav"]):
        built = site / ("index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html")
        assert built.is_file(), f"{page} was not built"


@pytest.mark.timeout(300)
def test_options_page_lists_every_parameter_with_its_default(site):
    """Each option is one list entry: its name, type and default first (never a table column off screen), no
    escaped pipe anywhere."""
    page = html.unescape((site / "reference" / "options" / "index.html").read_text())
    assert "\\|" not in re.sub(r"<[^>]+>", "", page), "the options page shows an escaped pipe"
    entries: dict[str, list[str]] = {}
    for name, rest in re.findall(r'<li><code class="lg-name">(\w+)</code>(.*?)<br>', page, flags=re.S):
        entries.setdefault(name, []).append(re.sub(r"<[^>]+>", "", rest))
    for cls in _configurable():
        for name, parameter in _parameters(cls):
            assert name in entries, f"{cls.__name__}({name}=...) is missing from the options page"
            default = "required" if parameter.default is inspect.Parameter.empty else f"default {parameter.default!r}"
            shown = [head for head in entries[name] if head.endswith(default)]
            assert shown, f"{cls.__name__}({name}=...): {default!r} not on its first line (got {entries[name]})"


def test_readable_types_spell_out_unions_and_choices():
    options = _load_options()
    assert options.readable_type("int | None") == "int or None"
    assert options.readable_type("Literal['dapo', 'grpo'] | None") == '"dapo" / "grpo" or None'
    assert options.readable_type("list[str | Callable] | None") == "list[str or Callable] or None"


def test_every_parameter_is_documented_and_its_trl_counterpart_exists():
    """The generator's own check: an undocumented parameter or a TRL name that does not exist fails the build."""
    options = _load_options()
    for cls in _configurable():
        assert options.undocumented(cls) == [], f"{cls.__name__}'s docstring leaves these out of Args:"
        rows = {option.name: option for option in options.options(cls)}
        assert [name for name, _ in _parameters(cls)] == list(rows)
    # TRL's own name with TRL's own default, and a renamed one found in TRL
    module_rows = {option.name: option for option in options.options(_configurable()[0])}
    assert module_rows["loss_type"].trl == "`GRPOConfig.loss_type` (`'dapo'`)"
    assert module_rows["betas"].trl.startswith("`GRPOConfig.adam_beta1` (`0.9`)")
    assert module_rows["val_pass_threshold"].trl == ""


def test_a_wrong_trl_name_fails_the_generator(monkeypatch):
    options = _load_options()
    monkeypatch.setitem(options.TRL_NAMES, "GRPOModule.betas", ("GRPOConfig.adam_betas",))
    with pytest.raises(ValueError, match="GRPOConfig has no field 'adam_betas'"):
        options.options(_configurable()[0])


def test_args_parser_reads_shared_entries_and_keeps_the_first_of_a_repeated_name():
    options = _load_options()
    doc = """Summary.

    Args:
        a, b: shared
            meaning.
        c: first.
        c: second, ignored.

    Raises:
        ValueError: not an argument.
    """
    assert options.parse_args_section(doc) == {"a": "shared meaning.", "b": "shared meaning.", "c": "first."}


@pytest.mark.timeout(300)
def test_api_pages_document_every_user_facing_name_and_no_internal_one(site):
    """Each name `docs/_gen/api_pages.py` puts on a page is there (and in the index); the internals are on none."""
    pages = _load_gen("api_pages")
    index = (site / "reference" / "api" / "index.html").read_text()
    shown = {}
    for page, (_, sections) in pages.PAGES.items():
        shown[page] = (site / "reference" / page / "index.html").read_text()
        for _, paths in sections:
            for path in paths:
                anchor = path.removeprefix("lightning_grpo.") if ".callbacks." in path else path
                assert f'id="{anchor}"' in shown[page], f"{path} is not on reference/{page}.md"
                assert f'href="../{page}/#{anchor}"' in index, f"the API index does not link {path}"
    for name in pages.INTERNAL:
        for page, text in shown.items():
            assert f'id="lightning_grpo.{name}"' not in text, f"the internal {name} is on reference/{page}.md"


@pytest.mark.timeout(300)
def test_cli_page_holds_every_subcommands_help(site):
    page = html.unescape((site / "reference" / "cli" / "index.html").read_text())
    for name in ("fit", "validate", "export", "vllm-serve"):
        assert f"lightning-grpo {name}" in page
    assert "--model.learning_rate" in page and "--data.num_generations" in page


def test_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150, f"README.md has {len(text.splitlines())} lines; the rest belongs in docs/"
    assert "./scripts/main.sh\n" in text and "./scripts/test.sh\n" in text and "./scripts/setup_vllm.sh" in text
    assert "mkdocs serve" in text
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links, "the README links into the docs"
    for link in links:
        if not link.startswith("http"):
            assert (ROOT / link).is_file(), f"README links to {link}, which does not exist"


@pytest.mark.timeout(300)
def test_first_reward_page_runs_as_written(tmp_path, no_leaked_processes):
    """The get-started page includes `docs/snippets/first_reward.py`; here it runs as a script, from a fresh folder."""
    page = (DOCS / "get-started" / "first-reward.md").read_text()
    assert '--8<-- "first_reward.py"' in page
    result = subprocess.run(
        [sys.executable, str(DOCS / "snippets" / "first_reward.py")],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = next(tmp_path.glob("logs/first_reward/version_*/metrics.csv"))
    import pandas as pd

    steps = pd.read_csv(metrics).dropna(subset=["reward"])
    assert 1 <= len(steps) <= 4  # 8 prompts, 2 groups per step (fewer if a group carried no signal), no max_steps
    assert steps.reward.between(0, 1).all()
    assert '--8<-- "first_reward_output.txt"' in page
    shown = (DOCS / "snippets" / "first_reward_output.txt").read_text()
    assert_same_printout(shown, result.stdout)


def printout(stdout: str) -> tuple[str, list[list[str]], list[list[str]]]:
    """What first_reward.py prints itself (Lightning's summary and bar left out): its rewards line, then the rows
    of the metrics table and of the completions table, each split into fields (the header first)."""
    lines = stdout.splitlines()
    rewards = next(line for line in lines if line.startswith("rewards:"))
    metrics_at = next(i for i, line in enumerate(lines) if line.split()[:2] == ["step", "reward"])
    completions_at = next(i for i, line in enumerate(lines) if line.split()[:2] == ["step", "prompt"])
    metrics = [line.split() for line in lines[metrics_at:completions_at]]
    return rewards, metrics, [line.split() for line in lines[completions_at:] if line.strip()]


def assert_same_printout(shown: str, printed: str) -> None:
    """The page's output is the script's: the rewards line and the tables' headers equal, each metrics row a step
    and three numbers, up to four steps and four completions. The fit's values vary with sampling."""
    shown_rewards, shown_metrics, shown_completions = printout(shown)
    rewards, metrics, completions = printout(printed)
    assert shown_rewards == rewards, f"the page shows {shown_rewards!r}, the script prints {rewards!r}"
    assert shown_metrics[0] == metrics[0] and shown_completions[0] == completions[0]
    for rows in (shown_metrics, metrics):
        assert 2 <= len(rows) <= 5 and all(len(row) == 4 and row[0].isdigit() for row in rows[1:]), rows
        [float(value) for row in rows[1:] for value in row[1:]]  # numbers, or this raises
    assert len(shown_completions) == len(completions) == 5


def test_the_printout_check_catches_a_changed_reward_line():
    shown = "rewards: [0.118, 1.0, 0.0]\n step reward reward_std loss\n 0 0.1 0.1 0.0\n step prompt completion\n"
    with pytest.raises(AssertionError, match="the page shows"):
        assert_same_printout(shown, shown.replace("0.118", "0.5"))


def test_layout_trees_name_every_folder_of_the_package():
    folders = sorted(p.parent.name for p in (ROOT / "lightning_grpo").glob("*/__init__.py"))
    assert "rollout" in folders
    for page in (DOCS / "concepts" / "layout.md", ROOT / "README.md"):
        text = page.read_text()
        missing = [name for name in folders if f"{name}/" not in text]
        assert not missing, f"{page.relative_to(ROOT)}'s tree lacks {missing}"
