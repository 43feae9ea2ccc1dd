"""Reward functions of the tests' fits, in a module that imports only the standard library.

cloudpickle ships a module-level function by reference, so each reward worker imports the module that defines it.
Defined in a test module (which imports torch, Lightning and TRL), every reward pool of every fit would spend ~10 s
importing them before the rollout child could start generating.
"""

from __future__ import annotations

import json
import sys
import time


def char_sum_reward(completions, **kwargs):
    """Varies with every character, so a random policy's groups carry a learning signal."""
    return [sum(map(ord, c[0]["content"])) % 97 / 97 for c in completions]


def constant_reward(completions, **kwargs):
    """The same reward for every completion: no group carries a learning signal, so a fit stalls."""
    return [1.0 for _ in completions]


def signal_on_odd_prompts(completions, prompts, **kwargs):
    """`char_sum_reward` for the odd prompts of `tiny_prompts` ("Say 1.", "Say 3.", ...), 1 for the even ones: the
    even prompts' groups carry no learning signal."""
    varying = char_sum_reward(completions)
    odd = [int(prompt[-1]["content"].split()[1].rstrip(".")) % 2 for prompt in prompts]
    return [reward if is_odd else 1.0 for reward, is_odd in zip(varying, odd, strict=True)]


def length_reward(completions, **kwargs):
    """A second reward column: the completion's length."""
    return [len(c[0]["content"]) / 8 for c in completions]


def scripted_reward(completions, prompts, *, log_dir, split=None, **columns):
    """A reward fixed by the text: NaN (None) for a third of the completions, else 1 or 0; writes what it scored."""
    rewards = []
    for completion in completions:
        assert isinstance(completion, str), completion  # raw-text prompts: completions are strings (TRL's format)
        rewards.append([None, 1.0, 0.0][sum(map(ord, completion)) % 3])
    with open(f"{log_dir}/{split[0] if split else 'train'}.jsonl", "a") as log:  # a column: one value per completion
        for prompt, reward in zip(prompts, rewards, strict=True):
            log.write(json.dumps({"prompt": prompt, "reward": reward}) + "\n")
    return rewards


def char_count_reward(completions, **kwargs):
    """The completion's length in characters."""
    return [float(len(c[0]["content"])) for c in completions]


class ChildOnlyReward:
    """A reward that loads in the rollout child but not in a reward worker, whose pool then cannot start."""

    def __call__(self, completions, **kwargs):
        return [1.0] * len(completions)

    def __reduce__(self):
        return _child_only_reward, ()


def _child_only_reward() -> ChildOnlyReward:
    if "lightning_grpo.rollout.reward_worker" in sys.modules:  # what a reward worker imported to load it
        raise RuntimeError("ChildOnlyReward never loads in a reward worker")
    return ChildOnlyReward()


def environment_mark(completions, **kwargs):
    """`$LIGHTNING_GRPO_TEST_MARK` plus a thousandth per character (so a group's rewards vary and it is kept): shows
    the environment the reward worker, and the rollout child that started it, got."""
    import os

    mark = float(os.environ["LIGHTNING_GRPO_TEST_MARK"])
    return [mark + len(c[0]["content"]) / 1000 for c in completions]


def hangs_on_say_0(completions, prompts, **kwargs):
    """Blocks for an hour on the prompt "Say 0." (past any test's `reward_timeout`), else `char_sum_reward`."""
    if "Say 0." in str(prompts[0]):
        time.sleep(3600)
    return char_sum_reward(completions)


async def async_raises_on_say_1(completions, prompts, **kwargs):
    """An `async def` reward that raises on the prompt "Say 1.", else the completion's length."""
    if "Say 1." in str(prompts[0]):
        raise RuntimeError("async_raises_on_say_1 raised on cue")
    return char_count_reward(completions)


def kernel_cache_capacity(completions, **kwargs):
    """The oneDNN kernel cache capacity in the reward worker's environment (the rollout child's, which started it),
    plus a thousandth per character."""
    import os

    capacity = float(os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "-1"))
    return [capacity + len(c[0]["content"]) / 1000 for c in completions]
