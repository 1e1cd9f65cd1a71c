"""The README's OpenAI (curl and `openai`) and CLI examples, run as written against a live SmolLM2 stack
(ports swapped for the test's, as test_readme does for grpcurl)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO_ROOT

DOC = REPO_ROOT / "README.md"


def _sh_lines(prefix: str) -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", DOC.read_text(), flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip().startswith(prefix)]


def _openai_block() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    (block,) = [b for b in blocks if "from openai import OpenAI" in b]
    return block


def _env(stack) -> dict[str, str]:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "LLMSERVE_ADDR": stack.router.address, "LLMSERVE_ADMIN_ADDR": stack.engines[0].address}


def _http(stack, text: str) -> str:
    return text.replace("localhost:8000", stack.http_address)


def test_curl_examples_work_as_written(smol_stack):
    lines = _sh_lines("curl ")
    assert len(lines) >= 5
    for line in lines:
        result = subprocess.run(["bash", "-c", _http(smol_stack, line)], capture_output=True, text=True,
                                timeout=300, env=_env(smol_stack))
        assert result.returncode == 0, f"{line}\n{result.stderr}"
        if '"stream":true' in line:
            events = [e for e in result.stdout.splitlines() if e]
            assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["usage"]["completion_tokens"] > 0
            continue
        body = json.loads(result.stdout)
        assert "error" not in body, body
        if "/v1/models" in line:
            assert {"SmolLM2-135M-Instruct", "all-MiniLM-L6-v2", "spam-detector"} <= {m["id"] for m in body["data"]}
        elif "/v1/embeddings" in line:
            assert [len(d["embedding"]) for d in body["data"]] == [384, 384]
        elif "capital of France" in line:
            assert "Paris" in body["choices"][0]["message"]["content"]
        else:
            assert body["choices"][0]["text"]


def test_openai_example_works_as_written(smol_stack):
    result = subprocess.run([sys.executable, "-c", _http(smol_stack, _openai_block())], capture_output=True,
                            text=True, timeout=300, env=_env(smol_stack), cwd="/")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "Paris" in lines[0] and lines[-1] == "384" and len(lines) >= 3


def test_cli_examples_work_as_written(smol_stack):
    lines = _sh_lines("llmserve ") + [line for line in _sh_lines("echo ") if "| llmserve " in line]
    assert {line.split()[1] for line in lines if line.startswith("llmserve ")} >= {
        "generate", "models", "predict", "load", "unload", "top"}
    assert any("llmserve chat" in line for line in lines)
    for line in lines:
        result = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=300,
                                env=_env(smol_stack), cwd="/")
        assert result.returncode == 0 and "Traceback" not in result.stderr, f"{line}\n{result.stderr}"
        out = result.stdout
        if "spam-detector" in line:
            assert out.splitlines()[1].split()[0] == "spam"  # highest score first
        elif "predict all-MiniLM" in line:
            assert out.startswith("embedding, 384 dimensions: [")
        elif "chat" in line:
            assert "Paris" in out
        elif line.startswith("llmserve load"):
            assert "all-MiniLM-L6-v2" in out
        elif line.startswith("llmserve unload"):
            assert out.startswith("unloaded all-MiniLM-L6-v2")
        elif "top" in line:
            assert smol_stack.engines[0].address in out and "KV USED" in out
        elif line.startswith("llmserve models"):
            assert "spam-detector" in out and "text-generation" in out
        else:
            assert out.strip()
        if " -v" in line:
            assert "request-id: " in result.stderr and "engine: " in result.stderr
