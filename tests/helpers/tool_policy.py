"""A tiny policy that calls a tool, and scripted environments around it, for the multi-turn tests.

A random tiny Llama never writes a well-formed tool call, so `tool_policy()` teaches one to (a short supervised fit,
deterministic, on the real model and the real chat template): asked "Find it." with the tool `lookup(key)`, it
answers `<tool_call>{"name": "lookup", "arguments": {"key": "k"}}</tool_call>`; after the tool result `42` it
answers `42`; after the result `again` it calls the tool again. Everything else about it is the tiny model.

The environments script the other side: `LookupEnv` answers `42` and rewards a rollout that looked the key up and
answered 42; `LoopingEnv` always answers `again` (a policy that never stops calling tools); `RaisingEnv`,
`HangingEnv`, `UnprintableEnv` and `BrokenRewardEnv` fail in one way each.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

PROMPT = [{"role": "user", "content": "Find it."}]
CALL = {"type": "function", "function": {"name": "lookup", "arguments": {"key": "k"}}}


class LookupEnv:
    """`lookup(key)` answers 42; the reward is 1 for a rollout that looked `k` up and then answered 42."""

    def reset(self, **row):
        self.keys = []
        return None

    def lookup(self, key: str) -> str:
        """Look a key up.

        Args:
            key: the key to look up.
        """
        self.keys.append(key)
        return "42"

    def get_reward(self) -> float:
        return float(self.keys == ["k"])


class LoopingEnv(LookupEnv):
    def lookup(self, key: str) -> str:
        """Look a key up.

        Args:
            key: the key to look up.
        """
        self.keys.append(key)
        return "again"


class RaisingEnv(LookupEnv):
    def lookup(self, key: str) -> str:
        """Look a key up.

        Args:
            key: the key to look up.
        """
        raise KeyError(f"no such key: {key}")


class HangingEnv(LookupEnv):
    def lookup(self, key: str) -> str:
        """Look a key up.

        Args:
            key: the key to look up.
        """
        time.sleep(3600)
        return "never"


class GatedLookupEnv(LookupEnv):
    """`lookup` marks `<gate>/called` and waits for `<gate>/open`: a test can change things between two turns."""

    def reset(self, gate: str, **row):
        self.gate = Path(gate)
        self.keys = []

    def lookup(self, key: str) -> str:
        """Look a key up.

        Args:
            key: the key to look up.
        """
        (self.gate / "called").touch()
        deadline = time.monotonic() + 60
        while not (self.gate / "open").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.keys.append(key)
        return "42"


class _Unprintable:
    def __str__(self):
        raise RuntimeError("cannot print me")


class UnprintableEnv(LookupEnv):
    def lookup(self, key: str) -> str:
        """Look a key up.

        Args:
            key: the key to look up.
        """
        return _Unprintable()


class BrokenRewardEnv(LookupEnv):
    def get_reward(self) -> float:
        raise RuntimeError("the judge is down")


class BrokenResetEnv(LookupEnv):
    def reset(self, **row):
        raise RuntimeError("the sandbox did not start")


def lookup(key: str) -> str:
    """Look a key up (a standalone tool).

    Args:
        key: the key to look up.
    """
    return "42"


def _training_sequences(tokenizer) -> list[tuple[list[int], list[int]]]:
    """(context, target) pairs: the call, the answer after `42`, the call again after `again`."""
    from lightning_grpo.rollout.chat import render_prompt

    first = render_prompt(tokenizer, PROMPT, tools=[lookup])
    called = [*PROMPT, {"role": "assistant", "content": "", "tool_calls": [CALL]}]
    full = tokenizer.apply_chat_template(called, tools=[lookup], return_dict=False)
    call_ids = full[len(first) : -1]  # the reply up to its <|im_end|>, without the template's trailing newline
    pairs = [(first, call_ids)]
    for result, target in (("42", tokenizer("42<|im_end|>")["input_ids"]), ("again", call_ids)):
        context = render_prompt(
            tokenizer, [*called, {"role": "tool", "name": "lookup", "content": result}], tools=[lookup]
        )
        pairs.append((context, target))
    return pairs


def train_tool_policy(max_steps: int = 300, target_loss: float = 5e-3, log=None) -> torch.nn.Module:
    """The tiny model (seed 0), fitted until its mean token loss on the three replies is below `target_loss`."""
    from lightning_grpo.models import char_tokenizer, tiny_llama

    pairs = _training_sequences(char_tokenizer())
    width = max(len(c) + len(t) for c, t in pairs)
    ids = torch.zeros(len(pairs), width, dtype=torch.long)
    labels = torch.full((len(pairs), width), -100)
    mask = torch.zeros(len(pairs), width, dtype=torch.long)
    for row, (context, target) in enumerate(pairs):
        sequence = context + target
        ids[row, : len(sequence)] = torch.tensor(sequence)
        labels[row, len(context) : len(sequence)] = torch.tensor(target)
        mask[row, : len(sequence)] = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tiny_llama(seed=0).train()
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.99))
        for step in range(max_steps):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            if log is not None:
                log(step, loss.item())
            if loss.item() < target_loss:
                break
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    return model.eval()


def cached_tool_policy() -> Path:
    """The trained policy's state dict in the cache folder, keyed by everything that determines it (trained once)."""
    import hashlib
    import inspect
    import os

    import transformers

    from lightning_grpo.models import CHATML_TEMPLATE
    from lightning_grpo.models.smollm2 import default_cache_dir

    recipe = [inspect.getsource(f) for f in (_training_sequences, train_tool_policy, lookup)]
    key = "\n".join([*recipe, CHATML_TEMPLATE, torch.__version__, transformers.__version__])
    path = default_cache_dir() / "tests" / f"tool_policy-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(train_tool_policy().state_dict(), partial)
        partial.replace(path)  # atomic: a concurrent session never reads half a file
    return path


