"""vLLM as its own process: `vllm serve` on the GPUs given to rollouts, with tensor parallelism,
driven over its HTTP API; the turn loop, tools and token bookkeeping are VLLMRolloutEngine's.

    server = VLLMServer("runs/x/checkpoints/sft/final", devices=(0, 1), tensor_parallel_size=2)
    engine = VLLMServerEngine(server, tokenizer, max_model_len=16384)
    engine.generate(requests, tools)                    # POST /v1/completions, prompt = token ids
    engine.load_weights_from_dir(step_checkpoint)       # POST /collective_rpc reload_weights, /reset_prefix_cache

The server runs with ``VLLM_SERVER_DEV_MODE=1``, which serves vLLM's own ``/collective_rpc`` and
``/reset_prefix_cache``: after each update the workers reload the weights in place from the checkpoint
directory rank 0 wrote (gathered, ZeRO-3 included) and the prefix cache is dropped, so no KV computed
with old weights is reused. Its Python may be another environment's (``python``), e.g. the CPU build's
``.venv-vllm`` in tests, or a CUDA image's.

HF checkpoints of a model with tied embeddings store only ``model.embed_tokens.weight``, and vLLM's
in-place reload then keeps the old ``lm_head`` (docs/distributed.md); for such a model the reload reads a
side directory of links to the checkpoint's files plus ``lm_head.safetensors``.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from rubricem_core.distributed.launch import free_port, stop_process_group
from rubricem_core.rollout.types import RolloutError
from rubricem_core.rollout.vllm_engine import LOGPROBS_MODE, TurnCall, TurnSample, VLLMRolloutEngine

SERVED_NAME = "policy"


class VLLMServer:
    """One `vllm serve` process of ``model_dir`` on loopback (killed with its process group on close)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        python: str = sys.executable,
        devices: Sequence[int] | None = None,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        dtype: str | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 900.0,
        request_timeout_s: float = 600.0,
        log_path: str | Path | None = None,
        max_concurrency: int = 64,
        weight_transfer: str | None = None,
        sleep_mode: bool = False,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.n_workers = tensor_parallel_size  # the workers a weight push reaches (one data-parallel replica)
        self.weight_transfer = weight_transfer
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.max_concurrency = max_concurrency
        cmd = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            SERVED_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--enable-prefix-caching",
            "--logprobs-mode",
            LOGPROBS_MODE,
            "--seed",
            "0",
            "--tensor-parallel-size",
            str(tensor_parallel_size),
            "--gpu-memory-utilization",
            str(gpu_memory_utilization),
        ]
        if max_model_len is not None:
            cmd += ["--max-model-len", str(max_model_len)]
        if dtype is not None:
            cmd += ["--dtype", dtype]
        if weight_transfer is not None:  # the workers join a trainer's transfer group on request
            cmd += ["--weight-transfer-config", json.dumps({"backend": weight_transfer})]
        if sleep_mode:  # CUDA only: vLLM refuses it on a CPU, where /sleep is accepted and does nothing
            cmd += ["--enable-sleep-mode"]
        self.asleep = False
        cmd += list(extra_args)
        full_env = {**os.environ, **(env or {}), "VLLM_SERVER_DEV_MODE": "1"}
        if devices is not None:
            full_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
        self.log_path = Path(log_path) if log_path is not None else None
        self._tail: collections.deque[str] = collections.deque(maxlen=80)
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=full_env,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        atexit.register(self.close)  # never leave a server (and its GPUs) behind a process that exits
        self.http = httpx.Client(base_url=self.base_url, timeout=request_timeout_s)
        self._side_dir: Path | None = None
        try:
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        assert self.proc.stdout is not None
        log = self.log_path.open("a") if self.log_path is not None else None
        for line in self.proc.stdout:
            self._tail.append(line.rstrip("\n"))
            if log is not None:
                log.write(line)
                log.flush()

    def _failure(self, what: str) -> RolloutError:
        return RolloutError(
            f"vLLM server ({self.base_url}, model {self.model_dir}) {what}; last lines of its "
            "output:\n" + "\n".join(self._tail)
        )

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self._failure(f"exited with code {self.proc.returncode} while starting")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise self._failure(f"did not answer /health within {timeout_s:.0f}s")

    def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        if self.proc.poll() is not None:
            raise self._failure(f"exited with code {self.proc.returncode}")
        response = self.http.post(path, json=body)
        if response.status_code != 200:
            raise self._failure(f"answered {path} with HTTP {response.status_code}: {response.text[:500]}")
        return response.json() if response.content else None

    # ---- sampling -------------------------------------------------------------------------------
    def _sample_one(self, call: TurnCall) -> TurnSample:
        body = {
            "model": SERVED_NAME,
            "prompt": call.prompt_ids,
            "max_tokens": call.max_tokens,
            "temperature": call.sampling.temperature,
            "top_p": call.sampling.top_p,
            "top_k": call.sampling.top_k if call.sampling.top_k > 0 else -1,
            "seed": call.seed,
            "stop": list(call.stop),
            "stop_token_ids": list(call.stop_token_ids),
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        choice = self._post("/v1/completions", body)["choices"][0]
        tokens = choice["logprobs"]["tokens"]
        ids = [int(t.removeprefix("token_id:")) for t in tokens]
        return TurnSample(ids, [float(x) for x in choice["logprobs"]["token_logprobs"]])

    def sample(self, calls: list[TurnCall]) -> list[TurnSample]:
        """One completion per call, sent concurrently (the server batches them); in call order."""
        if not calls:
            return []
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(calls))) as pool:
            return list(pool.map(self._sample_one, calls))

    # ---- weights --------------------------------------------------------------------------------
    def load_weights_from_dir(self, directory: str | Path) -> float:
        """Reload every worker's weights in place from an HF checkpoint directory, then drop the prefix
        cache; returns the seconds it took."""
        started = time.perf_counter()
        source = self._reload_source(Path(directory).resolve())
        self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(source)}})
        self.reset_prefix_cache()
        return time.perf_counter() - started

    def sleep(self) -> None:
        """Free the GPUs for the trainer: weights to host memory, KV cache dropped (level 1; the weights
        come back on wake-up, so a server that needs no new weights samples with the old ones)."""
        self._post("/sleep?level=1")
        self.asleep = True

    def wake_up(self) -> None:
        self._post("/wake_up")
        self.asleep = False

    def reset_prefix_cache(self) -> None:
        """Drop every cached KV block: none computed with old weights may be reused."""
        self._post("/reset_prefix_cache")

    def _reload_source(self, directory: Path) -> Path:
        config = json.loads((directory / "config.json").read_text())
        if not config.get("tie_word_embeddings"):
            return directory
        from safetensors import safe_open
        from safetensors.torch import save_file

        side = directory.parent / f".{directory.name}.vllm-reload"
        shutil.rmtree(side, ignore_errors=True)
        side.mkdir()
        files = sorted(directory.glob("*.safetensors"))
        for f in files:
            (side / f.name).symlink_to(f)
        for name in ("config.json", "model.safetensors.index.json"):
            if (directory / name).exists():
                (side / name).symlink_to(directory / name)
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                if "model.embed_tokens.weight" in handle.keys():
                    save_file(
                        {"lm_head.weight": handle.get_tensor("model.embed_tokens.weight")},
                        str(side / "lm_head.safetensors"),
                    )
        index = directory / "model.safetensors.index.json"
        if index.exists():  # vLLM reads only the files an index names
            data = json.loads(index.read_text())
            data["weight_map"]["lm_head.weight"] = "lm_head.safetensors"
            (side / index.name).unlink()
            (side / index.name).write_text(json.dumps(data))
        if self._side_dir is not None and self._side_dir != side:
            shutil.rmtree(self._side_dir, ignore_errors=True)
        self._side_dir = side
        return side

    def close(self) -> None:
        """Stop the server (idempotent)."""
        self.http.close()
        stop_process_group(self.proc)
        if self._side_dir is not None:
            shutil.rmtree(self._side_dir, ignore_errors=True)


