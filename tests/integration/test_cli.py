"""The installed `llmserve` command (pyproject.toml [project.scripts], installed by the Makefile), run as a
subprocess against real router → engine → worker processes (tiny random-weight model)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmserve.v1 import llm_pb2


def llmserve_path() -> str:
    found = shutil.which("llmserve", path=str(Path(sys.executable).parent))
    if not found:
        raise AssertionError("the llmserve command is not installed (make install: pip install --no-deps -e .)")
    return found


@pytest.fixture(scope="module")
def cli(tiny_stack):
    env = {**os.environ, "LLMSERVE_ADDR": tiny_stack.router.address,
           "LLMSERVE_ADMIN_ADDR": tiny_stack.engines[0].address}

    def run(*args: str, stdin: str = "", env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([llmserve_path(), *args], input=stdin, capture_output=True, text=True, timeout=180,
                              env={**env, **(env_extra or {})}, cwd="/")  # not the repo: the installed command
    return run


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return result.stdout


def test_generate_matches_the_api(cli, router):
    expected = router.Generate(llm_pb2.GenerateRequest(prompt="Hello, I am", sampling=llm_pb2.SamplingParams(
        temperature=0, max_tokens=8)), timeout=60).text
    assert _ok(cli("generate", "Hello, I am", "--temperature", "0", "--max-tokens", "8")) == expected + "\n"
    streamed = cli("generate", "Hello, I am", "--stream", "--temperature", "0", "--max-tokens", "8", "-v")
    assert _ok(streamed) == expected + "\n"
    assert "request-id: " in streamed.stderr and "ttft-seconds: " in streamed.stderr


def test_chat_reads_stdin_until_eof(cli, router):
    out = _ok(cli("chat", "--temperature", "0", "--max-tokens", "6", stdin="Hi\n\nWhat is your name?\n"))
    first = router.Generate(llm_pb2.GenerateRequest(messages=[llm_pb2.ChatMessage(role="user", content="Hi")],
                                                    sampling=llm_pb2.SamplingParams(temperature=0, max_tokens=6)),
                            timeout=60).text
    assert out.startswith(first + "\n")
    assert out.count("\n") >= 2  # one reply per non-empty line


def test_models_lists_the_model(cli, router):
    out = _ok(cli("models"))
    (model,) = router.ListModels(llm_pb2.ListModelsRequest(), timeout=30).models
    assert out.splitlines()[0].split()[:3] == ["NAME", "TASK", "FORMAT"]
    assert model.name in out and "text-generation" in out


def test_predict_on_a_generation_model_prints_its_completion(cli, router):
    (model,) = router.ListModels(llm_pb2.ListModelsRequest(), timeout=30).models
    out = _ok(cli("predict", model.name, "Hello"))
    assert out.endswith("\n") and len(out) > 1  # sampled text (README examples cover embedding and classifier)


def test_unload_then_load(cli, router):
    (model,) = router.ListModels(llm_pb2.ListModelsRequest(), timeout=30).models
    try:
        out = _ok(cli("unload", model.name))
        assert out.startswith(f"unloaded {model.name}")
        assert not router.ListModels(llm_pb2.ListModelsRequest(), timeout=30).models[0].loaded
    finally:
        out = _ok(cli("load", model.name))
    assert out.startswith(f"loaded {model.name}")
    assert _ok(cli("load", model.name)).startswith(f"{model.name} was already loaded")


def test_top_shows_every_engine(cli, tiny_stack):
    out = _ok(cli("top", "--iterations", "2", "--interval", "0.1"))
    assert out.count("llmserve top") == 2 and "\x1b[" not in out  # not a terminal: no screen clearing
    assert out.count(tiny_stack.engines[0].address) == 2
    header = next(line for line in out.splitlines() if line.startswith("ENGINE"))
    assert "KV USED" in header and "RUN" in header and "WAIT" in header
    once = _ok(cli("top", "--once"))
    assert once.count("llmserve top") == 1


def test_errors_print_status_and_message_without_traceback(cli):
    for args in (("generate", "Hi", "--model", "no-such-model"), ("predict", "no-such-model", "x"),
                 ("load", "no-such-model"), ("unload", "no-such-model")):
        result = cli(*args)
        assert result.returncode == 1, args
        assert "NOT_FOUND" in result.stderr and "no-such-model" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    bad = cli("generate", "Hi", "--temperature", "-1")
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "temperature" in bad.stderr
    down = cli("models", env_extra={"LLMSERVE_ADDR": "127.0.0.1:1"})
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr and "Traceback" not in down.stderr
