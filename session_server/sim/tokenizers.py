"""Offline tokenizers for tests and the simulator: one per chat-template family.

Owns building small, deterministic byte-level BPE tokenizers that declare the
same special tokens as the real model families and carry the family's real chat
template (packaged with the codec under ``trajectory/codec/templates``). Which
families have one, and their tokens, live in the family registry
(``trajectory/codec/families.py``, each row's ``sim``). Nothing is downloaded: the BPE is
trained in-process on a built-in corpus, wrapped in a transformers fast
tokenizer and saved, so callers load it back with the real path
``AutoTokenizer.from_pretrained(str(path))``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from trajectory.codec.families import QWEN_SPLIT, SimTokenizer, ours, sim_families

# the families with a simulator tokenizer (the family registry's `sim` rows)
FAMILIES: tuple[str, ...] = sim_families()

_VOCAB_SIZE = 3000
_BUILD_VERSION = "1"  # bump when the corpus or the recipe changes (cache key)


@dataclass(frozen=True)
class _FamilySpec(SimTokenizer):
    """What one build needs: the registry's tokenizer data and the template file it carries."""

    template_file: str = ""


def family_spec_tokens(family: str) -> tuple[str, ...]:
    """The special tokens a family's offline tokenizer declares."""
    return _spec(family).special_tokens


def chat_template_text(family: str) -> str:
    """The family's packaged (verbatim, public) chat template."""
    name = _spec(family).template_file
    return (
        resources.files("trajectory.codec")
        .joinpath("templates", name)
        .read_text(encoding="utf-8")
    )


def _spec(family: str) -> _FamilySpec:
    spec = ours(family)
    if spec is None or spec.sim is None or spec.template_file is None:
        raise ValueError(f"unknown tokenizer family {family!r}; expected one of {FAMILIES}")
    sim: SimTokenizer = spec.sim
    return _FamilySpec(sim.special_tokens, sim.bos, sim.eos, sim.pad, sim.prepend_bos, sim.split_pattern,
                       template_file=spec.template_file)


def _corpus() -> list[str]:
    """A fixed English + code + JSON corpus: covers what the tests and simulator emit."""
    english = [
        "The quick brown fox jumps over the lazy dog.",
        "You are a helpful assistant. Answer the user's question as well as you can.",
        "What is the weather like in Paris today? It is sunny and warm, about 24 degrees.",
        "Please search the web for the latest news about the stock market and summarise it.",
        "I will call the tool to look that up for you. Let me think about this step by step.",
        "Sure! Here is the answer: the result of the calculation is forty-two.",
        "Hello, how are you? I am fine, thank you. Good morning and good night.",
        "The function returned an error. Let me try again with different arguments.",
        "First, read the file. Then, write the output to a new file and run the tests.",
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n",
        "Environment: ipython\nYou have access to the following functions.",
        "Given the following functions, please respond with a JSON for a function call "
        "with its proper arguments that best answers the given prompt.",
        "# Tools\n\nYou may call one or more functions to assist with the user query.",
        "You are provided with function signatures within <tools></tools> XML tags:",
        "For each function call, return a json object with function name and arguments",
        "user assistant system tool ipython observation reasoning content thinking",
    ]
    code = [
        "def add(a: int, b: int) -> int:\n    return a + b\n",
        "for i in range(10):\n    print(i * i)\n",
        "import json\nimport os\n\nclass Foo:\n    def __init__(self):\n        self.x = None\n",
        "if x is not None and y == 3:\n\treturn {'a': [1, 2, 3]}\nelse:\n\traise ValueError('bad')\n",
        "const f = (x) => { return x.map((y) => y + 1); };\n",
        "SELECT name, count(*) FROM users WHERE id > 100 GROUP BY name;\n",
        "$ ls -la /tmp && cat README.md | grep -n 'error'\n",
    ]
    jsons = [
        json.dumps({"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}),
        json.dumps({"name": "search", "parameters": {"query": "news", "limit": 5}}),
        json.dumps({"name": "calculator", "arguments": {"expression": "2 + 2", "exact": True}}),
        json.dumps({"output": "sunny, 24C", "ok": True, "error": None, "items": [1, 2.5, -3]}),
        json.dumps(
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Get the current weather for a city",
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "description": "City name"}},
                        "required": ["city"],
                    },
                },
            },
            indent=4,
        ),
        '{"a": true, "b": false, "c": null, "d": 0, "e": [], "f": {}}',
        '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>',
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
        '<tool_response>\n{"temperature": 21}\n</tool_response>',
    ]
    digits = [" ".join(str(i) for i in range(0, 200)), "3.14159 2.71828 1e-5 -42 0x1F 100%"]
    spacing = ["\n\n", "\n", "  ", "    ", "\t", " \n ", "\r\n", "a  b   c    d", "x\n\ny\n\n\nz"]
    return (english + code + jsons + digits + spacing) * 3 + _generated_sentences()


