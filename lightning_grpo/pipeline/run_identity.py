"""What the exactly-once ledger depends on, recorded in each checkpoint and compared when a run resumes.

Group `g` is prompt `perm(seed, epoch)[g % N]` of epoch `g // N` (`GroupSchedule`), so the consumed group ids in a
checkpoint mean the same prompts only under the same prompts (their text, order and number), `epochs` and `seed`;
`num_generations` and the groups in one optimizer step shape what a group and a step are. A resume that changes
any of them would skip prompts it never trained and train others again, so it is refused, naming each difference;
`GRPODataModule(allow_changed_data=True)` starts a new ledger instead. Raising `epochs` is allowed: an epoch's
permutation depends only on the seed and the epoch, so the recorded group ids keep their prompts and the schedule
goes on with the new epochs (lowering it is refused: `max_steps` ends a run early). Everything else (learning rate,
logging, `max_steps`, sampling, rewards) may change.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from ..options import DataModuleOptions

log = logging.getLogger(__name__)

#: The recorded fields, in the order a refusal lists them.
FIELDS = ("dataset_fingerprint", "dataset_size", "epochs", "seed", "num_generations", "groups_per_step")


def prompts_fingerprint(prompts: Any) -> str:
    """A short hash of the training prompts in order (the `prompt` column as JSON): the dataset's identity."""
    digest = hashlib.sha256()
    for prompt in prompts["prompt"]:
        digest.update(json.dumps(prompt, sort_keys=True, default=str).encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def run_identity(prompts: Any, options: DataModuleOptions, groups_per_step: int | None) -> dict[str, Any]:
    """The recorded fields of a run on `prompts` under the data module's `options`; plain types only."""
    return {
        "dataset_fingerprint": prompts_fingerprint(prompts),
        "dataset_size": len(prompts),
        "epochs": int(options.steps.epochs),
        "seed": int(options.steps.seed),
        "num_generations": int(options.sampling.num_generations),
        "groups_per_step": groups_per_step,
    }


def identity_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`name: checkpoint -> now` for each recorded field that changed (a field missing on either side is skipped;
    `epochs` raised is no change)."""
    changed = []
    for name in FIELDS:
        before, now = recorded.get(name), current.get(name)
        if name == "epochs" and before is not None and now is not None and now > before:
            continue  # the schedule extends: the recorded ids mean the same prompts
        if before is not None and now is not None and before != now:
            label = "dataset (a hash of its prompts in order)" if name == "dataset_fingerprint" else name
            changed.append(f"{label}: {before} in the checkpoint, {now} now")
    return changed


def changed_run_message(differences: list[str]) -> str:
    """The refusal: each difference, and the two ways out."""
    return (
        f"The checkpoint's run differs in what its prompt-group ledger depends on ({'; '.join(differences)}), so its "
        "consumed groups would name other prompts. Resume with the run's own settings, start a new run (no "
        "--ckpt_path), or pass --data.allow_changed_data true to keep the weights and optimizer and start a new "
        "ledger (every group of the new data is generated)."
    )


def checked_restore(state: dict[str, Any], current: dict[str, Any], *, allow_changed: bool) -> dict[str, Any]:
    """The data module's restored `state`, refused when its run differs from `current`; with `allow_changed`, the
    same state without its ledger (the policy version is kept), and a warning saying so.

    Raises:
        ValueError: a recorded field changed (see `changed_run_message`).
    """
    differences = identity_differences(state.get("run") or {}, current)
    if not differences:
        return state
    if not allow_changed:
        raise ValueError(changed_run_message(differences))
    log.warning(
        "allow_changed_data: the checkpoint's run differs (%s); its prompt-group ledger is dropped and a new one "
        "starts, so all %d groups of this data are generated.",
        "; ".join(differences),
        current["dataset_size"] * current["epochs"],
    )
    return {key: value for key, value in state.items() if key != "progress"}
