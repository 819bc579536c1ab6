"""The newcomer's path through `session-server serve`: tokenizer names, fast failures, help."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import huggingface_hub.constants
import pytest

from session_server.ops import cli
from session_server.settings import ADMIN_TOKEN_ENV, Settings
from session_server.sim import FAULT_KINDS
from session_server.sim.tokenizers import FAMILIES


@pytest.fixture
def no_uvicorn(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """`serve` runs up to `uvicorn.run`, which records the app instead of serving."""
    import uvicorn

    seen: dict[str, Any] = {}

    def fake_run(app: Any, **kw: Any) -> None:
        seen["app"], seen["kw"] = app, kw

    monkeypatch.setattr(uvicorn, "run", fake_run)
    monkeypatch.setattr(cli.sys, "setswitchinterval", lambda _s: None)
    monkeypatch.setattr(cli.gc, "set_threshold", lambda *_a: None)
    import session_server.malloc_tuning as malloc_tuning

    monkeypatch.setattr(malloc_tuning, "retain_large_blocks", lambda mb: seen.setdefault("malloc_retain_mb", mb) > 0)
    return seen


@pytest.fixture(scope="module")
def builtin_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One TITO_CACHE_DIR for the module: the built-in tokenizer is trained once."""
    return tmp_path_factory.mktemp("tito-cache")


@pytest.fixture
def offline_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The hub endpoint is a closed local port, nothing is cached: an offline machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for var in ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)


def test_serve_keeps_large_blocks_in_its_heap_as_the_setting_says(
    no_uvicorn: dict[str, Any], monkeypatch: pytest.MonkeyPatch, builtin_cache: Path
) -> None:
    monkeypatch.setenv("TITO_CACHE_DIR", str(builtin_cache))
    base = ["serve", "--engine", "sglang=http://127.0.0.1:9", "--tokenizer", "qwen3"]
    assert cli.main(base) == 0 and no_uvicorn["malloc_retain_mb"] == 32
    no_uvicorn.clear()
    assert cli.main([*base, "--malloc-retain-mb", "0"]) == 0 and no_uvicorn["malloc_retain_mb"] == 0


def test_serve_accepts_the_simulators_builtin_tokenizer_names(
    no_uvicorn: dict[str, Any], monkeypatch: pytest.MonkeyPatch, builtin_cache: Path
) -> None:
    monkeypatch.setenv("TITO_CACHE_DIR", str(builtin_cache))
    rc = cli.main(["serve", "--engine", "sglang=http://127.0.0.1:9", "--tokenizer", "qwen3"])
    assert rc == 0 and "app" in no_uvicorn
    tok = cli.load_tokenizer("qwen3")
    assert "<|im_start|>" in tok.get_vocab() and tok.chat_template


