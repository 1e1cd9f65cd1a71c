"""Sentence embeddings with a stock transformers encoder: mean pooling over real tokens, L2-normalized.

This is what sentence-transformers does for all-MiniLM-L6-v2 (its modules.json: Transformer →
mean Pooling → Normalize), done here with ``AutoModel`` so the worker needs no extra library.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from services.common.model_source import ModelSource

log = logging.getLogger("llmserve.worker.encoder")

MAX_TOKENS = 256       # all-MiniLM-L6-v2 was trained on 256-token inputs; longer ones are truncated
BATCH = 32             # texts per forward pass (bounds peak memory for long lists)


class EncoderRunner:
    def __init__(self, source: ModelSource, dtype: str, device: str):
        if source.format != "safetensors":
            raise ValueError(f"{source.path}: an embedding model must be a safetensors directory")
        self.device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                   ("cpu" if device == "auto" else device))
        started = time.monotonic()
        self.tokenizer = AutoTokenizer.from_pretrained(source.path)
        dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        self.model = AutoModel.from_pretrained(source.path, dtype=dt).to(self.device).eval()
        self.load_seconds = time.monotonic() - started
        self.dimension = int(self.model.config.hidden_size)
        self.context_length = int(min(self.model.config.max_position_embeddings, MAX_TOKENS))
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        log.info("encoder %s loaded in %.2fs (dimension %d)", source.name, self.load_seconds, self.dimension)

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> torch.Tensor:
        """[len(texts), dimension] float32, each row of unit length."""
        out = []
        for i in range(0, len(texts), BATCH):
            batch = self.tokenizer(texts[i:i + BATCH], padding=True, truncation=True, max_length=self.context_length,
                                   return_tensors="pt").to(self.device)
            hidden = self.model(**batch).last_hidden_state.float()        # [B, T, dim]
            mask = batch["attention_mask"].unsqueeze(-1).float()          # [B, T, 1]
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # [B, dim]
            out.append(F.normalize(pooled, p=2, dim=1))
        return torch.cat(out) if out else torch.zeros(0, self.dimension)
