"""The progress ledger: which prompt groups are consumed, why, and when the stream must stop.

TRL ends an epoch-bounded run only when an optimizer step ends, so a run whose remaining rollouts are all dropped
(no reward signal, truncated, too stale, too long) would generate forever. `RolloutProgress` owns the set of consumed
group ids (trained or dropped) that the epoch bound and resume read, counts drops by reason, and raises
`RolloutStop` when every group of the run is consumed, or when `stall_groups` groups in a row were consumed without
one training. Each transition has one writer on rank 0: the filter stage drops (`SampleFilterQueue`), the collator
records collated groups (`ProgressCollator`), `score_step` records scored ones, and the data module commits a step
once it trained.

Rank 0 only, single-threaded: the DataLoader (`num_workers=0`) and the callbacks run on the main thread.
"""

from __future__ import annotations

import logging
import operator
from collections import Counter
from collections.abc import Iterable, Iterator, MutableSet
from typing import Any

log = logging.getLogger(__name__)

#: Why `SampleFilterQueue` drops a group, and the knob that changes it (quoted in the stall error).
DROP_HINTS = {
    "no_signal": "every sample of a group got the same reward: check the reward functions, raise num_generations "
    "or the sampling temperature, or train such groups (drop_no_signal_groups=False)",
    "stale": "groups arrived more than max_staleness versions behind the policy: raise max_staleness, or generate "
    "less far ahead (lower max_inflight_tasks)",
    "truncated": "every completion hit the length limit: raise max_completion_length, or set "
    "mask_truncated_completions=False",
    "oversize": "a sample (or a group) does not fit the planner's budget: raise token_budget or steps",
}


class RolloutStop(Exception):  # noqa: N818 - the seed's name
    """How the rollout stream ended: cleanly, with an error, or because the trainer was asked to stop.

    The one record of a stop. The ledger and the planner raise it; the collator wraps it in one stop item
    (`StepBatch(stop=...)`) per rank, and the stream scatters those, so every rank learns at the same micro-batch that
    the stream ended and how (`RolloutStopCallback` ends the fit on it). It crosses processes by pickle: `error` is
    text (type, message and traceback), never an exception object.

    Attributes:
        error: why the run cannot go on (a stall, or rank 0's pipeline failed), which every rank raises; None for a
            clean end.
        stalled: the error is a stall (a full pass over the prompts trained no group), not a failure.
        preempted: sent because the trainer was asked to stop (SIGTERM) while it waited for rollouts.
    """

    def __init__(self, error: str | None = None, *, stalled: bool = False, preempted: bool = False) -> None:
        super().__init__(error)
        self.error = error
        self.stalled = stalled
        self.preempted = preempted

    def __reduce__(self) -> tuple[Any, ...]:
        return _rollout_stop, (self.error, self.stalled, self.preempted)

    def __repr__(self) -> str:
        flags = "".join(f", {name}=True" for name in ("stalled", "preempted") if getattr(self, name))
        return f"RolloutStop(error={self.error!r}{flags})"


def _rollout_stop(error: str | None, stalled: bool, preempted: bool) -> RolloutStop:
    return RolloutStop(error, stalled=stalled, preempted=preempted)


