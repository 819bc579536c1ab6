"""What `verify-template` found, and how it is told: the verifier's report types.

`trajectory.codec.verify` plays the probe conversations; these records are its
result, read by the CLI (`VerifyReport.format_text` / `to_dict`, `ok` for the exit
status), the engine check and the tests. They hold no codec logic, so they live
apart from the player and the verifier module keeps to the checks themselves.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class FirstDifference:
    """Where two id sequences part: the index and a few decoded tokens either side."""

    index: int
    expected_len: int
    got_len: int
    expected_context: str  # decoded tokens around `index` in the template's full render
    got_context: str  # the same window in what our codec produced

    def describe(self) -> str:
        return (
            f"first differing token at index {self.index} "
            f"(full render {self.expected_len} ids, ours {self.got_len}): "
            f"template {self.expected_context} vs ours {self.got_context}"
        )


@dataclass(frozen=True)
class StepReport:
    """One bridged step: appending `roles` after an assistant turn."""

    scenario: str
    step: int
    thinking: str  # "on" / "off" / "default" (the template has no switch)
    roles: tuple[str, ...]
    append_only: bool | None  # None: the template could not render the step
    outcome: str  # exact | mismatch | refused | rewrite | unsupported
    detail: str = ""
    difference: FirstDifference | None = None

    @property
    def hard(self) -> bool:
        """A failure: on an append-only step, bridged ids differ from the full render."""
        return bool(self.append_only) and self.outcome == "mismatch"

    @property
    def warn(self) -> bool:
        """Not a failure, but a lost step: the bridge refused where the template is
        append-only (the server answers 400 or forks where it need not)."""
        return bool(self.append_only) and self.outcome == "refused"


@dataclass(frozen=True)
class ParseReport:
    """Canonical ids of one probe assistant message parsed back."""

    scenario: str
    thinking: str
    ok: bool | None  # None: the template cannot render this message (unsupported)
    detail: str = ""
    expected: dict[str, Any] | None = None
    got: dict[str, Any] | None = None


@dataclass
class VerifyReport:
    """Everything `verify_template` found; `ok` decides the exit status."""

    family: str | None
    family_requested: str | None
    thinking_switch: bool  # the template reads `enable_thinking`
    thinking_modes: list[str]
    steps: list[StepReport] = field(default_factory=list)
    parses: list[ParseReport] = field(default_factory=list)
    error: str | None = None  # the codec could not be built at all
    engine: str | None = None
    engine_status: str = "not requested"

    @property
    def hard_failures(self) -> list[str]:
        out = [f"{s.scenario}[{s.step}] ({s.thinking}): {s.detail}" for s in self.steps if s.hard]
        out += [f"parse {p.scenario} ({p.thinking}): {p.detail}" for p in self.parses if p.ok is False]
        if self.error:
            out.insert(0, self.error)
        return out

    @property
    def warnings(self) -> list[str]:
        return [f"{s.scenario}[{s.step}] ({s.thinking}): {s.detail}" for s in self.steps if s.warn]

    @property
    def ok(self) -> bool:
        return not self.hard_failures

    def roles(self) -> dict[str, dict[str, Any]]:
        """Per appended role: append-only everywhere/nowhere/sometimes, and bridge counts."""
        out: dict[str, dict[str, Any]] = {}
        for s in self.steps:
            for role in dict.fromkeys(s.roles):
                r = out.setdefault(role, {"steps": 0, "append_only_steps": 0, "compared": 0,
                                          "exact": 0, "refused": 0, "rewrite": 0, "unsupported": 0})
                r["steps"] += 1
                r["append_only_steps"] += bool(s.append_only)
                if s.outcome in ("exact", "mismatch"):
                    r["compared"] += 1
                    r["exact"] += s.outcome == "exact"
                elif s.outcome in r:
                    r[s.outcome] += 1
        for r in out.values():
            supported = r["steps"] - r["unsupported"]
            r["append_only"] = (
                "n/a" if not supported else "yes" if r["append_only_steps"] == supported
                else "no" if r["append_only_steps"] == 0 else "partly"
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "family": self.family,
            "family_requested": self.family_requested,
            "thinking_switch": self.thinking_switch,
            "thinking_modes": self.thinking_modes,
            "error": self.error,
            "hard_failures": self.hard_failures,
            "warnings": self.warnings,
            "roles": self.roles(),
            "steps": [asdict(s) | {"hard": s.hard, "warn": s.warn} for s in self.steps],
            "parses": [asdict(p) for p in self.parses],
            "engine": {"url": self.engine, "status": self.engine_status},
        }

    def verdict(self) -> str:
        """One line: what was checked and what holds (the last line of the text report)."""
        steps = [s for s in self.steps if s.outcome != "unsupported"]
        compared = [s for s in steps if s.outcome in ("exact", "mismatch")]
        exact = sum(s.outcome == "exact" for s in compared)
        rewrites = sum(s.outcome == "rewrite" for s in steps)
        refused = sum(s.outcome == "refused" for s in steps)
        judged = [p for p in self.parses if p.ok is not None]
        parsed = sum(p.ok is True for p in judged)
        checked = (f"{len(steps)} appended steps (thinking {', '.join(self.thinking_modes)}): "
                   f"{exact}/{len(compared)} bridged token-exact with the template's full render, "
                   f"{rewrites} where the template re-renders earlier turns (the committed tokens are kept), "
                   f"{refused} refused; {parsed}/{len(judged)} assistant messages parse back")
        if self.error:
            return f"FAILED: {self.error}"
        if not self.ok:
            return f"FAILED: {len(self.hard_failures)} hard mismatch(es) in {checked}"
        warned = f" ({len(self.warnings)} warning(s))" if self.warnings else ""
        return f"OK: {checked}{warned}"

    def format_text(self) -> str:
        """The human report: summary per role, every failure and warning on its own
        line, the steps reported only (re-rendered history) counted, then the verdict."""
        lines = [
            f"family: {self.family or '-'}"
            + (f" (requested {self.family_requested})" if self.family_requested else " (detected)"),
            f"thinking: {', '.join(self.thinking_modes)}"
            + ("" if self.thinking_switch else " (template has no enable_thinking switch)"),
        ]
        if self.error:
            lines.append(f"ERROR: {self.error}")
        roles = self.roles()
        if roles:
            lines.append("")
            lines.append(f"{'appended':<10} {'append-only':<12} {'token-exact':<12} {'refused':<8} "
                         "re-rendered  unsupported")
            for role, r in roles.items():
                exact = f"{r['exact']}/{r['compared']}" if r["compared"] else "-"
                lines.append(f"{role:<10} {r['append_only']:<12} {exact:<12} {r['refused']:<8} "
                             f"{r['rewrite']:<12} {r['unsupported']}")
            lines.append("(token-exact: of the steps compared, how many bridged to the template's own "
                         "render; re-rendered: the template rewrites earlier turns there, so only the new "
                         "tokens are compared)")
        if self.parses:
            good = sum(p.ok is True for p in self.parses)
            judged = sum(p.ok is not None for p in self.parses)
            lines.append(f"\nparse round-trip: {good}/{judged} assistant messages")
        loud = [s for s in self.steps if s.hard or s.warn]
        bad_parses = [p for p in self.parses if p.ok is False]
        if loud or bad_parses:
            lines.append("\nFAIL: bridge != the template's full render, or a parse that does not round-trip; "
                         "WARN: refused a step the template renders append-only:")
        for s in loud:
            lines.append(
                f"  [{'FAIL' if s.hard else 'WARN'}] {s.scenario}[{s.step}] +{'+'.join(s.roles)} "
                f"thinking={s.thinking}: {s.outcome}{' - ' + s.detail if s.detail else ''}"
            )
        for p in bad_parses:
            lines.append(f"  [FAIL] parse {p.scenario} thinking={p.thinking}: {p.detail}")
        quiet = [s for s in self.steps if s.outcome != "exact" and not (s.hard or s.warn)]
        if quiet:
            counts: dict[str, int] = {}
            for s in quiet:
                key = f"{s.outcome} +{'+'.join(s.roles)}"
                counts[key] = counts.get(key, 0) + 1
            differ = sum("differ" in s.detail for s in quiet)
            lines.append(f"\nreported, not failed: {len(quiet)} step(s): "
                         + ", ".join(f"{k} x{n}" for k, n in counts.items())
                         + (f"; in {differ} the new tokens differ from the full render's tail" if differ else "")
                         + " (--json lists each)")
        unjudged = [p for p in self.parses if p.ok is None]
        if unjudged:
            lines.append(f"parses not judged (the template cannot render the message): {len(unjudged)}")
        if self.engine:
            lines.append(f"\nengine {self.engine}: {self.engine_status}")
        lines.append("")
        lines.append(self.verdict())
        return "\n".join(lines)
