"""What one Lightning batch is: one optimizer step's micro-batches for one rank (or the stream's stop item).

Rank 0 plans each optimizer step (`StepPlanner`), packs it (`ProgressCollator` / `ScoringCollator`) into one
`StepBatch` per rank and scatters them; every rank trains on its own. The micro-batch dicts hold plain CPU tensors.
The stop item (a `StepBatch` whose `stop` is the stream's `RolloutStop`) crosses the scatter too, so every rank learns
at the same batch that the stream ended, but `StepStream` keeps it: training never sees it (see
`RolloutStopCallback`).

Keys of a micro-batch (one rank's packed row; `N` forwarded tokens, `S` segments, `K` gathered K/V rows, `M` loss
terms, `R` samples in the row, `C` rollout reward columns):

- from `TreeRow.pack()`: `input_ids` (N), `position_ids` (N), `shift_labels` (N), `tree_kv_index` (K),
  `tree_cu_seqlens_q` (S+1), `tree_cu_seqlens_k` (S+1), `tree_max_seqlens` (2), `token_index` (M),
  `old_log_probs` (M), `advantages` (M; NaN while trainer scoring is pending), `segment_id` (M; index into the row's
  samples).
- `sample_uid` (R) int64: the sample's index in the step's sample list (`StepBatch.samples` on rank 0), -1 for a
  filler copy that trains no token and is not scored. Unique within the step across ranks and micro-batches.
- `sample_group_id` (R) int64, `sample_truncated` (R) bool, `sample_trained_tokens` (R) int64, `sample_advantage`
  (R) float32 (NaN while trainer scoring is pending).
- `rollout_rewards` (R, C) float32: the rollout-side reward columns of each sample (NaN = not scored).
- `step_trained_tokens` () float32: loss terms of the whole optimizer step over all ranks and micro-batches, the
  token-mean loss normalizer (`dapo`, `bnpo`, `cispo`, `vespo`). `score_step` rewrites it when it masks samples.
- `step_sequences` () float32: samples with at least one loss term in the whole optimizer step over all ranks and
  micro-batches, the sequence-mean normalizer (`grpo`, `sapo`, `luspo`; times `max_completion_length` for
  `dr_grpo`). `score_step` rewrites it too.
- scorer inputs, under keys prefixed `s{index}_` (see `TrainerScorer.collate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..rollout.records import RolloutSample
from .ledger import RolloutStop

MicroBatch = dict[str, torch.Tensor]


def set_step_normalizers(micro_batches: list[MicroBatch]) -> None:
    """Write `step_trained_tokens` and `step_sequences` of the step these are all the micro-batches of (every rank's)
    into each of them."""
    tokens = sum(mb["token_index"].numel() for mb in micro_batches)
    sequences = sum(int((torch.bincount(mb["segment_id"].long().cpu()) > 0).sum()) for mb in micro_batches)
    for mb in micro_batches:
        write_step_normalizers(mb, tokens=tokens, sequences=sequences)


def write_step_normalizers(micro_batch: MicroBatch, *, tokens: float, sequences: float) -> None:
    """Set one micro-batch's step normalizers (float32 scalars on its device)."""
    device = micro_batch["token_index"].device
    micro_batch["step_trained_tokens"] = torch.tensor(float(tokens), dtype=torch.float32, device=device)
    micro_batch["step_sequences"] = torch.tensor(float(sequences), dtype=torch.float32, device=device)


@dataclass
class StepBatch:
    """One rank's share of one optimizer step, or the stop item that ends the stream on every rank at once.

    Attributes:
        micro_batches: `steps` packed micro-batches for this rank (empty for the stop item).
        group_ids: the prompt groups this step trains (same on every rank).
        reward_names: names of the rollout reward columns, in `rollout_rewards` column order.
        stop: set on the stop item only (which has no micro-batches): how the stream ended. Every rank receives it at
            the same fetch, and `RolloutStopCallback` ends the fit there.
        metrics: rank 0's planning, packing and sample metrics for this step (empty on other ranks).
        samples: the step's samples in `sample_uid` order, on rank 0 only (for logging and callbacks).
    """

    micro_batches: list[MicroBatch] = field(default_factory=list)
    group_ids: list[int] = field(default_factory=list)
    reward_names: list[str] = field(default_factory=list)
    stop: RolloutStop | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    samples: list[RolloutSample] = field(default_factory=list)
