"""The house rules, enforced on the static import graph.

Every module of `session_server/` and `trajectory/` is parsed with `ast` (nothing is
imported, so lazy imports inside functions and `TYPE_CHECKING` blocks count too),
relative imports are resolved, and `from pkg import name` points at `pkg.name` when
that is a module, else at `pkg`. A string literal naming a project module passed to
`importlib.import_module` or `importlib.resources.files` counts as an import too:
it runs that package's `__init__` just the same.

Layering rules (trajectory below the server, policies below the engines, the server
without the simulator) follow the graph transitively through the project's own
modules, so a middleman cannot hide a dependency. Package `__init__` modules are
edges only when imported by name (importing `a.b.c` does not count as `a.b`), so a
rule judges what a module's code depends on. "Who talks to engine adapters" is a
direct rule: the API layer reaches everything through the app's context, which by
design holds the engines; what it must not do is name an adapter itself.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("session_server", "trajectory")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _modules() -> dict[str, Path]:
    """Every project module by dotted name."""
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an `ImportFrom` names (its `level` dots resolved)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


# calls whose first argument names a module they import (`resources.files` imports the
# package to find its files)
_IMPORTING_CALLS = {"import_module", "files", "__import__"}


def _call_name(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


@cache
def direct_imports(module: str, strings: bool = False) -> frozenset[str]:
    """The modules `module` names in any import statement, anywhere in its body (and, with
    `strings`, in an importing call's string argument)."""
    path = _modules()[module]
    is_package = path.name == "__init__.py"
    known = _modules()
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if strings and isinstance(node, ast.Call) and _call_name(node) in _IMPORTING_CALLS and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                out.add(arg.value)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, is_package, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in known else base)
    return frozenset(out)


@cache
def reachable(module: str, strings: bool = False) -> frozenset[str]:
    """Every module `module` imports, directly or through other project modules."""
    seen: set[str] = set()
    todo = [module] if module in _modules() else []
    while todo:
        for dep in direct_imports(todo.pop(), strings):
            if dep not in seen:
                seen.add(dep)
                if dep in _modules():
                    todo.append(dep)
    return frozenset(seen)


def _within(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _violations(
    importers: Callable[[str], bool],
    forbidden: Callable[[str], bool],
    *,
    transitive: bool = True,
    strings: bool = False,
) -> dict[str, list[str]]:
    """{importer: [forbidden modules it reaches, and the first hops that lead there]}."""
    found: dict[str, list[str]] = {}
    for module in sorted(_modules()):
        if not importers(module):
            continue
        deps = reachable(module, strings) if transitive else direct_imports(module, strings)
        bad = sorted(dep for dep in deps if forbidden(dep))
        if bad:
            hops = sorted(d for d in direct_imports(module, strings) if d in bad or any(
                b in reachable(d, strings) for b in bad))
            found[module] = [*bad, f"(via {', '.join(hops)})"]
    return found


def _defines_policy(module: str) -> bool:
    """A module with a class built on the policy protocol (`PolicyBase` / `RoutingPolicy`)."""
    tree = ast.parse(_modules()[module].read_text())
    return any(
        isinstance(base, ast.Name) and base.id in ("PolicyBase", "RoutingPolicy")
        for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
        for base in node.bases
    )


@cache
def routing_policies() -> frozenset[str]:
    """The policy protocol, the factory, and every module that defines a policy."""
    routing = [m for m in _modules() if m.startswith("session_server.routing.")]
    found = {m for m in routing if _defines_policy(m)}
    return frozenset(found | {"session_server.routing.policy", "session_server.routing.factory"})


ENGINE_ADAPTERS = (
    "session_server.engines.sglang",
    "session_server.engines.sglang_replies",
    "session_server.engines.vllm",
    "session_server.engines.vllm_replies",
    "session_server.engines.http",
)
# the entry points that may start simulated engines (the `sim-engine` and `demo` commands)
SIM_USERS = ("session_server.ops.cli", "session_server.ops.demo")


def test_the_import_graph_sees_the_project() -> None:
    """The rules below are only as good as the graph: it must resolve what we know is there."""
    assert "session_server.sim.server" in _modules() and "trajectory.linear" in _modules()
    assert "session_server.sim.engine" in direct_imports("session_server.sim.server")
    assert "session_server.routing.policy" in direct_imports("session_server.routing.round_robin")
    assert "session_server.sim" in reachable("session_server.ops.cli")  # a lazy import, in a function
    assert "trajectory.codec" in direct_imports("session_server.sim.tokenizers", strings=True)  # resources.files(...)
    assert {"session_server.routing.sticky_cost", "session_server.routing.cache_aware",
            "session_server.routing.round_robin"} <= routing_policies()
    assert "session_server.routing.pool" not in routing_policies()


def _under(*prefixes: str) -> Callable[[str], bool]:
    return lambda m: _within(m, prefixes)


def test_trajectory_imports_nothing_from_session_server() -> None:
    """The library stands alone: no import statement reaches the service."""
    assert _violations(_under("trajectory"), _under("session_server")) == {}


def test_trajectory_reads_no_session_server_package() -> None:
    """Nor a module named by string (`resources.files`, `import_module`)."""
    assert _violations(_under("trajectory"), _under("session_server"), strings=True) == {}


def test_routing_policies_import_no_engine_module() -> None:
    assert _violations(lambda m: m in routing_policies(), _under("session_server.engines")) == {}


def test_routing_package_imports_no_engine_module() -> None:
    """All of routing/ (pool and health too) is target bookkeeping the simulator can share."""
    assert _violations(_under("session_server.routing"), _under("session_server.engines")) == {}


def test_api_layer_never_imports_an_engine_adapter() -> None:
    """Not an adapter module, nor the `engines` package that re-exports them."""

    def adapter(m: str) -> bool:
        return m in ENGINE_ADAPTERS or m == "session_server.engines"

    assert _violations(_under("session_server.api"), adapter, transitive=False) == {}


def test_server_never_imports_the_simulator() -> None:
    def server(m: str) -> bool:
        return _within(m, ["session_server"]) and not _within(m, ["session_server.sim", *SIM_USERS])

    assert _violations(server, _under("session_server.sim")) == {}
