"""The models guide's family table is the conformance zoo's list, with the paths the code picks for each family."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from helpers.model_zoo import FAMILIES

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _families_hook():
    spec = importlib.util.spec_from_file_location("docs_gen_families", DOCS / "_gen" / "families.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_models_guide_shows_one_row_per_tested_family_with_its_paths():
    hook = _families_hook()
    assert hook.MARKER in (DOCS / "guides" / "models.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in hook.families_table().splitlines() if line.startswith("| ")}
    assert set(rows) - {"family"} == set(FAMILIES)
    assert "| fast | tree |" in rows["llama"] and "| generic | padded |" in rows["qwen3_5_text"]
    assert "| generic | tree |" in rows["gpt2"]
