"""Weight transfers for tests: a strict recording one (TRL's WeightTransferProtocol), and a push as the data module does it."""

from __future__ import annotations

import torch


class RecordingTransfer:
    """TRL's WeightTransferProtocol, strictly: records every call and every streamed tensor."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.calls: list[tuple] = []
        self.sent: list[dict[str, torch.Tensor]] = []
        self.sent_versions: list[int | None] = []
        self.initialised = False
        self.paused = False
        self.fail_after = fail_after

    def init_weight_transfer(self) -> None:
        self.calls.append(("init",))
        self.initialised = True

    def pause(self) -> None:
        self.calls.append(("pause",))
        self.paused = True

    def send_weights(self, iterator) -> None:
        if not self.initialised:
            raise RuntimeError("send_weights before init_weight_transfer: TRL's NCCL client would send nothing")
        if not self.paused:
            raise RuntimeError("send_weights while the generator is not paused")
        self.calls.append(("send",))
        sent = {}
        for i, (name, tensor) in enumerate(iterator):
            if self.fail_after is not None and i == self.fail_after:
                raise OSError("the server went away mid-send")
            sent[name] = tensor.clone()
        self.sent.append(sent)
        self.sent_versions.append(None)

    def resume(self) -> None:
        self.calls.append(("resume",))
        self.paused = False

    def destroy(self) -> None:
        self.calls.append(("destroy",))


def push(transfer, model: torch.nn.Module, version: int | None = None) -> None:
    """What `WeightSync.push` does with one transfer: pause the generator, stream the weights, resume it."""
    transfer.pause()
    try:
        transfer.send_weights(model.named_parameters(), version=version)
    finally:
        transfer.resume()