class VLLMServerEngine(VLLMRolloutEngine):
    """VLLMRolloutEngine whose turns are sampled by a VLLMServer (its own process and devices)."""

    def __init__(
        self, server: VLLMServer, tokenizer: Any, tool_names: Sequence[str] | None = ("search", "browse"), **kwargs: Any
    ) -> None:
        super().__init__(None, tokenizer, tool_names, sampler=server.sample, **kwargs)
        self.server = server
        self.model_path = server.model_dir
        if kwargs.get("stop_token_ids") is None:  # the model's generation-config eos ids too, as in-process
            self.stop_token_ids = frozenset(self._default_stops())

    def load_weights_from_dir(self, directory: str | Path) -> None:
        self.stats["update_weights_s"] = self.server.load_weights_from_dir(directory)

    def push_weights(self, policy: Any) -> None:
        """The trainer's current weights, pushed by ``policy`` through vLLM's weight-transfer API
        (rubricem_core.rollout.weight_transfer), then the prefix cache dropped."""
        if self.server.weight_transfer is None:
            raise RolloutError("this vLLM server was started without a weight-transfer backend")
        started = time.perf_counter()
        self.stats["weight_push_s"] = policy.push_weights(
            self.server.base_url, self.server.weight_transfer, self.server.n_workers
        )
        self.server.reset_prefix_cache()
        self.stats["update_weights_s"] = time.perf_counter() - started

    def update_weights(self, state_dict: Any) -> None:
        raise RolloutError(
            "the vLLM server engine loads weights from a checkpoint directory "
            "(load_weights_from_dir), not from tensors in this process"
        )

    def close(self) -> None:
        self.server.close()
