"""Sentence embeddings and a classifier head run by ONNX Runtime: the worker's second framework.

The encoder graph is the transformers model with ``EncoderRunner``'s pooling (mean over real tokens,
L2-normalized), exported once with torch's TorchScript-based ONNX exporter (needs the ``onnx``
package, not ``onnxscript``) into the model's cache folder, as the GGUF conversion is; later loads
read the file. A classification worker's head (``ClassifierHead``: a linear layer and a softmax,
trained from the store's labelled file) is exported beside it. A store entry may name its own file
instead (``onnx_file``), whose inputs are ``input_ids``, ``attention_mask`` (and optionally
``token_type_ids``) and whose one output is the [batch, dim] embedding.

Failures name the file: onnxruntime not installed, or a file ONNX Runtime cannot load
(``OnnxUnavailable``; the worker exits with it, the engine answers FAILED_PRECONDITION).
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from services.common.model_source import ModelSource
from services.worker.classifier_head import ClassifierHead
from services.worker.encoder_runner import BATCH, MAX_TOKENS

log = logging.getLogger("llmserve.worker.onnx")

ORT_REQUIREMENT = "onnxruntime==1.32.0"
OPSET = 17
INPUTS = ("input_ids", "attention_mask", "token_type_ids")


class OnnxUnavailable(RuntimeError):
    """The model's ONNX file cannot be run here; the message names the file and why."""


def _onnxruntime(path: Path) -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise OnnxUnavailable(f"cannot run {path}: onnxruntime is not installed ({exc}); "
                              f"pip install {ORT_REQUIREMENT}") from None
    return onnxruntime


def _session(ort: Any, path: Path, threads: int) -> Any:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads  # 0 = ONNX Runtime's choice (all cores), as torch's 0
    options.log_severity_level = 3          # errors only: its warnings would drown the worker's log
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types (InvalidProtobuf, Fail, NoSuchFile)
        raise OnnxUnavailable(f"{path} is not a valid ONNX model ONNX Runtime can load: "
                              f"{type(exc).__name__}: {str(exc)[:300]}") from None


class _PooledEncoder(torch.nn.Module):
    """What ``EncoderRunner.embed`` computes, as one graph: encoder, masked mean, L2 normalization."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask,
                            token_type_ids=token_type_ids).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return F.normalize((hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9), p=2, dim=1)


class _Head(torch.nn.Module):
    def __init__(self, head: ClassifierHead):
        super().__init__()
        self.weight = torch.nn.Parameter(head.weight.clone(), requires_grad=False)
        self.bias = torch.nn.Parameter(head.bias.clone(), requires_grad=False)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return torch.softmax(embeddings @ self.weight.T + self.bias, dim=-1)


def _export(module: torch.nn.Module, args: tuple[torch.Tensor, ...], names: list[str], dynamic: dict[str, dict[int, str]],
            target: Path) -> None:
    """Export once, atomically (a concurrent loader sees the whole file or none)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".export-", suffix=".onnx", dir=target.parent)
    os.close(fd)
    try:
        with torch.no_grad():
            torch.onnx.export(module.eval(), args, tmp, input_names=names, output_names=["output"],
                              dynamic_axes=dynamic, opset_version=OPSET, dynamo=False)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def export_encoder(model_dir: Path, target: Path) -> None:
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    sample = tokenizer(["an example sentence", "two"], padding=True, return_tensors="pt")
    token_types = sample.get("token_type_ids", torch.zeros_like(sample["input_ids"]))
    dynamic = {n: {0: "batch", 1: "tokens"} for n in INPUTS} | {"output": {0: "batch"}}
    _export(_PooledEncoder(model), (sample["input_ids"], sample["attention_mask"], token_types), list(INPUTS),
            dynamic, target)
    log.info("exported %s to ONNX at %s in %.1fs (first load only)", model_dir, target, time.monotonic() - started)


class OnnxEncoderRunner:
    """``EncoderRunner``'s interface (embed, dimension, context_length, ...) on an ONNX Runtime session."""

    def __init__(self, source: ModelSource, onnx_file: str = "", threads: int = 0):
        if source.format != "safetensors":
            raise ValueError(f"{source.path}: an ONNX model's source must be a model directory (its tokenizer)")
        started = time.monotonic()
        self.path = Path(onnx_file) if onnx_file else source.cache_dir / "onnx" / "encoder.onnx"
        self.threads = threads
        self.ort = _onnxruntime(self.path)
        if not onnx_file and not self.path.is_file():
            export_encoder(source.path, self.path)
        self.session = _session(self.ort, self.path, threads)
        self.inputs = [i.name for i in self.session.get_inputs()]
        missing = {"input_ids", "attention_mask"} - set(self.inputs)
        if missing or not set(self.inputs) <= set(INPUTS):
            raise OnnxUnavailable(f"{self.path}: inputs {self.inputs}, expected input_ids, attention_mask "
                                  "(and optionally token_type_ids)")
        self.tokenizer = AutoTokenizer.from_pretrained(source.path)
        self.device = "cpu"
        self.context_length = MAX_TOKENS
        self.weights_bytes = self.path.stat().st_size
        self.dimension = int(self.embed(["dimension probe"]).shape[1])
        self.load_seconds = time.monotonic() - started
        log.info("ONNX encoder %s loaded from %s in %.2fs (dimension %d)", source.name, self.path, self.load_seconds,
                 self.dimension)

    def embed(self, texts: list[str]) -> torch.Tensor:
        """[len(texts), dimension] float32, each row of unit length."""
        out = []
        for i in range(0, len(texts), BATCH):
            batch = self.tokenizer(texts[i:i + BATCH], padding=True, truncation=True, max_length=self.context_length,
                                   return_tensors="np")
            feed = {name: batch[name].astype(np.int64) if name in batch else np.zeros_like(batch["input_ids"],
                                                                                              dtype=np.int64)
                    for name in self.inputs}
            out.append(torch.from_numpy(self.session.run(None, feed)[0]).float())
        return torch.cat(out) if out else torch.zeros(0, 0)

    def head(self, head: ClassifierHead) -> "OnnxHead":
        """The trained head as an ONNX graph beside the encoder (exported once per head)."""
        digest = hashlib.sha256(head.weight.numpy().tobytes() + head.bias.numpy().tobytes()).hexdigest()[:12]
        target = self.path.parent / f"head-{digest}.onnx"
        if not target.is_file():
            _export(_Head(head), (torch.zeros(2, head.weight.shape[1]),), ["embeddings"],
                    {"embeddings": {0: "batch"}, "output": {0: "batch"}}, target)
        return OnnxHead(head.labels, head.heldout_accuracy, _session(self.ort, target, self.threads))


class OnnxHead:
    """``ClassifierHead``'s interface (labels, scores) on an ONNX Runtime session."""

    def __init__(self, labels: list[str], heldout_accuracy: float, session: Any):
        self.labels = labels
        self.heldout_accuracy = heldout_accuracy
        self.session = session

    def scores(self, embeddings: torch.Tensor) -> torch.Tensor:
        """[N, dim] → [N, num_labels] probabilities."""
        return torch.from_numpy(self.session.run(None, {"embeddings": embeddings.numpy().astype(np.float32)})[0])
