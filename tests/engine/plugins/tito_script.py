"""A vLLM logits-processor plugin that makes a request sample a scripted text, for tests only.

Loaded with `--logits-processors tito_script:Script` (this folder on the engine's
PYTHONPATH). A request whose `sampling_params.extra_args` carries `script` (token ids) and
`script_start` (where the script begins in prompt + output) samples `script[p]` at every
position p it covers: all other logits are -inf. A random-weight model's own text is noise
(greedy, it repeats one token), so a test that needs the same text across a pause (a stop
string that a resubmission must complete) scripts it. Because the position counts the
prompt, a resubmitted `prompt + partial` goes on with the script where the partial ended,
as a real model's deterministic continuation would.

Raw logprobs (vLLM's default `--logprobs-mode`) are computed before logits processors, so
the reported logprob of a scripted token is still the model's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates


@dataclass
class _Scripted:
    script: list[int]
    start: int
    prompt_len: int
    output: list[int]  # vLLM's running list of the request's sampled ids (a reference)

    def next_id(self) -> int | None:
        p = self.prompt_len + len(self.output) - self.start
        return self.script[p] if 0 <= p < len(self.script) else None


class Script(LogitsProcessor):
    """Force each scripted request's next id; leave every other request alone."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """A malformed script is the request's 400, never an exception in the engine core."""
        args = sampling_params.extra_args or {}
        if "script" not in args:
            return
        script, start = args.get("script"), args.get("script_start")
        if (not isinstance(script, list) or not all(type(i) is int and i >= 0 for i in script)
                or type(start) is not int or start < 0):
            raise ValueError("extra_args.script must be a list of token ids and script_start an int >= 0")

    def __init__(self, vllm_config: object, device: torch.device, is_pin_memory: bool) -> None:
        self.scripted: dict[int, _Scripted] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it changes the argmax: never skipped

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def scripted(params, prompt, output):  # type: ignore[no-untyped-def]
            args = params.extra_args or {}
            if "script" not in args:
                return None
            return _Scripted(list(args["script"]), int(args["script_start"]), len(prompt or []), output)

        process_dict_updates(self.scripted, batch_update, scripted)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, req in self.scripted.items():
            token = req.next_id()
            if token is not None and token < logits.shape[1]:
                logits[index].fill_(float("-inf"))
                logits[index, token] = 0.0
        return logits
