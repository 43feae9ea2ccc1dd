"""A format reward: partial credit for an answer inside <answer> tags."""

import re

from lightning_grpo.rewards import completion_text

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def answer_tags(completions, **columns):
    """1.0 for exactly one non-empty <answer>...</answer>, 0.5 for an empty one or
    several, 0.0 for none. It checks the layout only; pair it with a correctness reward.
    """
    rewards = []
    for completion in completions:
        answers = ANSWER.findall(completion_text(completion))
        if not answers:
            rewards.append(0.0)
        else:
            rewards.append(1.0 if len(answers) == 1 and answers[0].strip() else 0.5)
    return rewards
