"""GRPOModule's loss options: TRL's names, defaults and meanings; a bad value or a combination TRL refuses fails at
construction, naming the options and the fix."""

from __future__ import annotations

import pytest

from lightning_grpo.module import GRPOModule


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"epsilon_high": -0.1}, "epsilon_high=-0.1"),
        ({"epsilon": 0.2, "epsilon_high": 0.1}, "epsilon_high=0.1"),
    ],
)
def test_an_epsilon_high_below_epsilon_or_negative_is_refused(options, named):
    with pytest.raises(ValueError, match=named):
        GRPOModule("tiny-random", **options)
