"""One step's forward pass for Llama-family models, written out with few tensor ops.

At batch 1 a decode step is mostly per-op overhead: the stock transformers layer runs about 45 tensor
ops (three projections for q, k and v, an unfused RMSNorm of seven ops, rotate-half, two more for the
MLP's gate and up). This step runs the same math in 9 calls per layer: q, k and v in one projection,
gate and up in one (the prepacked bfloat16 matmuls of ``linear.py``), the attention, and the glue
between them fused in ``layer_ops.py`` (residual add + RMSNorm, rotary embedding + KV write, SiLU · up;
torch's ops where the C++ kernels do not run). It reads the weights of the loaded transformers model
(and uses its embedding and rotary embedding modules), so the model is still loaded and configured
by transformers; in float32 its outputs equal the stock forward's (a test checks it).

Models it does not describe exactly (biases, another activation, another attention) run the stock
forward with the paged attention registered in ``paged_attention.py``; ``LlamaStep.supports`` decides.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from services.worker import paged_attention
from services.worker.layer_ops import LayerOps
from services.worker.linear import Linear


@dataclass
class _Layer:
    index: int
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Callable[[torch.Tensor], torch.Tensor]   # [q heads | k heads | v heads] × head_dim outputs (Linear)
    o: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor]   # [gate | up] outputs
    down: Callable[[torch.Tensor], torch.Tensor]


class LlamaStep:
    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        return LlamaStep.supports_config(model.config)

    @staticmethod
    def supports_config(cfg: Any) -> bool:
        return (cfg.model_type in ("llama", "mistral") and cfg.hidden_act == "silu"
                and not getattr(cfg, "attention_bias", False) and not getattr(cfg, "mlp_bias", False)
                and getattr(cfg, "pretraining_tp", 1) == 1
                and getattr(cfg, "sliding_window", None) is None)

    def __init__(self, model: torch.nn.Module):
        """Takes the decoder layers' weights out of ``model`` (the stock layers are dropped, so the weights
        are held once); ``model`` keeps its embedding, rotary embedding, final norm and head."""
        inner = model.model
        layers = []
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(_Layer(
                index=i,
                input_norm=layer.input_layernorm.weight.detach(),
                post_norm=layer.post_attention_layernorm.weight.detach(),
                qkv=Linear(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])),
                o=Linear(attn.o_proj.weight),
                gate_up=Linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                down=Linear(mlp.down_proj.weight)))
        weight = inner.embed_tokens.weight
        self._configure(model.config, inner.embed_tokens, inner.rotary_emb, inner.norm.weight.detach(), layers,
                        weight.dtype, weight.device)
        inner.layers = torch.nn.ModuleList()  # the weights live in self.layers now

    @classmethod
    def from_parts(cls, cfg: Any, embed: Callable[[torch.Tensor], torch.Tensor], rotary: torch.nn.Module,
                   final_norm: torch.Tensor, layers: list[_Layer], ops: LayerOps | None = None,
                   decode: Any = None) -> "LlamaStep":
        """A step over weights held elsewhere (``native_model.py``: GGUF blocks); fp32 activations on CPU.
        ``layers``' matmuls are any ``y = x @ W.T`` callables; ``ops``: the glue (default ``LayerOps.for_model``);
        ``decode``: runs whole the steps its ``runs(layout)`` accepts (``native_step.NativeDecodeStep``)."""
        step = cls.__new__(cls)
        step._configure(cfg, embed, rotary, final_norm, layers, torch.float32, torch.device("cpu"), ops)
        step.decode = decode
        return step

    def _configure(self, cfg: Any, embed: Callable[[torch.Tensor], torch.Tensor], rotary: torch.nn.Module,
                   final_norm: torch.Tensor, layers: list[_Layer], dtype: torch.dtype, device: torch.device,
                   ops: LayerOps | None = None) -> None:
        self.embed, self.rotary, self.final_norm, self.layers = embed, rotary, final_norm, layers
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.intermediate = cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.ops = ops or LayerOps.for_model(dtype, device, cfg.hidden_size, self.head_dim, self.intermediate)
        self.scaling = self.head_dim ** -0.5
        self.decode: Any = None

    def linears(self) -> list[Any]:
        return [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 layout: paged_attention.StepLayout) -> torch.Tensor:
        """``input_ids``, ``positions``: [T] (all sequences' tokens, flattened) → hidden states [T, hidden],
        after the final norm. Per layer: norm → qkv → rotary + KV write → attention → o → add + norm →
        gate/up → silu · up → down → add + the next norm (each add and norm one call: ``layer_ops.py``)."""
        ops, eps = self.ops, self.eps
        h = self.embed(input_ids)
        cos, sin = self.rotary(h[None], positions[None])
        cos, sin = cos[0], sin[0]                                               # [T, head_dim]
        if self.decode is not None and self.decode.runs(layout):
            return self.decode(h, cos, sin, layout)                              # every layer in one call
        t, heads, kv_heads, d = h.shape[0], self.heads, self.kv_heads, self.head_dim
        normed = ops.add_rms_norm(h, None, self.layers[0].input_norm, eps)
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(normed)
            k_cache, v_cache = layout.pool.layer(layer.index)
            ops.rope_store(qkv, cos, sin, heads, kv_heads, d, layout.slot_mapping, k_cache, v_cache)
            q = qkv[:, :heads * d].view(t, heads, d).transpose(0, 1)[None]
            k = qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d).transpose(0, 1)[None]
            v = qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d).transpose(0, 1)[None]
            attn = paged_attention.attend(layout, layer.index, q, k, v, self.scaling, stored=True)
            normed = ops.add_rms_norm(h, layer.o(attn.reshape(t, heads * d)), layer.post_norm, eps)
            act = ops.silu_mul(layer.gate_up(normed), self.intermediate)
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            normed = ops.add_rms_norm(h, layer.down(act), next_norm, eps)
        return normed
