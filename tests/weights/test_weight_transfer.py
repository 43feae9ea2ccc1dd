"""Shared-memory weight sync: version semantics, errors naming the tensor, a spawned child, no leaks, crash safety."""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import inspect
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers.transfers import push
from transformers import DynamicCache

from lightning_grpo.models import tiny_llama
from lightning_grpo.rollout.generator import EmbeddedGenerator, GeneratorSpec, PolicySpec
from lightning_grpo.rollout.sampling import teacher_forced_logprobs
from lightning_grpo.weights.factory import make_weight_transfer
from lightning_grpo.weights.shared_memory import SharedMemoryWeightTransfer

PROMPTS = [[2, 40, 41, 42, 43, 44, 45], [2, 50, 51], [2, 60, 61, 62, 63, 64, 65, 66, 67]]
SHM_DIR = "/dev/shm"


def generate_all(generator, prompts=PROMPTS, **kwargs):
    async def run():
        return await asyncio.gather(*(generator.generate(p, **kwargs) for p in prompts))

    return asyncio.run(run())


def max_error(model, prompts, outputs) -> float:
    return max(
        (teacher_forced_logprobs(model, p, o.token_ids) - torch.tensor(o.logprobs)).abs().max().item()
        for p, o in zip(prompts, outputs, strict=True)
    )


@pytest.fixture
def generator(transfer):
    """A generator on seed-0 weights (version 0) that receives the transfer's syncs."""
    generator = EmbeddedGenerator(
        tiny_llama(seed=0), eos_token_ids=[], max_tokens=10, weight_receiver=transfer.receiver(), seed=0
    )
    yield generator
    generator.close()


def test_generations_switch_to_new_weights_and_version_only_after_resume(transfer, generator):
    old, new = tiny_llama(seed=0), tiny_llama(seed=1)
    transfer.pause()
    transfer.send_weights(new.named_parameters(), version=5)

    before = generate_all(generator)  # sent but not published: old weights, old version
    assert [o.model_version for o in before] == [0, 0, 0] and generator.applied_version == 0
    assert max_error(old, PROMPTS, before) <= 1e-4

    transfer.resume()
    after = generate_all(generator)
    assert [o.model_version for o in after] == [5, 5, 5] and generator.applied_version == 5
    assert max_error(new, PROMPTS, after) <= 1e-4
    assert transfer.version == 5 and generator.metrics()["generation/weight_syncs_total"] == 1


def switched_logprobs(old, new, prompt, ids, switch) -> torch.Tensor:
    """Logprobs of `ids` sampled by `old` up to token `switch` and by `new` from there, over the cache `old` computed.

    Token j's keys and values are computed at the step that samples token j + 1, so `old` computed the prompt and
    tokens 0 .. switch - 2, and `new` the rest.
    """
    seq = torch.tensor([list(prompt) + list(ids)])
    cut = len(prompt) + switch - 1
    cache_kwarg = "cache" if "cache" in inspect.signature(old.forward).parameters else "past_key_values"
    cache = DynamicCache(config=old.config)
    with torch.inference_mode():
        before = old(seq[:, :cut], use_cache=True, **{cache_kwarg: cache}).logits[0, len(prompt) - 1 :]
        after = new(seq[:, cut:-1], use_cache=True, **{cache_kwarg: cache}).logits[0]
    logprobs = torch.cat([before, after]).log_softmax(-1)
    return logprobs.gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)


@pytest.mark.timeout(60)
def test_sync_under_a_running_completion_applies_at_the_next_step_and_tags_it_with_the_oldest_version(transfer):
    """Weights swap between two decode steps, under running completions: their next tokens are sampled by the new
    weights (logprobs of exactly that distribution), and the output carries the oldest version that sampled it."""
    old, new = tiny_llama(seed=0), tiny_llama(seed=1)
    receiver = transfer.receiver()
    with EmbeddedGenerator(copy.deepcopy(old), eos_token_ids=[], max_tokens=400, weight_receiver=receiver) as gen:

        async def run():
            in_flight = asyncio.ensure_future(gen.generate(PROMPTS[0]))
            await asyncio.sleep(0.05)
            assert not in_flight.done(), "the generation ended before the sync; nothing was tested"
            await asyncio.to_thread(push, transfer, new, 1)
            return await in_flight, await gen.generate(PROMPTS[1], max_tokens=10)

        during, next_one = asyncio.run(run())
    switch = list(during.token_versions).index(1)
    assert 0 < switch < 400 and during.token_versions == (0,) * switch + (1,) * (400 - switch)
    assert during.model_version == 0  # the oldest weights that sampled it: staleness is never under-counted
    reference = switched_logprobs(old, new, PROMPTS[0], during.token_ids, switch)
    assert (reference - torch.tensor(during.logprobs)).abs().max() <= 1e-4
    assert max_error(old, PROMPTS[:1], [during]) > 1e-2  # the tokens after the switch are not the old model's
    assert next_one.model_version == 1 and set(next_one.token_versions) == {1}
    assert max_error(new, PROMPTS[1:2], [next_one]) <= 1e-4


