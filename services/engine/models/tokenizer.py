"""Tokenizer of the served model: encode prompts, render chats, decode outputs.

Loaded with transformers' AutoTokenizer (no torch needed). A GGUF's tokenizer is converted once
and saved beside the converted model in the model cache, so later starts take milliseconds.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from services.common.model_source import ModelSource
from services.engine.models.tool_prompt import template_takes_tools, with_tools_in_system

log = logging.getLogger("llmserve.engine.tokenizer")


class Tokenizer:
    def __init__(self, source: ModelSource):
        self._tok: Any = AutoTokenizer.from_pretrained(_tokenizer_dir(source))
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


def _tokenizer_dir(source: ModelSource) -> Path:
    if source.format == "safetensors":
        return source.path
    target = source.cache_dir / "tokenizer"
    if (target / "tokenizer_config.json").is_file():
        return target
    log.info("converting the tokenizer of %s (first load only)", source.path)
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
