"""`lightning-grpo export`: a checkpoint's trained policy as a Hugging Face folder, a LoRA adapter alone or merged.

    lightning-grpo export runs/lora/version_0/checkpoints/last.ckpt exported/            # the adapter (PEFT)
    lightning-grpo export runs/lora/version_0/checkpoints/last.ckpt exported/ --merged   # a plain transformers model

A `GRPOModule` checkpoint records its policy (`policy.CHECKPOINT_KEY`: the model name, the dtype, the LoRA config),
so the policy is rebuilt from its base model and the checkpoint's weights: for LoRA, the adapters the checkpoint
holds on the base weights it does not hold. The folder also gets the tokenizer. The adapter folder loads with
`PeftModel.from_pretrained(base, folder)` (`base_model_name_or_path` names the base model's folder); the merged one,
and a full fine-tuning checkpoint's, with `AutoModelForCausalLM.from_pretrained(folder)`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..training.policy import CHECKPOINT_KEY, apply_peft, missing_trainable_keys, peft_config_from_dict
from .parsing import SuggestingParser

_PREFIX = "policy."


def export_policy(
    checkpoint: str | Path, output: str | Path, *, merged: bool = False, model: str | None = None
) -> Path:
    """Write the policy trained in `checkpoint` (a single-file `.ckpt` of a `GRPOModule` fit) to folder `output`.

    Args:
        checkpoint: the `.ckpt` file (a distributed checkpoint folder must be consolidated first, with
            `python -m lightning.pytorch.utilities.consolidate_checkpoint <folder>`).
        output: the folder to write (created; files in it are overwritten).
        merged: for a LoRA checkpoint, merge the adapters into the base weights and write a plain transformers
            model; otherwise write the adapter alone. A full fine-tuning checkpoint is always written whole.
        model: the base policy's `load_policy` name or path, when the checkpoint does not record one (a policy that
            was passed to `GRPOModule` as a module).

    Returns:
        The output folder.

    Raises:
        FileNotFoundError: no checkpoint file at `checkpoint`.
        ValueError: the checkpoint names no policy and `model` is not given, or lacks the adapters its config needs.

    Example::

        from transformers import AutoModelForCausalLM

        from lightning_grpo import export_policy

        folder = export_policy("checkpoints/last.ckpt", "exported", merged=True)
        policy = AutoModelForCausalLM.from_pretrained(folder)
    """
    from ..models.loading import _resolve_path, load_policy, load_tokenizer

    state = _read_checkpoint(Path(checkpoint))
    record = state.get(CHECKPOINT_KEY) or {}
    name = model or record.get("model")
    if name is None:
        raise ValueError(
            f"The checkpoint {checkpoint} does not name its policy (it was passed to GRPOModule as a module): pass "
            "`model=` (`--model NAME` on the command line), the base model's load_policy name or folder."
        )
    policy = load_policy(name, dtype=getattr(torch, record.get("dtype") or "float32"))
    weights = {
        key.removeprefix(_PREFIX): value for key, value in state["state_dict"].items() if key.startswith(_PREFIX)
    }
    if record.get("peft_config"):
        config = peft_config_from_dict(record["peft_config"])
        config.base_model_name_or_path = str(_resolve_path(name))
        policy = apply_peft(policy, config, policy_name=f"the policy {name!r}")
        missing = missing_trainable_keys(weights, policy, prefix="")
        if missing:
            raise ValueError(f"The checkpoint {checkpoint} lacks the adapter tensors {missing[:3]} ({len(missing)}).")
        policy.load_state_dict(weights, strict=False)  # the adapters; the base weights come from `name`
        if merged:
            policy = policy.merge_and_unload()
    else:
        policy.load_state_dict(weights)
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(output)
    load_tokenizer(name).save_pretrained(output)
    return output


def _read_checkpoint(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise ValueError(
            f"{path} is a distributed checkpoint (a folder). Consolidate it into one file first: "
            f"`python -m lightning.pytorch.utilities.consolidate_checkpoint {path}`."
        )
    if not path.is_file():
        raise FileNotFoundError(f"No checkpoint at {path}.")
    return torch.load(path, map_location="cpu", weights_only=True)


def main(argv: Sequence[str] | None = None) -> int:
    """`lightning-grpo export CHECKPOINT OUTPUT [--merged] [--model NAME]`."""
    parser = SuggestingParser(
        prog="lightning-grpo export",
        description="Write a GRPOModule checkpoint's trained policy as a Hugging Face folder (a LoRA adapter, or "
        "with --merged a plain transformers model).",
    )
    parser.add_argument("checkpoint", help="a .ckpt file written during `lightning-grpo fit`")
    parser.add_argument("output", help="the folder to write")
    parser.add_argument("--merged", action="store_true", help="merge LoRA adapters into the base weights")
    parser.add_argument("--model", default=None, help="the base policy, if the checkpoint does not name it")
    args = parser.parse_args(argv)
    try:
        folder = export_policy(args.checkpoint, args.output, merged=args.merged, model=args.model)
    except (ValueError, FileNotFoundError) as error:
        parser.exit(2, f"lightning-grpo export: error: {error}\n")
    print(f"Exported the policy to {folder}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
