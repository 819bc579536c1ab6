"""Routing simulation, the report: per-policy metrics, the markdown table, the PNG and
the README section they are written into."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.routing_cluster import Cluster

__all__ = ["COLUMNS", "markdown_table", "metrics", "pct", "update_readme", "write_png"]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def metrics(cluster: Cluster) -> dict[str, Any]:
    """The per-policy numbers of one finished run (the report's row)."""
    st = cluster.stats
    processed = [r.processed_tokens for r in cluster.ranks]
    mean = sum(processed) / len(processed)
    min_rate = min((e.min_iter_rate for e in cluster.engines), default=math.inf)
    return {
        "timeouts": st.timeouts,
        "lost_turns": st.lost_turns,
        "completed_turns": st.completed_turns,
        "hit_rate": st.cached_tokens / max(1, st.prompt_tokens),
        "ideal_hit_rate": st.ideal_cached_tokens / max(1, st.prompt_tokens),
        "reprefill_tokens": st.reprefill_tokens,
        "ttft_p50_s": pct(st.ttft_s, 50),
        "ttft_p99_s": pct(st.ttft_s, 99),
        "turn_latency_p50_s": pct(st.latency_s, 50),
        "turn_latency_p99_s": pct(st.latency_s, 99),
        "decode_rate_min_tok_s": min(st.decode_rates, default=0.0),
        "decode_rate_p50_tok_s": pct(st.decode_rates, 50),
        "decode_step_rate_min_tok_s": 0.0 if min_rate == math.inf else min_rate,
        "makespan_s": st.makespan_s,
        "load_imbalance": max(processed) / mean if mean else 0.0,
        "migrations": st.migrations,
        "rehomes": st.rehomes,
        "retries": st.retries,
        "aborted_sessions": st.aborted_sessions,
    }



COLUMNS = (
    ("timeouts", "timeouts", "{:d}"),
    ("lost_turns", "lost turns", "{:d}"),
    ("hit_rate", "hit rate", "{:.1%}"),
    ("ideal_hit_rate", "ideal", "{:.1%}"),
    ("reprefill_tokens", "re-prefilled tok", "{:,}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.1f}"),
    ("ttft_p99_s", "TTFT p99 s", "{:.1f}"),
    ("turn_latency_p50_s", "turn p50 s", "{:.1f}"),
    ("turn_latency_p99_s", "turn p99 s", "{:.1f}"),
    ("decode_rate_min_tok_s", "min decode tok/s", "{:.1f}"),
    ("decode_rate_p50_tok_s", "p50 decode tok/s", "{:.1f}"),
    ("makespan_s", "makespan s", "{:.0f}"),
    ("load_imbalance", "imbalance", "{:.2f}"),
    ("migrations", "migrations", "{:d}"),
)


def markdown_table(
    result: dict[str, Any], columns: tuple[tuple[str, str, str], ...] = COLUMNS, label: str = "policy"
) -> str:
    head = f"| {label} | " + " | ".join(c[1] for c in columns) + " |"
    sep = "|---|" + "---:|" * len(columns)
    rows = [
        f"| {name} | " + " | ".join(fmt.format(m[key]) for key, _, fmt in columns) + " |"
        for name, m in result["policies"].items()
    ]
    return "\n".join([head, sep, *rows])


def write_png(result: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["policies"])
    pol = result["policies"]
    panels = (
        ("hit_rate", "prefix hit rate (ideal dashed)"),
        ("turn_latency_p99_s", "turn latency p99 (s)"),
        ("timeouts", "timeouts"),
        ("reprefill_tokens", "re-prefilled tokens"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(18, 4.5))
    for ax, (key, label) in zip(axes, panels, strict=True):
        ax.bar(names, [pol[n][key] for n in names], color="tab:blue")
        if key == "hit_rate":
            ax.plot(names, [pol[n]["ideal_hit_rate"] for n in names], "k--")
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=45)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def update_readme(path: Path, scenario: str, body: str) -> None:
    """Replace only this scenario's subsection under '## Routing simulation'."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    sub = f"### {scenario}\n\n{body.strip()}\n"
    m = re.search(r"^## Routing simulation\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    if m is None:
        intro = (
            "Same policy objects as the server, in a discrete-event cluster "
            "(`bench/routing_sim.py`). Regenerate with "
            "`python bench/routing_sim.py --scenario SCENARIO --readme bench/README.md`.\n"
        )
        text = text.rstrip("\n") + f"\n\n## Routing simulation\n\n{intro}\n{sub}"
    else:
        section = m.group(1)
        pat = re.compile(rf"^### {re.escape(scenario)}\n.*?(?=^### |\Z)", flags=re.S | re.M)
        section = (
            pat.sub(lambda _: sub + "\n", section)
            if pat.search(section)
            else section.rstrip("\n") + f"\n\n{sub}\n"
        )
        text = text[: m.start(1)] + section + text[m.end(1) :]
    path.write_text(text.rstrip("\n") + "\n")

