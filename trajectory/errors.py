"""Typed errors of the trajectory library.

Every failure the library can detect is one of these, so callers (the session
server, RL workers) can map them without parsing messages:

    TrajectoryError
    ├── InvariantError          a trajectory invariant would break (mask/logprob
    │                           alignment, checkpoint not a prefix, bad span)
    ├── CheckpointError         rollback to a checkpoint that does not exist
    ├── BranchError             unknown branch, or a fork index out of range
    ├── ExportError             an export blob is malformed or inconsistent
    ├── SampleError             a samples request is invalid (unknown picker,
    │                           bad max_seq_len or reward)
    ├── CodecError              the chat-template codec cannot do what was asked
    │   └── TemplateNotSupported   an unknown template failed probing/verification
    └── ValidationError         one engine result violates a strict check
                                (carries `field` and `index`)
"""

from __future__ import annotations


class TrajectoryError(Exception):
    """Base of every error raised by the trajectory library."""


class InvariantError(TrajectoryError):
    """An operation would leave a trajectory in a state that breaks an invariant."""


class CheckpointError(TrajectoryError):
    """A rollback named a checkpoint that does not exist on this trajectory."""


class BranchError(TrajectoryError):
    """A tree operation named an unknown branch or an impossible fork point."""


class ExportError(TrajectoryError):
    """An exported trajectory could not be decoded, or decodes inconsistently."""


class SampleError(TrajectoryError):
    """A request for training samples is invalid: unknown picker, bad max_seq_len or reward."""


class CodecError(TrajectoryError):
    """The chat-template codec cannot render, bridge or parse what it was given."""


class TemplateNotSupported(CodecError):
    """A chat template failed probing or the append-only verification."""


class ValidationError(TrajectoryError):
    """One engine result failed a strict check; nothing from it may be committed.

    `field` names the offending field (e.g. ``"output_ids"``), `index` the
    position inside it when the field is a sequence (else ``None``).
    """

    def __init__(self, field: str, message: str, index: int | None = None) -> None:
        self.field = field
        self.index = index
        where = f"{field}[{index}]" if index is not None else field
        super().__init__(f"{where}: {message}")
