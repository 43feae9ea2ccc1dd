"""A reward that abstains: None where it has nothing to say, never a made-up 0."""

from lightning_grpo.rewards import completion_text


def exact_answer(completions, answer, **columns):
    """1.0 when the completion's last line is the row's answer, else 0.0.

    A row without an answer (`None` in the column: an open-ended prompt in a mixed
    dataset) is not scored: `None`. That completion's reward in this column is NaN,
    left out of `rewards/exact_answer`, and the other columns alone rank it.
    """
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        if gold is None:
            rewards.append(None)
            continue
        lines = completion_text(completion).strip().splitlines() or [""]
        rewards.append(1.0 if lines[-1].strip() == str(gold) else 0.0)
    return rewards
