"""vLLM as its own process: `vllm serve` on the GPUs given to rollouts, with tensor parallelism,
driven over its HTTP API; the turn loop, tools and token bookkeeping are VLLMRolloutEngine's.

    server = VLLMServer("runs/x/checkpoints/sft/final", devices=(0, 1), tensor_parallel_size=2)
    engine = VLLMServerEngine(server, tokenizer, max_model_len=16384)
    engine.generate(requests, tools)                    # POST /v1/completions, prompt = token ids
    engine.load_weights_from_dir(step_checkpoint)       # POST /collective_rpc reload_weights, /reset_prefix_cache

The server listens on 127.0.0.1 and answers only requests that carry its API key (the launch's
``vllm_api_key``, in ``VLLM_API_KEY``): vLLM's own key check covers ``/v1`` paths only, so
``--middleware rubricem_core.rollout.vllm_auth.RequireApiKey`` checks every other route too. It runs with
``VLLM_SERVER_DEV_MODE=1``, which serves vLLM's own ``/collective_rpc`` and
``/reset_prefix_cache``: after each update the workers reload the weights in place from the checkpoint
directory rank 0 wrote (gathered, ZeRO-3 included) and the prefix cache is dropped, so no KV computed
with old weights is reused. Its Python may be another environment's (``python``), e.g. the CPU build's
``.venv-vllm`` in tests, or a CUDA image's.

A fleet (``VLLMFleet``, ``start_fleet``; ``rollout.replicas``) is N such servers, each on its own
``tensor_parallel_size`` devices. ``ReplicaRouter`` keeps every call of one request (its group: one
prompt, n rows, every turn) on one replica, whose prefix cache holds their shared past, and places a
new group on the live replica with the fewest outstanding tokens. A replica that dies mid-step (its
process exits) has its calls re-sent to the others: a call is a pure function of its ids, seed and the
step's weights, which every replica holds, so the step's trajectories are those it would have had
(docs/rollout_fleet.md). Weights reach every live replica before each step: one checkpoint reload on
each, or one push through one transfer group spanning all of them (weight_transfer.FleetWeightSync).

HF checkpoints of a model with tied embeddings store only ``model.embed_tokens.weight``, and vLLM's
in-place reload then keeps the old ``lm_head`` (docs/distributed.md); for such a model the reload reads a
side directory of links to the checkpoint's files plus ``lm_head.safetensors``.
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from rubricem_core.distributed.guard import SECRET_ENV, vllm_api_key
from rubricem_core.processes import free_port, popen_until_released, stop_process_group
from rubricem_core.rollout.server_guard import guarded_command
from rubricem_core.rollout.types import RolloutError
from rubricem_core.rollout.vllm_engine import LOGPROBS_MODE, TurnCall, TurnSample

SERVED_NAME = "policy"
ADAPTER_NAME = "policy-lora"  # rollout.weight_transfer adapter: the name each step's adapter is loaded under
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM accepts


def lora_server_args(rank: int) -> tuple[list[str], dict[str, str]]:
    """(arguments, environment) of a `vllm serve` that loads each step's LoRA adapter at run time."""
    max_rank = next((r for r in LORA_RANKS if r >= rank), None)
    if max_rank is None:
        raise RolloutError(f"policy.lora.rank {rank} is above the largest rank vLLM serves ({LORA_RANKS[-1]})")
    args = ["--enable-lora", "--max-lora-rank", str(max_rank), "--max-loras", "1"]
    return args, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


AUTH_MIDDLEWARE = "rubricem_core.rollout.vllm_auth.RequireApiKey"  # the key on every route, not only /v1
log = logging.getLogger(__name__)


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def server_command(
    model_dir: Path,
    *,
    python: str,
    host: str,
    port: int,
    tensor_parallel_size: int,
    gpu_memory_utilization: float,
    max_model_len: int | None,
    dtype: str | None,
    weight_transfer: str | None,
    sleep_mode: bool,
    extra_args: Sequence[str],
) -> list[str]:
    """The `vllm serve` command line of one replica (no secret on it: ``ps`` shows it), run under
    server_guard, which takes the server's engine processes down with it however the server ends."""
    cmd = [
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        host,
        "--port",
        str(port),
        "--middleware",
        AUTH_MIDDLEWARE,
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
    if not _cuda_here():
        # vLLM's CPU build rewinds a seeded request's generator when it splits the request's prompt over
        # two scheduler steps, and CPU generators cannot rewind ("CPU Generator does not use offset": the
        # engine dies). Every row here is seeded, so prompts are prefilled whole.
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_model_len or 0, 8192))]
    if dtype is not None:
        cmd += ["--dtype", dtype]
    if weight_transfer is not None:  # the workers join a trainer's transfer group on request
        cmd += ["--weight-transfer-config", json.dumps({"backend": weight_transfer})]
    if sleep_mode:  # CUDA only: vLLM refuses it on a CPU, where /sleep is accepted and does nothing
        cmd += ["--enable-sleep-mode"]
    return guarded_command(python, "vllm.entrypoints.openai.api_server", cmd + list(extra_args))


