"""Load a model with stock transformers classes, converting a GGUF once into a safetensors cache.

The first load of a GGUF dequantizes it (tens of seconds on CPU); the converted copy under the
cache folder loads in well under a second and gives identical logits.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from services.common.model_source import ModelSource

log = logging.getLogger("llmserve.worker.loader")


def converted_dir(source: ModelSource) -> Path:
    return source.cache_dir / "model"


def load_causal_lm(source: ModelSource, dtype: torch.dtype, device: torch.device, attn_implementation: str) -> torch.nn.Module:
    path = ensure_safetensors(source)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    return model.to(device).eval()


def ensure_safetensors(source: ModelSource) -> Path:
    """The model as a safetensors directory; converts (once) when the source is a GGUF file."""
    if source.format == "safetensors":
        return source.path
    target = converted_dir(source)
    if (target / "config.json").is_file():
        return target
    log.info("converting %s to safetensors under %s (first load only)", source.path, target)
    model = AutoModelForCausalLM.from_pretrained(source.path.parent, gguf_file=source.path.name, dtype=torch.float32)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        # Weights are already plain floats; the attached GGUF quantizer only blocks save_pretrained.
        quantizer.remove_quantization_config(model)
    save_pretrained_atomically(model, target)
    return target


def save_pretrained_atomically(obj: Any, target: Path) -> None:
    """``obj.save_pretrained`` into ``target`` all at once: a concurrent loader sees all or nothing (and a
    loader that lost the race to another keeps the winner's copy)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".model-", dir=target.parent))
    try:
        obj.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
