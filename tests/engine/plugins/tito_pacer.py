"""A vLLM logits-processor plugin that paces the engine, for tests only.

Loaded into the engine process with `--logits-processors tito_pacer:Pacer` (this folder on
its PYTHONPATH; it imports vLLM, so it is never imported by the test process itself). A
request whose `sampling_params.extra_args` carries `pace_ms` makes every decode step of the
batch it is in sleep that long before it samples: a floor on how long the request runs,
whatever the machine's speed. Tests that must land an event (a pause, a hang-up) while the
engine is sampling use it instead of guessing how fast an unknown CPU samples: on a fast
runner a 1,200-token turn could end before the test looked at it.

The logits are returned untouched, so the tokens and logprobs are the engine's own.
"""

from __future__ import annotations

import time

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates


class Pacer(LogitsProcessor):
    """Sleep the longest `pace_ms` among the batch's requests at every step."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """A bad pace is the request's 400, never an exception inside the engine core."""
        ms = (sampling_params.extra_args or {}).get("pace_ms")
        if ms is not None and (isinstance(ms, bool) or not isinstance(ms, int | float) or not 0 <= ms <= 1000):
            raise ValueError(f"extra_args.pace_ms must be a number of ms in [0, 1000], got {ms!r}")

    def __init__(self, vllm_config: object, device: torch.device, is_pin_memory: bool) -> None:
        self.paces: dict[int, float] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # never skipped, greedy batches included

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def pace(params, _prompt, _output):  # type: ignore[no-untyped-def]
            ms = (params.extra_args or {}).get("pace_ms")
            return float(ms) / 1000 if ms else None

        process_dict_updates(self.paces, batch_update, pace)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.paces:
            time.sleep(max(self.paces.values()))
        return logits