class ServerProcess:
    """One `vllm serve` process: its command and environment, its output (the log file and a tail, read by
    one thread) and its exit. It listens on ``host`` (loopback unless a replica must be reached from another
    node) and answers only requests that carry ``api_key`` (AUTH_MIDDLEWARE, every route)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        api_key: str,
        python: str = sys.executable,
        host: str = "127.0.0.1",
        devices: Sequence[int | str] | None = None,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        dtype: str | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        weight_transfer: str | None = None,
        sleep_mode: bool = False,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.port = free_port()
        self.base_url = f"http://{host}:{self.port}"
        cmd = server_command(
            self.model_dir,
            python=python,
            host=host,
            port=self.port,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            dtype=dtype,
            weight_transfer=weight_transfer,
            sleep_mode=sleep_mode,
            extra_args=extra_args,
        )
        # the key in the environment (a command line is public on this machine); the launch secret stays out
        full_env = {**os.environ, **(env or {}), "VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": api_key}
        full_env.pop(SECRET_ENV, None)
        if devices is not None:
            full_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
        self.log_path = Path(log_path) if log_path is not None else None
        self._tail: collections.deque[str] = collections.deque(maxlen=80)
        self._released = threading.Event()
        # SIGTERM to the guard when this process dies, even by SIGKILL: it stops the server and its engine (server_guard)
        self.proc = popen_until_released(
            cmd,
            self._released,
            signal.SIGTERM,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=full_env,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        # This thread is the only reader of the server's output pipe: if it died the server would block on a
        # full pipe (64 KiB, a few steps of request logs) and stall the run, so a log it cannot open is skipped.
        assert self.proc.stdout is not None
        log = None
        if self.log_path is not None:
            try:
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                log = self.log_path.open("a")
            except OSError as exc:
                self._tail.append(f"(server log {self.log_path} not written: {exc})")
        for line in self.proc.stdout:
            self._tail.append(line.rstrip("\n"))
            if log is not None:
                log.write(line)
                log.flush()

    def failure(self, what: str) -> RolloutError:
        return server_failure(self.base_url, self.model_dir, what, self.tail(), self.proc.poll())

    def wait_ready(self, timeout_s: float, api_key: str) -> None:
        """Until the server answers /health (RolloutError with its output's tail if it exits or times out)."""
        headers = {"Authorization": f"Bearer {api_key}"}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self.failure(f"exited with code {self.proc.returncode} while starting")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5, headers=headers).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise self.failure(f"did not answer /health within {timeout_s:.0f}s")

    def tail(self) -> str:
        """The last lines of the server's output."""
        return "\n".join(self._tail)

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def dead(self, broken_connection: bool = False, wait_s: float = 10.0) -> bool:
        """Whether the process has exited; after a broken connection it is given ``wait_s`` to finish
        dying, so a killed replica is told from a refused request."""
        if self.proc.poll() is not None:
            return True
        if broken_connection:
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                return False
            return True
        return False

    def stop(self) -> None:
        """Stop the server and its process group (idempotent)."""
        stop_process_group(self.proc)
        self._released.set()


# what a dead server's output says killed it, most specific first: (pattern, what to tell the operator)
ROOT_CAUSES: tuple[tuple[str, str], ...] = (
    ("out of memory", "out of memory"),
    ("OutOfMemoryError", "out of memory"),
    ("Cannot allocate memory", "out of memory"),
    ("insufficient memory", "out of memory"),
    ("Address already in use", "its port is taken"),
    ("No module named", "a module is missing from rollout.server_python's environment"),
    ("ModuleNotFoundError", "a module is missing from rollout.server_python's environment"),
)


def root_cause(tail: str, code: int | None = None) -> str | None:
    """One line on why a `vllm serve` process died, from its output's last lines and exit code."""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    for pattern, meaning in ROOT_CAUSES:
        for line in reversed(lines):
            if pattern.lower() in line.lower():
                return f"{meaning}: {line[-300:]}"
    if code in (-9, 137):
        return "killed by SIGKILL, most likely the kernel's out-of-memory killer (dmesg says)"
    errors = [line for line in lines if line.split(":")[0].endswith(("Error", "Exception"))]
    return errors[-1][-300:] if errors else None


def server_failure(base_url: str, model_dir: Path, what: str, tail: str, code: int | None = None) -> RolloutError:
    cause = root_cause(tail, code)
    because = f" ({cause})" if cause else ""
    return RolloutError(
        f"vLLM server ({base_url}, model {model_dir}) {what}{because}; last lines of its output:\n{tail}"
    )