def test_receiver_does_not_copy_while_the_trainer_writes(transfer):
    receiver = transfer.receiver()
    model = tiny_llama(seed=0)
    try:
        push(transfer, tiny_llama(seed=1), version=1)  # published, not applied yet
        transfer.pause()
        transfer.send_weights(tiny_llama(seed=2).named_parameters(), version=2)
        assert receiver.has_update() and receiver.poll(model) is None  # locked: nothing copied, model untouched
        torch.testing.assert_close(model.state_dict(), tiny_llama(seed=0).state_dict())
        transfer.resume()
        assert receiver.poll(model) == 2
        torch.testing.assert_close(model.state_dict(), tiny_llama(seed=2).state_dict())
    finally:
        receiver.close()


def test_dtypes_are_cast_on_both_sides(transfer):
    """The manifest is fp32: bf16 tensors are cast up on the send, and a bf16 generator model casts down on the copy."""
    source = tiny_llama(seed=1).to(torch.bfloat16)
    receiver = transfer.receiver()
    target = tiny_llama(seed=0).to(torch.bfloat16)
    try:
        push(transfer, source)
        assert receiver.poll(target) == 1
        torch.testing.assert_close(target.state_dict(), source.state_dict(), rtol=0, atol=0)
    finally:
        receiver.close()


def test_receiver_of_a_destroyed_transfer_says_so():
    transfer = SharedMemoryWeightTransfer(tiny_llama(seed=0))
    receiver = transfer.receiver()
    transfer.destroy()
    with pytest.raises(RuntimeError, match="cannot find shared-memory block .* was destroyed"):
        receiver.poll(tiny_llama(seed=0))


def test_transfer_refuses_to_be_pickled_and_names_the_receiver(transfer):
    with pytest.raises(TypeError, match=r"transfer.receiver\(\)"):
        pickle.dumps(transfer)


def test_default_version_is_the_previous_plus_one_and_may_not_go_down(transfer):
    model = tiny_llama(seed=0)
    push(transfer, model)
    push(transfer, model)
    assert transfer.version == 2
    push(transfer, model, version=7)
    with pytest.raises(ValueError, match=r"send_weights\(version=3\)`: version 7 is already published"):
        transfer.send_weights(model.named_parameters(), version=3)
    assert transfer.version == 7
    push(transfer, model)
    assert transfer.version == 8


def test_send_of_an_unknown_name_raises_naming_the_tensor(transfer):
    tensors = list(tiny_llama(seed=1).named_parameters()) + [("model.extra.weight", torch.zeros(2))]
    with pytest.raises(ValueError, match=r"got tensor 'model.extra.weight', which is not in its manifest"):
        transfer.send_weights(tensors)


def test_send_of_a_wrong_shape_raises_naming_the_tensor(transfer):
    tensors = dict(tiny_llama(seed=1).named_parameters())
    tensors["model.norm.weight"] = torch.ones(64)
    with pytest.raises(ValueError, match=r"'model.norm.weight' with shape \(64,\), but the manifest says \(128,\)"):
        transfer.send_weights(tensors.items())


def test_failed_send_is_never_published(transfer, generator, caplog):
    new = tiny_llama(seed=1)
    partial = list(new.named_parameters())[:3]
    with pytest.raises(ValueError, match=r"got no tensor for \['model.layers.0.self_attn.v_proj.weight'"):
        transfer.send_weights(partial)
    with caplog.at_level("WARNING"):
        transfer.resume()
    assert "after a failed send: nothing was published" in caplog.text
    assert transfer.version == 0 and not generator._receiver.has_update()
    outputs = generate_all(generator)
    assert {o.model_version for o in outputs} == {0}
    assert max_error(tiny_llama(seed=0), PROMPTS, outputs) <= 1e-4
    push(transfer, new)  # a complete send after the failure goes through
    assert max_error(new, PROMPTS, generate_all(generator)) <= 1e-4


def test_tied_lm_head_is_stored_once_and_skipped_when_sent(transfer, generator):
    model = tiny_llama(seed=1)
    unique_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert transfer.nbytes < unique_bytes + 64 * 64  # header + alignment, no second copy of the embeddings
    transfer.pause()
    transfer.send_weights(model.state_dict().items())  # includes lm_head.weight
    transfer.resume()
    assert max_error(model, PROMPTS, generate_all(generator)) <= 1e-4


