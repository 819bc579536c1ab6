"""Token trajectories for agentic RL: what RL workers import.

Pure library (no network, no asyncio, never imports the service): compact token
storage, linear trajectories with turns and checkpoints, a session's branch
tree, the chat-template codec (`trajectory.codec`), strict validation of engine
output, history reconciliation and export.
"""

from __future__ import annotations

from .buffer import TokenBuffer
from .errors import (
    BranchError,
    CheckpointError,
    CodecError,
    ExportError,
    InvariantError,
    TemplateNotSupported,
    TrajectoryError,
    ValidationError,
)
from .export import from_dict, from_npz_bytes, to_dict, to_npz_bytes
from .history import Plan, reconcile
from .linear import LinearTrajectory, TurnRecord, WeightSpan, WeightVersion
from .tree import Branch, TrajectoryTree
from .validate import Expectations, GenerationLike, ValidGeneration, validate_generation

__all__ = [
    "Branch",
    "BranchError",
    "CheckpointError",
    "CodecError",
    "Expectations",
    "ExportError",
    "GenerationLike",
    "InvariantError",
    "LinearTrajectory",
    "Plan",
    "TemplateNotSupported",
    "TokenBuffer",
    "TrajectoryError",
    "TrajectoryTree",
    "TurnRecord",
    "ValidGeneration",
    "ValidationError",
    "WeightSpan",
    "WeightVersion",
    "from_dict",
    "from_npz_bytes",
    "reconcile",
    "to_dict",
    "to_npz_bytes",
    "validate_generation",
]
