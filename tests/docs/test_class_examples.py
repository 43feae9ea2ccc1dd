"""The `Example::` of each entry class's docstring (what `--help` users and the API page read first) runs as written:
a real `Trainer.fit` on the tiny model with a real rollout child."""

from __future__ import annotations

import inspect
import textwrap

import pytest

from lightning_grpo import GRPODataModule, GRPOModule


def example_of(cls: type) -> str:
    """The code of the `Example::` block of `cls`'s docstring (the indented lines after it)."""
    doc = inspect.getdoc(cls) or ""
    _, marker, rest = doc.partition("Example::\n")
    assert marker, f"{cls.__name__}'s docstring has no `Example::` block"
    lines = []
    for line in rest.splitlines():
        if line and not line.startswith(" "):  # the next section
            break
        lines.append(line)
    code = textwrap.dedent("\n".join(lines)).strip()
    assert code, f"{cls.__name__}'s `Example::` block is empty"
    return code


def test_example_of_reads_the_indented_block_only():
    class Documented:
        """Summary.

        Example::

            x = 1
            y = x + 1

        Note:
            not code.
        """

    assert example_of(Documented) == "x = 1\ny = x + 1"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cls", [GRPOModule, GRPODataModule], ids=lambda cls: cls.__name__)
def test_the_class_example_fits_as_written(cls, tmp_path, monkeypatch, no_leaked_processes):
    monkeypatch.chdir(tmp_path)  # Lightning writes its checkpoints under the working folder
    namespace: dict = {}
    exec(compile(example_of(cls), f"<{cls.__name__} Example>", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.state.status == "finished"
    assert trainer.global_step >= 1, "the example trained no optimizer step"
    data = trainer.datamodule
    assert isinstance(data, GRPODataModule) and isinstance(trainer.lightning_module, GRPOModule)
    if trainer.max_steps == -1:  # the run ended by itself: every prompt group was consumed
        summary = data.progress_summary()
        assert summary["groups_consumed"] == summary["groups_total"]
