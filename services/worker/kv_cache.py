"""The paged KV memory: one pool of fixed-size blocks per layer, addressed by slot.

The engine owns which blocks a sequence holds (its block table); the worker only reads and
writes the slots those tables name. Slot ``s`` is position ``s % block_size`` of block
``s // block_size``.
"""
from __future__ import annotations

import torch

from services.worker import huge_pages


def head_elements(head_dim: int, dtype: torch.dtype) -> int:
    """Elements one KV head takes in a slot: ``head_dim``, or for int8 values (the native kernels' q8, C++
    ``native_glue.h``) the head's int8 values and then the 4 bytes of their fp32 scale."""
    return head_dim + 4 if dtype == torch.int8 else head_dim


class KVPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 budget_bytes: int, dtype: torch.dtype, device: torch.device, value_dtype: torch.dtype | None = None):
        """``dtype``: the keys' element type, and the values' unless ``value_dtype`` says otherwise (torch.int8:
        q8 values, ``head_elements``)."""
        self.dtype, self.value_dtype = dtype, value_dtype or dtype
        shapes = [(num_kv_heads, head_dim), (num_kv_heads, head_elements(head_dim, self.value_dtype))]
        row_bytes = [shapes[0][0] * shapes[0][1] * dtype.itemsize,
                     shapes[1][0] * shapes[1][1] * self.value_dtype.itemsize]
        bytes_per_block = num_layers * block_size * sum(row_bytes)
        self.num_blocks = max(1, budget_bytes // bytes_per_block)
        self.block_size = block_size
        num_slots = self.num_blocks * block_size
        # the bytes of every layer's keys [slots, kv_heads, head_dim] then its values [slots, kv_heads, head_dim (q8:
        # + 4)]; on CPU in a mapping with huge pages asked for (a long context's step reads its blocks scattered over
        # the pool)
        nbytes = self.num_blocks * bytes_per_block
        self.data = huge_pages.zeros(nbytes) if device.type == "cpu" else \
            torch.zeros(nbytes, dtype=torch.uint8, device=device)
        # each layer's (k, v) views made once: a step asks for every layer's
        self._layers = []
        offset = 0
        for _ in range(num_layers):
            kv = []
            for kind, shape, row in zip((dtype, self.value_dtype), shapes, row_bytes):
                kv.append(self.data[offset:offset + num_slots * row].view(kind).view(num_slots, *shape))
                offset += num_slots * row
            self._layers.append((kv[0], kv[1]))

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of one layer, each [slots, kv_heads, head_dim] (q8 values: head_dim + 4, ``head_elements``)."""
        return self._layers[layer_idx]
