"""The dataset formats guide's example (docs/snippets/dataset_formats_example.py, included in
docs/guides/dataset_formats.md) runs and prints what the page says it prints."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
EXAMPLE = DOCS / "snippets" / "dataset_formats_example.py"


@pytest.mark.timeout(120)
def test_the_guide_example_runs_and_prints_its_comments(tmp_path, monkeypatch, capsys):
    assert f'--8<-- "{EXAMPLE.name}"' in (DOCS / "guides" / "dataset_formats.md").read_text()
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "Tom has 1,200 cards and buys 34.",
        "",
        "Put the final answer in \\boxed{}.",
        "1234",
        "[1.0, 0.0]",
        "[1.0, 0.05]",
    ]