RELOAD_READY = ".complete"  # written last into a reload side directory: it is whole


def reload_source(directory: Path) -> Path:
    """What vLLM's ``reload_weights`` reads for an HF checkpoint directory: the directory itself, or for a
    model with tied embeddings a side directory beside it (its files linked, plus ``lm_head.weight``, which
    vLLM's reload expects and the checkpoint does not store). The side directory is built once per
    checkpoint, under a name of its own and renamed into place, so replicas reloading the same step
    concurrently share one and never see it half-built (two used to rmtree and mkdir the same path)."""
    from rubricem_core.policy.loading import servable_dir

    directory = servable_dir(Path(directory)).resolve()  # a LoRA checkpoint: its merged copy
    config = json.loads((directory / "config.json").read_text())
    if not config.get("tie_word_embeddings"):
        return directory
    from safetensors import safe_open
    from safetensors.torch import save_file

    side = directory.parent / f".{directory.name}.vllm-reload"
    if (side / RELOAD_READY).is_file():
        return side
    staging = directory.parent / f".{directory.name}.vllm-reload.{os.getpid()}.{threading.get_ident()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    files = sorted(directory.glob("*.safetensors"))
    for f in files:
        (staging / f.name).symlink_to(f)
    for name in ("config.json", "model.safetensors.index.json"):
        if (directory / name).exists():
            (staging / name).symlink_to(directory / name)
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            if "model.embed_tokens.weight" in handle.keys():
                save_file(
                    {"lm_head.weight": handle.get_tensor("model.embed_tokens.weight")},
                    str(staging / "lm_head.safetensors"),
                )
    index = directory / "model.safetensors.index.json"
    if index.exists():  # vLLM reads only the files an index names
        data = json.loads(index.read_text())
        data["weight_map"]["lm_head.weight"] = "lm_head.safetensors"
        (staging / index.name).unlink()
        (staging / index.name).write_text(json.dumps(data))
    (staging / RELOAD_READY).write_text("")
    if side.exists() and not (side / RELOAD_READY).is_file():
        shutil.rmtree(side, ignore_errors=True)  # left half-built by a process that died (or older code)
    try:
        staging.rename(side)
    except OSError:  # another replica's is in place: the same content, use it
        shutil.rmtree(staging, ignore_errors=True)
        if not (side / RELOAD_READY).is_file():
            raise
    return side


