"""The KV cache of one decoding group: transformers' ``DynamicCache``, preallocated when it can.

``DynamicCache`` grows each layer with ``torch.cat``, copying the whole cache at every step.
A group knows its longest sequence up front (prompt width + ``max_new_tokens``), so for models
whose layers are all plain full attention the layers here write into buffers of that size and
hand the model views of the filled part: the same keys and values, without the copies. Models
with other layer kinds (sliding window, linear attention) keep transformers' own layers.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

__all__ = ["PreallocatedLayer", "drop_leading_columns", "new_group_cache"]


class PreallocatedLayer(DynamicLayer):
    """A full-attention layer whose keys and values live in ``[A, H, capacity, D]`` buffers.

    ``keys`` and ``values`` are views ``[A, H, length, D]`` of the filled part, as
    ``DynamicLayer`` would hold them.
    """

    _layer_type = None  # never registered as transformers' default for any layer type

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        rows, heads, _, _ = key_states.shape
        self._key_buffer = key_states.new_empty((rows, heads, self.capacity, key_states.shape[-1]))
        self._value_buffer = value_states.new_empty(
            (rows, heads, self.capacity, value_states.shape[-1])
        )
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[A, H, Q, D]`` new states after the filled part; return all ``[A, H, T, D]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(
                f"KV cache overflow: {end} positions for a capacity of {self.capacity}"
            )
        self._key_buffer[:, :, self.length : end] = key_states
        self._value_buffer[:, :, self.length : end] = value_states
        self.length = end
        keys, values = self._refresh()
        return keys, values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only rows ``indices`` ``[A']``."""
        if self.is_initialized:
            self._key_buffer = self._key_buffer[indices]
            self._value_buffer = self._value_buffer[indices]
            self._refresh()

    def drop_leading(self, count: int) -> None:
        """Forget the first ``count`` positions of every row (padding no remaining row needs)."""
        self.capacity -= count
        self.length -= count
        if self.is_initialized:
            self._key_buffer = self._key_buffer[:, :, count:]
            self._value_buffer = self._value_buffer[:, :, count:]
            self._refresh()

    def reset(self) -> None:
        self.length = 0
        super().reset()

    def _refresh(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Point ``keys`` and ``values`` at the filled part of the buffers; return them."""
        keys = self._key_buffer[:, :, : self.length]
        values = self._value_buffer[:, :, : self.length]
        self.keys, self.values = keys, values
        return keys, values


def new_group_cache(model_config: PretrainedConfig, capacity: int) -> DynamicCache:
    """A cache for one group whose sequences (padding included) never exceed ``capacity``.

    Args:
        model_config: the model's config.
        capacity: the most positions any layer will hold.
    """
    cache = DynamicCache(config=model_config)
    if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [PreallocatedLayer(capacity) for _ in cache.layers]
    return cache


def drop_leading_columns(cache: DynamicCache, count: int) -> bool:
    """Remove the first ``count`` cached positions of every row, when the layout allows it.

    Only preallocated layers are cut; a cache with transformers' own layers is left alone.
    Returns whether the columns went.
    """
    layers = [layer for layer in cache.layers if isinstance(layer, PreallocatedLayer)]
    if not layers or len(layers) != len(cache.layers):
        return False
    for layer in layers:
        layer.drop_leading(count)
    return True
