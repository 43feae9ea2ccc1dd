"""Reading a rollout worker's queue in tests, and checking what it sampled."""

from __future__ import annotations

import queue
import time

import numpy as np

from lightning_grpo.rollout.records import RolloutSample


def collect_groups(worker, count: int, timeout: float = 120.0) -> dict[int, list[RolloutSample]]:
    """Read samples until `count` whole groups arrived."""
    groups: dict[int, list[RolloutSample]] = {}
    deadline = time.monotonic() + timeout
    while sum(len(s) == s[0].group_rows for s in groups.values()) < count:
        assert time.monotonic() < deadline, f"only {len(groups)} groups after {timeout} s"
        worker.check_health(stale_after_s=60)
        try:
            sample = worker.rollout_buffer.get(timeout=0.5)
        except queue.Empty:
            continue
        groups.setdefault(sample.group_id, []).append(sample)
    return groups


def drained_rate(worker, key: str, settle_s: float = 1.0) -> tuple[float, float]:
    """The `(numerator, denominator)` of rate `key` summed over what the child has sent to `worker.metrics_queue`."""
    time.sleep(settle_s)  # the queue's feeder thread delivers what was put just before
    total = [0.0, 0.0]
    while True:
        try:
            payload = worker.metrics_queue.get(timeout=0.2)
        except queue.Empty:
            return total[0], total[1]
        if key in payload:
            total[0] += payload[key][0]
            total[1] += payload[key][1]


def counters_until(worker, expected: dict[str, float], timeout: float = 60.0) -> dict[str, float]:
    """Sum the counters (`*_total`) the child sent to `worker.metrics_queue` until each of `expected` reached its value
    (or `timeout` s passed); returns the sums of those keys."""
    totals = dict.fromkeys(expected, 0.0)
    deadline = time.monotonic() + timeout
    while any(totals[key] < value for key, value in expected.items()) and time.monotonic() < deadline:
        try:
            payload = worker.metrics_queue.get(timeout=0.2)
        except queue.Empty:
            continue
        for key in totals:
            totals[key] += float(payload.get(key, 0.0))
    return totals


def groups_per_version(worker, sync, models, per_version: int = 2, timeout: float = 180.0):
    """Publish each of `models` in turn through `sync` (the first one already pushed) and let `per_version` groups in
    after each push: for a worker paced by `groups_per_step=per_version`, `max_staleness=0`. Returns the groups."""
    groups: dict[int, list[RolloutSample]] = {}
    for version in range(len(models)):
        if version:
            sync.push(models[version])
        worker.groups_consumed = per_version * version  # lets the next groups in, after the push
        groups |= collect_groups(worker, per_version, timeout=timeout)
    return groups


def check_sampled_by(samples, model, temperature: float, atol: float = 1e-4) -> None:
    """Each sample's logprobs are those of a teacher-forced forward of `model` at `temperature`."""
    from lightning_grpo.rollout.sampling import teacher_forced_logprobs

    for sample in samples:
        prompt_len = int((sample.completion_mask == 0).sum())
        completion = sample.input_ids[prompt_len:].tolist()
        reference = teacher_forced_logprobs(model, sample.input_ids[:prompt_len].tolist(), completion, temperature)
        np.testing.assert_allclose(sample.old_log_probs[prompt_len:], reference.numpy(), atol=atol)


def check_stopped_samples(groups, model, tokenizer, stop: list[str], max_tokens: int, **sampling) -> None:
    """Each sample is cut at its first stop string (then not truncated) or else at an EOS id or `max_tokens`, and its
    logprobs are those of the processed distribution (`sampling`); at least one met a stop string."""
    from lightning_grpo.rollout.sampling import teacher_forced_logprobs

    stopped = 0
    for sample in (s for samples in groups.values() for s in samples):
        prompt_len = int((sample.completion_mask == 0).sum())
        completion = sample.input_ids[prompt_len:].tolist()
        text = tokenizer.decode(completion, skip_special_tokens=True)
        hits = [s for s in stop if s in text]
        if hits:  # it ended at the first stop string: the one its last token completed, and the only one
            stopped += 1
            assert not sample.truncated and len(hits) == 1 and text.count(hits[0]) == 1, (text, sample.truncated)
            assert text.endswith(hits[0])
        else:
            ended = completion[-1] == tokenizer.eos_token_id
            assert sample.truncated == (not ended) and (ended or len(completion) == max_tokens)
        reference = teacher_forced_logprobs(model, sample.input_ids[:prompt_len].tolist(), completion, **sampling)
        np.testing.assert_allclose(sample.old_log_probs[prompt_len:], reference.numpy(), atol=1e-4)
    assert stopped > 0, "no completion met a stop string; nothing was tested"


def make_group(
    group_id: int,
    *,
    size: int = 4,
    prompt: list[int] | None = None,
    completion_lens: list[int] | None = None,
    advantages: list[float] | None = None,
    version: int = 0,
    truncated: list[bool] | None = None,
    vocab: int = 50,
    seed: int | None = None,
) -> list[RolloutSample]:
    """A whole group of `size` rollout samples sharing one prompt, as the rollout child would queue it.

    Defaults: a 4-token prompt unique to the group, 3-token completions, advantages +1/-1 (a learning signal).
    """
    rng = np.random.default_rng(group_id if seed is None else seed)
    prompt = list(prompt) if prompt is not None else [1000 + group_id, 1, 2, 3]
    completion_lens = completion_lens or [3] * size
    advantages = advantages if advantages is not None else [1.0 if i % 2 == 0 else -1.0 for i in range(size)]
    truncated = truncated or [False] * size
    samples = []
    for i in range(size):
        completion = rng.integers(0, vocab, completion_lens[i]).tolist()
        ids = np.array(prompt + completion, dtype=np.int64)
        mask = np.array([0] * len(prompt) + [1] * len(completion), dtype=np.int64)
        samples.append(
            RolloutSample(
                prompt="p",
                completion="c",
                input_ids=ids,
                completion_mask=mask,
                old_log_probs=np.where(mask == 1, -0.5, 0.0).astype(np.float32),
                advantage=float(advantages[i]),
                model_version=version,
                group_id=group_id,
                metrics={"reward": float(advantages[i]), "rewards/acc": float(advantages[i] > 0)},
                enqueued_at=time.time(),
                truncated=truncated[i],
                group_rows=size,
            )
        )
    return samples


def queue_of(groups: list[list[RolloutSample]]) -> queue.Queue:
    """A rollout queue holding every sample of `groups`, in order."""
    q: queue.Queue = queue.Queue()
    for group in groups:
        for sample in group:
            q.put(sample)
    return q
