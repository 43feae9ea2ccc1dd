"""A GGUF file converted once to a Hugging Face folder (fp32 safetensors, config, tokenizer), written atomically.

transformers' GGUF loader (`from_pretrained(..., gguf_file=...)`) dequantizes every tensor to fp32 with the `gguf`
package's `dequantize` and maps the names to the transformers architecture; the model it returns cannot be saved as
is (its config claims GGUF quantization), so its weights are copied into a clean model of the same class and saved
with the tokenizer. Later loads read the safetensors in well under a second. SmolLM2 (`smollm2.py`) and Gemma 3
(`gemma3.py`) both convert through `convert_gguf`.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def convert_gguf(gguf: Path, target: Path, *, finish: Callable[[Any, Any], None] | None = None) -> None:
    """Write the model and tokenizer of the GGUF file `gguf` to the folder `target` as fp32 safetensors.

    The folder is written next to `target` and renamed into place, so an interrupted conversion never leaves a
    half-written cache; an existing `target` is replaced. `finish(model, tokenizer)` may adjust both before they are
    saved (a generation config the GGUF does not carry).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config.to_dict()
    config.pop("quantization_config", None)  # save_pretrained refuses a model that claims GGUF quantization
    model_type = config.pop("model_type")
    model = type(quantized)(AutoConfig.for_model(model_type, **config))
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    del quantized
    if finish is not None:
        finish(model, tokenizer)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def is_converted(folder: Path) -> bool:
    """Whether `folder` holds a finished conversion (its weights and its tokenizer)."""
    return (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """While converting, one `gguf.GGUFReader` per file and one tensor-name map per architecture.

    transformers parses the file's metadata (for SmolLM2, 49k vocabulary entries and their merges; for Gemma 3, 262k)
    once for the tokenizer, once for the config and once for the weights, and builds gguf's tensor-name map anew for
    every module of the model; both are pure functions of their arguments, and together they are most of a
    conversion's time. transformers imports both names from `gguf` when it calls them, so replacing them on the
    module reaches it.
    """
    import gguf

    make_reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple, object] = {}

    def shared_reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = make_reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, name_map
