"""The reference model of the KL term (`GRPOModule(beta > 0)`): its log-probabilities of a micro-batch's loss terms.

`ReferencePolicy` is what `GRPOModule` calls: one method, the log-probabilities of a packed micro-batch's terms under
the reference, from a no-grad forward over the same packed rows (no second packing), on the policy's forward (tree
or padded: `LossContext.packing`). `ReferenceModel` implements it
with a frozen copy of the initial policy on the trainer's device, sharded like the policy under FSDP2, mixed into
the policy's direction by TR-DPO (`mix`, GRPOTrainer's `sync_ref_model`), and saved in checkpoints only once a mix
made it differ from the initial policy. `DisabledAdaptersReference` is the reference of a LoRA policy whose adapters
start at zero: the policy itself with its adapters disabled (PEFT's `disable_adapter`), as GRPOTrainer does under
PEFT, so no copy of the base weights is held. `make_reference` picks one.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from .loss import LossContext, packed_logprobs
from .sharding import shard_policy

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy


@runtime_checkable
class ReferencePolicy(Protocol):
    """A reference for the KL term: `GRPOModule` calls `logprobs` once per micro-batch of each planned step, before
    its updates, on every rank (a sharded reference's forward is a collective)."""

    def logprobs(self, micro_batch: dict[str, torch.Tensor], context: LossContext) -> torch.Tensor:
        """`(M,)` float32 log-probabilities of the micro-batch's loss terms under the sampling distribution of
        `context` (temperature, top-k, top-p), without grad."""
        ...


class ReferenceModel:
    """A frozen copy of the policy it is built from (the initial policy), as GRPOTrainer's `ref_model`.

    Not an `nn.Module` attribute of the LightningModule on purpose: it is not trained, not wrapped by DDP/FSDP with
    the policy, and not in the module's `state_dict`; `GRPOModule` moves it to the trainer's device, shards it like
    the policy under FSDP2 (`shard`), and checkpoints it itself once `mixed`.

    Args:
        policy: the policy to copy, before it is sharded (its weights at the start of training).
    """

    def __init__(self, policy: torch.nn.Module) -> None:
        self.model = copy.deepcopy(policy)
        self.model.requires_grad_(False)
        self.model.eval()
        self.mixed = False

    def shard(self, strategy: Strategy) -> None:
        """Shard the copy as the policy is (`shard_policy`: FSDP2 under `ModelParallelStrategy`, else nothing), so
        that each rank holds and mixes its own shards."""
        shard_policy(self.model, strategy)

    def to(self, device: torch.device | str) -> ReferenceModel:
        self.model.to(device)
        return self

    def logprobs(self, micro_batch: dict[str, torch.Tensor], context: LossContext) -> torch.Tensor:
        with torch.no_grad():
            return _logprobs(self.model, micro_batch, context)

    @torch.no_grad()
    def mix(self, policy: torch.nn.Module, alpha: float) -> None:
        """TR-DPO's update, `reference = alpha * policy + (1 - alpha) * reference`, parameter by parameter (shard by
        shard under FSDP2: both are sharded alike)."""
        _reshard(self.model)
        _reshard(policy)
        pairs = zip(self.model.parameters(), policy.parameters(), strict=True)
        for reference, current in pairs:
            reference.data.mul_(1.0 - alpha).add_(current.data, alpha=alpha)
        self.mixed = True

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """`(name, full tensor)` of each parameter (a sharded one is gathered: call it on every rank)."""
        for name, param in self.model.named_parameters():
            yield name, _full(param.detach())

    def state_dict(self) -> dict[str, Any]:
        """The full parameters on CPU, and whether a mix changed them; every rank must call it (gathers shards)."""
        return {"mixed": self.mixed, "parameters": {name: value.cpu() for name, value in self.named_parameters()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved (each rank keeps its own shard of a sharded parameter)."""
        _reshard(self.model)
        params = dict(self.model.named_parameters())
        missing = sorted(set(params) ^ set(state["parameters"]))
        if missing:
            raise ValueError(f"The checkpoint's reference model does not match the policy: {missing[:5]} differ.")
        with torch.no_grad():
            for name, param in params.items():
                _copy_full(param, state["parameters"][name])
        self.mixed = bool(state.get("mixed", True))


class DisabledAdaptersReference:
    """The reference of a LoRA policy whose adapters started at zero: the same `peft.PeftModel` with its adapters
    disabled, which is exactly the initial policy and shares its (frozen, possibly sharded) base weights.

    Args:
        policy: the `peft.PeftModel` being trained.
    """

    def __init__(self, policy: torch.nn.Module) -> None:
        self.policy = policy
        self.mixed = False  # TR-DPO cannot mix into it (`GRPOModule` refuses `sync_ref_model` with LoRA)

    def logprobs(self, micro_batch: dict[str, torch.Tensor], context: LossContext) -> torch.Tensor:
        with torch.no_grad(), self.policy.disable_adapter():
            return _logprobs(self.policy, micro_batch, context)


def make_reference(policy: torch.nn.Module, adapters_start_at_zero: bool) -> ReferencePolicy:
    """The KL reference of `policy` before it trains: the policy with its adapters disabled when it is a LoRA policy
    whose adapters are still zero (a fresh `peft_config` with PEFT's default or Gaussian initialisation), else a
    frozen copy (a full policy, a `PeftModel` with trained adapters, or an initialisation such as PiSSA that changes
    the base weights)."""
    if adapters_start_at_zero:
        return DisabledAdaptersReference(policy)
    return ReferenceModel(policy)


def adapters_start_at_zero(peft_config: Any) -> bool:
    """Whether PEFT initialises these adapters to a zero update (so the base model is the initial policy)."""
    return getattr(peft_config, "init_lora_weights", None) in (True, "gaussian")


def _logprobs(model: torch.nn.Module, micro_batch: dict[str, torch.Tensor], context: LossContext) -> torch.Tensor:
    logprobs, _ = packed_logprobs(
        model,
        micro_batch,
        context.temperature,
        top_k=context.top_k,
        top_p=context.top_p,
        min_p=context.min_p,
        packing=context.packing,
    )
    return logprobs


def _reshard(model: torch.nn.Module) -> None:
    """Register FSDP2's sharded parameters again (its root keeps the unsharded ones after a forward), so that a
    model's parameters are its shards (DTensors), the same kind as in a model sharded alike."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into `param`, or into its local shard when it is a DTensor."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        local = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
        param.data.copy_(local)
        return
    param.data.copy_(full.to(param.device, param.dtype))