def test_receiver_rejects_a_model_of_another_shape_naming_the_tensor(transfer):
    push(transfer, tiny_llama(seed=1))
    receiver = transfer.receiver()
    try:
        with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' has shape \(120, 128\).*\(100, 128\)"):
            receiver.poll(tiny_llama(seed=0, vocab_size=120))
    finally:
        receiver.close()


def test_receiver_pickles_small_and_works_after_the_round_trip(transfer):
    receiver = transfer.receiver()
    data = pickle.dumps(receiver)
    assert len(data) < 16_384
    copy_ = pickle.loads(data)
    model = tiny_llama(seed=0)
    push(transfer, tiny_llama(seed=1), version=4)
    try:
        assert copy_.poll(model) == 4 and copy_.poll(model) is None  # applied once
        torch.testing.assert_close(model.state_dict(), tiny_llama(seed=1).state_dict())
    finally:
        copy_.close()


def own_blocks() -> set[str]:
    """This process's blocks in /dev/shm (their names carry the pid; other test workers make their own)."""
    return {name for name in os.listdir(SHM_DIR) if name.startswith(f"lgrpo_{os.getpid()}_")}


@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm (Linux)")
def test_destroy_removes_the_shared_memory_and_lock_file():
    before = own_blocks()
    transfer = SharedMemoryWeightTransfer(tiny_llama(seed=0))
    assert own_blocks() - before == {transfer.block_name}
    with EmbeddedGenerator(
        PolicySpec.from_model(tiny_llama(seed=0)), max_tokens=3, weight_receiver=transfer.receiver()
    ) as generator:
        push(transfer, tiny_llama(seed=1))
        generate_all(generator)
    transfer.destroy()
    transfer.destroy()  # idempotent
    assert own_blocks() == before
    assert not os.path.exists(transfer.lock_path)
    with pytest.raises(RuntimeError, match=r"pause\(\)` called after `destroy"):
        transfer.pause()


def test_without_dev_shm_the_lock_is_a_temp_file_removed_on_destroy(monkeypatch, tmp_path):
    """macOS has no /dev/shm: the flock then lives on a small file in the temp folder."""
    import lightning_grpo.weights.shared_memory as weight_transfer

    monkeypatch.setattr(weight_transfer, "_SHM_DIR", str(tmp_path / "absent"))
    transfer = SharedMemoryWeightTransfer(tiny_llama(seed=0))
    receiver = transfer.receiver()
    assert transfer.lock_path.endswith(f"{transfer.block_name}.lock") and os.path.exists(transfer.lock_path)
    push(transfer, tiny_llama(seed=1))
    assert receiver.poll(tiny_llama(seed=0)) == 1
    receiver.close()
    transfer.destroy()
    assert not os.path.exists(transfer.lock_path)


@pytest.mark.timeout(60)
def test_pause_times_out_while_another_process_holds_the_lock_and_not_after_it_dies(no_leaked_processes):
    transfer = SharedMemoryWeightTransfer(tiny_llama(seed=0), lock_timeout_s=0.3)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, transfer.lock_path], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(TimeoutError, match="waited 0.3 s for the generator"):
            transfer.pause()
        holder.kill()  # the kernel releases an flock with its holder: a killed child never hangs the trainer
        holder.wait(10)
        transfer.pause()
        transfer.resume()
    finally:
        holder.kill()
        holder.wait(10)
        transfer.destroy()


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_SH)
print("locked", flush=True)
time.sleep(60)
"""

KILL_SELF = """
import os, signal, torch
from lightning_grpo.weights.shared_memory import SharedMemoryWeightTransfer
transfer = SharedMemoryWeightTransfer([("weight", torch.zeros(1000))])
print(transfer.block_name, transfer.lock_path, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(90)
@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm (Linux)")
def test_shared_memory_is_removed_after_the_trainer_is_sigkilled():
    trainer = subprocess.run([sys.executable, "-c", KILL_SELF], capture_output=True, text=True, timeout=60)
    assert trainer.returncode == -signal.SIGKILL, trainer.stderr
    block_name, lock_path = trainer.stdout.split()
    block = os.path.join(SHM_DIR, block_name)
    assert lock_path == block  # the lock is the block's own file: no separate file to leak
    deadline = time.monotonic() + 20
    while os.path.exists(block) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(block), "the resource tracker did not unlink the block"


def _serve_in_child(spec: GeneratorSpec, requests, results) -> None:
    """Rollout-child stand-in: build the generator from its spec, generate on request, report ids/logprobs/version."""
    with spec.build() as generator:
        while requests.get(timeout=60) is not None:
            outputs = generate_all(generator)
            results.put([(o.token_ids, o.logprobs, o.model_version) for o in outputs])


@pytest.mark.timeout(120)
def test_spawned_child_generates_with_the_weights_the_parent_pushes(no_leaked_processes):
    ctx = mp.get_context("spawn")
    transfer = SharedMemoryWeightTransfer(tiny_llama(seed=0))
    spec = GeneratorSpec(
        PolicySpec.from_model(tiny_llama(seed=0)), eos_token_ids=(), max_tokens=8, weight_receiver=transfer.receiver()
    )
    requests, results = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_serve_in_child, args=(spec, requests, results), daemon=True)
    child.start()
    try:
        requests.put("go")  # the child has no weights yet: it waits for the first sync
        for version, seed in [(1, 1), (2, 2)]:
            policy = tiny_llama(seed=seed)
            push(transfer, policy, version=version)
            if version == 2:
                requests.put("go")
            got = results.get(timeout=60)
            assert [v for _, _, v in got] == [version] * len(PROMPTS)
            for prompt, (ids, logprobs, _) in zip(PROMPTS, got, strict=True):
                reference = teacher_forced_logprobs(policy, prompt, ids)
                assert (reference - torch.tensor(logprobs)).abs().max().item() <= 1e-4
        requests.put(None)
        child.join(30)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)
        transfer.destroy()


