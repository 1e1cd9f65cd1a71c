"""A text classifier as embedding + logistic regression head, trained from a labelled file.

The head is trained the first time a classification worker starts (a few seconds on CPU) and
cached beside the converted models, keyed by the training file's content and the encoder, so
later starts just load it. One line in five (by position) is held out and never trained on; the
accuracy on it is stored with the head and reported by the worker.

Training file: one example per line, ``label<TAB>text``; blank lines and ``#`` comments skipped.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from services.common.model_source import cache_root

log = logging.getLogger("llmserve.worker.classifier")

HELDOUT_EVERY = 5      # every 5th example is held out for the accuracy figure
EPOCHS = 400
LEARNING_RATE = 0.05
WEIGHT_DECAY = 1e-3


@dataclass(frozen=True)
class ClassifierHead:
    labels: list[str]
    weight: torch.Tensor        # [num_labels, dim]
    bias: torch.Tensor          # [num_labels]
    heldout_accuracy: float
    num_train: int
    num_heldout: int

    def scores(self, embeddings: torch.Tensor) -> torch.Tensor:
        """[N, dim] → [N, num_labels] probabilities."""
        return torch.softmax(embeddings @ self.weight.T + self.bias, dim=-1)


def read_examples(path: Path) -> list[tuple[str, str]]:
    examples = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        label, sep, text = line.partition("\t")
        if not sep or not label.strip() or not text.strip():
            raise ValueError(f"{path} line {lineno}: expected 'label<TAB>text'")
        examples.append((label.strip(), text.strip()))
    if len({label for label, _ in examples}) < 2:
        raise ValueError(f"{path}: needs examples of at least two labels")
    return examples


def load_or_train(train_data: Path, encoder_key: str, embed: Callable[[list[str]], torch.Tensor]) -> ClassifierHead:
    digest = hashlib.sha256(train_data.read_bytes() + encoder_key.encode()).hexdigest()[:12]
    cached = cache_root() / "classifier-heads" / f"{train_data.stem}-{digest}.pt"
    if cached.is_file():
        state = torch.load(cached, weights_only=True)
        return ClassifierHead(**state)
    head = train(read_examples(train_data), embed)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    torch.save(head.__dict__, tmp)
    tmp.replace(cached)
    log.info("trained a %s head on %d examples from %s: held-out accuracy %.3f on %d examples (cached at %s)",
             "/".join(head.labels), head.num_train, train_data, head.heldout_accuracy, head.num_heldout, cached)
    return head


def train(examples: list[tuple[str, str]], embed: Callable[[list[str]], torch.Tensor]) -> ClassifierHead:
    labels = sorted({label for label, _ in examples})
    x = embed([text for _, text in examples]).clone()  # [N, dim]; clone: out of inference mode, for autograd
    y = torch.tensor([labels.index(label) for label, _ in examples])           # [N]
    heldout = torch.tensor([i % HELDOUT_EVERY == HELDOUT_EVERY - 1 for i in range(len(examples))])
    torch.manual_seed(0)
    linear = torch.nn.Linear(x.shape[1], len(labels))
    opt = torch.optim.Adam(linear.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    with torch.enable_grad():
        for _ in range(EPOCHS):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(linear(x[~heldout]), y[~heldout])
            loss.backward()
            opt.step()
    with torch.no_grad():
        accuracy = float((linear(x[heldout]).argmax(-1) == y[heldout]).float().mean())
    return ClassifierHead(labels, linear.weight.detach().clone(), linear.bias.detach().clone(), accuracy,
                          int((~heldout).sum()), int(heldout.sum()))
