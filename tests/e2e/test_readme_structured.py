"""The README's "Structured output and tool calls" examples (curl, grpcurl, the CLI and `openai`), run as
written against a live SmolLM2 stack (ports swapped for the test's, as the other README tests do)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO_ROOT

HEADING = "## Structured output and tool calls\n"


def _section() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    start = text.index(HEADING)
    end = text.find("\n## ", start + len(HEADING))
    return text[start:end]


def _lines() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", _section(), flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def _env(stack) -> dict[str, str]:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "LLMSERVE_ADDR": stack.router.address, "LLMSERVE_ADMIN_ADDR": stack.engines[0].address}


def _swap(stack, text: str) -> str:
    return (text.replace("localhost:8000", stack.http_address).replace("localhost:50051", stack.router.address)
            .replace("localhost:50052", stack.engines[0].address))


def test_shell_examples_work_as_written(smol_stack):
    lines = _lines()
    assert {line.split()[0] for line in lines} == {"curl", "grpcurl", "llmserve"}
    for line in lines:
        result = subprocess.run(["bash", "-c", _swap(smol_stack, line)], capture_output=True, text=True,
                                timeout=300, env=_env(smol_stack), cwd="/")
        assert result.returncode == 0, f"{line}\n{result.stderr}"
        out = result.stdout
        if line.startswith("llmserve "):
            assert out.strip() in ("yes", "no"), out
            continue
        body = json.loads(out)
        if line.startswith("grpcurl ") and "regex" in line:
            assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", body["text"]), body
        elif line.startswith("grpcurl "):
            assert isinstance(json.loads(body["text"])["name"], str), body
        elif '"tools"' in line:
            choice = body["choices"][0]
            assert choice["finish_reason"] == "tool_calls", body
            call = choice["message"]["tool_calls"][0]["function"]
            assert call["name"] == "get_weather" and "city" in json.loads(call["arguments"])
        elif "choice" in line:
            assert body["choices"][0]["message"]["content"] in ("yes", "no"), body
        else:
            city = json.loads(body["choices"][0]["message"]["content"])
            assert set(city) == {"name", "country"}, body


def test_openai_example_works_as_written(smol_stack):
    (block,) = re.findall(r"```py\n(.*?)```", _section(), flags=re.S)
    result = subprocess.run([sys.executable, "-c", _swap(smol_stack, block)], capture_output=True, text=True,
                            timeout=300, env=_env(smol_stack), cwd="/")
    assert result.returncode == 0, result.stderr
    city, call = result.stdout.splitlines()
    assert city.strip()
    finish, name, arguments = call.split(" ", 2)
    assert finish == "tool_calls" and name == "get_weather" and "city" in json.loads(arguments)