def load_tool_policy(path: Path) -> torch.nn.Module:
    from lightning_grpo.models import tiny_llama

    model = tiny_llama(seed=0)
    model.load_state_dict(torch.load(path))
    return model.eval()


# -- checks of multi-turn samples ---------------------------------------------------------------------------------


def notebook_environment() -> type:
    """`LookupEnv` as a notebook defines it: in `__main__` of a kernel, which a spawned process cannot import."""
    import inspect

    cell = inspect.getsource(LookupEnv).replace("class LookupEnv:", "class NotebookLookupEnv:")
    namespace = {"__name__": "notebook_cell_not_importable"}
    exec(cell, namespace)  # as a kernel runs a cell: the class's module is nothing a spawned process can import
    return namespace["NotebookLookupEnv"]


def policy_token_mask(tokenizer, input_ids) -> list[int]:
    """1 on the tokens of the policy's replies (after each `<|im_start|>assistant\\n`, up to and including its
    `<|im_end|>`), 0 on everything else: the system and user prompt and every tool result."""
    import re

    pieces = tokenizer.convert_ids_to_tokens(list(input_ids))
    starts, position = [], 0
    for piece in pieces:
        starts.append(position)
        position += len(piece)
    text = "".join(pieces)
    mask = [0] * len(pieces)
    for reply in re.finditer(r"(?<=<\|im_start\|>assistant\n)(?:(?!<\|im_start\|>).)*?(?:<\|im_end\|>|$)", text, re.S):
        for index, start in enumerate(starts):
            if reply.start() <= start < reply.end():
                mask[index] = 1
    return mask


def check_conversation_samples(samples, model, tokenizer, *, temperature: float, reward_column: str) -> int:
    """Assert what every multi-turn sample must satisfy; returns how many of them called a tool.

    Their masks train exactly the policy's tokens, their logprobs equal a teacher-forced forward of the whole
    conversation (<= 1e-4), and the environment's reward (1 for a rollout that looked `k` up once) is the sample's
    reward column and the source of its advantage.
    """
    import numpy as np

    from lightning_grpo.rollout.advantages import compute_group_advantages
    from lightning_grpo.rollout.sampling import teacher_forced_logprobs

    called = 0
    for sample in samples:
        ids = sample.input_ids.tolist()
        assert sample.completion_mask.tolist() == policy_token_mask(tokenizer, ids), tokenizer.decode(ids)
        start = int(sample.completion_mask.argmax())
        reference = teacher_forced_logprobs(model, ids[:start], ids[start:], temperature=temperature).numpy()
        trained = sample.completion_mask[start:].astype(bool)
        np.testing.assert_allclose(sample.old_log_probs[start:][trained], reference[trained], atol=1e-4)
        assert (sample.old_log_probs[start:][~trained] == 0).all()
        messages = sample.completion
        ran = [
            m
            for m, after in zip(messages, messages[1:], strict=False)
            if m.get("tool_calls") and after["role"] == "tool"
        ]
        looked_up = [c["function"]["arguments"].get("key") for m in ran for c in m["tool_calls"]]
        assert sample.metrics[f"rewards/{reward_column}"] == float(looked_up == ["k"])
        called += bool(ran)
    rewards = np.array([[s.metrics[f"rewards/{reward_column}"] for s in samples]])
    _, advantages = compute_group_advantages(rewards, np.ones(1))
    np.testing.assert_allclose([s.advantage for s in samples], advantages, atol=1e-6)
    return called
