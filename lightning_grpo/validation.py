"""Held-out validation: greedy completions of held-out prompts from the policy being trained."""

from __future__ import annotations

from typing import Any

import torch

from .data import as_messages


@torch.no_grad()
def greedy_completions(
    policy: torch.nn.Module,
    rows: list[dict[str, Any]],
    tokenizer: Any,
    *,
    max_tokens: int,
    attention: str,
    fixed_length: bool = False,
) -> list[list[dict[str, str]]]:
    """One greedy completion per row's `prompt`, as an assistant message, from a left-padded batched `generate`.

    Args:
        policy: the policy (in its train-time attention; switched to `attention` for the padded batch and back).
        rows: held-out dataset rows, each with a `prompt` (chat messages or a string).
        tokenizer: the policy's tokenizer (its chat template renders each prompt).
        max_tokens: tokens per completion.
        attention: the attention implementation for a padded batch (the policy's loaded one, not tree attention).
        fixed_length: run all `max_tokens` steps and cut each completion at its EOS afterwards. Needed where the
            policy's forward is a collective (a sharded policy): an early stop at EOS would differ between ranks.
    """
    prompts = [
        tokenizer.apply_chat_template(as_messages(row["prompt"]), add_generation_prompt=True, return_dict=False)
        for row in rows
    ]
    device = next(policy.parameters()).device
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    previous = policy.config._attn_implementation
    policy.set_attn_implementation(attention)
    try:
        out = policy.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=None if fixed_length else tokenizer.eos_token_id,
        )
    finally:
        policy.set_attn_implementation(previous)
    completions = [_cut_at(row.tolist(), tokenizer.eos_token_id) for row in out[:, width:]]
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    return [[{"role": "assistant", "content": text}] for text in texts]


def _cut_at(ids: list[int], eos: int | None) -> list[int]:
    """`ids` up to and including the first `eos`."""
    return ids[: ids.index(eos) + 1] if eos is not None and eos in ids else ids
