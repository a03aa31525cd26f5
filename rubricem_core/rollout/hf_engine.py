"""Multi-turn, tool-augmented rollouts with a Hugging Face causal LM and one KV cache kept across turns.

Design: one batch, one cache. Every sample of every request is a *row*. Each row owns a queue of
tokens the model has not seen yet: first its prompt, later its last sampled token, and after a tool
call that token plus the tool output ids. Every forward call takes up to ``max_chunk_tokens`` queued
tokens from every live row, right-padded into one ``[rows, L]`` chunk:

    row 0 (prompt / tool output)  t t t t t t      ← ingested in one call
    row 1 (sampling)              t . . . . .      ← '.' = hole: attention_mask 0
    row 2 (sampling)              t . . . . .

The cache grows by ``L`` slots for every row; holes stay masked forever (the 2-D attention mask
keeps one bit per cache slot), and ``position_ids`` count only a row's real tokens, so RoPE sees
each row as one contiguous sequence. A row whose queue empties in the call samples its next token
from the logits at its last real position. So a 300-token tool output is ingested in one call while
the other rows keep sampling, and no prefix is ever re-encoded. Finished rows are dropped from the
batch dimension of the cache; when holes make the cache much longer than the longest row, every
row's real slots are gathered to the front (keys already carry their rotary positions, and the
causal mask only orders past slots before new ones, so moving past slots is exact). With
``max_batch_rows`` set, waiting rows join the running batch as others finish (continuous batching):
a joining row gets zero-filled, masked past slots and its prompt arrives through its queue. The
cache is transformers' ``DynamicCache`` with its layers swapped for a growing buffer that appends in
place (the stock layer concatenates the whole cache every step).

Invariants that keep the numbers right: a row's first chunk starts with real tokens (right padding),
so no query ever sees only masked keys (that would put NaNs into hole slots, and 0 x NaN poisons
later attention); a row's forward is the same function of its real tokens whatever the holes are,
which ``tests/test_rollout_hf.py`` checks by recomputing every sampled logprob without a cache.

Where the rest lives: per-row bookkeeping (incremental detokenization, stage ids, turn ends, tool
budget, finish reasons, the trajectory) is :class:`~rubricem_core.rollout.rows.RowState`, shared
with the vLLM engine; tool calls of one step run in parallel threads (``rows.run_tool_calls``);
sampling is ``sampling.draw``; the cache and its surgery are ``kv_cache.BatchKVCache``.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from rubricem_core.rollout.batch import GroupHook, RowBatch, allowed_tools, default_stop_ids, row_rng
from rubricem_core.rollout.kv_cache import BatchKVCache
from rubricem_core.rollout.rows import RowState, run_tool_calls
from rubricem_core.rollout.sampling import draw, filter_top_k_top_p
from rubricem_core.rollout.types import ForcedPolicy, RolloutError, RolloutRequest
from rubricem_core.tools.base import ToolEnv
from rubricem_core.trajectory import TokenTrajectory

_filter_top_k_top_p = filter_top_k_top_p  # its old import path (tests)


class HFRolloutEngine:
    """Batched multi-turn sampling with a kept KV cache over a transformers causal LM.

    ``model`` may be the trainer's own module (on CPU the engine and trainer share it; ``sync_from``
    is then a no-op). ``tool_names`` are the tools the policy may call (they must exist in the
    ``ToolEnv`` given to ``generate``); None allows every tool of the env. ``max_chunk_tokens``
    bounds the tokens one row feeds per forward call; ``max_batch_rows`` bounds the rows in the batch
    (None: all at once); ``compact_min_slots`` is the fewest cache slots a compaction must free.
    ``forced_policy`` is a test/benchmark hook (see ``types.ForcedPolicy``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        tool_names: Sequence[str] | None = ("search", "browse"),
        *,
        stop_token_ids: Sequence[int] | None = None,
        max_chunk_tokens: int = 256,
        tool_timeout_s: float = 60.0,
        compact_min_slots: int = 64,
        max_batch_rows: int | None = None,
        forced_policy: ForcedPolicy | None = None,
    ):
        if max_chunk_tokens < 1:
            raise RolloutError(f"max_chunk_tokens must be >= 1, got {max_chunk_tokens}")
        if max_batch_rows is not None and max_batch_rows < 1:
            raise RolloutError(f"max_batch_rows must be >= 1 (or None for all rows), got {max_batch_rows}")
        if not tool_timeout_s > 0:
            raise RolloutError(f"tool_timeout_s must be > 0, got {tool_timeout_s}")
        layer_types = getattr(model.config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise RolloutError(
                f"HFRolloutEngine needs full-attention layers only; {type(model).__name__} has "
                f"{sorted(set(layer_types))}"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.tool_names = None if tool_names is None else tuple(tool_names)
        self.max_chunk_tokens = int(max_chunk_tokens)
        self.tool_timeout_s = float(tool_timeout_s)
        self.compact_min_slots = int(compact_min_slots)
        self.max_batch_rows = max_batch_rows
        self.forced_policy = forced_policy
        if stop_token_ids is None:
            gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
            stop_token_ids = sorted(default_stop_ids(tokenizer, gen_eos))
        self.stop_token_ids = frozenset(map(int, stop_token_ids))
        if not self.stop_token_ids:
            raise RolloutError("no stop token: the tokenizer has no eos_token_id and none was given")
        self._decoder = getattr(model, model.base_model_prefix)
        self._lm_head = model.get_output_embeddings()
        self._softcap = getattr(model.config, "final_logit_softcapping", None)
        params = inspect.signature(self._decoder.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.stats: dict[str, float] = {}
        # called as (finished trajectories, all trajectories) while generate runs: the task's progress line
        self.on_progress: Callable[[int, int], None] | None = None
        # called as (request index, its trajectories) once per request when its last row ends (a streaming judge)
        self.on_group_done: GroupHook | None = None

    # ---- weights --------------------------------------------------------------------------------
    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.model.load_state_dict(dict(state_dict), strict=True)

    def sync_from(self, model: torch.nn.Module) -> None:
        if model is self.model:
            return  # shared module: the engine already sees the trainer's weights
        self.update_weights(model.state_dict())

    # ---- public entry ---------------------------------------------------------------------------
    def generate(self, requests: list[RolloutRequest], tools: ToolEnv) -> list[list[TokenTrajectory]]:
        self.stats = {}
        batch = RowBatch(
            requests,
            allowed_tools(self.tool_names, tools),
            self.tokenizer,
            self.stop_token_ids,
            vocab_size=self._lm_head.weight.shape[0],
            rng=row_rng,
        )
        started = time.perf_counter()
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                self._run(batch)
        finally:
            self.model.train(was_training)
        self.stats["generate_s"] = time.perf_counter() - started
        batch.report(None, self.on_group_done)  # every group fires, rows that never ran included
        return batch.trajectories()

    # ---- the loop ---------------------------------------------------------------------------------
    def _run(self, batch: RowBatch) -> None:
        device = self._lm_head.weight.device
        waiting = batch.live
        limit = self.max_batch_rows or len(waiting)
        rows, waiting = waiting[:limit], waiting[limit:]
        cache = BatchKVCache(self.model.config, device, len(rows))
        n_forward = n_slots = n_real_slots = 0
        while rows:
            # 1. one chunk: up to max_chunk_tokens queued tokens per row, right-padded with holes
            width = min(max(len(r.queue) for r in rows), self.max_chunk_tokens)
            ids = torch.zeros((len(rows), width), dtype=torch.long)
            pos = torch.zeros((len(rows), width), dtype=torch.long)
            real = torch.zeros((len(rows), width), dtype=torch.bool)
            last = []
            for i, row in enumerate(rows):
                take = min(len(row.queue), width)
                ids[i, :take] = torch.tensor(row.queue[:take])
                pos[i, :] = cache.positions[i] + torch.arange(width).clamp_max(max(take - 1, 0))
                real[i, :take] = True
                row.queue = row.queue[take:]
                cache.positions[i] += take
                last.append(take - 1)
            cache.extend(real)
            hidden = self._forward(ids.to(device), pos.to(device), cache.mask, cache.cache)
            n_forward += 1
            n_slots += len(rows) * width
            n_real_slots += int(real.sum())

            # 2. rows whose queue is empty sample their next token
            ready = [i for i, row in enumerate(rows) if not row.queue]
            if ready:
                at = torch.tensor([last[i] for i in ready], device=device)
                picked = hidden[torch.tensor(ready, device=device), at]
                tokens, logprobs = self._sample([rows[i] for i in ready], self._logits(picked))
                calls = [
                    rows[i] for i, token, logprob in zip(ready, tokens, logprobs) if rows[i].accept(token, logprob)
                ]
                run_tool_calls(calls, self.tool_timeout_s)

            # 3. drop finished rows; compact the cache when holes make it much longer than needed
            keep = [i for i, row in enumerate(rows) if not row.finished]
            if len(keep) < len(rows):
                cache.keep(keep)
                rows = [rows[i] for i in keep]
            if not rows:  # start the next rows on a fresh cache
                cache.reset()
            if waiting and len(rows) < limit:
                admitted, waiting = waiting[: limit - len(rows)], waiting[limit - len(rows) :]
                cache.admit(len(admitted))
                self.stats["admitted"] = self.stats.get("admitted", 0) + len(admitted)
                rows = rows + admitted
            if rows and cache.compact(self.compact_min_slots):
                self.stats["compactions"] = self.stats.get("compactions", 0) + 1
            batch.report(self.on_progress, self.on_group_done)
        self.stats.update(forward_calls=n_forward, chunk_slots=n_slots, real_slots=n_real_slots)

    # ---- model ------------------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache: Any) -> torch.Tensor:
        out = self._decoder(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{self._cache_kwarg: cache}
        )
        return out.last_hidden_state

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._lm_head(hidden).float()
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        if not torch.isfinite(logits).all():
            raise RuntimeError("non-finite logits in rollout: the model weights or the cache are corrupt")
        return logits

    def _sample(self, rows: list[RowState], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Draw one token per row; return the tokens and their logprobs under the sampled distribution."""
        tokens, logp = draw(logits, [r.sampling for r in rows], [r.uniform() for r in rows])
        if self.forced_policy is not None:
            tokens = self._force(rows, tokens, logits.shape[-1])
        chosen = logp.gather(1, tokens[:, None]).squeeze(1)
        return tokens.tolist(), chosen.tolist()

    def _force(self, rows: list[RowState], tokens: torch.Tensor, vocab: int) -> torch.Tensor:
        policy = self.forced_policy
        if policy is None:
            return tokens
        tokens = tokens.clone()
        for i, row in enumerate(rows):
            forced = policy(row.forced_context())
            if forced is not None:
                if not 0 <= int(forced) < vocab:
                    raise RolloutError(
                        f"forced_policy returned token id {forced}, outside the vocabulary (size {vocab})"
                    )
                tokens[i] = int(forced)
        return tokens
