"""Sampled ids are bounded by the model's vocabulary rows, not its tokenizer's ids: a real
model pads its output layer (Qwen3: 151,936 rows for 151,669 ids) and may sample any row."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from session_server.model_config import model_vocab_size, read_config_vocab_size

from ..stack import live_stack


@pytest.fixture
def padded_qwen3_dir(qwen3_dir: Path, tmp_path: Path) -> Path:
    """The offline Qwen3 tokenizer beside a model config with 64 more rows than it has ids."""
    d = tmp_path / "padded"
    shutil.copytree(qwen3_dir, d)
    n = len(AutoTokenizer.from_pretrained(str(d)))
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": n + 64}))
    return d


async def test_an_id_in_the_vocabulary_padding_is_committed_and_noted(padded_qwen3_dir: Path) -> None:
    """The engine samples an id the tokenizer cannot decode (the simulator's `oov_id`: the
    tokenizer's size + 7, inside the model's rows here): committed exactly, not a 502, and
    the turn and the session say which ids no text shows."""
    async with live_stack(padded_qwen3_dir, "vllm") as st:
        tokenizer_ids = len(AutoTokenizer.from_pretrained(str(padded_qwen3_dir)))
        sid = await st.session()
        await st.fault("oov_id")
        r = await st.chat(sid)
        assert r.status_code == 200, r.text
        traj = await st.trajectory(sid)
        view = (await st.http.get(f"/sessions/{sid}")).json()
    (turn,) = traj["branches"][0]["turns"]
    sampled = traj["branches"][0]["token_ids"][turn["output_start"]:turn["output_end"]]
    assert sampled[0] == tokenizer_ids + 7
    assert turn["extra"]["undecodable_ids"] == {"count": 1, "first_index": 0, "ids": [tokenizer_ids + 7],
                                                "tokenizer_size": tokenizer_ids}
    assert "undecodable_ids" in [d["kind"] for d in view["diagnostics"]]


async def test_an_id_past_the_model_rows_is_still_bad_engine_output(padded_qwen3_dir: Path) -> None:
    from session_server.settings import Settings

    tokenizer_ids = len(AutoTokenizer.from_pretrained(str(padded_qwen3_dir)))
    async with live_stack(padded_qwen3_dir, "vllm", settings=Settings(vocab_size=tokenizer_ids + 4)) as st:
        sid = await st.session()
        await st.fault("oov_id")
        r = await st.chat(sid)
    assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_invalid"


def test_the_rows_come_from_the_setting_then_the_config_never_below_the_tokenizer(
        padded_qwen3_dir: Path, qwen3_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(padded_qwen3_dir))
    n = len(tok)
    assert model_vocab_size(tok) == n + 64
    assert model_vocab_size(tok, override=n + 100) == n + 100
    assert model_vocab_size(tok, override=n - 1) == n  # fewer rows than ids: the ids win
    assert model_vocab_size(AutoTokenizer.from_pretrained(str(qwen3_dir))) == n  # no config: the tokenizer
    assert read_config_vocab_size({"text_config": {"vocab_size": 262_208}}) == 262_208
    assert read_config_vocab_size({"vocab_size": True}) is None