def test_make_weight_transfer_picks_the_backend():
    model = tiny_llama(seed=0)
    transfer = make_weight_transfer("embedded", model)
    try:
        assert isinstance(transfer, SharedMemoryWeightTransfer)
    finally:
        transfer.destroy()
    with pytest.raises(ValueError, match=r"generator='sglang'"):
        make_weight_transfer("sglang", model)


def test_vllm_weight_transfer_is_trls_nccl_client_which_needs_vllm():
    """The NCCL path needs vllm and a GPU, so it cannot run here; this checks it reaches TRL's client."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed: the client would be built and would look for a server")
    with pytest.raises(ImportError, match="vLLM is required to use WeightTransferClient"):
        make_weight_transfer("vllm", tiny_llama(seed=0), vllm_transfer="nccl")


def test_a_packed_lm_head_follows_each_sync():
    """A vocabulary-sized LM head runs on pre-packed weights; a sync re-packs it, so logprobs follow the new head."""
    from lightning_grpo.models.packed_matmul import packing_available

    old, new = tiny_llama(seed=0, vocab_size=1 << 15), tiny_llama(seed=1, vocab_size=1 << 15)
    transfer = SharedMemoryWeightTransfer(old)
    try:
        with EmbeddedGenerator(
            copy.deepcopy(old), eos_token_ids=[], max_tokens=8, weight_receiver=transfer.receiver(), seed=0
        ) as generator:
            assert generator._batch._decoder._head._product is not None or not packing_available(torch.float32)
            before = generate_all(generator)
            push(transfer, new, version=1)
            after = generate_all(generator)
    finally:
        transfer.destroy()
    assert max_error(old, PROMPTS, before) <= 1e-4
    assert {o.model_version for o in after} == {1} and max_error(new, PROMPTS, after) <= 1e-4


def test_a_bf16_generator_runs_every_layer_packed_and_follows_each_sync():
    """In bf16 every linear layer runs on weights laid out once (AMX tiles, else oneDNN's packing, where this CPU has
    its bf16 kernels); a sync lays them all out again, so the logprobs follow the new weights, within bf16's resolution of a teacher-forced bf16
    forward (batched and whole-sequence products round differently)."""
    from lightning_grpo.models.packed_matmul import packing_available

    if not packing_available(torch.bfloat16):
        pytest.skip("oneDNN has no bf16 kernels on this CPU: bf16 layers run unpacked")
    old, new = tiny_llama(seed=0), tiny_llama(seed=1)
    transfer = SharedMemoryWeightTransfer(old)
    try:
        with EmbeddedGenerator(
            copy.deepcopy(old).to(torch.bfloat16), eos_token_ids=[], max_tokens=8, weight_receiver=transfer.receiver()
        ) as generator:
            decoder = generator._batch._decoder
            products = [linear._product for layer in decoder._layers for linear in layer.linears]
            assert all(product is not None for product in [*products, decoder._head._product])
            before = generate_all(generator)
            push(transfer, new, version=1)
            after = generate_all(generator)
    finally:
        transfer.destroy()
    old_bf16, new_bf16 = copy.deepcopy(old).to(torch.bfloat16), copy.deepcopy(new).to(torch.bfloat16)
    assert max_error(old_bf16, PROMPTS, before) <= 2e-2
    assert {o.model_version for o in after} == {1} and max_error(new_bf16, PROMPTS, after) <= 2e-2
    assert max_error(old_bf16, PROMPTS, after) > 0.1  # the new weights, not the old ones, sampled them