class GroupIdSet(MutableSet[int]):
    """A set of group ids (non-negative ints) kept as a bitmap: one bit per id up to the largest one.

    A run's consumed ids take `total_groups / 8` bytes, allocated as the ids grow and never more, where a `set` holds
    an int object and a table slot per id and so grows with every step of a long run. It behaves as a `set` of ints:
    `in`, `len`, iteration (in ascending order), `add`, `discard`, `update`, `clear`, and `==`/`<=`/`-`/`|` with any
    set.

    Raises:
        ValueError: `add` of a negative id.
    """

    __slots__ = ("_bits", "_count")

    def __init__(self, group_ids: Iterable[int] = ()) -> None:
        self._bits = bytearray()
        self._count = 0
        self.update(group_ids)

    def __contains__(self, group_id: object) -> bool:
        try:
            index = operator.index(group_id)  # type: ignore[arg-type]
        except TypeError:
            return False
        byte = index >> 3
        return 0 <= byte < len(self._bits) and bool(self._bits[byte] >> (index & 7) & 1)

    def __iter__(self) -> Iterator[int]:
        for byte_index, byte in enumerate(self._bits):
            if byte:
                yield from (byte_index * 8 + bit for bit in range(8) if byte >> bit & 1)

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        return f"GroupIdSet({list(self)!r})"

    def add(self, group_id: int) -> None:
        index = operator.index(group_id)
        if index < 0:
            raise ValueError(f"`GroupIdSet.add({group_id})`: group ids are never negative.")
        byte, mask = index >> 3, 1 << (index & 7)
        if byte >= len(self._bits):
            self._bits.extend(bytes(byte + 1 - len(self._bits)))
        if not self._bits[byte] & mask:
            self._bits[byte] |= mask
            self._count += 1

    def discard(self, group_id: int) -> None:
        if group_id in self:
            index = operator.index(group_id)
            self._bits[index >> 3] &= ~(1 << (index & 7)) & 0xFF
            self._count -= 1

    def update(self, group_ids: Iterable[int]) -> None:
        """Add every id of `group_ids`."""
        for group_id in group_ids:
            self.add(group_id)

    def clear(self) -> None:
        self._bits.clear()
        self._count = 0

    def first_missing(self) -> int:
        """The smallest id not in the set."""
        full = len(self._bits) - len(self._bits.lstrip(b"\xff"))  # leading bytes with all 8 ids present
        return next(i for i in range(full * 8, full * 8 + 9) if i not in self)


