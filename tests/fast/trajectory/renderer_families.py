"""Offline tokenizers for the `renderers`-backed families.

Each family: the renderer name, the real public template (tests/fast/data/templates,
verbatim from llama.cpp's test set) and the special tokens the real tokenizer
declares (those the template names, plus the ones the renderer looks up).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent.parent / "data" / "templates"
_QWEN = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
         "</tool_call>", "<tool_response>", "</tool_response>")
_VISION = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
_GLM = ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
        "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>",
        "</arg_key>", "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>")
_DS = tuple(f"<\uff5c{n}\uff5c>" for n in (
    "begin\u2581of\u2581sentence", "end\u2581of\u2581sentence", "User", "Assistant",
    "tool\u2581calls\u2581begin", "tool\u2581calls\u2581end", "tool\u2581call\u2581begin",
    "tool\u2581call\u2581end", "tool\u2581sep", "tool\u2581outputs\u2581begin",
    "tool\u2581outputs\u2581end", "tool\u2581output\u2581begin", "tool\u2581output\u2581end",
)) + ("<think>", "</think>")
_KIMI = ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
         "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
         "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
         "<think>", "</think>")
_MINIMAX = ("]~!b[", "]~b]", "[e~[", "<think>", "</think>", "<minimax:tool_call>",
            "</minimax:tool_call>")
_GEMMA = ("<bos>", "<eos>", "<pad>", "<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>",
          "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>",
          "<|image|>", "<|audio|>", "<|video|>", '<|"|>', "<|image>", "<image|>", "<|audio>", "<audio|>")
_DS4 = _DS + tuple(f"<\uff5c{n}\uff5c>" for n in (
    "latest_reminder", "action", "authority", "domain", "query", "read_url", "title")) + ("\uff5cDSML\uff5c",)
_LLAMA = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
          "<|eot_id|>", "<|eom_id|>", "<|python_tag|>")


@dataclass(frozen=True)
class RendererFamily:
    name: str  # our id for the test (the model family)
    renderer: str  # the renderers registry name
    template: str  # file under TEMPLATES
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    reasoning: bool = True
    max_calls: int = 3


RENDERER_FAMILIES: tuple[RendererFamily, ...] = (
    RendererFamily("qwen3-r", "qwen3", "Qwen-Qwen3-0.6B.jinja", _QWEN, None, "<|im_end|>"),
    RendererFamily("qwen3.5", "qwen3.5", "Qwen3.5-4B.jinja", _QWEN + _VISION, None, "<|im_end|>"),
    RendererFamily("glm-4.6", "glm-4.5", "GLM-4.6.jinja", _GLM, None, "<|endoftext|>"),
    RendererFamily("glm-4.7", "glm-5", "GLM-4.7-Flash.jinja", _GLM, None, "<|endoftext|>"),
    RendererFamily("deepseek-v3.1", "deepseek-v3", "deepseek-ai-DeepSeek-V3.1.jinja", _DS,
                   _DS[0], _DS[1]),
    RendererFamily("deepseek-v3.2", "deepseek-v3", "deepseek-ai-DeepSeek-V3.2.jinja", _DS,
                   _DS[0], _DS[1]),
    RendererFamily("kimi-k2", "kimi-k2", "moonshotai-Kimi-K2.jinja", _KIMI, "[BOS]", "<|im_end|>",
                   reasoning=False),
    RendererFamily("kimi-k2-instruct", "kimi-k2", "Kimi-K2-Instruct.jinja", _KIMI, "[BOS]", "<|im_end|>",
                   reasoning=False),
    RendererFamily("kimi-k2-thinking", "kimi-k2", "Kimi-K2-Thinking.jinja", _KIMI, "[BOS]", "<|im_end|>"),
    RendererFamily("minimax-m2", "minimax-m2", "MiniMax-M2.jinja", _MINIMAX, "]~!b[", "[e~["),
    RendererFamily("nemotron-3-nano", "nemotron-3", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja",
                   _QWEN, None, "<|im_end|>"),
    RendererFamily("qwen3-coder", "qwen3.5", "Qwen3-Coder.jinja", _QWEN + _VISION, None, "<|im_end|>"),
    RendererFamily("deepseek-v4-flash", "deepseek-v4", "deepseek-ai-DeepSeek-V4-Flash-0731.jinja", _DS4,
                   _DS[0], _DS[1]),
    # K2-Instruct/K2-Thinking with the tool-call ids taken from the messages (tool_call['id'],
    # the result's tool_call_id), as the model repository's templates render them; the
    # llama.cpp copies above compute them with `list.append`, which transformers' sandbox
    # refuses (served by our KimiCodec, not by renderers)
    RendererFamily("kimi-k2-instruct-ids", "kimi-k2", "Kimi-K2-Instruct-ids.jinja", _KIMI, "[BOS]",
                   "<|im_end|>", reasoning=False),
    RendererFamily("kimi-k2-thinking-ids", "kimi-k2", "Kimi-K2-Thinking-ids.jinja", _KIMI, "[BOS]",
                   "<|im_end|>"),
    RendererFamily("llama-3.2", "llama-3", "meta-llama-Llama-3.2-3B-Instruct.jinja", _LLAMA,
                   "<|begin_of_text|>", "<|eot_id|>", reasoning=False, max_calls=1),
    # served by our Gemma4Codec (trajectory/codec/gemma4.py), not the renderer: see
    # test_renderers_codec.OURS
    RendererFamily("gemma-4", "gemma4", "google-gemma-4-31B-it.jinja", _GEMMA, "<bos>", "<eos>"),
)
BY_NAME = {f.name: f for f in RENDERER_FAMILIES}

_NAMED = re.compile(r"<\|[A-Za-z0-9_./:-]{1,48}\|>|<\uff5c[^\uff5c<>\s]{1,48}\uff5c>")


def template_text(family: RendererFamily) -> str:
    return (TEMPLATES / family.template).read_text(encoding="utf-8")


def special_tokens(family: RendererFamily) -> tuple[str, ...]:
    """The family's specials plus every `<|name|>` / `<｜name｜>` its template names."""
    named = tuple(sorted(set(_NAMED.findall(template_text(family)))))
    bos = (family.bos,) if family.bos else ()
    return tuple(dict.fromkeys(bos + (family.eos,) + family.specials + named))


def build(family: RendererFamily, out_dir: Path) -> Path:
    from session_server.sim.tokenizers import build_template_tokenizer

    return build_template_tokenizer(
        out_dir, template_text(family), special_tokens(family), bos=family.bos, eos=family.eos
    )

# gpt-oss: served by our harmony codec, not renderers (its renderer needs
# openai-harmony's vocabulary download and renders tool calls unlike the template), so it
# is kept out of RENDERER_FAMILIES; `build(GPT_OSS, dir)` gives the offline tokenizer.
_HARMONY = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
            "<|end|>", "<|message|>", "<|call|>", "<|endofprompt|>")
GPT_OSS = RendererFamily("gpt-oss", "gpt-oss", "openai-gpt-oss-120b.jinja", _HARMONY, "<|startoftext|>",
                         "<|return|>", max_calls=1)
