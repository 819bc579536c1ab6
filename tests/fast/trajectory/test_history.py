"""reconcile: first, append, rollback on retries, fork on rewritten history."""

from __future__ import annotations

from typing import Any

import pytest

from trajectory.errors import InvariantError
from trajectory.history import Plan, reconcile


def eq(a: Any, b: Any) -> bool:
    return a == b


SYS = {"role": "system", "content": "s"}
U1 = {"role": "user", "content": "u1"}
A1 = {"role": "assistant", "content": "a1"}
T1 = {"role": "tool", "content": "t1", "tool_call_id": "c1"}
A2 = {"role": "assistant", "content": "a2"}
U2 = {"role": "user", "content": "u2"}
A3 = {"role": "assistant", "content": "a3"}
HISTORY = [SYS, U1, A1, T1, A2, U2, A3]
COUNTS = [0, 3, 5, 7]


def plan(request: list, history: list = HISTORY, counts: list = COUNTS) -> Plan:
    return reconcile(history, counts, request, eq)


def test_first() -> None:
    assert plan([SYS, U1], [], [0]) == Plan("first", 0, [SYS, U1])


def test_append() -> None:
    u3 = {"role": "user", "content": "u3"}
    assert plan([*HISTORY, u3]) == Plan("append", 3, [u3])


def test_append_with_client_injected_assistant() -> None:
    injected = {"role": "assistant", "content": "prefill"}
    assert plan([*HISTORY, U2, injected]) == Plan("append", 3, [U2, injected])


def test_request_ending_with_client_assistant_is_new_context() -> None:
    injected = {"role": "assistant", "content": "client"}
    assert plan([*HISTORY, injected]) == Plan("append", 3, [injected])


def test_identical_request_is_append_with_nothing_new() -> None:
    assert plan(list(HISTORY)) == Plan("append", 3, [])


def test_retry_of_last_turn_rolls_back() -> None:
    assert plan([SYS, U1, A1, T1, A2, U2]) == Plan("rollback", 2, [U2])


def test_earlier_retry_rolls_back_further() -> None:
    assert plan([SYS, U1, A1, T1]) == Plan("rollback", 1, [T1])


def test_edited_tool_result_rolls_back() -> None:
    t1b = {**T1, "content": "other"}
    assert plan([SYS, U1, A1, t1b, A2, U2]) == Plan("rollback", 1, [t1b, A2, U2])


def test_edited_assistant_is_context_after_rollback() -> None:
    a2b = {"role": "assistant", "content": "edited"}
    assert plan([SYS, U1, A1, T1, a2b, U2]) == Plan("rollback", 1, [T1, a2b, U2])


def test_rewritten_system_forks() -> None:
    sys2 = {"role": "system", "content": "compacted"}
    req = [sys2, U1, A1, T1]
    assert plan(req) == Plan("fork", 0, req)


def test_retry_of_first_turn_forks() -> None:
    assert plan([SYS, U1]) == Plan("fork", 0, [SYS, U1])


def test_empty_request_against_history_forks() -> None:
    assert plan([]) == Plan("fork", 0, [])


def test_equal_is_called_committed_first() -> None:
    seen = []

    def spy(committed: Any, requested: Any) -> bool:
        seen.append((committed, requested))
        return committed == requested

    reconcile([SYS], [0, 1], [SYS, U1], spy)
    assert seen == [(SYS, SYS)]


@pytest.mark.parametrize(
    "counts",
    [
        pytest.param([], id="empty"),
        pytest.param([1, 7], id="not-from-0"),
        pytest.param([0, 3, 6], id="short"),
        pytest.param([0, 5, 3, 7], id="decreasing"),
    ],
)
def test_inconsistent_counts_raise(counts: list) -> None:
    with pytest.raises(InvariantError):
        plan([SYS], HISTORY, counts)


def test_linear_time() -> None:
    calls = 0

    def counting(a: Any, b: Any) -> bool:
        nonlocal calls
        calls += 1
        return a == b

    history = [{"role": "user", "content": str(i)} for i in range(2000)]
    counts = list(range(0, 2001, 2))
    reconcile(history, counts, [*history, {"role": "user", "content": "x"}], counting)
    assert calls == 2000
