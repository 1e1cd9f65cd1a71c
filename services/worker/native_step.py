"""The native path's decode steps in one C++ call each (``kernels/native_step.cpp``).

``LlamaStep`` runs a step op by op: per layer four ``QuantLinear`` matmuls and the glue of ``native_ops.py``
between them, each a ctypes call with its own tensors and OpenMP region. For a step whose rows are all decode
rows (the native attention runs it: ``layout.kernel_rows``) and that the block kernels take whole (at most
``quant_linear.PREFILL_ROWS`` rows, 12-bit activations), this class runs every layer in one call instead: one
OpenMP region, the phases meeting at barriers, no Python between. Row for row it computes what the op-by-op
path does, bit for bit (the same C++ arithmetic; ``tests/unit/test_native_step.py``), so which path a step
takes changes its speed, never its tokens. Steps with prefill chunks keep the op-by-op path where the attention
runs them as chunks (the avx512 build's prefill kernel); without it a chunk's queries are decode rows, run here.
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch

from services.worker import quant_linear
from services.worker.kv_cache import KVPool
from services.worker.quant_linear import QuantLinear

FUSED = True    # False: every step op by op (tests compare the two)

_TYPES = {"q4_1": 0, "q8_0": 1}
# the C step's kv_type for each (keys, values) element type (int8 values: q8, kv_cache.py)
_KV_TYPES = {(torch.float32, torch.float32): 0, (torch.float16, torch.float16): 1, (torch.float16, torch.int8): 2}


class _Matrix(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("type", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Matrix), ("o", _Matrix), ("gate_up", _Matrix), ("down", _Matrix),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


class _Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim",
                                                    "intermediate", "block_size", "kv_type")] + \
               [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("final_norm", ctypes.c_void_p),
                ("layer", ctypes.POINTER(_Layer))]


class NativeDecodeStep:
    """``step(h, cos, sin, layout)`` → the hidden states after the final norm, for the steps ``runs`` accepts."""

    def __init__(self, lib: ctypes.CDLL, layers: list[Any], final_norm: torch.Tensor, cfg: Any, head_dim: int):
        self._lib, self._layers, self._final_norm = lib, layers, final_norm
        self._cfg, self._head_dim = cfg, head_dim
        self._pool: KVPool | None = None
        self._model: _Model | None = None

    @classmethod
    def build(cls, layers: list[Any], final_norm: torch.Tensor, cfg: Any, head_dim: int) -> "NativeDecodeStep | None":
        """None where a layer's matrix is not a native Q4_1/Q8_0 matrix (dequantized: the op-by-op path) or the
        kernels do not run here."""
        mats = [m for layer in layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if not mats or not all(isinstance(m, QuantLinear) and m.native for m in mats):
            return None
        lib = mats[0].library            # the kernel build the matrices were repacked for
        if any(m.library is not lib for m in mats):
            return None
        return cls(lib, layers, final_norm, cfg, head_dim)

    def runs(self, layout: Any) -> bool:
        rows = layout.kernel_rows
        return (FUSED and rows is not None and rows.row_seq is None
                and rows.split is None and layout.num_tokens <= quant_linear.PREFILL_ROWS and self._bind(layout.pool))

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: Any) -> torch.Tensor:
        """``h`` [T, hidden] fp32 (the embeddings; left as the residual stream), ``cos``/``sin`` [T, head_dim]."""
        rows = layout.kernel_rows
        h, cos, sin = h.contiguous(), cos.contiguous(), sin.contiguous()
        out = torch.empty_like(h)
        self._lib.llmserve_native_step(
            ctypes.byref(self._model), h.shape[0], h.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            layout.slot_mapping.data_ptr(), rows.tables.data_ptr(), rows.tables.shape[1], rows.lens.data_ptr(),
            out.data_ptr())
        return out

    def _bind(self, pool: KVPool) -> bool:
        """The C description of the model over ``pool``'s caches (built once per pool); False where the C++
        step does not take this model's shapes."""
        if pool is self._pool:
            return self._model is not None
        self._pool, self._model = pool, None
        if pool.data.device.type != "cpu" or (pool.dtype, pool.value_dtype) not in _KV_TYPES:
            return False
        cfg = self._cfg

        def matrix(m: QuantLinear) -> _Matrix:
            return _Matrix(m.packed.data_ptr(), m.padded_rows, m.in_features, _TYPES[quant_linear.NATIVE_TYPES[m.qtype]])

        layers = (_Layer * len(self._layers))()
        for i, layer in enumerate(self._layers):
            k_cache, v_cache = pool.layer(layer.index)
            layers[i] = _Layer(matrix(layer.qkv), matrix(layer.o), matrix(layer.gate_up), matrix(layer.down),
                               layer.input_norm.data_ptr(), layer.post_norm.data_ptr(),
                               k_cache.data_ptr(), v_cache.data_ptr())
        # the structure keeps ``layers`` alive (ctypes holds the array an instance points to)
        model = _Model(len(self._layers), cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                       self._head_dim, cfg.intermediate_size, pool.block_size, _KV_TYPES[pool.dtype, pool.value_dtype],
                       cfg.rms_norm_eps, self._head_dim ** -0.5, self._final_norm.data_ptr(), layers)
        if self._lib.llmserve_native_step_supports(ctypes.byref(model)) == 0:
            self._model = model
        return self._model is not None
