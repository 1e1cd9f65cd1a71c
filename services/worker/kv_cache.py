"""The paged KV memory: one pool of fixed-size blocks per layer, addressed by slot.

The engine owns which blocks a sequence holds (its block table); the worker only reads and
writes the slots those tables name. Slot ``s`` is position ``s % block_size`` of block
``s // block_size``.
"""
from __future__ import annotations

import torch

from services.worker import huge_pages


class KVPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 budget_bytes: int, dtype: torch.dtype, device: torch.device):
        bytes_per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
        self.num_blocks = max(1, budget_bytes // bytes_per_block)
        self.block_size = block_size
        num_slots = self.num_blocks * block_size
        # [layers, 2 (k, v), slots, kv_heads, head_dim]; on CPU in a mapping with huge pages asked for (a long
        # context's step reads its blocks scattered over the pool)
        shape = (num_layers, 2, num_slots, num_kv_heads, head_dim)
        if device.type == "cpu":
            self.data = huge_pages.zeros(self.num_blocks * bytes_per_block).view(dtype).view(shape)
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=device)
        # each layer's (k, v) views made once: a step asks for every layer's, and two indexings cost ~10 µs
        self._layers = [(self.data[i, 0], self.data[i, 1]) for i in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of one layer, each [slots, kv_heads, head_dim]."""
        return self._layers[layer_idx]
