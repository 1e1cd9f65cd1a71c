"""One step's forward pass for Llama-family models, written out with few tensor ops.

At batch 1 a decode step is mostly per-op overhead: the stock transformers layer runs about 45 tensor
ops (three projections for q, k and v, an unfused RMSNorm of seven ops, rotate-half, two more for the
MLP's gate and up). This step runs the same math with about 18 per layer: q, k and v in one
projection, gate and up in one, ``F.rms_norm``, the rotary embedding on q and k together, and the
prepacked bfloat16 matmuls of ``linear.py``. It reads the weights of the loaded transformers model
(and uses its embedding, rotary embedding and final norm modules), so the model is still loaded and
configured by transformers; in float32 its outputs equal the stock forward's (a test checks it).

Models it does not describe exactly (biases, another activation, another attention) run the stock
forward with the paged attention registered in ``paged_attention.py``; ``LlamaStep.supports`` decides.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.worker import paged_attention
from services.worker.linear import Linear


@dataclass
class _Layer:
    index: int
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Linear          # [q heads | k heads | v heads] × head_dim outputs
    o: Linear
    gate_up: Linear      # [gate | up] outputs
    down: Linear


class LlamaStep:
    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        cfg = model.config
        return (cfg.model_type in ("llama", "mistral") and cfg.hidden_act == "silu"
                and not getattr(cfg, "attention_bias", False) and not getattr(cfg, "mlp_bias", False)
                and getattr(cfg, "pretraining_tp", 1) == 1
                and getattr(cfg, "sliding_window", None) is None)

    def __init__(self, model: torch.nn.Module):
        """Takes the decoder layers' weights out of ``model`` (the stock layers are dropped, so the weights
        are held once); ``model`` keeps its embedding, rotary embedding, final norm and head."""
        cfg = model.config
        inner = model.model
        self.embed, self.rotary, self.norm = inner.embed_tokens, inner.rotary_emb, inner.norm
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.intermediate = cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.scaling = inner.layers[0].self_attn.scaling
        self.layers = []
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                index=i,
                input_norm=layer.input_layernorm.weight.detach(),
                post_norm=layer.post_attention_layernorm.weight.detach(),
                qkv=Linear(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])),
                o=Linear(attn.o_proj.weight),
                gate_up=Linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                down=Linear(mlp.down_proj.weight)))
        inner.layers = torch.nn.ModuleList()  # the weights live in self.layers now

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 layout: paged_attention.StepLayout) -> torch.Tensor:
        """``input_ids``, ``positions``: [T] (all sequences' tokens, flattened) → hidden states [T, hidden]."""
        h = self.embed(input_ids)
        cos, sin = self.rotary(h[None], positions[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]                      # [T, 1, head_dim]
        t, heads, kv_heads, d, half = h.shape[0], self.heads, self.kv_heads, self.head_dim, self.head_dim // 2
        q_k = (heads + kv_heads) * d
        for layer in self.layers:
            qkv = layer.qkv(F.rms_norm(h, (h.shape[-1],), layer.input_norm, self.eps))
            qk = qkv[:, :q_k].view(t, heads + kv_heads, d)
            # rotary embedding on q and k at once: x·cos + rotate_half(x)·sin
            qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
            q = qk[:, :heads].transpose(0, 1)[None]
            k = qk[:, heads:].transpose(0, 1)[None]
            v = qkv[:, q_k:].view(t, kv_heads, d).transpose(0, 1)[None]
            attn = paged_attention.attend(layout, layer.index, q, k, v, self.scaling)
            h = h + layer.o(attn.reshape(t, heads * d))
            gate_up = layer.gate_up(F.rms_norm(h, (h.shape[-1],), layer.post_norm, self.eps))
            h = h + layer.down(F.silu(gate_up[:, :self.intermediate]) * gate_up[:, self.intermediate:])
        return self.norm(h)
