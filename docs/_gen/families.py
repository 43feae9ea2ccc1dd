"""MkDocs hook: the models guide's family table (`<!-- families -->`), computed from the conformance zoo.

Each row is a family of `tests/helpers/model_zoo.FAMILIES`, the list every test in tests/models/ is parametrized
over (generation exact against teacher forcing, training exact against a per-sample forward, LoRA "all-linear", a
2-step fit from a checkpoint folder); its generator path comes from `rollout.decoder_choice.choose_decoder` and its
training path from `training.packing_choice`, run on the family's tiny model, so the table says what the code picks.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- families -->"


def on_page_markdown(markdown: str, **kwargs: object) -> str:
    return markdown.replace(MARKER, families_table()) if MARKER in markdown else markdown


def families_table() -> str:
    """The Markdown table: family, model type, generator path, training path, LoRA, vLLM-CPU."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.model_zoo import FAMILIES, VLLM_FAMILIES, zoo_model

    from lightning_grpo.rollout.decoder_choice import choose_decoder
    from lightning_grpo.training.packing_choice import tree_unsupported_reason

    logging.getLogger("transformers").setLevel(logging.ERROR)  # the hybrids' "falling back to PyTorch" notes
    rows = ["| family | `model_type` | generator | training | LoRA | vLLM-CPU |", "|---|---|---|---|---|---|"]
    padded: list[str] = []
    for family, (model_type, _) in FAMILIES.items():
        model = zoo_model(family)
        generator = choose_decoder(model.config).path
        padded_because = tree_unsupported_reason(model)
        if padded_because is not None:
            padded.append(f"- {family}: {padded_because}.")
        training = "tree" if padded_because is None else "padded"
        served = "tested" if family in VLLM_FAMILIES else ""
        rows.append(f"| {family} | `{model_type}` | {generator} | {training} | all-linear | {served} |")
    return "\n".join([*rows, "", "Why a family trains on the padded path:", "", *padded])


if __name__ == "__main__":
    print(families_table())
