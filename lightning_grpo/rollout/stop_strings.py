"""Stop strings: a completion ends at the first token whose text completes one of them, as it would at an EOS id."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: vLLM's OpenAI-compatible `/v1/completions` rejects a request with more stop strings than this.
VLLM_MAX_STOP_STRINGS = 4


class StopStrings:
    """Finds the stop string a completion's newest token completed, in its decoded text (special tokens skipped).

    Only the text of the completion's last tokens is decoded at each step, enough to hold the longest stop string
    (4 tokens per character covers byte-level tokenizers, where a character can take up to 4 tokens). The text of the
    prompt never matches: as vLLM's `stop`, it looks at the completion only.

    Args:
        stop: the stop strings (non-empty).
        tokenizer: the policy's tokenizer (`decode`).

    Raises:
        ValueError: no stop string, or an empty one.
    """

    def __init__(self, stop: Sequence[str], tokenizer: Any) -> None:
        self.stop = check_stop(stop)
        if not self.stop:
            raise ValueError("`StopStrings(stop=[])` needs at least one stop string.")
        self._tokenizer = tokenizer
        self._window = 4 * max(map(len, self.stop)) + 4

    def found(self, token_ids: list[int]) -> str | None:
        """The stop string `token_ids`' text contains, if any (the first in `stop` order)."""
        text = self._tokenizer.decode(token_ids[-self._window :], skip_special_tokens=True)
        return next((s for s in self.stop if s in text), None)


def check_stop(stop: Sequence[str] | str | None) -> tuple[str, ...]:
    """`stop` as a tuple of strings, refusing a bare string (a common slip for a one-element list) and empty ones.

    Raises:
        ValueError: naming the bad value and the fix (a fragment the caller puts in its own message).
    """
    if stop is None:
        return ()
    if isinstance(stop, str):
        raise ValueError(f"stop={stop!r} is a string (pass a list of stop strings, e.g. stop=[{stop!r}])")
    stop = tuple(stop)
    if any(not isinstance(s, str) or not s for s in stop):
        raise ValueError(f"stop={list(stop)!r} (must be a list of non-empty strings)")
    return stop
