"""The weight-update control plane: pause, abort, resume without losing a token.

- plane.py: `ControlPlane`, the server-wide plane (pause gate, in-flight registry,
  weight version and cache salt, engine fan-out through fanout.py, metrics.py);
- resilient.py: `generate_resilient`, one turn as abort -> accumulate -> resubmit
  segments (a state machine of named phases; a segment's own helpers in segment.py),
  assembled (assemble.py) into one `ResilientResult`.

The loop uses the plane only through its public methods.
"""

from __future__ import annotations

from .assemble import ResilientResult, WeightSpan
from .metrics import ControlMetrics
from .plane import MAX_WEIGHT_VERSION, PAUSE_MODES, ControlPlane, EngineSource
from .resilient import AbortEvent, generate_resilient, new_request_id

__all__ = [
    "MAX_WEIGHT_VERSION",
    "PAUSE_MODES",
    "AbortEvent",
    "ControlMetrics",
    "ControlPlane",
    "EngineSource",
    "ResilientResult",
    "WeightSpan",
    "generate_resilient",
    "new_request_id",
]
