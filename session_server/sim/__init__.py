"""Simulated SGLang/vLLM engines (wire-faithful) for tests, benchmarks and the demo.

`engine` is the core (ranks, prefix caches from `cache`, the generate loop, pause
modes) with token choice in `sampler` and fault injection in `faults`;
`sglang_wire` and `vllm_wire` are the two wire formats over it (sharing `wire`);
`server` assembles a servable `SimEngine` with the `/sim/*` test controls.
"""

from __future__ import annotations

from session_server.sim.cache import PrefixCache
from session_server.sim.sampler import Cursor, ScriptedPolicy, SimModel, sim_model_from_tokenizer
from session_server.sim.server import (
    FAULT_KINDS,
    SimEngine,
    load_sim_model,
    run_sim_engine,
    running_sim,
)

__all__ = [
    "FAULT_KINDS",
    "Cursor",
    "PrefixCache",
    "ScriptedPolicy",
    "SimEngine",
    "SimModel",
    "load_sim_model",
    "run_sim_engine",
    "running_sim",
    "sim_model_from_tokenizer",
]
