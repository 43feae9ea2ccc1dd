"""Rank 0's stages from the rollout queue to every rank's batch, in flow order.

`grouping` (whole groups) → `filtering` (drop groups that would train nothing) → `planner` (one optimizer step, no
group split, no empty row) → `collating` (one packed `StepBatch` per rank) → `stopping` (the stream ends with one
`RolloutStop`) → `stream` (rank 0's pipeline, scattered to every rank). `ledger` is the progress ledger every stage
reports to; `batch` is what one Lightning batch is.
"""
