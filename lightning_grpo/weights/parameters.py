"""The policy's full parameters, under the names the generator expects: what every weight push streams."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable, Iterator
from typing import Literal

import torch

from .._trl import iter_vllm_named_params
from ..models.lora import is_peft_model
from .adapters import lora_layers, merged_tensor

# Wrapper prefixes that are not part of a checkpoint name: DDP, FSDP1 and activation checkpointing.
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")

#: How a partial push widens the tensors that changed: not at all, or to every tensor of the same parent module
#: (a vLLM server fuses q/k/v and gate/up projections into one layer, which it must reload whole).
ChangedScope = Literal["tensors", "modules"]


def checkpoint_name(name: str) -> str:
    """`name` without the wrapper parts DDP, FSDP1 and activation checkpointing add to a parameter's name."""
    name = name.removeprefix("module.")
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def generator_parameters(
    policy: torch.nn.Module, *, trainable_only: bool = False, names: Collection[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, full tensor)` of each parameter the generator receives, in the same order on every rank.

    Names are the policy's checkpoint names (`model.layers.0.self_attn.q_proj.weight`); a tied parameter comes once.
    With `trainable_only` the parameters and names are those of TRL's vLLM manifest (`_iter_vllm_named_params`:
    frozen parameters are skipped, PEFT prefixes stripped), which a server fed over NCCL sized its buffers from;
    otherwise every parameter comes, as a generator built without weights needs. A LoRA policy (PEFT) streams the
    base model's parameters under their base names in both cases, each adapted one merged with its adapters
    (`adapters.merged_tensor`, computed beside the trained weights: the policy is not modified). `names` keeps only
    those names (a partial push, see `changed_names`).

    A parameter sharded by FSDP2 (a DTensor) is gathered with `full_tensor()`, one at a time: that is a collective,
    so every rank must iterate this to the end, in step. Under FSDP1 call it inside `full_parameters(model)`.
    """
    layers = lora_layers(policy)
    for name, param in generator_manifest(policy, trainable_only=trainable_only):
        if names is not None and name not in names:
            continue
        layer = layers.get(id(param))
        if layer is not None:
            yield name, merged_tensor(layer, param)
            continue
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield name, tensor


def generator_manifest(
    policy: torch.nn.Module, *, trainable_only: bool = False
) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """`(name, parameter)` in `generator_parameters`' order and names, without reading or merging any value.

    The parameters give shapes and dtypes (global ones for DTensors) to size a transfer's buffers from; a LoRA
    policy's adapted parameters are its base weights, whose merged values keep their shape and dtype.
    """
    if trainable_only or is_peft_model(policy):
        named: Iterable[tuple[str, torch.nn.Parameter]] = iter_vllm_named_params(policy)
    else:
        named = policy.named_parameters()
    for name, param in named:
        yield checkpoint_name(name), param


def changed_names(
    policy: torch.nn.Module, *, trainable_only: bool = False, scope: ChangedScope = "tensors"
) -> frozenset[str]:
    """The names of `generator_parameters` whose values training can change: trainable parameters, and the merged
    weights of LoRA-adapted layers. The rest stays as the first push sent it.

    With `scope="modules"` every tensor of the same parent module comes too (`...self_attn.q_proj.weight` brings
    `...self_attn.k_proj.weight`, `v_proj` and `o_proj`), for a generator that reloads fused layers whole.
    """
    layers = lora_layers(policy)
    manifest = list(generator_manifest(policy, trainable_only=trainable_only))
    changed = {name for name, param in manifest if id(param) in layers or param.requires_grad}
    if scope == "modules":
        parents = {_parent_module(name) for name in changed}
        changed |= {name for name, _ in manifest if _parent_module(name) in parents}
    return frozenset(changed)


def _parent_module(name: str) -> str:
    """`model.layers.0.self_attn.q_proj.weight` -> `model.layers.0.self_attn` (the module holding the layer)."""
    return name.rsplit(".", 2)[0] if name.count(".") >= 2 else ""


def full_parameters(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """A context in which an FSDP1-wrapped `model`'s parameters are whole (on every rank); a no-op otherwise.

    FSDP2 needs none: `generator_parameters` gathers its DTensors one by one.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    if not isinstance(model, FullyShardedDataParallel):
        return contextlib.nullcontext()
    return FullyShardedDataParallel.summon_full_params(model, writeback=False, recurse=True)
