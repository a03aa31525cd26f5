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
    # under the guard that stops the server's engine with it (rollout/server_guard.py)
    assert args[0] == "-c" and any("server_guard.py" in a for a in args[:4])
    assert args[args.index("vllm.entrypoints.openai.api_server") + 1] == "--model"
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


def test_the_server_log_goes_to_a_directory_not_made_yet(tmp_path):
    """The server's output pipe has one reader, which also writes the log file. Its directory (a run's
    state/) need not exist yet: it is made, and the pipe is drained, so a chatty server never blocks on a
    full pipe. Here 200 KiB of output (over a pipe's 64 KiB) precede the exit."""
    from rubricem_core.rollout.vllm_server import VLLMServer

    script = tmp_path / "python"
    script.write_text(
        '#!/bin/sh\ni=0\nwhile [ $i -lt 2000 ]; do printf "line %04d %0100d\\n" $i 0; i=$((i+1)); done\nexit 3\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "run" / "state" / "vllm-server.log"
    with pytest.raises(RolloutError, match="exited with code 3 while starting"):
        VLLMServer(tmp_path / "model", python=str(script), log_path=log, startup_timeout_s=60)
    lines = log.read_text().splitlines()
    assert len(lines) == 2000 and lines[-1].startswith("line 1999")
