"""A Llama-family GGUF model run over the file's own blocks (``--dtype native``).

Every projection of every layer is a ``QuantLinear`` over the tensor's blocks (q, k, v fused into one matrix,
gate and up into one, as ``llama_step.py`` wants: whole block rows concatenated); the token embedding is read
row by row from its blocks, and is the output head as well when the model ties them (SmolLM2: Q8_0). The norms
are the file's F32 vectors. Activations are fp32 (bfloat16 arithmetic is emulated on CPUs without AVX-512
BF16). Nothing is converted to safetensors and no transformers model is built: the configuration comes from
the GGUF metadata (transformers' reader), the rotary embedding is transformers' own module.

llama.cpp's converter permutes the rows of q and k (its rotary layout interleaves the two halves of each
head); they are permuted back here, whole rows of blocks, as transformers does when it dequantizes.

A tensor type without a native kernel is dequantized to fp32 (``QuantLinear``'s portable path); ``summary``
names those tensors, and the worker logs it and reports it in ``WorkerInfo.weights``.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, dequantize
from transformers import AutoConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from services.common.model_source import ModelSource
from services.worker.gguf_weights import CorruptModel, GGUFWeights
from services.worker.llama_step import LlamaStep, _Layer
from services.worker.model_loader import save_pretrained_atomically
from services.worker.native_ops import NativeLayerOps
from services.worker.native_step import NativeDecodeStep
from services.worker.quant_linear import QuantLinear, gather

log = logging.getLogger("llmserve.worker.native")


@dataclass
class NativeModel:
    config: Any
    step: LlamaStep
    lm_head: QuantLinear
    weights_bytes: int
    summary: str          # what runs natively and what was dequantized


def supported(source: ModelSource) -> bool:
    return source.format == "gguf"


def load_native(source: ModelSource) -> NativeModel:
    """The model in ``source`` (a GGUF file) over its blocks; ``CorruptModel`` names a bad tensor; ``ValueError``
    where the architecture is not one ``LlamaStep`` runs."""
    weights = GGUFWeights(source.path)
    cfg = _config(source)
    if not LlamaStep.supports_config(cfg):
        raise ValueError(f"native weights run Llama-family models; {source.name} is {cfg.model_type!r} "
                         "(use --dtype float32 or bfloat16)")
    try:
        return _build(weights, cfg)
    finally:
        weights.close()


def _build(weights: GGUFWeights, cfg: Any) -> NativeModel:
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    kinds: Counter[str] = Counter()
    dequantized: list[str] = []
    matrices: list[QuantLinear] = []

    def linear(*names: str, permute: tuple[int | None, ...] = ()) -> QuantLinear:
        parts, qtypes, k = [], set(), None
        for i, name in enumerate(names):
            blocks, qtype, n, k_ = weights.matrix(name)
            if k is not None and k_ != k:
                raise CorruptModel(f"tensor {name}: {k_} columns, {names[0]} has {k}")
            k = k_
            per_head = permute[i] if i < len(permute) else None
            if per_head:
                blocks = blocks.reshape(per_head, n // per_head // 2, 2, -1).swapaxes(2, 1).reshape(n, -1)
            parts.append(blocks)
            qtypes.add(qtype)
        if len(qtypes) != 1:    # mixed types in one fused matrix: dequantize them together
            dense = np.concatenate([_dense(weights, nm) for nm in names])
            lin = QuantLinear(dense.view(np.uint8), GGMLQuantizationType.F32, dense.shape[0], dense.shape[1])
        else:
            qtype = qtypes.pop()
            lin = QuantLinear(np.concatenate(parts) if len(parts) > 1 else parts[0], qtype,
                              sum(p.shape[0] for p in parts), k)
        for name in names:
            kinds[weights.tensors[name].tensor_type.name] += 1
            if not lin.native:
                dequantized.append(f"{name} ({weights.tensors[name].tensor_type.name})")
        matrices.append(lin)
        return lin

    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"blk.{i}."
        layers.append(_Layer(
            index=i,
            input_norm=weights.vector(p + "attn_norm.weight"),
            post_norm=weights.vector(p + "ffn_norm.weight"),
            qkv=linear(p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight", permute=(heads, kv_heads)),
            o=linear(p + "attn_output.weight"),
            gate_up=linear(p + "ffn_gate.weight", p + "ffn_up.weight"),
            down=linear(p + "ffn_down.weight")))
    embed = linear("token_embd.weight")
    head = linear("output.weight") if weights.has("output.weight") else embed
    gather(matrices)    # one mapping in the step's order, huge pages asked for
    final_norm = weights.vector("output_norm.weight")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    ops = NativeLayerOps.for_native(cfg.hidden_size, head_dim, cfg.intermediate_size)
    decode = NativeDecodeStep.build(layers, final_norm, cfg, head_dim)   # all-decode steps in one C++ call
    step = LlamaStep.from_parts(cfg, embed.rows, LlamaRotaryEmbedding(config=cfg), final_norm, layers, ops, decode)
    norms = [t for layer in layers for t in (layer.input_norm, layer.post_norm)] + [final_norm]
    held = sum(m.held_bytes() for m in matrices) + sum(t.numel() * 4 for t in norms)
    summary = "native blocks: " + ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))
    summary += "; dequantized to fp32: " + (", ".join(dequantized) if dequantized else "none")
    if dequantized:
        log.warning("native weights: no kernel for %s: dequantized to fp32", ", ".join(dequantized))
    return NativeModel(cfg, step, head, held, summary)


def _config(source: ModelSource) -> Any:
    """The model's configuration from the GGUF metadata (transformers' reader, slow: it parses the whole header
    again), cached as a config.json under the model's cache folder after the first load."""
    cached = source.cache_dir / "native"
    if (cached / "config.json").is_file():
        return AutoConfig.from_pretrained(cached)
    cfg = AutoConfig.from_pretrained(source.path.parent, gguf_file=source.path.name)
    save_pretrained_atomically(cfg, cached)
    return cfg


def _dense(weights: GGUFWeights, name: str) -> np.ndarray:
    blocks, qtype, n, k = weights.matrix(name)
    return dequantize(blocks, qtype).reshape(n, k).astype(np.float32)
