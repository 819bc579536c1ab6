"""What a sample read back from a payload must satisfy before it is handed to a trainer.

`trajectory.sample_formats` reads three formats; every sample any of them yields is
checked here, so the rules hold the same way whichever format a batch travelled in:
arrays of the right dtype and length, ids and masks in range, logprobs finite and 0.0
off the mask, turns in order with the mask inside their outputs, one per-turn reward and
lineage per turn, a known status.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from trajectory.errors import ExportError
from trajectory.lineage import lineage_from_dict
from trajectory.samples import STATUSES, Sample

__all__ = ["ARRAYS", "ROUTED_DTYPES", "check_arrays", "check_int", "check_meta"]

ARRAYS: tuple[tuple[str, np.dtype], ...] = (
    ("token_ids", np.dtype(np.int32)),
    ("loss_mask", np.dtype(np.uint8)),
    ("logprobs", np.dtype(np.float32)),
    ("weight_version_index", np.dtype(np.int32)),
)
ROUTED_DTYPES: dict[str, np.dtype[Any]] = {"uint8": np.dtype(np.uint8), "int16": np.dtype(np.int16)}


def check_int(v: Any, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ExportError(f"{where} must be an int, got {v!r}")
    return v


def check_arrays(s: Sample, where: str) -> None:
    n = len(s.token_ids)
    for name, dtype in ARRAYS:
        arr = getattr(s, name)
        if not isinstance(arr, np.ndarray) or arr.dtype != dtype or arr.shape != (n,):
            raise ExportError(f"{where} {name} must be {dtype} [{n}]")
    if n == 0:
        return
    if int(s.token_ids.min()) < 0:
        raise ExportError(f"{where} token_ids has a negative id")
    if int(s.loss_mask.max()) > 1:
        raise ExportError(f"{where} loss_mask is not 0/1")
    if not np.isfinite(s.logprobs).all() or ((s.loss_mask == 0) & (s.logprobs != 0.0)).any():
        raise ExportError(f"{where} logprobs are not finite, or not 0.0 where the mask is 0")
    sup = s.sampling_support
    if sup is not None and len(sup) != n:
        raise ExportError(f"{where} sampling_support has {len(sup)} rows for {n} tokens")
    r = s.routed_experts
    if r is not None and (r.ndim != 3 or r.shape[0] != n - 1 or r.dtype.name not in ROUTED_DTYPES):
        raise ExportError(f"{where} routed_experts must be uint8/int16 [{n - 1}, layers, topk]")
    idx = s.weight_version_index
    if int(idx.min()) < -1 or int(idx.max()) >= len(s.version_table):
        raise ExportError(f"{where} weight_version_index outside its table of {len(s.version_table)}")


def check_meta(s: Sample, where: str) -> None:
    n = len(s.token_ids)
    prev = 0
    for i, (p, o, e) in enumerate(s.turn_boundaries):
        if not prev <= p <= o <= e <= n:
            raise ExportError(f"{where} turn {i} boundaries {(p, o, e)} out of order in {n} tokens")
        prev = e
    if n and s.loss_mask.any():
        inside = np.zeros(n, dtype=bool)
        for _, o, e in s.turn_boundaries:
            inside[o:e] = True
        if (s.loss_mask.astype(bool) & ~inside).any():
            raise ExportError(f"{where} loss_mask is 1 outside the turns' outputs")
    if s.status not in STATUSES:
        raise ExportError(f"{where} status {s.status!r} is not one of {STATUSES}")
    if s.reason is not None and not isinstance(s.reason, str):
        raise ExportError(f"{where} reason must be a str or null")
    if s.reward is not None and (not isinstance(s.reward, float) or not math.isfinite(s.reward)):
        raise ExportError(f"{where} reward must be a finite float or null, got {s.reward!r}")
    tr = s.turn_rewards
    if not isinstance(tr, list) or len(tr) != len(s.turn_boundaries) or not all(
            r is None or (isinstance(r, float) and math.isfinite(r)) for r in tr):
        raise ExportError(f"{where} turn_rewards must be one finite float or null per turn, got {tr!r}")
    tl = s.turn_lineage
    if not isinstance(tl, list) or len(tl) != len(s.turn_boundaries):
        raise ExportError(f"{where} turn_lineage must be one lineage or null per turn, got {tl!r}")
    for i, d in enumerate(tl):
        try:
            lin = lineage_from_dict(d)
        except ValueError as exc:
            raise ExportError(f"{where} turn_lineage[{i}]: {exc}") from exc
        if lin is not None and d is not None and lin.to_dict() != d:
            raise ExportError(f"{where} turn_lineage[{i}] has fields {sorted(d)}, not a lineage's")
    if not isinstance(s.metadata, dict) or not isinstance(s.diagnostics, list):
        raise ExportError(f"{where} metadata must be an object and diagnostics a list")
    for v in s.version_table:
        if v is None or isinstance(v, bool) or not isinstance(v, str | int | float):
            raise ExportError(f"{where} version_table holds {v!r}")
