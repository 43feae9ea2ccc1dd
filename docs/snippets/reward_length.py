"""Length penalties: TRL's soft overlong punishment (DAPO), and a per-token cost."""

from trl.rewards import get_soft_overlong_punishment

MAX_COMPLETION_LENGTH = 64  # the data module's max_completion_length

# 0 up to 48 tokens, then falling linearly to -1 at 64 tokens (DAPO's Eq. 13)
soft_overlong = get_soft_overlong_punishment(
    max_completion_len=MAX_COMPLETION_LENGTH, soft_punish_cache=16
)


def token_cost(completion_ids, **columns):
    """-0.01 per completion token: the token ids arrive by name, as in TRL."""
    return [-0.01 * len(ids) for ids in completion_ids]
