"""A recovered session's diagnostics are the live one's: the bounded list and its count
of the notes it dropped."""

from __future__ import annotations

import time

import numpy as np

from session_server.journal import Row
from session_server.journal_records import CREATE, TURN, create_body, replay_rows, turn_body
from session_server.sessions import MAX_DIAGNOSTICS, Session, SessionConfig


def test_a_recovered_session_keeps_its_count_of_dropped_diagnostics() -> None:
    s = Session("w0.abc", SessionConfig(ttl_s=60.0), 0.0)
    rows = [Row(1, s.id, CREATE, time.time(), create_body(s))]
    for k in range(MAX_DIAGNOSTICS + 10):  # a long session: every turn repaired, one note each
        op = "first" if k == 0 else "append"
        ids, lps = np.array([7, 8], dtype=np.int32), np.zeros(2, dtype=np.float32)
        record = s.tree.active.trajectory.commit_turn([k + 1], ids, lps, finish_reason="stop", repair_ids=[9],
                                                     request_messages=[], assistant_message={}, engine="e0")
        before = len(s.diagnostics)
        s.note("repair", turn=record.index, tokens=1, finish_reason="stop")  # as commit.py notes it
        notes = list(s.diagnostics)[-1:] if len(s.diagnostics) >= before else []
        rows.append(Row(len(rows) + 1, s.id, TURN, time.time(), turn_body(
            op=op, branch_id=0, checkpoint=0, reason=None, shared=None, tools=None, seq=record.seq,
            prompt_ids=[k + 1], ids=ids, logprobs=lps, repair=[9], finish="stop", spans=None, version=None,
            request_messages=[], assistant_message={}, engine="e0", cached=0, extra={}, routed=None,
            answered=None, control=None, notes=notes)))
    [back] = replay_rows(rows, time.monotonic).sessions
    assert s.diagnostics_dropped == 10
    assert list(back.diagnostics) == list(s.diagnostics)
    assert back.diagnostics_dropped == s.diagnostics_dropped  # the session view's diagnostics_dropped
