"""What a generator receives from a LoRA policy (PEFT): merged weights computed beside the trained ones, or the
adapter itself.

A generator without LoRA support (the embedded generator, a vLLM server fed full weights) needs each adapted layer's
merged weight, `W + scale * B @ A` (or the layer's own variant of it, such as DoRA's), under the base model's name.
`merged_tensor` computes it with PEFT's own `get_delta_weight` / `merge_safe` into a new tensor, so the trainer's
copy is never merged and unmerged (no round trip that could leave it merged, or drift in low precision). A vLLM
server started with `--enable-lora` instead loads the adapter: `adapter_tensors` streams it in PEFT's saved format.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from peft import LoraConfig


def lora_layers(policy: torch.nn.Module) -> dict[int, Any]:
    """`id(parameter) -> LoRA layer` for each base parameter whose generator value the layer's adapters change.

    That is the base layer's weight, and its bias when the adapter trains one (`lora_bias=True`). Empty for a policy
    without LoRA layers.
    """
    from peft.tuners.lora import LoraLayer

    layers: dict[int, Any] = {}
    for module in policy.modules():
        if not isinstance(module, LoraLayer) or not _adapters(module):
            continue
        base = module.get_base_layer()
        layers[id(adapted_parameter(module))] = module
        if getattr(base, "bias", None) is not None and any(module.lora_bias.get(a) for a in _adapters(module)):
            layers[id(base.bias)] = module
    return layers


def adapted_parameter(layer: Any) -> torch.Tensor:
    """The base parameter a LoRA layer adapts: its base layer's `weight`, or, for PEFT's `ParamWrapper` (LoRA on a
    parameter such as a mixture-of-experts block's stacked expert weights), the parameter it names."""
    return getattr(layer.get_base_layer(), getattr(layer, "parameter_name", None) or "weight")


def merged_tensor(layer: Any, param: torch.Tensor) -> torch.Tensor:
    """The merged value of `param` (its base layer's weight or bias) under `layer`'s active adapters, as a new full
    tensor; `layer` is left as it is. A collective when the parameters are FSDP2 DTensors (every rank calls it)."""
    base = layer.get_base_layer()
    with torch.no_grad():
        if param is getattr(base, "bias", None):
            merged = _full(param).clone()
            for adapter in _adapters(layer):
                if layer.lora_bias.get(adapter):
                    merged += _full(layer.lora_B[adapter].bias * layer.scaling[adapter]).to(merged.dtype)
            return merged
        merged = _full(param)
        for adapter in _adapters(layer):
            variant = getattr(layer, "lora_variant", {}).get(adapter)
            if variant is not None:  # DoRA and other variants merge their own way
                merged = _full(variant.merge_safe(layer, adapter, merged.clone()))
            elif _plain_linear(layer, adapter, merged):
                # get_delta_weight's `B @ A * scaling`, fused into one pass that writes the merged tensor once
                a, b = _full(layer.lora_A[adapter].weight), _full(layer.lora_B[adapter].weight)
                merged = torch.addmm(merged, b, a, alpha=layer.scaling[adapter])
            else:
                merged = merged + _full(layer.get_delta_weight(adapter)).to(merged.dtype)
        return merged.detach()


def active_adapter(policy: Any) -> str:
    """The name of the PEFT policy's one active adapter.

    Raises:
        ValueError: several adapters are active (a generator serves one policy).
    """
    active = list(policy.active_adapters)
    if len(active) != 1:
        raise ValueError(f"The policy has {len(active)} active adapters {active}; activate one to push it.")
    return active[0]


def adapter_config(policy: Any) -> LoraConfig:
    """The active adapter's config."""
    return policy.peft_config[active_adapter(policy)]


def adapter_tensors(policy: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, full tensor)` of the active adapter, named as `PeftModel.save_pretrained` writes them (the adapter name
    left out: `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), in the same order on every rank.

    A DTensor (FSDP2) is gathered with `full_tensor()`: every rank must iterate this to the end, in step.
    """
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(policy, adapter_name=active_adapter(policy))
    for name, tensor in state.items():
        yield name, _full(tensor.detach())


def _adapters(layer: Any) -> list[str]:
    """The layer's active adapters that hold weights in it (an adapter may skip some layers)."""
    held = set(layer.lora_A) | set(getattr(layer, "lora_embedding_A", {}))
    return [adapter for adapter in layer.active_adapters if adapter in held and not layer.disable_adapters]


def _plain_linear(layer: Any, adapter: str, weight: torch.Tensor) -> bool:
    """Whether `layer`'s delta for `adapter` is exactly `scaling * B @ A` in `weight`'s float32 (PEFT's Linear without
    `fan_in_fan_out`; PEFT computes half-precision deltas on CPU in float32, so those take `get_delta_weight`)."""
    from peft.tuners.lora import Linear

    lora_b = layer.lora_B[adapter].weight if adapter in layer.lora_B else None
    return (
        isinstance(layer, Linear)
        and not layer.fan_in_fan_out
        and lora_b is not None
        and weight.dtype == lora_b.dtype == torch.float32
    )


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