def test_serve_unfetchable_hub_name_fails_fast_with_one_line(
    no_uvicorn: dict[str, Any], offline_hub: None, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = cli.main(["serve", "--engine", "sglang=http://127.0.0.1:9", "--tokenizer", "no-such-org/no-such-model-7b"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "app" not in no_uvicorn
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("session-server serve: error:") and "no-such-org/no-such-model-7b" in err
    assert "local tokenizer directory" in err and all(name in err for name in FAMILIES)


def test_serve_unfetchable_hub_name_never_tries_online(offline_hub: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The slow path (an online from_pretrained) is not entered when the hub is unreachable."""
    from transformers import AutoTokenizer

    calls: list[dict[str, Any]] = []
    real = AutoTokenizer.from_pretrained

    def spy(name: str, **kw: Any) -> Any:
        calls.append(kw)
        return real(name, **kw)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", spy)
    with pytest.raises(cli.TokenizerUnavailable):
        cli.load_tokenizer("no-such-org/no-such-model-7b")
    assert calls == [{"local_files_only": True}]


def test_serve_bad_local_directory_is_one_line_exit_2(
    no_uvicorn: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = cli.main(["serve", "--engine", "sglang=http://127.0.0.1:9", "--tokenizer", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    rc = cli.main(["serve", "--engine", "sglang=http://127.0.0.1:9", "--tokenizer", str(tmp_path / "missing")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "does not exist" in err and len(err.splitlines()) == 1, err


def test_serve_admin_token_from_flag_or_env(
    no_uvicorn: dict[str, Any], monkeypatch: pytest.MonkeyPatch, builtin_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from starlette.testclient import TestClient

    monkeypatch.setenv("TITO_CACHE_DIR", str(builtin_cache))
    base = ["serve", "--engine", "sglang=http://127.0.0.1:9", "--tokenizer", "qwen3", "--cpu-workers", "1",
            "--decode-processes", "0"]
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "from-env")
    assert cli.main(base) == 0
    with TestClient(no_uvicorn["app"]) as c:
        assert c.get("/control/state").status_code == 401
        assert c.get("/control/state", headers={"Authorization": "Bearer from-env"}).status_code == 200
    assert cli.main([*base, "--admin-token", "from-flag", "--instance-id", "pod-1"]) == 0
    with TestClient(no_uvicorn["app"]) as c:
        assert c.get("/control/state", headers={"Authorization": "Bearer from-flag"}).status_code == 200
        assert c.get("/health").json()["instance_id"] == "pod-1"
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "")
    assert cli.main(base) == 2
    assert "admin token is empty" in capsys.readouterr().err


def test_every_serve_flag_has_help_with_its_default() -> None:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    serve = sub.choices["serve"]  # type: ignore[index]
    for action in serve._actions:
        if action.dest == "help":
            continue
        assert action.help, f"--{action.dest} has no help"
    text = serve.format_help()
    for flag, default in (("--port", "8000"), ("--ttl-s", "3600.0"), ("--max-body-bytes", "33554432"),
                          ("--routing-policy", "sticky_cost"), ("--turn-timeout-s", "600.0")):
        assert flag in text and f"(default: {default})" in " ".join(text.split()), flag


def test_sim_engine_help_documents_fault_injection() -> None:
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    text = sub.choices["sim-engine"].format_help()  # type: ignore[index]
    assert "POST   /sim/faults" in text and '"count"' in text
    assert all(kind in text for kind in FAULT_KINDS)


def _serve_parser() -> Any:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["serve"]  # type: ignore[index]


def _settings(argv: list[str]) -> Settings:
    args = cli.build_parser().parse_args(["serve", "--engine", "http://x:1", "--tokenizer", "t", *argv])
    return cli.settings_from_args(args)


def test_every_setting_is_a_serve_flag_with_the_models_default() -> None:
    """One typed model: each field has a flag; the flag's help shows the model's default
    (the parser holds none of its own: an unset flag is None)."""
    serve = _serve_parser()
    by_dest = {a.dest: a for a in serve._actions}
    text = " ".join(serve.format_help().split())
    for name, info in Settings.model_fields.items():
        action = by_dest[f"setting_{name}"]
        assert "--" + name.replace("_", "-") in action.option_strings
        assert action.default is None
        if info.default is not None:
            assert f"(default: {info.default})" in text, name


_UNKNOWN_FAMILY = ("--template-family / TITO_TEMPLATE_FAMILY: unknown template family 'qwen-9000'; "
                   "known: qwen3, llama3, llama3.1, glm4moe, gemma4, deepseek, prime-qwen3")


def test_environment_fills_settings_and_a_flag_beats_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TITO_MAX_SESSIONS", "77")
    monkeypatch.setenv("TITO_CLAMP_LOGPROB_SENTINEL", "true")
    s = _settings([])
    assert s.max_sessions == 77 and s.clamp_logprob_sentinel is True and s.max_branches == 64
    s = _settings(["--max-sessions", "5", "--no-clamp-logprob-sentinel", "--ttl-s", "9", "--max-body-mb", "2"])
    assert (s.max_sessions, s.clamp_logprob_sentinel, s.default_ttl_s, s.max_body_bytes) == (5, False, 9.0, 2 * 1024 * 1024)


@pytest.mark.parametrize(("argv", "env", "needle"), [
    (["--max-sessions", "0"], {}, "--max-sessions / TITO_MAX_SESSIONS"),
    ([], {"TITO_MAX_SESSIONS": "abc"}, "--max-sessions / TITO_MAX_SESSIONS"),
    (["--turn-timeout-s", "-1"], {}, "--turn-timeout-s"),
    (["--max-body-mb", "1", "--max-body-bytes", "4096"], {}, "not both"),
    (["--template-family", "qwen-9000"], {}, _UNKNOWN_FAMILY),
    ([], {"TITO_TEMPLATE_FAMILY": "qwen-9000"}, _UNKNOWN_FAMILY),
])
def test_bad_setting_is_one_line_and_exit_2(
    argv: list[str], env: dict[str, str], needle: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], no_uvicorn: dict[str, Any],
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc = cli.main(["serve", "--engine", "sglang=http://127.0.0.1:9", "--tokenizer", "/nonexistent", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and needle in err and len(err.splitlines()) == 1, err
    assert "app" not in no_uvicorn


def test_template_family_flag_alias_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--template-family`, its alias `--family` and TITO_TEMPLATE_FAMILY fill one setting."""
    assert _settings([]).template_family is None
    assert _settings(["--template-family", "qwen3.5"]).template_family == "qwen3.5"
    assert _settings(["--family", "glm-5"]).template_family == "glm-5"
    monkeypatch.setenv("TITO_TEMPLATE_FAMILY", "generic")
    assert _settings([]).template_family == "generic"
    assert _settings(["--family", "llama3"]).template_family == "llama3"
    flags = [a.option_strings for a in _serve_parser()._actions if "--family" in a.option_strings]
    assert flags == [["--template-family", "--family"]]  # one option, not two


@pytest.mark.parametrize(("argv", "line"), [
    ([], "chat-template family: qwen3 (digest: "),
    (["--family", "generic"], "chat-template family: generic (forced: "),
])
def test_serve_logs_the_family_and_why(
    no_uvicorn: dict[str, Any], monkeypatch: pytest.MonkeyPatch, builtin_cache: Path,
    caplog: pytest.LogCaptureFixture, argv: list[str], line: str,
) -> None:
    from starlette.testclient import TestClient

    monkeypatch.setenv("TITO_CACHE_DIR", str(builtin_cache))
    base = ["serve", "--engine", "sglang=http://127.0.0.1:9", "--tokenizer", "qwen3", "--cpu-workers", "1",
            "--decode-processes", "0"]
    assert cli.main([*base, *argv]) == 0
    with caplog.at_level("INFO"), TestClient(no_uvicorn["app"]) as c:
        assert c.get("/health").status_code in (200, 503)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("chat-template family:")]
    assert len(lines) == 1 and lines[0].startswith(line), lines


def test_sim_engine_routed_experts_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """`sim-engine --routed-layers/--routed-topk/--routed-experts` shape the simulated MoE
    (the R3 bench runs 60 x top-8); `--enable-return-routed-experts` is vLLM's server flag."""
    import session_server.sim as sim
    from session_server.sim.routed import DEFAULT_ROUTED, RoutedSpec

    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(sim, "run_sim_engine", lambda *a, **kw: seen.append(kw))
    assert cli.main(["sim-engine", "--protocol", "vllm", "--tokenizer", "toy", "--routed-layers", "60",
                     "--routed-topk", "8", "--routed-experts", "128", "--enable-return-routed-experts"]) == 0
    assert cli.main(["sim-engine", "--protocol", "sglang", "--tokenizer", "toy"]) == 0
    assert seen[0]["routed"] == RoutedSpec(layers=60, topk=8, num_experts=128)
    assert seen[0]["return_routed_experts"] is True
    # no flag: the served model's config.json shapes it, as SGLang reads it (sim.routed.model_spec)
    assert seen[1]["routed"] == "model" and seen[1]["return_routed_experts"] is False
    assert cli.main(["sim-engine", "--protocol", "sglang", "--tokenizer", "toy", "--routed-topk", "8"]) == 0
    assert seen[2]["routed"] == RoutedSpec(layers=DEFAULT_ROUTED.layers, topk=8, num_experts=DEFAULT_ROUTED.num_experts)


@pytest.mark.parametrize("spec", ["http://a b:80", "sglang=http://h:1 ", "vllm"])
def test_serve_engine_url_with_whitespace_or_no_url_is_a_cli_error_naming_it(
    spec: str, capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["serve", "--engine", spec, "--tokenizer", "t"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--engine" in err and repr(spec) in err
