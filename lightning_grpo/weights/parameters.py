"""The policy's full parameters, under the names the generator expects: what every weight push streams."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .._trl import iter_vllm_named_params

# Wrapper prefixes that are not part of a checkpoint name: DDP, FSDP1 and activation checkpointing.
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def checkpoint_name(name: str) -> str:
    """`name` without the wrapper parts DDP, FSDP1 and activation checkpointing add to a parameter's name."""
    name = name.removeprefix("module.")
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def generator_parameters(
    policy: torch.nn.Module, *, trainable_only: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, full tensor)` of each parameter the generator receives, in the same order on every rank.

    Names are the policy's checkpoint names (`model.layers.0.self_attn.q_proj.weight`); a tied parameter comes once.
    With `trainable_only` the parameters and names are those of TRL's vLLM manifest (`_iter_vllm_named_params`:
    frozen parameters are skipped, PEFT prefixes stripped), which a server fed over NCCL sized its buffers from;
    otherwise every parameter comes, as a generator built without weights needs.

    A parameter sharded by FSDP2 (a DTensor) is gathered with `full_tensor()`, one at a time: that is a collective,
    so every rank must iterate this to the end, in step. Under FSDP1 call it inside `full_parameters(model)`.
    """
    named = iter_vllm_named_params(policy) if trainable_only else policy.named_parameters()
    for name, param in named:
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield checkpoint_name(name), tensor


def full_parameters(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """A context in which an FSDP1-wrapped `model`'s parameters are whole (on every rank); a no-op otherwise.

    FSDP2 needs none: `generator_parameters` gathers its DTensors one by one.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    if not isinstance(model, FullyShardedDataParallel):
        return contextlib.nullcontext()
    return FullyShardedDataParallel.summon_full_params(model, writeback=False, recurse=True)
