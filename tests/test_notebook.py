"""`notebooks/quickstart.ipynb` runs top to bottom in a fresh kernel: a reward function defined in a cell trains the
tiny model through a real rollout child, the reward climbs, and the notebook plots it and shows completions of the
first and the last step from the completions table.

The kernel is this environment's ipykernel (`python3` resolves to the running interpreter), started in its own
process session by jupyter_client; after the last cell no other process of that session (the rollout child, the
reward workers) may be left.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from helpers.processes import is_forkserver, session_processes
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).parents[1] / "notebooks" / "quickstart.ipynb"


def processes_left(kernel_pid: int, grace: float = 15) -> list[str]:
    """Processes of the kernel's session other than the kernel (and Python's multiprocessing resource tracker and
    the forkserver that forks rollout children, which live as long as the kernel) still alive after `grace` seconds,
    described; they are killed."""

    def others() -> list[psutil.Process]:
        return [p for p in session_processes(kernel_pid) if p.pid != kernel_pid and not is_forkserver(p)]

    deadline = time.monotonic() + grace
    while others() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = others()
    described = [f"{p.pid}: {' '.join(p.cmdline())[:120]}" for p in left]
    for process in left:
        process.kill()
    return described


def outputs(notebook: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]


@pytest.mark.timeout(300)
def test_quickstart_notebook_shows_the_reward_of_a_cell_defined_function_climbing(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        notebook, kernel_name="python3", timeout=240, resources={"metadata": {"path": str(tmp_path)}}
    )
    # Checked while the kernel lives: on shutdown jupyter_client signals the kernel's whole process group, which
    # would hide a rollout child the data module failed to stop.
    with client.setup_kernel():
        kernel_pid = client.km.provisioner.pid
        for index, cell in enumerate(notebook.cells):
            client.execute_cell(cell, index)
        leftovers = processes_left(kernel_pid)
    assert not leftovers, f"processes left behind by the notebook: {leftovers}"

    text = "".join(output.get("text", "") for output in outputs(notebook))
    steps = re.search(r"(\d+) optimizer steps, mean reward ([\d.]+)", text)
    assert steps is not None, text[-3000:]
    assert int(steps[1]) >= 10 and 0 <= float(steps[2]) <= 1
    climbed = re.search(r"reward climbed from ([\d.]+) \(first 3 steps\) to ([\d.]+)", text)
    assert climbed is not None and float(climbed[2]) > float(climbed[1]) + 0.3, text[-3000:]
    table = re.search(r"first step: mean reward ([\d.]+); last step: ([\d.]+)", text)
    assert table is not None and float(table[2]) > float(table[1]), text[-3000:]
    held_out = re.search(r"held-out digit_fraction \(greedy\): (.*)", text)
    assert held_out is not None, text[-3000:]
    at_steps = [int(step) for step in re.findall(r"at step (\d+)", held_out[1])]
    # One step numbering: validation every 4 optimizer steps is drawn and printed at 4, 8, ... as the bar says. The
    # last is the fit's end, which is earlier than 4 x the validations when groups without a signal were dropped.
    assert at_steps and at_steps[:-1] == list(range(4, 4 * len(at_steps) - 3, 4)), held_out[0]
    assert at_steps[-1] in (4 * len(at_steps), int(steps[1])), (held_out[0], steps[0])
    assert "\r" not in text, "the progress bar prints lines in a notebook, not carriage returns"
    assert any("image/png" in output.get("data", {}) for output in outputs(notebook)), "the plot was not shown"
    assert (tmp_path / "reward.png").stat().st_size > 1000
    assert next(tmp_path.glob("logs/quickstart/version_*/metrics.csv")).stat().st_size > 0
    assert next(tmp_path.glob("logs/quickstart/version_*/completions.csv")).stat().st_size > 0
