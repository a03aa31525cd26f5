"""The transformers engine's batch KV cache: growing in-place layers, a per-slot mask, row surgery.

One cache holds every running row. Each forward call appends ``L`` slots for every row; slots a
row did not fill are holes, masked forever by the 2-D attention mask (one bit per row per slot),
and each row's position counter counts only its real tokens, so RoPE sees each row as one
contiguous sequence. Surgery keeps the numbers exact:

- ``keep``: finished rows leave the batch dimension.
- ``admit``: waiting rows join a running batch (continuous batching) with zero-filled, masked past
  slots (zeros, never NaN, so 0 x value stays 0 in attention); their prompts arrive as tokens.
- ``compact``: when holes make the cache much longer than the longest row, every row's real slots
  are gathered to the front. Keys already carry their rotary positions, and the causal mask only
  orders past slots before new ones, so moving past slots changes nothing.

The cache is transformers' ``DynamicCache`` with its layers swapped for :func:`growing_layer_class`,
a buffer that appends in place (the stock layer concatenates the whole cache every step).
"""

from __future__ import annotations

from typing import Any

import torch


class BatchKVCache:
    """The running batch's cache, its attention mask ``[rows, slots]`` and each row's next position."""

    def __init__(self, model_config: Any, device: torch.device, rows: int):
        self.model_config = model_config
        self.device = device
        self.cache = _new_cache(model_config)
        self.mask = torch.zeros((rows, 0), dtype=torch.bool, device=device)
        self.positions = [0] * rows  # real tokens of each row in the cache = its next position id

    def _layers(self) -> list[Any]:
        return [layer for layer in self.cache.layers if layer.get_seq_length() > 0]

    def extend(self, real: torch.Tensor) -> None:
        """Account for one forward chunk: ``real`` is ``[rows, width]``, True where a row fed a token."""
        self.mask = torch.cat([self.mask, real.to(self.device)], dim=1)

    def keep(self, rows: list[int]) -> None:
        """Drop every row not in ``rows`` (batch indices, ascending)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        for layer in self._layers():
            layer.select_rows(index)
        self.mask = self.mask[index]
        self.positions = [self.positions[i] for i in rows]

    def reset(self) -> None:
        """A fresh, empty cache (once every row has left, the next rows start from zero slots)."""
        self.cache = _new_cache(self.model_config)
        self.mask = torch.zeros((0, 0), dtype=torch.bool, device=self.device)
        self.positions = []

    def admit(self, count: int) -> None:
        """Add ``count`` rows at the end of the batch: past slots are zero-filled holes."""
        for layer in self._layers():
            layer.add_rows(count)
        self.mask = torch.cat([self.mask, self.mask.new_zeros((count, self.mask.shape[1]))], dim=0)
        self.positions += [0] * count

    def compact(self, min_slots: int) -> bool:
        """Gather real slots to the front when that frees at least ``max(min_slots, slots / 8)``."""
        mask = self.mask
        slots = mask.shape[1]
        longest = max(self.positions)
        if slots - longest < max(min_slots, slots // 8):
            return False
        # Per row: indices of its real slots (in order), padded with slot 0 (masked) up to `longest`.
        counts = mask.sum(dim=1)
        order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :longest]
        new_mask = torch.arange(longest, device=mask.device)[None, :] < counts[:, None]
        order = torch.where(new_mask, order, torch.zeros_like(order))
        for layer in self._layers():
            layer.gather_slots(order)
        self.mask = new_mask
        return True


def _new_cache(model_config: Any) -> Any:
    from transformers import DynamicCache

    cache = DynamicCache(config=model_config)
    cache.layers = [growing_layer_class()() for _ in cache.layers]
    return cache


_GROWING_LAYER: type | None = None


def growing_layer_class() -> type:
    """A transformers ``DynamicLayer`` that appends in place into a buffer doubling when full.

    The stock layer concatenates the whole cache on every step (a full copy per token per layer);
    writing into spare capacity makes a decode step cost what attention costs (about 2x faster on
    CPU at a few thousand slots). ``keys``/``values`` are views of the used part of the buffers.
    Built lazily so importing this module does not import transformers' cache code.
    """
    global _GROWING_LAYER
    if _GROWING_LAYER is not None:
        return _GROWING_LAYER
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        def __init__(self, **kwargs: Any):
            super().__init__(**kwargs)
            self._k: torch.Tensor | None = None
            self._v: torch.Tensor | None = None
            self._len = 0

        def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
            if self._k is None or self._v is None:
                raise RuntimeError("GrowingLayer has no key/value buffers before its first update()")
            return self._k, self._v

        def _reserve(self, need: int) -> None:
            k, v = self._buffers()
            if need <= k.shape[-2]:
                return
            capacity = max(need + need // 2, 64)
            self._k = k.new_zeros((*k.shape[:2], capacity, k.shape[-1]))
            self._v = v.new_zeros((*v.shape[:2], capacity, v.shape[-1]))
            self._k[..., : self._len, :] = k[..., : self._len, :]
            self._v[..., : self._len, :] = v[..., : self._len, :]

        def _expose(self) -> None:
            k, v = self._buffers()
            self.keys = k[..., : self._len, :]
            self.values = v[..., : self._len, :]

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if self._k is None:
                self._k, self._v = key_states[..., :0, :], value_states[..., :0, :]
            end = self._len + key_states.shape[-2]
            self._reserve(end)
            k, v = self._buffers()
            k[..., self._len : end, :] = key_states
            v[..., self._len : end, :] = value_states
            self._len = end
            self._expose()
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self._len

        # surgery used by BatchKVCache; each keeps the spare capacity where it can
        def select_rows(self, index: torch.Tensor) -> None:
            k, v = self._buffers()
            self._k, self._v = k[index], v[index]
            self._expose()

        def add_rows(self, count: int) -> None:
            k, v = self._buffers()
            self._k = torch.cat([k, k.new_zeros((count, *k.shape[1:]))], dim=0)
            self._v = torch.cat([v, v.new_zeros((count, *v.shape[1:]))], dim=0)
            self._expose()

        def gather_slots(self, order: torch.Tensor) -> None:
            def pick(cache: torch.Tensor) -> torch.Tensor:
                b, h, _, d = cache.shape
                return torch.gather(cache, 2, order[:, None, :, None].expand(b, h, order.shape[1], d))

            self._k, self._v = pick(self.keys), pick(self.values)
            self._len = order.shape[1]
            self._expose()

        def crop(self, tokens_to_remove: int) -> None:
            raise NotImplementedError("the rollout cache is never cropped")

    _GROWING_LAYER = GrowingLayer
    return GrowingLayer
