"""The metrics reference, generated from `lightning_grpo.training.metric_catalog` (the one list of logged names)."""

from __future__ import annotations

from lightning_grpo.training.metric_catalog import SECTIONS


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    """One table per section: each metric's full name, what it means, and when a step's row has it."""
    parts = []
    for title, metrics in SECTIONS:
        parts += [f"## {title}", "", "| metric | meaning | logged |", "|---|---|---|"]
        for metric in metrics:
            name = metric.name.replace("<", "&lt;")
            parts.append(f'| <code class="lg-name">{name}</code> | {_cell(metric.meaning)} | {_cell(metric.logged)} |')
        parts.append("")
    return "\n".join(parts)
