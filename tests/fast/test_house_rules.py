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


# The layers, top to bottom. A module may import its own layer or any layer below it,
# never one above. The longest matching prefix names a module's layer.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("tools", ("session_server.ops", "session_server.client", "session_server.sim")),
    ("app", ("session_server.app", "session_server.lifecycle", "session_server.durability")),
    ("api", ("session_server.api", "session_server.auth")),
    ("turn", ("session_server.turn",)),
    ("wiring", ("session_server.context", "session_server.settings")),
    ("engine side", ("session_server.control", "session_server.routing", "session_server.engines")),
    ("foundation", ("session_server.errors", "session_server.metrics", "session_server.offload",
                    "session_server.sessions", "session_server.model_config", "session_server.routed",
                    "session_server.structured", "session_server.grammar", "session_server.loopback",
                    "session_server.parent_death", "session_server.child_process", "session_server.journal", "session_server.journal_file", "session_server.journal_records",
                    "session_server.journal_writer", "session_server.tracing", "session_server.malloc_tuning")),
    ("trajectory", ("trajectory",)),
)
MAX_MODULE_LINES = 450


def layer_of(module: str) -> int | None:
    """The index in `LAYERS` of the longest prefix that names `module` (None: unplaced)."""
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if _within(module, [prefix]) and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    return None if best is None else best[0]


def _edges(*, packages: bool = False) -> dict[str, set[str]]:
    """Direct imports between project modules. Without `packages`, package `__init__`s
    are left out (a package re-exports its modules, so every `from pkg import name` in
    them would read as a circle); with it, a package named in an import is an edge too,
    as the layers must see it (`from ..control import X` depends on control's layer)."""
    mods = _modules()
    inits = {m for m, p in mods.items() if p.name == "__init__.py"}
    keep = set() if packages else inits
    return {m: {d for d in direct_imports(m) if d in mods and d != m and d not in keep}
            for m in mods if m not in keep}


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(m for m in _modules() if m not in PACKAGES and layer_of(m) is None)
    assert unplaced == [], "place these in LAYERS (and in docs/architecture.md)"


def test_layers_import_only_downward() -> None:
    """`tools → app → api → turn → wiring → {control, routing, engines} → foundation →
    trajectory`: an import that runs up a layer is a callback waiting to happen."""
    upward = sorted(
        f"{m} ({LAYERS[lm][0]}) imports {d} ({LAYERS[ld][0]})"
        for m, deps in _edges(packages=True).items() if (lm := layer_of(m)) is not None
        for d in deps if (ld := layer_of(d)) is not None and ld < lm
    )
    assert upward == []


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in edges), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles() -> None:
    """Type-only imports count: a circle through `TYPE_CHECKING` is still two modules that
    cannot be understood apart."""
    assert _circles(_edges()) == []


def test_no_module_over_the_line_cap() -> None:
    over = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert over == {}
