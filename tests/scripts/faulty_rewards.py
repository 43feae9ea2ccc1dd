"""A reward function for the command-line fault run (tests/cli/test_run_logging.py), imported by path as the CLI does.

`flaky` reads the dataset's `fault` column and misbehaves on cue: it raises, hangs past the reward timeout, or kills
its worker process (every time, so the pool's retry dies too). Otherwise it scores a constant 1. The run's other
reward, which gives its groups a learning signal, is `helpers.fit_rewards.char_sum_reward`.
"""

from __future__ import annotations

import os
import time


def flaky(completions, fault, **kwargs):
    if fault[0] == "raise":
        raise RuntimeError("flaky raised on cue")
    if fault[0] == "hang":
        time.sleep(600)
    if fault[0] == "kill":
        os._exit(3)
    return [1.0 for _ in completions]
