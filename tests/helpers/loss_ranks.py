"""One optimizer step's gradient of the GRPO loss, on one process or on one gloo rank of several: what
`tests/test_loss_ranks.py` compares. Each rank runs `micro_batch_loss` and a backward per micro-batch, then averages
the gradients over ranks as DDP does (an all-reduce of the sum, divided by the world size)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_grpo.models import tiny_llama
from lightning_grpo.training.loss import LossContext, micro_batch_loss, packed_logprobs
from lightning_grpo.training.loss_options import LossOptions


def step_gradient(micro_batches: list[dict], options: LossOptions, world_size: int = 1) -> dict[str, torch.Tensor]:
    """`{"loss": the step's loss, <parameter name>: its gradient}` of the tiny policy (seed 0) on this rank's
    micro-batches, averaged over ranks; the reference (with `beta > 0`) is the tiny model of seed 1."""
    policy = tiny_llama(0)
    reference = tiny_llama(1) if options.beta else None
    context = LossContext(max_completion_length=8, world_size=world_size, num_micro_batches=len(micro_batches))
    total = torch.zeros(())
    for micro_batch in micro_batches:
        micro_batch = dict(micro_batch)
        if reference is not None:
            with torch.no_grad():
                micro_batch["ref_log_probs"] = packed_logprobs(reference, micro_batch)[0]
        loss, _, _ = micro_batch_loss(policy, micro_batch, options, context)
        loss.backward()
        total += loss.detach()
    out = {"loss": total / world_size}
    out.update({name: param.grad.clone() for name, param in policy.named_parameters()})
    if world_size > 1:
        for value in out.values():
            dist.all_reduce(value)
        out = {name: value if name == "loss" else value / world_size for name, value in out.items()}
    return out


def run_loss_rank(rank: int, world_size: int, workdir: str) -> None:
    """One gloo rank: reads `cases.pkl` (per case, the options and every rank's micro-batches) from `workdir` and
    pickles each case's `step_gradient` to `rank{rank}.pkl`."""
    import pickle
    from datetime import timedelta

    torch.set_num_threads(1)
    with open(f"{workdir}/cases.pkl", "rb") as f:
        cases = pickle.load(f)
    dist.init_process_group(
        "gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        results = [step_gradient(per_rank[rank], options, world_size) for options, per_rank in cases]
        with open(f"{workdir}/rank{rank}.pkl", "wb") as f:
            pickle.dump(results, f)
    finally:
        dist.destroy_process_group()