_WORDS = (
    "the of and to in is that for it as with was on be by this are at from or have an "
    "they which one you were all we can her has there been if more when will would who "
    "so no about out up into just what could time only new some them other than then "
    "these now like over also after use two how our work first well way even because "
    "any day most us through good people year make think get see know take come give "
    "find tell ask call try need feel leave put mean keep let begin seem help show hear "
    "play run move live believe hold bring happen write provide sit stand lose pay meet "
    "include continue set learn change lead understand watch follow stop create speak "
    "read allow add spend grow open walk win offer remember love consider appear buy "
    "wait serve die send expect build stay fall cut reach kill remain suggest raise pass "
    "sell require report decide pull city weather temperature search query result file "
    "path directory error value number string list object array boolean function tool "
    "argument parameter response request message model server session token prompt "
    "answer question problem solution code test data python json http user assistant"
).split()


_SUFFIXES = ("", "", "", "s", "ed", "ing", "er", "ly", "_id", "Name", "()", ":")


def _generated_sentences() -> list[str]:
    """Deterministic filler text (fixed seed) so BPE learns a few thousand merges."""
    import random

    rng = random.Random(20240726)
    out = []
    for _ in range(3000):
        n = rng.randint(4, 14)
        words = [rng.choice(_WORDS) + rng.choice(_SUFFIXES) for _ in range(n)]
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        if rng.random() < 0.2:
            words.append(str(rng.randint(0, 99999)))
        sep = rng.choice([". ", ", ", "\n", "? ", "! "])
        out.append(" ".join(words) + sep)
    return out


def _build_backend(spec: _FamilySpec):  # -> tokenizers.Tokenizer
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    # The real Llama 3 / Qwen2 split pattern (newline runs are one piece, so a prompt
    # ending in "\n\n" tokenizes the same alone as in front of the reply), then bytes.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(spec.split_pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in spec.special_tokens]
    )
    if spec.prepend_bos and spec.bos is not None:
        bos_id = tok.token_to_id(spec.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos} $A",
            pair=f"{spec.bos} $A {spec.bos} $B",
            special_tokens=[(spec.bos, bos_id)],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def build_tokenizer(family: str, out_dir: Path) -> Path:
    """Train the family's tokenizer, attach its chat template and save it to `out_dir`."""
    return _save(_spec(family), chat_template_text(family), Path(out_dir))


def build_template_tokenizer(
    out_dir: Path,
    template: str,
    special_tokens: tuple[str, ...],
    *,
    bos: str | None = None,
    eos: str,
    pad: str | None = None,
) -> Path:
    """An offline tokenizer for any template: the given special tokens (BOS/EOS
    included) on the shared BPE, carrying `template` verbatim."""
    spec = _FamilySpec(tuple(dict.fromkeys(special_tokens)), bos, eos, pad or eos, False, QWEN_SPLIT)
    return _save(spec, template, Path(out_dir))


def _save(spec: _FamilySpec, template: str, out_dir: Path) -> Path:
    from transformers import PreTrainedTokenizerFast

    backend = _build_backend(spec)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=spec.bos,
        eos_token=spec.eos,
        pad_token=spec.pad,
        clean_up_tokenization_spaces=False,
        model_max_length=131072,
    )
    fast.chat_template = template
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return out_dir


def _default_cache_root() -> Path:
    env = os.environ.get("TITO_CACHE_DIR")
    if env:
        return Path(env) / "tokenizers"
    return Path.home() / ".cache" / "tito-session-server" / "tokenizers"


def cached_tokenizer_dir(family: str, cache_root: Path | None = None) -> Path:
    """Build the family's tokenizer once (atomically) and return its directory."""
    _spec(family)
    root = Path(cache_root) if cache_root is not None else _default_cache_root()
    final = root / f"v{_BUILD_VERSION}" / family
    if (final / "tokenizer.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{family}-", dir=final.parent))
    try:
        build_tokenizer(family, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process won the race; its complete build is as good as ours.
            if not (final / "tokenizer.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