class RolloutProgress:
    """Consumed and trained prompt groups, and the stream's stop conditions.

    A group is *consumed* once it trained or its rollouts were dropped. A group moves through these states:

    - `hold(ids)`: collated with advantages pending (trainer scoring). Counted consumed for the end-of-run check, but
      neither resets nor extends a stall; `score_step` later reports it with `train` or `exclude`.
    - `train(ids)`: collated into a step that trains it. Resets the stall run. Not yet in `state_dict()`.
    - `commit(ids)`: the optimizer step that trained it is done. Step k+1 is collated before the checkpoint at step
      k is saved (the stream looks ahead to learn whether the run ends), so only committed groups are checkpointed
      as trained; collated but uncommitted ones are regenerated on resume.
    - `drop(id, reason)` / `exclude(id, reason)`: consumed without training (final at once, checkpointed). Each
      extends the stall run and counts under its reason.

    The stream ends with `RolloutStop()` once `total_groups` group ids are consumed, and with `RolloutStop(error=...)`
    once `stall_groups` groups in a row were consumed without one training (the stall wins when both hold).

    Args:
        consumed: group ids consumed before this run. A `GroupIdSet` or a `set` is updated in place, so a caller may
            share it; other iterables are copied into a `GroupIdSet` (what `consumed` is by default).
        total_groups: the number of groups in the run, `len(GroupSchedule)` (epochs x prompts): the run's groups
            are all consumed once that many distinct ids (all in `range(total_groups)`) are.
        stall_groups: how many groups in a row may be consumed without one training; callers default it to one
            pass over the prompts.

    Raises:
        ValueError: on non-positive `total_groups` or `stall_groups`, or ids outside `range(total_groups)`.

    Example::

        progress = RolloutProgress(total_groups=len(schedule), stall_groups=schedule.num_prompts)
        progress.load_state_dict(checkpoint_state)  # on resume
        child_ids = schedule.group_ids(skip=set(progress.consumed))
    """

    def __init__(self, consumed: Iterable[int] = (), *, total_groups: int, stall_groups: int) -> None:
        if total_groups < 1 or stall_groups < 1:
            raise ValueError(
                f"`RolloutProgress(total_groups={total_groups}, stall_groups={stall_groups})`: both must be at least 1 "
                "(total_groups is the run's number of groups, len(GroupSchedule))."
            )
        self.total_groups = total_groups
        self.stall_groups = stall_groups
        self.consumed: GroupIdSet | set[int] = (
            consumed if isinstance(consumed, GroupIdSet | set) else GroupIdSet(consumed)
        )
        self._check_ids(self.consumed, "consumed")
        self.dropped: Counter[str] = Counter()  # drops per reason, over the whole run
        self.excluded: Counter[str] = Counter()  # exclusions per reason, over the whole run
        self.trained_total = 0  # committed trained groups, over the whole run
        self._uncommitted: set[int] = set()
        self._held: set[int] = set()
        self._stall_run = 0
        self._stall_reasons: Counter[str] = Counter()

    def outstanding(self) -> int:
        """Groups of the run not consumed yet (some may sit in the planner's open step)."""
        return self.total_groups - len(self.consumed)

    def final_group_count(self) -> int:
        """How many groups' fate is final: trained in a committed step, dropped or excluded (pacing reads it)."""
        return len(self.consumed) - len(self._uncommitted) - len(self._held)

    @property
    def stall_run(self) -> int:
        """Groups consumed in a row without one training."""
        return self._stall_run

    def train(self, group_ids: Iterable[int]) -> None:
        """Record groups that trained (collated into a step); resets the stall run. Commit them after the step."""
        new = self._claim(group_ids, "train")
        for group_id in new:
            self._held.discard(group_id)
            self._uncommitted.add(group_id)
        if new:
            self._stall_run = 0
            self._stall_reasons.clear()

    def hold(self, group_ids: Iterable[int]) -> None:
        """Record collated groups whose advantages are pending; `train` or `exclude` resolves each later."""
        for group_id in self._claim(group_ids, "hold", allow_held=False):
            self._held.add(group_id)

    def commit(self, group_ids: Iterable[int]) -> None:
        """Mark trained groups as final once the optimizer step that trained them is done (rank 0).

        Ids already final (dropped, excluded, committed) are ignored.

        Raises:
            ValueError: for an id never collated, or one still held (score_step did not report it).
        """
        group_ids = list(group_ids)
        held = [g for g in group_ids if g in self._held]
        unknown = [g for g in group_ids if g not in self.consumed]
        problems = []
        if held:
            problems.append(
                f"groups {held} are held for trainer scoring (score_step must report each with train() or exclude() first)"
            )
        if unknown:
            problems.append(f"groups {unknown} were never collated")
        if problems:
            raise ValueError(f"`RolloutProgress.commit({group_ids})`: {'; '.join(problems)}.")
        for group_id in group_ids:
            if group_id in self._uncommitted:
                self._uncommitted.remove(group_id)
                self.trained_total += 1

    def drop(self, group_id: int, reason: str) -> None:
        """Count `group_id` as consumed without training; may end the stream (raises `RolloutStop`)."""
        if self._consume_untrained(group_id, reason, self.dropped, "drop"):
            self.check()

    def exclude(self, group_id: int, reason: str = "masked") -> None:
        """Count a collated group whose every sample scoring took out of the loss.

        Runs outside the stream (in `score_step`), so it never raises `RolloutStop`: a stall it completes is raised
        by the stream's next `check`, or after the run's last step by `stall_error`.
        """
        self._check_ids([group_id], "exclude")
        if group_id in self._held or group_id in self._uncommitted:
            self._held.discard(group_id)
            self._uncommitted.discard(group_id)
            self.consumed.discard(group_id)  # consumed again below, as excluded
        self._consume_untrained(group_id, reason, self.excluded, "exclude")

    def check(self) -> None:
        """End the stream when a full pass over the prompts trained no group, or when every group is consumed.

        Raises:
            RolloutStop: with `error` (and `stalled`) on a stall, without when the run's groups are all consumed.
        """
        error = self.stall_error()
        if error is not None:
            raise RolloutStop(error=error, stalled=True)
        if len(self.consumed) >= self.total_groups:
            raise RolloutStop()

    def stall_error(self) -> str | None:
        """The stall error when `stall_groups` groups in a row were consumed without one training, else None.

        `check` raises it. The stream asks for the next step only once the previous one was scored and trained, so a
        stall completed by `score_step`'s exclusions of the last step ends the stream with this error too.
        """
        return self._stall_message() if self._stall_run >= self.stall_groups else None

    def summary(self) -> dict[str, int]:
        """`{"groups_consumed", "groups_total", "groups_trained", "groups_dropped"}` (dropped and excluded together)."""
        return {
            "groups_consumed": self.final_group_count(),
            "groups_total": self.total_groups,
            "groups_trained": self.trained_total,
            "groups_dropped": sum(self.dropped.values()) + sum(self.excluded.values()),
        }

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs, as plain ints, lists and dicts (Lightning loads checkpoints with weights_only=True).

        Consumed ids are the final ones (committed, dropped, excluded), stored as `frontier` (the smallest id not
        consumed) plus the sorted ids above it.
        """
        pending = self._uncommitted | self._held  # consumed, not final yet
        frontier = min([_first_missing(self.consumed), *pending])
        return {
            "frontier": frontier,
            "consumed_above": sorted(g for g in self.consumed if g > frontier and g not in pending),
            "dropped": dict(self.dropped),
            "excluded": dict(self.excluded),
            "trained_total": self.trained_total,
            "stall_run": self._stall_run,
            "stall_reasons": dict(self._stall_reasons),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output; ids at or past `total_groups` (a run made shorter) are left out."""
        above = [int(g) for g in state.get("consumed_above", ())]
        self.consumed.clear()
        self.consumed.update(range(min(int(state.get("frontier", 0)), self.total_groups)))
        self.consumed.update(g for g in above if 0 <= g < self.total_groups)
        self.dropped = Counter(state.get("dropped", {}))
        self.excluded = Counter(state.get("excluded", {}))
        self.trained_total = int(state.get("trained_total", 0))
        self._stall_run = int(state.get("stall_run", 0))
        self._stall_reasons = Counter(state.get("stall_reasons", {}))
        self._uncommitted.clear()
        self._held.clear()

    def _check_ids(self, group_ids: Iterable[int], verb: str) -> None:
        bad = [g for g in group_ids if not 0 <= g < self.total_groups]
        if bad:
            raise ValueError(
                f"`RolloutProgress.{verb}`: group ids {bad[:10]} are outside the run's range(total_groups="
                f"{self.total_groups}). Set total_groups to len(GroupSchedule) of the schedule that made them."
            )

    def _claim(self, group_ids: Iterable[int], verb: str, allow_held: bool = True) -> list[int]:
        """Consume the ids not consumed yet (and held ones when `allow_held`); warn about the others."""
        group_ids = list(group_ids)
        self._check_ids(group_ids, verb)
        new, seen = [], []
        for group_id in dict.fromkeys(group_ids):
            if group_id not in self.consumed or (allow_held and group_id in self._held):
                new.append(group_id)
                self.consumed.add(group_id)
            else:
                seen.append(group_id)
        if seen:
            log.warning("RolloutProgress.%s: groups %s were already consumed; ignoring them.", verb, seen[:10])
        return new

    def _consume_untrained(self, group_id: int, reason: str, counter: Counter[str], verb: str) -> bool:
        self._check_ids([group_id], verb)
        if group_id in self.consumed:
            log.warning("RolloutProgress.%s: group %d was already consumed; ignoring it.", verb, group_id)
            return False
        self.consumed.add(group_id)
        counter[reason] += 1
        self._stall_run += 1
        self._stall_reasons[reason] += 1
        return True

    def _stall_message(self) -> str:
        reasons = ", ".join(f"{reason}: {count}" for reason, count in self._stall_reasons.most_common())
        hints = "; ".join(f"{r}: {DROP_HINTS[r]}" for r, _ in self._stall_reasons.most_common() if r in DROP_HINTS)
        return (
            f"RolloutProgress(stall_groups={self.stall_groups}): {self._stall_run} prompt groups in a row were "
            f"consumed without one training ({reasons}), so the run stopped instead of generating forever. "
            f"HINT: {hints or 'check the trainer scorers, which excluded every sample'}. Raise stall_groups to "
            "tolerate longer stretches without training."
        )


def _first_missing(group_ids: GroupIdSet | set[int]) -> int:
    """The smallest id not in `group_ids` (a `GroupIdSet` finds it without walking every id)."""
    if isinstance(group_ids, GroupIdSet):
        return group_ids.first_missing()
    missing = 0
    while missing in group_ids:
        missing += 1
    return missing
