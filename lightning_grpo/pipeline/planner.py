"""Rank 0's step planning: whole rollout groups off the queue, packed into one optimizer step's rows.

`GroupedQueue` releases a group once all of its rows arrived; `SampleFilterQueue` (filtering.py) drops the groups that
would train nothing; `StepPlanner` places the rest into `steps` micro-batches of `num_processes` rows, never splitting
a group across two optimizer steps and never leaving a row empty; `ProgressCollator` packs the plan for every rank.
"""

from __future__ import annotations

import enum
import logging
import math
import queue
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from .._trl import TreeRow
from ..rollout.records import RolloutSample
from .filtering import DroppedGroup
from .ledger import GroupIdSet, RolloutProgress, RolloutStop
from .metrics import append_metric

log = logging.getLogger(__name__)

Group = list[RolloutSample]


class _Source(enum.Enum):
    END = "end"  # an iterable source ran out


_END = _Source.END


@dataclass(slots=True)
class GroupExtra:
    """One sequence a trainer scorer scores with a group but never trains, e.g. EBFT's reference answer."""

    scorer: int  # index of the scorer in `StepPlanner(scorers=...)`, the `index` its `collate(rows, index)` gets
    group_id: int
    index: int  # position in the scorer's `group_extras(samples)` list for this group
    value: Any  # what `group_extras` returned


class ScoredRow(TreeRow):
    """A `TreeRow` that also carries the group extras assigned to it.

    Each entry of `samples` is a dict with TRL's keys (`input_ids`, `completion_mask`, `old_log_probs`, `advantage`,
    `group_id`) plus `uid` (index in the step's sample list, -1 for a filler copy), `truncated` and `sample` (the
    `RolloutSample`, None for a filler). `extras` holds the `GroupExtra`s of groups in this row; they are not part of
    the trie and count against no budget. With `share_prefixes=False` no two samples share a token (plain packing).
    `pop()` undoes the last `add()` exactly, so the planner can try a group and take it back.
    """

    def __init__(self, share_prefixes: bool = True) -> None:
        super().__init__()
        self.share_prefixes = share_prefixes
        self.extras: list[GroupExtra] = []
        self._undo: list[tuple[int, int, int, bool]] = []  # per sample: nodes, load, trained, group seen before it

    @property
    def uids(self) -> list[int]:
        return [sample["uid"] for sample in self.samples]

    def fits(self, sample: dict[str, Any], budget: int) -> bool:
        if self.share_prefixes:
            return super().fits(sample, budget)
        trained = int(sample["completion_mask"].sum())
        return len(self.tokens) + len(sample["input_ids"]) <= budget and self.trained + trained <= budget

    def add(self, sample: dict[str, Any]) -> None:
        self._undo.append((len(self.tokens), self.load, self.trained, sample["group_id"] in self.groups))
        if self.share_prefixes:
            super().add(sample)
            return
        # keys no other sample can match: each sample becomes its own chain, which `pack()` lays out as one segment
        tag = len(self.samples)
        children, nodes = self.roots, []
        for depth, token in enumerate(sample["input_ids"].tolist()):
            children[(token, tag, depth)] = len(self.tokens)
            self.tokens.append(token)
            self.children.append({})
            self.load += depth + 1
            nodes.append(len(self.tokens) - 1)
            children = self.children[nodes[-1]]
        self.samples.append(sample)
        self.sample_nodes.append(nodes)
        self.groups.add(sample["group_id"])
        self.trained += int(sample["completion_mask"].sum())

    def pop(self) -> dict[str, Any]:
        """Remove and return the sample added last, leaving the row exactly as it was before that `add`."""
        num_nodes, self.load, self.trained, group_seen = self._undo.pop()
        sample, nodes = self.samples.pop(), self.sample_nodes.pop()
        # the nodes `add` created are one chain at the end of the node lists: unlink its head from its parent
        new = [depth for depth, node in enumerate(nodes) if node >= num_nodes]
        if new:
            parent = self.roots if new[0] == 0 else self.children[nodes[new[0] - 1]]
            del parent[next(key for key, node in parent.items() if node == nodes[new[0]])]
            del self.tokens[num_nodes:], self.children[num_nodes:]
        if not group_seen:
            self.groups.discard(sample["group_id"])
        return sample


