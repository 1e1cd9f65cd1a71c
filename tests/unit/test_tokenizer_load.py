"""The engine's tokenizer: a GGUF's converted tokenizer loads with the class it was saved with, in a
process that never imports torch, and tokenizes as transformers' AutoTokenizer does."""
from __future__ import annotations

import json
import subprocess
import sys

from transformers import AutoTokenizer

from services.common.model_source import resolve_model
from services.engine.models.tokenizer import Tokenizer, _tokenizer_dir
from tests.helpers import REPO_ROOT

TEXTS = ["Hello, I am", "  spaces\tand\nnewlines ", "émoji 🎉 日本語", "<|im_start|>user\nhi<|im_end|>", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a cat?"}]

# In a fresh interpreter: the engine's imports and one tokenizer load, then what it encoded and whether torch came in.
_CHILD = f"""
import json, sys
import services.engine.__main__
from services.common.model_source import resolve_model
from services.engine.models.tokenizer import Tokenizer
tok = Tokenizer(resolve_model("smollm2"))
print(json.dumps({{"torch": "torch" in sys.modules, "ids": [tok.encode(t) for t in {TEXTS!r}],
                  "chat": tok.encode_chat({CHAT!r}), "class": type(tok.hf).__name__}}))
"""


def test_the_converted_tokenizer_loads_without_torch_and_encodes_as_autotokenizer():
    path = _tokenizer_dir(resolve_model("smollm2"))   # converts it into the cache on a fresh clone
    reference = AutoTokenizer.from_pretrained(path)
    out = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                         check=True)
    child = json.loads(out.stdout.strip().splitlines()[-1])
    assert child["torch"] is False, "the engine imported torch to load a tokenizer"
    assert child["class"] == type(reference).__name__
    assert child["ids"] == [list(reference(t)["input_ids"]) for t in TEXTS]
    text = reference.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert child["chat"] == list(reference(text, add_special_tokens=False)["input_ids"])


def test_a_model_directory_still_loads_through_autotokenizer(tiny_model_dir):
    tok = Tokenizer(resolve_model(str(tiny_model_dir)))
    reference = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert type(tok.hf) is type(reference)
    assert [tok.encode(t) for t in TEXTS] == [list(reference(t)["input_ids"]) for t in TEXTS]
    assert tok.eos_token_ids == frozenset([reference.eos_token_id])
