"""Per-turn TITO cost against context length: it must track the new tokens only.

For contexts of 1K, 10K and 100K tokens (a long first user message), run at
least 50 further turns; each turn is the server's CPU work on the trajectory:
attach the request to the session's tree (`trajectory.history.attach`, the
server's matching), bridge the new tool message (`codec.bridge`), close the
sampled turn (`codec.close_turn`) and commit it (`TrajectoryTree.commit_turn`).
Reports the p50 per context length, the 100K/1K ratio (target <= 1.5), and the
bytes per stored token of the 100K trajectory (target <= 12).

    python bench/codec_overhead.py --json bench/results/codec_overhead.json
    python bench/codec_overhead.py --family all --json bench/results/codec_overhead_families.json

`--family` is one of our hand-written families (qwen3, llama3, llama3.1, glm4moe:
offline tokenizers with the real templates), a `renderers`-backed family of
`tests/fast/trajectory/renderer_families.py` (e.g. qwen3.5, glm-4.7; gemma-4
runs our Gemma4Codec, which serves it), or
`all` (every one of both; a family whose codec cannot run the turn is reported
with its error).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from session_server.sim.tokenizers import FAMILIES, cached_tokenizer_dir  # noqa: E402
from trajectory.codec import load_codec  # noqa: E402
from trajectory.errors import TemplateNotSupported  # noqa: E402
from trajectory.history import attach  # noqa: E402
from trajectory.linear import LinearTrajectory  # noqa: E402
from trajectory.tree import TrajectoryTree  # noqa: E402

CONTEXTS = (1000, 10000, 100000)
# renderer_families entries one of our codecs serves (its family name)
SERVED_BY_OURS = {"gemma-4": "gemma4"}


def _long_text(tokenizer: Any, n_tokens: int) -> str:
    """Text of about `n_tokens` tokens (the bulk of the context)."""
    words = ("alpha", "beta", "gamma", "delta", "config", "value", "result", "path", "error", "check")
    text = " ".join(words[i % len(words)] + str(i % 97) for i in range(n_tokens))
    ids = tokenizer.encode(text, add_special_tokens=False)[:n_tokens]
    return str(tokenizer.decode(ids))


def _turn_message(i: int) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "reasoning_content": f"step {i}: look at the next file",
        "tool_calls": [{
            "id": f"call_{i:08x}",
            "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/m{i}.py"})},
        }],
    }


def run_context(codec: Any, tokenizer: Any, context: int, turns: int) -> tuple[float, LinearTrajectory]:
    tree = TrajectoryTree()
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": _long_text(tokenizer, context - 160)},
    ]
    prompt = codec.render_first(msgs, tools=None, template_kwargs=None)
    first = _turn_message(0)
    sampled = codec.canonical_assistant_ids(first)
    tree.commit_turn(prompt, sampled, [-0.1] * len(sampled), finish_reason="stop",
                     repair_ids=codec.close_turn(sampled), request_messages=msgs, assistant_message=first)
    base_request = [*msgs, first]
    times = []
    for i in range(1, turns + 1):
        traj = tree.active.trajectory
        # every measured turn runs at the same context: roll back to checkpoint 1 (untimed)
        if traj.num_turns > 1:
            traj.rollback(1)
        tool_msg = {"role": "tool", "tool_call_id": "call_00000000", "content": f"def f{i}():\n    return {i}\n"}
        request = [*base_request, tool_msg]
        assistant = _turn_message(i)
        sampled = codec.canonical_assistant_ids(assistant)  # what the engine returns (not timed)
        t0 = time.perf_counter()
        plan = attach(tree, request)
        history = request[: len(request) - len(plan.new_messages)]
        result = codec.bridge(history, traj.tail(16), plan.new_messages, tools=None, template_kwargs=None)
        repair = codec.close_turn(sampled)
        tree.commit_turn(result.prompt_ids, sampled, [-0.1] * len(sampled), finish_reason="tool_calls",
                         repair_ids=repair, request_messages=plan.new_messages, assistant_message=assistant)
        times.append(time.perf_counter() - t0)
    return float(np.percentile(np.array(times) * 1000, 50)), tree.active.trajectory


def _load(family: str, root: Path) -> tuple[Any, Any]:
    """(tokenizer, codec) of one of our families or a renderers-backed one; a renderers
    family whose renderer refuses its template (DeepSeek V3.1/V3.2/V4-Flash) is measured
    with the codec that serves it (detected from the template, as the server does)."""
    if family in FAMILIES:
        tokenizer = AutoTokenizer.from_pretrained(str(cached_tokenizer_dir(family)))
        return tokenizer, load_codec(tokenizer)
    from tests.fast.trajectory.renderer_families import BY_NAME, build
    from trajectory.codec.renderers_codec import RenderersCodec

    spec = BY_NAME[family]
    tokenizer = AutoTokenizer.from_pretrained(str(build(spec, root / family)))
    if family in SERVED_BY_OURS:  # our codec serves it, not the renderer (test_renderers_codec.OURS)
        return tokenizer, load_codec(tokenizer, family=SERVED_BY_OURS[family])
    try:
        return tokenizer, RenderersCodec(tokenizer, spec.renderer)
    except TemplateNotSupported:  # refused at load: measure what serves it
        return tokenizer, load_codec(tokenizer)


def measure(family: str, turns: int, root: Path) -> dict[str, Any]:
    tokenizer, codec = _load(family, root)
    p50: dict[str, float] = {}
    contexts: dict[str, int] = {}
    traj = None
    for ctx in CONTEXTS:
        p50[str(ctx)], traj = run_context(codec, tokenizer, ctx, turns)
        contexts[str(ctx)] = traj.checkpoints[1]
        print(f"{family}: context {ctx:>6} (actual {contexts[str(ctx)]} tokens): per-turn p50 {p50[str(ctx)]:.3f} ms")
    assert traj is not None
    out = {
        "family": family,
        "codec": type(codec).__name__,
        "turns": turns,
        "p50_ms": p50,
        "actual_context_tokens": contexts,
        "ratio_100k_1k": p50["100000"] / p50["1000"],
        "bytes_per_token": traj.buffer.bytes_per_token(),
    }
    print(f"{family}: ratio 100K/1K: {out['ratio_100k_1k']:.2f}  bytes/token: {out['bytes_per_token']:.2f}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--turns", type=int, default=60)
    ap.add_argument("--family", default="qwen3")
    args = ap.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        if args.family != "all":
            out: Any = measure(args.family, args.turns, Path(tmp))
        else:
            from tests.fast.trajectory.renderer_families import RENDERER_FAMILIES

            out = []
            for family in [*FAMILIES, *(f.name for f in RENDERER_FAMILIES)]:
                try:
                    out.append(measure(family, args.turns, Path(tmp)))
                except Exception as exc:  # a family whose codec cannot run the turn: say why
                    print(f"{family}: error {type(exc).__name__}: {exc}")
                    out.append({"family": family, "error": f"{type(exc).__name__}: {exc}"[:300]})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
