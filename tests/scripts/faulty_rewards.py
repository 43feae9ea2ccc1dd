"""Reward functions for the command-line fault run (tests/test_run_logging.py), imported by path as the CLI does.

`char_sum` varies with every character, so a random policy's groups carry a learning signal; `flaky` reads the
dataset's `fault` column and misbehaves on cue: it raises, hangs past the reward timeout, or kills its worker process
(every time, so the pool's retry dies too). Otherwise it scores a constant 1.
"""

from __future__ import annotations

import os
import time


def char_sum(completions, **kwargs):
    return [sum(map(ord, c[0]["content"])) % 97 / 97 for c in completions]


def flaky(completions, fault, **kwargs):
    if fault[0] == "raise":
        raise RuntimeError("flaky raised on cue")
    if fault[0] == "hang":
        time.sleep(600)
    if fault[0] == "kill":
        os._exit(3)
    return [1.0 for _ in completions]
