"""`GRPOModule`'s options that its helpers read, as typed, frozen records built once from its hyper-parameters.

The module's flat, TRL-named arguments stay its interface (the YAML keys, `save_hyperparameters`, the checkpoint);
`ModuleOptions.from_hparams` reads each key once and checks the loss options, and the loss, validation, checkpoint
and scoring helpers take the record they read. Defaults live in one place, the module's signature.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..options import from_flat
from .compilation import CompileOptions
from .loss_options import LossOptions, ReferenceSync, module_loss_options
from .packing_choice import PackingMode


@dataclass(frozen=True, slots=True)
class ValidationOptions:
    """How `validation_step` samples and scores held-out prompts."""

    val_max_tokens: int | None  #: tokens per validation turn; None: the data module's `max_completion_length`
    num_generations_eval: int  #: completions per held-out prompt (the k of `val/pass@k`)
    val_temperature: float  #: 0 for greedy; above 0, sampled at this temperature
    val_pass_threshold: float  #: a completion passes when its weighted reward is at least this


@dataclass(frozen=True, slots=True)
class ModuleOptions:
    """What `GRPOModule`'s helpers read of its options (the optimizer's and the clipping's go to
    `build_optimizers` and `clip_gradient_norm` as values)."""

    loss: LossOptions  #: the loss family's options, checked (TRL's deprecated cap read as its upper clip bound)
    num_iterations: int  #: optimizer steps on each planned step (GRPO's mu)
    reference: ReferenceSync  #: TR-DPO's reference mixing
    validation: ValidationOptions  #: held-out sampling and scoring
    scorer_weights: list[float] | None  #: one weight per trainer-scorer column; None: 1 each
    dtype: Literal["float32", "bfloat16"]  #: the policy's dtype when loaded by name
    packing: PackingMode  #: the forward: "tree", "padded", or "auto" (tree where it is exact)
    router_aux_loss_coef: float | None  #: the MoE load-balancing loss's weight; None: the model config's
    compile: CompileOptions  #: whether and how the policy's decoder layers are compiled for training

    @classmethod
    def from_hparams(cls, hparams: Mapping[str, Any], *, lora: bool) -> ModuleOptions:
        """The records of the module's hyper-parameters (its `__init__` arguments by name), the loss options checked.

        Raises:
            ValueError: an invalid loss option or combination, or `sync_ref_model` with LoRA (see
                `module_loss_options`); a `packing` other than 'auto', 'tree' or 'padded'; an unknown
                `torch_compile_backend` or `torch_compile_mode`.
        """
        if hparams["packing"] not in ("auto", "tree", "padded"):
            raise ValueError(f"`GRPOModule(packing={hparams['packing']!r})` must be 'auto', 'tree' or 'padded'.")
        reference = from_flat(ReferenceSync, hparams)
        loss = module_loss_options(
            from_flat(LossOptions, hparams),
            vllm_importance_sampling_cap=hparams["vllm_importance_sampling_cap"],
            num_iterations=hparams["num_iterations"],
            reference=reference,
            lora=lora,
        )
        return cls(
            loss=loss,
            num_iterations=hparams["num_iterations"],
            reference=reference,
            validation=from_flat(ValidationOptions, hparams),
            scorer_weights=hparams["scorer_weights"],
            dtype=hparams["dtype"],
            packing=hparams["packing"],
            router_aux_loss_coef=hparams["router_aux_loss_coef"],
            compile=CompileOptions.resolve(
                hparams["torch_compile"], hparams["torch_compile_backend"], hparams["torch_compile_mode"]
            ),
        )
