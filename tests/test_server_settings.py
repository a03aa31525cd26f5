"""`rollout.server_env`, `rollout.enforce_eager` and `rollout.server_python` reach the `vllm serve` command.

The server's Python is a shell script here that records its arguments and environment and exits, so the
real construction path (fleet_engine → start_fleet → VLLMServer → Popen) runs without vLLM."""

from __future__ import annotations

import stat

import pytest

from rubricem_core.config import load_config
from rubricem_core.rollout.factory import fleet_engine
from rubricem_core.rollout.types import RolloutError


def _recording_python(tmp_path):
    script = tmp_path / "python"
    script.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\nenv > {tmp_path}/env\nexit 3\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


@pytest.mark.parametrize("eager", [True, False])
def test_server_settings_reach_the_command(tmp_path, eager):
    python = _recording_python(tmp_path)
    cfg = load_config(
        "tiny",
        {
            "rollout.engine": "vllm_server",
            "rollout.server_python": str(python),
            "rollout.server_env": {"VLLM_CPU_KVCACHE_SPACE": "3", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
            "rollout.enforce_eager": eager,
            "rollout.server_startup_timeout_s": 30,
            "rollout.server_dtype": "bfloat16" if eager else None,
        },
    )
    with pytest.raises(RolloutError, match="exited with code 3 while starting"):
        fleet_engine(tmp_path / "model", None, cfg, tmp_path / "server.log", push=False)
    args = (tmp_path / "args").read_text().split()
    env = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line)
    assert args[:2] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert ("--enforce-eager" in args) is eager
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert args[args.index("--host") + 1] == "127.0.0.1"
    # on a CPU (this machine) a seeded request's prompt is never split over two scheduler steps: the CPU
    # build's generators cannot rewind and the engine died on the first long prompt
    assert args[args.index("--dtype") + 1] == ("bfloat16" if eager else cfg.policy.dtype)
    assert "--no-enable-chunked-prefill" in args
    assert int(args[args.index("--max-num-batched-tokens") + 1]) >= cfg.rollout.max_total_tokens


def test_a_missing_server_python_is_named(tmp_path):
    cfg = load_config(
        "tiny", {"rollout.engine": "vllm_server", "rollout.server_python": str(tmp_path / "no-venv" / "python")}
    )
    with pytest.raises(RolloutError, match=r"rollout.server_python .*no-venv/python.* does not exist.*vllm_cpu_env"):
        fleet_engine(tmp_path / "model", None, cfg, tmp_path / "server.log", push=False)