class GroupExtrasSource(Protocol):
    """What the planner needs of a trainer scorer (see `TrainerScorer`)."""

    def group_extras(self, samples: list[RolloutSample]) -> Sequence[Any]:
        """Sequences scored with the group but not trained; may be empty. Runs on rank 0 while planning."""
        ...


@dataclass
class StepPlan:
    """One optimizer step: `steps` micro-batches of `num_processes` rows; rank r trains `micro_batches[m][r]`.

    Attributes:
        micro_batches: `steps` lists of `num_processes` non-empty rows.
        samples: the step's samples in `sample_uid` order (groups contiguous, in the order they were accepted).
        group_ids: the groups of the step, in `samples` order.
        pending_group_ids: the groups whose advantages are NaN (trainer scoring pending); a subset of `group_ids`.
        metrics: this step's packing metrics (`batch/*`), one float each.
    """

    micro_batches: list[list[ScoredRow]]
    samples: list[RolloutSample]
    group_ids: list[int]
    pending_group_ids: list[int] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def rows(self) -> list[ScoredRow]:
        return [row for rows in self.micro_batches for row in rows]


@dataclass
class _AcceptedGroup:
    samples: Group
    dicts: list[dict[str, Any]]
    extras: list[GroupExtra]
    pending: bool


class _OpenStep:
    def __init__(self, num_rows: int, share_prefixes: bool) -> None:
        self.rows = [ScoredRow(share_prefixes) for _ in range(num_rows)]
        self.groups: list[_AcceptedGroup] = []
        self.empty_places = 0  # groups dropped while this step was open, whose places nobody takes


def check_step_capacity(
    group_rows: int,
    steps: int,
    num_processes: int,
    token_budget: int,
    samples_per_row: int,
    *,
    max_sample_tokens: int | None = None,
) -> None:
    """Fail early when a group can never fit in one optimizer step.

    With `token_budget <= 0` a step holds `steps * num_processes * samples_per_row` samples, and a group of
    `group_rows` must fit. With a token budget a row holds at least one sample, so what can be checked up front needs
    the longest possible sample (prompt + completion), `max_sample_tokens`: it must fit in `token_budget`, and a group
    of such samples sharing nothing must fit the step. Without it, only the arguments themselves are checked; a group
    that then does not fit a whole step at run time is dropped as `oversize` (see `StepPlanner`).

    Raises:
        ValueError: listing every problem and the knob to change.
    """
    problems = []
    for name, value in (("group_rows", group_rows), ("steps", steps), ("num_processes", num_processes)):
        if value < 1:
            problems.append(f"`{name}={value}` must be at least 1.")
    if not problems:
        rows = steps * num_processes
        where = f"a step has {rows} (steps={steps} x num_processes={num_processes})"
        if token_budget <= 0:
            if samples_per_row < 1:
                problems.append(
                    f"`samples_per_row={samples_per_row}` must be at least 1 when `token_budget={token_budget}` "
                    "(<= 0 selects fixed-count rows). Set samples_per_row, or a positive token_budget."
                )
            elif group_rows > rows * samples_per_row:
                problems.append(
                    f"A group of {group_rows} samples needs {math.ceil(group_rows / samples_per_row)} rows of "
                    f"samples_per_row={samples_per_row}, but {where}. Raise samples_per_row or steps, "
                    "or lower num_generations."
                )
        elif max_sample_tokens is not None:
            per_row = token_budget // max_sample_tokens
            if per_row == 0:
                problems.append(
                    f"A sample of up to max_sample_tokens={max_sample_tokens} tokens (prompt + completion) does not "
                    f"fit in token_budget={token_budget}. Raise token_budget, or lower the prompt or completion length."
                )
            elif group_rows > rows * per_row:
                problems.append(
                    f"A group of {group_rows} samples of up to {max_sample_tokens} tokens needs "
                    f"{math.ceil(group_rows / per_row)} rows of token_budget={token_budget}, but {where}. "
                    "Raise token_budget or steps, or lower num_generations."
                )
    if problems:
        raise ValueError("check_step_capacity: " + " ".join(problems))