class ServerClient:
    """The HTTP side of one `vllm serve` replica, whoever started its process (this process: VLLMServer; a
    Ray actor on some node: ray_replicas.RayReplica): sampling, weights, sleep and prefix-cache resets, every
    request with the server's API key. Subclasses say whether the process is gone (``dead``), what it last
    wrote (``tail``) and why a lost replica was lost (``lost_reason``)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str,
        model_dir: str | Path,
        tensor_parallel_size: int = 1,
        weight_transfer: str | None = None,
        max_concurrency: int = 64,
        request_timeout_s: float = 600.0,
    ) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.model_dir = Path(model_dir)
        self.n_workers = tensor_parallel_size  # the workers a weight push reaches (one data-parallel replica)
        self.weight_transfer = weight_transfer
        self.max_concurrency = max_concurrency
        self.model_name = SERVED_NAME  # ADAPTER_NAME once a LoRA adapter is loaded (load_adapter)
        self.asleep = False
        # one connection per call in flight (httpx's default pool of 100 would queue the rest)
        limits = httpx.Limits(max_connections=max_concurrency + 8, max_keepalive_connections=max_concurrency + 8)
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.http = httpx.Client(base_url=base_url, timeout=request_timeout_s, limits=limits, headers=self.headers)
        self._side_dir: Path | None = None

    # ---- the process, as far as this client knows it -----------------------------------------------
    def exit_code(self) -> int | None:
        """The process's exit code when this client can tell it cheaply (before every request), else None."""
        return None

    def tail(self) -> str:
        """The last lines of the server's output."""
        return ""

    def dead(self, exc: BaseException | None = None, wait_s: float = 10.0) -> bool:
        """Whether the server is gone (after a call failed with ``exc``)."""
        return False

    def lost_reason(self) -> str:
        """Why a dead replica is lost, with its output's last lines (for the fleet's report)."""
        code, tail = self.exit_code(), self.tail()
        cause = root_cause(tail, code)
        return f"exited with code {code}{f' ({cause})' if cause else ''}; last lines:\n{tail}"

    def _failure(self, what: str) -> RolloutError:
        return server_failure(self.base_url, self.model_dir, what, self.tail(), self.exit_code())

    def _post(self, path: str, body: dict[str, Any] | None = None, text: bool = False) -> Any:
        """The JSON reply (``text``: the reply's text, for routes that answer in words)."""
        code = self.exit_code()
        if code is not None:
            raise self._failure(f"exited with code {code}")
        response = self.http.post(path, json=body)
        if response.status_code != 200:
            raise self._failure(f"answered {path} with HTTP {response.status_code}: {response.text[:500]}")
        if text:
            return response.text
        return response.json() if response.content else None

    # ---- sampling -------------------------------------------------------------------------------
    def sample_one(self, call: TurnCall) -> TurnSample:
        body = {
            "model": self.model_name,
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
        if choice.get("finish_reason") in ("abort", "error"):
            # a stopping (or pausing) server answers its requests in flight with what it has, often nothing:
            # a failed call (re-sent by the fleet when the replica is gone), never a short sample
            raise self._failure(f"ended the completion with finish_reason {choice['finish_reason']!r}")
        tokens = choice["logprobs"]["tokens"]
        ids = [int(t.removeprefix("token_id:")) for t in tokens]
        return TurnSample(ids, [float(x) for x in choice["logprobs"]["token_logprobs"]])

    def sample(self, calls: list[TurnCall]) -> list[TurnSample]:
        """One completion per call, sent concurrently (the server batches them); in call order."""
        if not calls:
            return []
        if len(calls) == 1:
            return [self.sample_one(calls[0])]
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(calls))) as pool:
            return list(pool.map(self.sample_one, calls))

    # ---- weights --------------------------------------------------------------------------------
    def load_weights_from_dir(self, directory: str | Path) -> float:
        """Reload every worker's weights in place from an HF checkpoint directory, then drop the prefix
        cache; returns the seconds it took. (A replica on another node reads the same path: the run
        directory must be on storage every node mounts.)"""
        started = time.perf_counter()
        source = self._reload_source(Path(directory).resolve())
        self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(source)}})
        self.reset_prefix_cache()
        return time.perf_counter() - started

    def load_adapter(self, directory: str | Path) -> float:
        """Load a LoRA adapter (peft's files) in place of the last one, sample with it from now on, and drop the
        prefix cache; the seconds it took. The server must have been started with ``lora_server_args`` and read
        ``directory`` (a replica on another node: storage every node mounts)."""
        started = time.perf_counter()
        body = {"lora_name": ADAPTER_NAME, "lora_path": str(Path(directory).resolve()), "load_inplace": True}
        self._post("/v1/load_lora_adapter", body, text=True)  # "Success: LoRA adapter ... added successfully."
        self.model_name = ADAPTER_NAME
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
        side = reload_source(directory)
        if self._side_dir is not None and self._side_dir != side:
            shutil.rmtree(self._side_dir, ignore_errors=True)  # the last step's (other replicas are past it too)
        if side != directory:
            self._side_dir = side
        return side

    def close(self) -> None:
        """Close the client (idempotent); subclasses stop the server too."""
        self.http.close()
        if self._side_dir is not None:
            shutil.rmtree(self._side_dir, ignore_errors=True)


class VLLMServer(ServerClient):
    """One `vllm serve` process of ``model_dir`` on loopback, started by this process (``rollout.placement:
    local``), and its client; the process is killed with its process group on close."""

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
        api_key: str | None = None,
    ) -> None:
        api_key = api_key or vllm_api_key()  # trainer rank 0 derives the same from the launch secret
        self.process = ServerProcess(
            model_dir,
            api_key=api_key,
            python=python,
            devices=devices,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            dtype=dtype,
            extra_args=extra_args,
            env=env,
            log_path=log_path,
            weight_transfer=weight_transfer,
            sleep_mode=sleep_mode,
        )
        self.proc = self.process.proc
        self.port = self.process.port
        self.log_path = self.process.log_path
        super().__init__(
            self.process.base_url,
            api_key=api_key,
            model_dir=model_dir,
            tensor_parallel_size=tensor_parallel_size,
            weight_transfer=weight_transfer,
            max_concurrency=max_concurrency,
            request_timeout_s=request_timeout_s,
        )
        atexit.register(self.close)  # never leave a server (and its GPUs) behind a process that exits
        try:
            self.process.wait_ready(startup_timeout_s, api_key)
        except BaseException:
            self.close()
            raise

    def exit_code(self) -> int | None:
        return self.process.returncode

    def tail(self) -> str:
        return self.process.tail()

    def dead(self, exc: BaseException | None = None, wait_s: float = 10.0) -> bool:
        """Whether the process has exited; after a broken connection (``exc``) it is given ``wait_s``
        to finish dying, so a killed replica is told from a refused request."""
        return self.process.dead(isinstance(exc, httpx.TransportError), wait_s)

    def close(self) -> None:
        """Stop the server (idempotent)."""
        super().close()
        self.process.stop()
