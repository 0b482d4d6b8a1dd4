"""The engine machinery without an engine: how a missing vLLM environment is reported (the engine tests
themselves are in test_vllm.py, marker ``engine``)."""

from __future__ import annotations

import json

import pytest

from fp8kit.cli import main
from fp8kit.engines.vllm import ENV_VAR, run_vllm, vllm_unavailable


def test_a_missing_vllm_environment_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert "scripts/vllm_env.sh" in vllm_unavailable()
    assert "does not exist" in vllm_unavailable(str(tmp_path / "nope" / "python"))
    with pytest.raises(RuntimeError, match="scripts/vllm_env.sh"):
        run_vllm([tmp_path], None)


def test_eval_engine_refuses_before_any_work(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv(ENV_VAR, raising=False)
    export = tmp_path / "q"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "compressed-tensors"}}))
    assert main(["eval", "--engine", "vllm", "--model", "smollm2"]) == 2
    assert "--checkpoint DIR" in capsys.readouterr().err
    assert main(["eval", "--engine", "vllm", "--checkpoint", str(export)]) == 2
    assert "scripts/vllm_env.sh" in capsys.readouterr().err