class StepPlanner:
    """Plans one optimizer step at a time, keeping every group inside one step.

    A step is `steps` micro-batches of `num_processes` rows. Samples are placed like TRL's `TokenBudgetBatcher`: rows
    holding the group first, then the least loaded row that fits, within `token_budget` unique and trained tokens per
    row, or `samples_per_row` samples when `token_budget <= 0`. When a group does not fit, its samples are taken back
    out (`ScoredRow.pop`), the step of the groups accepted so far is emitted and the group opens the next one. A group
    that does not fit even an empty step is dropped as `oversize` through `progress` (`check_step_capacity` catches
    such settings at start-up when given the longest sample). Empty rows, which would desync collectives, are filled
    by spreading samples, or failing that with a copy of the step's shortest sample that trains no token and is not
    scored (uid -1). Rows are then ordered into micro-batches by attention cost, so that each micro-batch and each
    rank's total is balanced.

    A `DroppedGroup` from the source (`SampleFilterQueue(replace_dropped_groups=False)`) takes a place in the open
    step and trains nothing, so the step goes out with fewer groups; a step is never emitted without a group.

    A step is emitted when the next group does not fit, when its groups and empty places reach `max_groups_per_step`,
    when no row has room for the shortest completion seen so far, when every group `progress` still expects is in the
    open step (nothing else can arrive before it trains), and when the source ends or raises `RolloutStop`: the
    partial step goes out first, so no sample is left behind. After a `RolloutStop` the planner asks `progress.check()`
    again once that step is collated, since training it may have cleared a stall; without `progress` it re-raises the
    stop.

    Iterate it on rank 0 (each iteration yields a `StepPlan`); pass the same `progress` to `ProgressCollator`.

    Args:
        dataset: where groups come from: an object with `get(timeout)` returning a group or raising `queue.Empty`
            (`SampleFilterQueue`, `GroupedQueue`), or an iterable of groups (lists of `RolloutSample`); either may
            give a `DroppedGroup` instead of a group.
        num_processes: ranks; rows per micro-batch.
        steps: micro-batches per optimizer step (gradient accumulation).
        token_budget: cap on a row's unique and trained tokens; `<= 0` caps the sample count instead.
        samples_per_row: samples per row when `token_budget <= 0`.
        scorers: trainer scorers; each one's `group_extras(samples)` is called once per accepted group.
        metrics: sink (`dict[str, list]`) for events outside a step: `progress/dropped_oversize_total` for groups too
            big for a step. A step's packing metrics travel in `StepPlan.metrics`.
        share_prefixes: tree-pack samples that share a prefix; False packs them end to end.
        progress: the run's `RolloutProgress`, for the end-of-run emission and oversize drops.
        poll_interval_s: longest wait on `dataset.get`, between checks of whether the open step must go out.
        max_groups_per_step: emit a step once it holds this many groups (None: no cap). Set it to the rollout loop's
            `groups_per_step` when generation is paced: the paced child admits at most `(max_staleness + 1) *
            groups_per_step` groups the trainer has not consumed, and groups in the open step are not consumed yet,
            so a planner waiting for more would wait forever.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        num_processes: int,
        steps: int,
        token_budget: int,
        samples_per_row: int,
        scorers: Sequence[GroupExtrasSource] = (),
        metrics: dict[str, list] | None = None,
        share_prefixes: bool = True,
        progress: RolloutProgress | None = None,
        poll_interval_s: float = 0.1,
        max_groups_per_step: int | None = None,
    ) -> None:
        problems = [
            f"{name}={value}" for name, value in (("num_processes", num_processes), ("steps", steps)) if value < 1
        ]
        if token_budget <= 0 and samples_per_row < 1:
            problems.append(f"samples_per_row={samples_per_row} with token_budget={token_budget}")
        if poll_interval_s <= 0:
            problems.append(f"poll_interval_s={poll_interval_s}")
        if max_groups_per_step is not None and max_groups_per_step < 1:
            problems.append(f"max_groups_per_step={max_groups_per_step}")
        if problems:
            raise ValueError(
                f"`StepPlanner({', '.join(problems)})`: num_processes, steps and max_groups_per_step must be at least "
                "1, poll_interval_s positive, and samples_per_row at least 1 when token_budget <= 0 (fixed-count rows)."
            )
        self.dataset = dataset
        self.num_processes = num_processes
        self.steps = steps
        self.token_budget = token_budget
        self.samples_per_row = samples_per_row
        self.scorers = list(scorers)
        self.metrics = metrics if metrics is not None else {}
        self.share_prefixes = share_prefixes
        self.progress = progress
        self.poll_interval_s = poll_interval_s
        self.max_groups_per_step = max_groups_per_step
        #: samples received, placed into emitted steps, and dropped (groups too big for a step)
        self.samples_in = self.samples_planned = self.samples_dropped = 0
        self._min_trained: int | None = None
        self._seen = GroupIdSet()  # group ids received, so that a duplicate never trains twice
        self._open = self._new_step()

    @property
    def num_rows(self) -> int:
        return self.steps * self.num_processes

    def __iter__(self) -> Iterator[StepPlan]:
        source = None if hasattr(self.dataset, "get") else iter(self.dataset)
        while True:
            stop = plan = None
            try:
                group = self._pull(source)
                if group is _END:
                    break
                if isinstance(group, DroppedGroup):
                    self._open.empty_places += 1
                elif group:
                    plan = self._accept(group)
            except RolloutStop as exc:
                stop = exc
            if plan is not None:
                yield plan
            if stop is not None:
                if not self._open.groups:
                    raise stop
                yield self._emit()
                if self.progress is None:
                    raise stop
                self.progress.check()  # training the emitted step may have cleared a stall
                continue
            if self._open.groups and self._should_emit():
                yield self._emit()
        if self._open.groups:
            yield self._emit()

    def _pull(self, source: Iterator[Group] | None) -> Group | DroppedGroup | Literal[_Source.END] | None:
        """The next group or dropped group's place; None when none arrived within `poll_interval_s`; `_END` when an
        iterable ran out."""
        if self.progress is not None:
            self.progress.check()  # the run may have ended while the last step trained
        if source is not None:
            item = next(source, _END)
        else:
            try:
                item = self.dataset.get(timeout=self.poll_interval_s)
            except queue.Empty:
                return None
        return item if item is _END or isinstance(item, DroppedGroup) else list(item)

    def _new_step(self) -> _OpenStep:
        return _OpenStep(self.num_rows, self.share_prefixes)

    def _accept(self, samples: Group) -> StepPlan | None:
        """Add a group to the open step; returns the step it closed, if any. May raise `RolloutStop` (a drop)."""
        group_id = samples[0].group_id
        if group_id in self._seen:
            log.warning(
                "Skipping group %d: the planner already received it (a duplicate from the rollout loop).", group_id
            )
            append_metric(self.metrics, "progress/duplicate_total", 1.0)
            return None
        self._seen.add(group_id)
        group = self._prepare(samples)
        if self._place(self._open, group):
            return None
        fresh = self._new_step()
        if not self._place(fresh, group):
            self._drop_too_big(group)
            return None
        plan = self._emit()
        self._open = fresh
        return plan

    def _prepare(self, samples: Group) -> _AcceptedGroup:
        self.samples_in += len(samples)
        dicts = [self._sample_dict(sample) for sample in samples]
        for d in dicts:
            trained = int(d["completion_mask"].sum())
            if trained > 0 and (self._min_trained is None or trained < self._min_trained):
                self._min_trained = trained
        group_id = samples[0].group_id
        extras = [
            GroupExtra(scorer=j, group_id=group_id, index=i, value=value)
            for j, scorer in enumerate(self.scorers)
            for i, value in enumerate(scorer.group_extras(samples))
        ]
        pending = any(math.isnan(sample.advantage) for sample in samples)
        return _AcceptedGroup(samples=samples, dicts=dicts, extras=extras, pending=pending)

    def _sample_dict(self, sample: RolloutSample) -> dict[str, Any]:
        return {
            "input_ids": sample.input_ids,
            "completion_mask": sample.completion_mask,
            "old_log_probs": sample.old_log_probs,
            "advantage": sample.advantage,
            "group_id": sample.group_id,
            "uid": -1,  # set when the step is emitted
            "truncated": sample.truncated,
            "sample": sample,
        }

    def _fits(self, row: ScoredRow, sample: dict[str, Any]) -> bool:
        if self.token_budget <= 0:
            return len(row.samples) < self.samples_per_row
        trained = int(sample["completion_mask"].sum())
        if row.trained + trained > self.token_budget:
            return False
        if len(row.tokens) + len(sample["input_ids"]) <= self.token_budget:
            return True  # fits even if it shares nothing: skip the trie walk
        return row.fits(sample, self.token_budget)

    def _place(self, step: _OpenStep, group: _AcceptedGroup) -> bool:
        """Place every sample of `group` in `step`; on failure undo and return False."""
        before = [len(row.samples) for row in step.rows]
        for sample in group.dicts:
            row = self._pick_row(step.rows, sample)
            if row is None:
                for row, count in zip(step.rows, before, strict=True):
                    while len(row.samples) > count:
                        row.pop()
                return False
            row.add(sample)
        step.groups.append(group)
        return True

    def _pick_row(self, rows: list[ScoredRow], sample: dict[str, Any]) -> ScoredRow | None:
        group_id = sample["group_id"]
        by_load = sorted(rows, key=lambda row: row.load)
        home = next((row for row in by_load if group_id in row.groups and self._fits(row, sample)), None)
        if home is not None:
            return home
        return next((row for row in by_load if self._fits(row, sample)), None)

    def _build_row(self, samples: list[dict[str, Any]]) -> ScoredRow:
        row = ScoredRow(self.share_prefixes)
        for sample in samples:
            row.add(sample)
        return row

    def _drop_too_big(self, group: _AcceptedGroup) -> None:
        group_id, count = group.samples[0].group_id, len(group.samples)
        log.warning(
            "Dropping group %d: its %d samples do not fit in one optimizer step of %d rows (steps=%d x "
            "num_processes=%d, token_budget=%d, samples_per_row=%d). Raise token_budget or steps, or lower "
            "num_generations.",
            group_id,
            count,
            self.num_rows,
            self.steps,
            self.num_processes,
            self.token_budget,
            self.samples_per_row,
        )
        self.samples_dropped += count
        append_metric(self.metrics, "progress/dropped_oversize_total", 1.0)
        if self.progress is not None:
            self.progress.drop(group_id, "oversize")

    def _should_emit(self) -> bool:
        if self.progress is not None and self.progress.outstanding() <= len(self._open.groups):
            return True  # every group still expected is here: nothing else arrives before this step trains
        places = len(self._open.groups) + self._open.empty_places
        if self.max_groups_per_step is not None and places >= self.max_groups_per_step:
            return True
        return all(self._row_full(row) for row in self._open.rows)

    def _row_full(self, row: ScoredRow) -> bool:
        if self.token_budget <= 0:
            return len(row.samples) >= self.samples_per_row
        if self._min_trained is None:
            return False
        room = min(self.token_budget - len(row.tokens), self.token_budget - row.trained)
        return room < self._min_trained

    def _emit(self) -> StepPlan:
        step, self._open = self._open, self._new_step()
        samples: list[RolloutSample] = []
        group_ids: list[int] = []
        pending: list[int] = []
        for group in step.groups:
            group_ids.append(group.samples[0].group_id)
            if group.pending:
                pending.append(group_ids[-1])
            for sample, d in zip(group.samples, group.dicts, strict=True):
                d["uid"] = len(samples)
                samples.append(sample)
        spread = self._spread(step.rows)
        fillers = self._fill(step.rows, [d for group in step.groups for d in group.dicts])
        self._assign_extras(step.rows, step.groups)
        micro_batches = self._order(step.rows)
        self.samples_planned += len(samples)
        metrics = self._step_metrics(micro_batches, len(samples), len(group_ids), step.empty_places, spread, fillers)
        return StepPlan(micro_batches, samples, group_ids, pending, metrics)

    def _spread(self, rows: list[ScoredRow]) -> int:
        """Move samples from the fullest rows into empty ones; a sample alone always fits a row."""
        moved = 0
        for i in [i for i, row in enumerate(rows) if not row.samples]:
            donor = max(range(len(rows)), key=lambda j: (len(rows[j].samples), rows[j].load))
            if len(rows[donor].samples) < 2:
                break
            rows[i] = self._build_row([rows[donor].pop()])
            moved += 1
        return moved

    def _fill(self, rows: list[ScoredRow], dicts: list[dict[str, Any]]) -> int:
        empty = [i for i, row in enumerate(rows) if not row.samples]
        if not empty:
            return 0
        template = min(dicts, key=lambda d: len(d["input_ids"]))
        filler = {
            **template,
            "completion_mask": np.zeros_like(template["completion_mask"]),
            "advantage": 0.0,
            "group_id": -1,
            "uid": -1,
            "truncated": False,
            "sample": None,
        }
        for i in empty:
            rows[i] = self._build_row([filler])
        return len(empty)

    @staticmethod
    def _assign_extras(rows: list[ScoredRow], groups: list[_AcceptedGroup]) -> None:
        for group in groups:
            if group.extras:
                group_id = group.samples[0].group_id
                row = max(rows, key=lambda row: sum(d["group_id"] == group_id for d in row.samples))
                row.extras.extend(group.extras)

    def _order(self, rows: list[ScoredRow]) -> list[list[ScoredRow]]:
        """Costliest rows share micro-batches; within each, the costliest row goes to the least loaded rank."""
        by_cost = sorted(rows, key=lambda row: row.load, reverse=True)
        totals = [0] * self.num_processes
        micro_batches = []
        for m in range(self.steps):
            chunk = by_cost[m * self.num_processes : (m + 1) * self.num_processes]
            placed: list[ScoredRow | None] = [None] * self.num_processes
            for row in chunk:
                rank = min((r for r in range(self.num_processes) if placed[r] is None), key=lambda r: totals[r])
                placed[rank] = row
                totals[rank] += row.load
            micro_batches.append([row for row in placed if row is not None])  # all placed: a row per rank
        return micro_batches

    def _step_metrics(
        self,
        micro_batches: list[list[ScoredRow]],
        num_samples: int,
        num_groups: int,
        empty_places: int,
        spread: int,
        fillers: int,
    ) -> dict[str, float]:
        rows = [row for mb in micro_batches for row in mb]
        row_tokens = [len(row.tokens) for row in rows]
        raw = sum(len(d["input_ids"]) for row in rows for d in row.samples if d["uid"] != -1)
        imbalance = []
        for mb in micro_batches:
            loads = [row.load for row in mb]
            imbalance.append(max(loads) / (sum(loads) / len(loads)) if sum(loads) else 1.0)
        if self.token_budget > 0:
            fill = sum(row_tokens) / (self.token_budget * len(rows))
        else:
            fill = num_samples / (self.samples_per_row * len(rows))
        return {
            "batch/samples_per_row": num_samples / len(rows),
            "batch/row_tokens_mean": sum(row_tokens) / len(rows),
            "batch/row_tokens_max": float(max(row_tokens)),
            "batch/row_imbalance": sum(imbalance) / len(imbalance),
            "batch/packing_ratio": raw / max(sum(row_tokens), 1),
            "batch/row_fill_frac": fill,
            "batch/groups_per_step": float(num_groups),
            "batch/empty_places_per_step": float(empty_places),
            "batch/spread_samples_total": float(spread),
            "batch/filler_rows_total": float(fillers),
        }
