"""Data-parallel training of the policy: FSDP2 sharding, which strategies synchronise its gradients, and gradient
sync only on a step's last micro-batch.

Every rank trains its own rows of a step (`StepStream` scatters them), so the ranks' gradients must be reduced. DDP
does it (Lightning wraps the module) and FSDP2 does it once `shard_policy` applied `fully_shard` under
`ModelParallelStrategy`; both are tested on several CPU processes with gloo. Anything else on several processes would
train one policy per rank, and FSDP1 (`strategy="fsdp"`, which torch runs on GPUs only) and DeepSpeed are untested
with this module's manual optimization, so `check_strategy` refuses them all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    ParallelStrategy,
    Strategy,
)

from .compilation import decoder_layers

#: The strategies whose gradient reduction `GRPOModule` works with, for the error message.
SUPPORTED = (
    "strategy='ddp' (any device), or FSDP2 through ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1) "
    "(shards the policy like FSDP; CPU and GPU)"
)


def check_strategy(strategy: Strategy, world_size: int) -> None:
    """Refuse, at start-up, a strategy that `GRPOModule` does not train under.

    Raises:
        ValueError: FSDP1 (`FSDPStrategy`, `strategy="fsdp"`) or DeepSpeed at any world size; on several processes a
            strategy other than DDP or data-parallel `ModelParallelStrategy`, or `ModelParallelStrategy` with a
            tensor-parallel dimension. The message names what works.
    """
    if isinstance(strategy, FSDPStrategy | DeepSpeedStrategy):
        name = "FSDPStrategy (FSDP1)" if isinstance(strategy, FSDPStrategy) else "DeepSpeedStrategy"
        raise ValueError(
            f"`{name}` is not supported by GRPOModule (untested with its manual optimization); use {SUPPORTED}."
        )
    if world_size == 1:
        return
    if isinstance(strategy, ModelParallelStrategy):
        tensor_parallel = strategy.device_mesh["tensor_parallel"].size()
        if tensor_parallel > 1:
            raise ValueError(
                f"`ModelParallelStrategy(tensor_parallel_size={tensor_parallel})`: GRPOModule shards the policy with "
                "FSDP2 over the data-parallel dimension and gives every rank its own rows, so a tensor-parallel "
                f"dimension would leave ranks with unsynchronised gradients. Use ModelParallelStrategy("
                f"data_parallel_size={world_size}, tensor_parallel_size=1)."
            )
        return
    if isinstance(strategy, DDPStrategy):
        return
    raise ValueError(
        f"`{type(strategy).__name__}` on {world_size} processes does not reduce the policy's gradients across ranks "
        f"as GRPOModule trains it (every rank trains its own rows), so each rank would train its own policy. Use "
        f"{SUPPORTED}."
    )


def shard_policy(policy: torch.nn.Module, strategy: Strategy) -> None:
    """Apply FSDP2's `fully_shard` to each decoder layer and to the whole policy, under `ModelParallelStrategy`.

    Layers are the modules whose class the model lists in `_no_split_modules` (transformers' decoder layers), so each
    is gathered for its own forward and backward; the root holds the embeddings, the final norm and a (tied) output
    layer. Tree attention and the packed loss run unchanged. A policy already sharded is left as it is; under any
    other strategy this does nothing.
    """
    if not isinstance(strategy, ModelParallelStrategy) or is_fsdp2(policy):
        return
    from torch.distributed.fsdp import fully_shard

    mesh = strategy.device_mesh["data_parallel"]
    for layer in decoder_layers(policy):
        fully_shard(layer, mesh=mesh)
    fully_shard(policy, mesh=mesh)


def is_fsdp2(module: torch.nn.Module) -> bool:
    """Whether `fully_shard` was applied to `module`."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def is_sharded(policy: torch.nn.Module, wrapped: torch.nn.Module | None) -> bool:
    """Whether the policy's forward is a collective (FSDP2 on the policy, or FSDP1 around the LightningModule): every
    rank must then run the same number of forwards."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return is_fsdp2(policy) or isinstance(wrapped, FullyShardedDataParallel)


def gradient_scaler(trainer: Any) -> Any:
    """The fp16 gradient scaler of `trainer`'s precision plugin, if any (None without a trainer)."""
    return getattr(getattr(trainer, "precision_plugin", None), "scaler", None)


def clip_gradient_norm(module: Any, optimizer: Any, max_norm: float) -> None:
    """Clip the policy's gradient norm to `max_norm` over all ranks: FSDP1 clips through its root wrapper (Lightning's
    `clip_gradients` refuses norm clipping under FSDP1); a fused optimizer without a gradient scaler through torch
    (Lightning's mixed-precision plugin refuses it); everything else through Lightning (FSDP2's DTensor gradients
    give the global norm)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    trainer = module.trainer
    inner = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer wraps it
    if isinstance(trainer.model, FullyShardedDataParallel):
        trainer.model.clip_grad_norm_(max_norm)
    elif inner.defaults.get("fused") and gradient_scaler(trainer) is None:
        # the plugin refuses an optimizer that unscales gradients by itself (a fused one) even in bf16, which has no
        # scaler to unscale: its own norm clipping, without that check
        trainer.precision_plugin.clip_grad_by_norm(inner, max_norm)
    else:
        module.clip_gradients(optimizer, gradient_clip_val=max_norm, gradient_clip_algorithm="norm")


@contextlib.contextmanager
def gradient_sync(strategy: Strategy, policy: torch.nn.Module, wrapped: Any, enabled: bool) -> Iterator[None]:
    """Reduce gradients in this backward only when `enabled`: one reduction per optimizer step, on its last
    micro-batch, whatever the strategy (DDP's `no_sync`, FSDP1's `no_sync`, FSDP2's `set_requires_gradient_sync`)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if enabled or not isinstance(strategy, ParallelStrategy):
        yield
    elif is_fsdp2(policy):
        policy.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            policy.set_requires_gradient_sync(True)
    elif isinstance(wrapped, FullyShardedDataParallel):
        with wrapped.no_sync():
            yield
    else:
        with strategy.block_backward_sync():
            yield
