"""The resilient turn as a state machine: it still reaches the control plane only through
the plane's public interface, now that the plane is an attribute of the turn (`self.control`),
which the bare-name check of test_house_seams.py does not see."""

from __future__ import annotations

import ast
from pathlib import Path

import session_server

CONTROL = Path(session_server.__file__).parent / "control"


def _plane(node: ast.expr) -> bool:
    """`control` or `<anything>.control`: the plane under either spelling."""
    return (isinstance(node, ast.Name) and node.id == "control") or (
        isinstance(node, ast.Attribute) and node.attr == "control")


def test_the_turn_and_its_segment_helpers_use_only_the_planes_public_interface() -> None:
    for name in ("resilient.py", "segment.py"):
        tree = ast.parse((CONTROL / name).read_text())
        private = [n.attr for n in ast.walk(tree)
                   if isinstance(n, ast.Attribute) and n.attr.startswith("_") and _plane(n.value)]
        assert private == [], name


def test_the_phase_machine_reaches_the_plane_through_the_turn() -> None:
    """The check above looks at what the machine actually does: its phases use `self.control`."""
    tree = ast.parse((CONTROL / "resilient.py").read_text())
    via_turn = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _plane(n)
                and isinstance(n.value, ast.Name) and n.value.id == "self"]
    assert via_turn
