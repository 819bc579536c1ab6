"""The house: the control split, the engine registry and the deduplicated helpers."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

import session_server
from session_server.control import ControlPlane
from session_server.engines.registry import EngineRegistry
from session_server.errors import NoHealthyEngine
from session_server.routing.pool import Engine, EnginePool

PKG = Path(session_server.__file__).parent


def _imports(path: Path) -> set[str]:
    """Absolute names of the modules `path` imports (relative ones resolved)."""
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(parts[: len(parts) - node.level]) if node.level else []
            out.add(".".join([*base, node.module] if node.module else base))
    return out


def test_resilient_loop_uses_only_the_planes_public_interface() -> None:
    tree = ast.parse((PKG / "control" / "resilient.py").read_text())
    private = [
        n.attr for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "control"
        and n.attr.startswith("_")
    ]
    assert private == []


def test_control_modules_stay_small() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in (PKG / "control").glob("*.py")}
    assert max(sizes.values()) <= 400, sizes


async def test_state_counters_are_the_prometheus_values() -> None:
    control = ControlPlane(lambda: [], grace_s=0.0)
    assert not hasattr(control, "counters")  # no parallel dict
    await control.pause("abort")
    control.record_abort(empty=True)
    control.record_abort(empty=False)
    control.record_resubmit()
    waiter = asyncio.create_task(control.wait_open())
    await asyncio.sleep(0.01)
    await control.resume()
    waited = await waiter
    counters = control.state()["counters"]
    reg = control.metrics.registry
    assert counters == {
        "pauses": 1, "resumes": 1, "aborts": 2, "empty_aborts": 1, "resubmits": 1,
        "paused_wait_s": pytest.approx(waited), "paused_too_long": 0, "version_mismatches": 0,
        "engine_failures": 0, "turns_ended_stale": 0,
    }
    assert isinstance(counters["pauses"], int)  # JSON keeps writing 1, not 1.0
    assert reg.get_sample_value("tito_turn_aborts_total") == 2
    assert reg.get_sample_value("tito_turn_paused_wait_seconds_sum") == pytest.approx(counters["paused_wait_s"])


def test_routing_imports_no_engine_module() -> None:
    for path in (PKG / "routing").glob("*.py"):
        bad = {m for m in _imports(path) if m.startswith("session_server.engines")}
        assert not bad, f"{path.name} imports {bad}"
    assert "adapter" not in Engine.__dataclass_fields__


def test_only_the_registry_reaches_adapters() -> None:
    """Routes, the turn pipeline and the plane never build, health-check or close an adapter."""
    pipeline = ("turn/pipeline.py", "turn/prepare.py", "turn/engine_request.py", "turn/dispatch.py", "turn/commit.py")
    routes = ("app.py", "api/routes/turns.py", "api/turn_endpoint.py")
    for name in (*routes, *pipeline, "context.py", "control/plane.py"):
        src = (PKG / name).read_text()
        for needle in ("make_adapter", "verify_engine", ".adapter.", "adapter.aclose", "adapter.health"):
            assert needle not in src, f"{name} uses {needle}"


class _FakeAdapter:
    protocol = "vllm"

    def __init__(self, url: str) -> None:
        self.base_url = url
        self.closed = False
        self.healthy = True

    async def health(self) -> bool:
        if self.closed:
            raise ConnectionError("closed")
        return self.healthy

    async def resume(self) -> None:
        pass

    async def aclose(self, drain_s: float = 0.0) -> None:
        await asyncio.sleep(0)
        self.closed = True


async def test_registry_lifecycle_keeps_pool_and_adapters_in_step() -> None:
    registry = EngineRegistry(EnginePool())
    a, b = _FakeAdapter("http://a"), _FakeAdapter("http://b")
    registry.attach("e0", a, dp_size=2)  # type: ignore[arg-type]
    registry.attach("e1", b)  # type: ignore[arg-type]
    assert sorted(registry.pool.targets) == ["e0/0", "e0/1", "e1/0"]
    assert registry.adapter("e0") is a and registry.adapters() == [a, b]
    control = ControlPlane(registry, grace_s=0.0)  # the plane fans out through the registry
    report = await control.resume()
    assert sorted(report["engines"]) == ["http://a", "http://b"] and report["ok"]
    view = registry.view()
    assert [(e["id"], e["base_url"], e["dp_size"]) for e in view["engines"]] == [
        ("e0", "http://a", 2), ("e1", "http://b", 1)]

    await registry.check_health(registry.pool.engines["e1"])
    b.healthy = False
    with pytest.raises(Exception, match="reported unhealthy"):
        await registry.check_health(registry.pool.engines["e1"])

    assert registry.remove("e0", drain_s=0.0) is not None
    assert "e0/0" not in registry.pool.targets and registry.adapters() == [b]
    with pytest.raises(NoHealthyEngine):
        registry.adapter("e0")
    assert await registry.answers_health("e0")  # a removed engine answers until closed
    for _ in range(5):
        await asyncio.sleep(0)
    assert a.closed and not await registry.answers_health("e0")
    assert registry.remove("e0") is None
    await registry.aclose()
    assert b.closed


def test_one_is_int_and_one_raw_payload_helper() -> None:
    defs: dict[str, list[str]] = {}
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                defs.setdefault(node.name, []).append(str(path.relative_to(PKG)))
    assert "_is_int" not in defs
    assert "_routed" not in defs and len(defs.get("_raw_or_none", [])) + len(defs.get("raw_or_none", [])) == 1


def test_rendezvous_score_is_the_stable_hash_of_the_pair() -> None:
    from session_server.routing.policy import rendezvous_score, stable_hash

    assert rendezvous_score("s1", "e0/1") == stable_hash("s1|e0/1")
