"""Weight pushes to several vLLM servers: every push reaches every live server before the version is published.

`GRPODataModule(generator="vllm", vllm_server_url=[...])` pushes through a `VLLMFanOutWeightTransfer`: one transfer
per server (merged weights over HTTP, or the LoRA adapter), each step of TRL's protocol run on all servers at once
(pause all, send to all, resume all). `WeightSync` publishes the new version only after `resume()` returned, so no
server's sample is tagged with a version before every live server holds its weights. A server that fails a step
fails the push with an error naming its URL; with failover it is marked lost in shared flags the rollout child reads
(it sends that server nothing more, and requests in flight there again to a live server) and the push goes on with
the others. TRL's NCCL client is not fanned out: each server would need its own NCCL group; start one vLLM server with
data parallelism (`--data-parallel-size N`) and pass its one URL instead.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

log = logging.getLogger(__name__)


class VLLMFanOutWeightTransfer:
    """TRL's `WeightTransferProtocol` over several vLLM servers, one transfer each; only rank 0 uses it.

    Each push writes the weights once per server (a folder each under `/dev/shm`, removed at the next push), so a
    push holds the model in RAM once per server for a moment.

    Args:
        transfers: one `VLLMHTTPWeightTransfer` (or `VLLMLoRAWeightTransfer`, all with one `lora_name`) per server.
        failover: go on with the other servers when one fails a step (it is marked lost) instead of raising.
        lost: shared flags, one byte per server, set for each lost server (the rollout child reads them, and sets
            them for the servers it loses); default new ones.

    Raises:
        RuntimeError: (from the protocol's methods) a server failed a step without failover, or no server is left;
            the message names each URL.
    """

    def __init__(self, transfers: Sequence[Any], *, failover: bool = False, lost: Any = None) -> None:
        if len(transfers) < 2:
            raise ValueError(f"`VLLMFanOutWeightTransfer` takes two transfers or more, got {len(transfers)}.")
        self.transfers = list(transfers)
        self.urls = [transfer.server_url for transfer in self.transfers]
        self.failover = failover
        if lost is None:
            from ..rollout.start_method import rollout_context

            lost = rollout_context().Array("b", len(self.transfers))  # locked: it travels as a process argument
        self.lost = lost
        self.version: int | None = None
        self._abandoned: set[int] = set()

    @property
    def live(self) -> list[int]:
        """The servers not lost, in order."""
        return [i for i in range(len(self.transfers)) if not self.lost[i]]

    @property
    def lora_name(self) -> str | None:
        """The served adapter names' prefix (adapter-only pushes), the same on every server; else None."""
        return getattr(self.transfers[0], "lora_name", None)

    def served_name(self, version: int) -> str:
        """The model name requests send for the adapter of `version` (adapter-only pushes)."""
        return self.transfers[0].served_name(version)

    # -- protocol --------------------------------------------------------------------------------------------------

    def init_weight_transfer(self) -> None:
        self._each("could not be set up for weight pushes", lambda transfer: transfer.init_weight_transfer())

    def pause(self) -> None:
        self._each("could not be paused for a weight push", lambda transfer: transfer.pause())

    def send_weights(
        self, iterator: Iterable[tuple[str, torch.Tensor]], version: int | None = None, *, partial: bool = False
    ) -> None:
        """Send the same `(name, tensor)` pairs to every live server (see `VLLMHTTPWeightTransfer.send_weights`)."""
        tensors = list(iterator)
        options = {"partial": True} if partial else {}  # an adapter transfer takes no `partial`
        self._each(
            "did not take the weight push", lambda transfer: transfer.send_weights(iter(tensors), version, **options)
        )
        self.version = version

    def resume(self) -> None:
        self._each("could not be resumed after a weight push", lambda transfer: transfer.resume())

    def destroy(self) -> None:
        """Release every server's transfer; a lost server is not contacted (its folders are removed); idempotent."""
        for index, transfer in enumerate(self.transfers):
            if self.lost[index]:
                self._abandon(index)
                continue
            try:
                transfer.destroy()
            except Exception as error:  # one server's failure must not keep the others' folders
                log.warning("releasing the weight transfer to %s failed: %s", self.urls[index], error)

    # -- helpers ---------------------------------------------------------------------------------------------------

    def _each(self, failed: str, step: Callable[[Any], None]) -> None:
        """Run `step` on every live server's transfer at once; lose (or raise for) each that fails."""
        live = self.live
        if not live:
            raise RuntimeError(self._none_left())
        with ThreadPoolExecutor(len(live), thread_name_prefix="grpo-vllm-push") as pool:
            futures = {index: pool.submit(step, self.transfers[index]) for index in live}
        errors = {index: future.exception() for index, future in futures.items() if future.exception() is not None}
        if not errors:
            return
        whys = " ".join(f"The vLLM server at {self.urls[i]} {failed}: {error}" for i, error in errors.items())
        if not self.failover:
            raise RuntimeError(f"{whys} (GRPODataModule(vllm_failover=True) would go on with the other servers.)")
        for index in errors:
            self.lost[index] = 1  # before the version is published: the child sends this server nothing newer
            self._abandon(index)
        if not self.live:
            raise RuntimeError(f"{whys} {self._none_left()}")
        log.error("%s Failover: going on with %d other vLLM server(s).", whys, len(self.live))

    def _abandon(self, index: int) -> None:
        if index not in self._abandoned:
            self._abandoned.add(index)
            self.transfers[index].abandon()

    def _none_left(self) -> str:
        return f"Every vLLM server is lost ({', '.join(self.urls)}): no server is left to generate on."

    def __getstate__(self) -> None:
        raise TypeError("A `VLLMFanOutWeightTransfer` stays in the trainer process (rank 0); it cannot be pickled.")


def fan_out(
    kind: str,
    urls: Sequence[str],
    model: torch.nn.Module,
    *,
    server_timeout: float,
    request_timeout: float,
    max_staleness: int,
    failover: bool,
) -> VLLMFanOutWeightTransfer:
    """One transfer of `kind` (`"http"` or `"vllm_lora"`) per server in `urls`, fanned out.

    Raises:
        ValueError: `kind` is `"nccl"` (say why and what to do instead).
    """
    if kind == "http":
        from .vllm_http import VLLMHTTPWeightTransfer

        transfers = [
            VLLMHTTPWeightTransfer(url, model=model, server_timeout=server_timeout, request_timeout=request_timeout)
            for url in urls
        ]
    elif kind == "vllm_lora":
        from .vllm_lora import VLLMLoRAWeightTransfer

        name = f"lgrpo-lora-{os.getpid()}-{secrets.token_hex(3)}"  # one name: the loop requests it on every server
        transfers = [
            VLLMLoRAWeightTransfer(
                url,
                model=model,
                max_staleness=max_staleness,
                lora_name=name,
                server_timeout=server_timeout,
                request_timeout=request_timeout,
            )
            for url in urls
        ]
    else:
        raise ValueError(
            f"`vllm_server_url` lists {len(urls)} servers, but weights reach vLLM over NCCL ({kind!r}), which TRL's "
            "client sets up for one server: start one vLLM server with data parallelism (`--data-parallel-size N`) "
            "and pass its one URL, or push over HTTP with vllm_transfer='http'."
        )
    return VLLMFanOutWeightTransfer(transfers, failover=failover)
