"""Tokenizer of the served model: encode prompts, render chats, decode outputs.

Loaded with transformers' AutoTokenizer. A GGUF's tokenizer is converted once and saved beside the
converted model in the model cache, so later starts take milliseconds; that saved one (a plain
``tokenizer.json`` tokenizer, ``TokenizersBackend``) is loaded with its own class. AutoTokenizer
picks a class by reading the model's config, and importing it imports torch (transformers'
configuration code does when torch is installed): 2-4 s of an engine's start on 2 cores, and
memory, in a process that runs no tensor code. So transformers is imported when a tokenizer
is loaded, not when the engine starts (the engine loads it while the worker starts: runtime.py).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from services.common.model_source import ModelSource
from services.engine.models.tool_prompt import template_takes_tools, with_tools_in_system

log = logging.getLogger("llmserve.engine.tokenizer")


class Tokenizer:
    def __init__(self, source: ModelSource):
        self._tok: Any = _load(source)
        eos = self._tok.eos_token_id
        self.eos_token_ids: frozenset[int] = frozenset([eos] if eos is not None else [])
        self.has_chat_template = bool(getattr(self._tok, "chat_template", None))
        # The most characters one token can stand for: a text longer than context × this cannot fit,
        # and is refused before it is tokenized (tokenizing 50 MB costs a minute of CPU).
        self.max_token_chars = max(len(t) for t in self._tok.convert_ids_to_tokens(list(range(len(self._tok)))) if t)

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text)["input_ids"])

    def encode_chat(self, messages: list[dict[str, str]], tools: list[Any] | None = None) -> list[int]:
        """``tools``: OpenAI function definitions, for the template's ``tools`` argument (or, when the
        template takes none, stated in the system message: ``tool_prompt``)."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; send a prompt instead of messages")
        extra: dict[str, Any] = {}
        if tools and template_takes_tools(self._tok.chat_template):
            extra["tools"] = tools
        elif tools:
            messages = with_tools_in_system(messages, tools)
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=True))

    @property
    def hf(self) -> Any:
        """The transformers tokenizer itself (for libraries that wrap one, e.g. llguidance)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def token_text(self, token_id: int) -> str:
        return str(self._tok.decode([token_id]))


def _load(source: ModelSource) -> Any:
    path = _tokenizer_dir(source)
    if path != source.path and _saved_class(path) == "TokenizersBackend":
        # Our own conversion (below): the class it was saved with is the class to load.
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _saved_class(path: Path) -> str:
    try:
        return str(json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class", ""))
    except (OSError, ValueError):
        return ""


def _tokenizer_dir(source: ModelSource) -> Path:
    if source.format == "safetensors":
        return source.path
    target = source.cache_dir / "tokenizer"
    if (target / "tokenizer_config.json").is_file():
        return target
    log.info("converting the tokenizer of %s (first load only)", source.path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source.path.parent, gguf_file=source.path.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=target.parent))
    try:
        tok.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "tokenizer_config.json").is_file():
            raise
    return target
