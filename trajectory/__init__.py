"""Token trajectories for agentic RL: what RL workers import.

Pure library (no network, no asyncio, never imports the service): compact token
storage, linear trajectories with turns and checkpoints, a session's branch
tree, the chat-template codec (`trajectory.codec`), strict validation of engine
output, history reconciliation, export, and training samples (`build_samples`,
serialised by `trajectory.sample_formats`).
"""

from __future__ import annotations

from .buffer import TokenBuffer
from .errors import (
    BranchError,
    CheckpointError,
    CodecError,
    ExportError,
    InvariantError,
    SampleError,
    TemplateNotSupported,
    TrajectoryError,
    ValidationError,
)
from .export import branch_line, from_dict, from_npz_bytes, to_dict, to_npz_bytes
from .history import Attachment, Plan, attach, reconcile
from .linear import LinearTrajectory
from .sample_formats import (
    load_samples_json,
    load_samples_npz,
    load_samples_safetensors,
    samples_to_json,
    samples_to_npz,
    samples_to_safetensors,
)
from .samples import PICKERS, Sample, build_samples, register_picker
from .tree import Branch, TrajectoryTree
from .turn_record import TurnRecord, WeightSpan, WeightVersion
from .validate import Expectations, GenerationLike, ValidGeneration, validate_generation

__all__ = [
    "Attachment",
    "Branch",
    "BranchError",
    "CheckpointError",
    "CodecError",
    "Expectations",
    "ExportError",
    "GenerationLike",
    "InvariantError",
    "LinearTrajectory",
    "PICKERS",
    "Plan",
    "Sample",
    "SampleError",
    "TemplateNotSupported",
    "TokenBuffer",
    "TrajectoryError",
    "TrajectoryTree",
    "TurnRecord",
    "ValidGeneration",
    "ValidationError",
    "WeightSpan",
    "WeightVersion",
    "attach",
    "branch_line",
    "build_samples",
    "from_dict",
    "from_npz_bytes",
    "load_samples_json",
    "load_samples_npz",
    "load_samples_safetensors",
    "reconcile",
    "register_picker",
    "samples_to_json",
    "samples_to_npz",
    "samples_to_safetensors",
    "to_dict",
    "to_npz_bytes",
    "validate_generation",
]
