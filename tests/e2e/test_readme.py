"""The README's grpcurl lines, run as written against a live stack (ports swapped for the test's)."""
from __future__ import annotations

import json
import re
import shlex

from tests.helpers import REPO_ROOT, grpcurl


def readme_grpcurl_lines() -> list[str]:
    text = (REPO_ROOT / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip().startswith("grpcurl ")]


def test_readme_has_an_example_for_every_rpc():
    lines = " ".join(readme_grpcurl_lines())
    for rpc in ("Generate", "GenerateBatch", "GenerateStream", "ListModels", "Predict"):
        assert f"llmserve.v1.LLMService/{rpc} " in lines + " ", rpc
    assert "-plaintext localhost:50051 list" in lines and "describe llmserve.v1.LLMService" in lines


def test_readme_grpcurl_lines_work_as_written(smol_stack):
    router, engine = smol_stack.router.address, smol_stack.engines[0].address
    lines = readme_grpcurl_lines()
    assert len(lines) >= 8
    for line in lines:
        args = shlex.split(line.replace("localhost:50051", router).replace("localhost:50052", engine))[1:]
        result = grpcurl(*args)
        assert result.returncode == 0, f"{line}\n{result.stderr}"
        if "LLMService/Predict" in line and "spam-detector" in line:
            labels = json.loads(result.stdout)["classification"]["labels"]
            expected = "spam" if "free iPhone" in line else "ham"  # the README says so
            assert labels[0]["label"] == expected and labels[0]["score"] > 0.5, result.stdout
        if "LLMService/Predict" in line and "all-MiniLM-L6-v2" in line:
            assert json.loads(result.stdout)["embedding"]["dimension"] == 384
        if "EngineAdmin/LoadModel" in line:
            assert json.loads(result.stdout)["model"]["loaded"]
        if "LLMService/Generate " in line + " ":
            assert json.loads(result.stdout)["text"]
        if line.endswith(" list"):
            assert "llmserve.v1.LLMService" in result.stdout and "grpc.health.v1.Health" in result.stdout
        if "describe" in line:
            for rpc in ("Generate", "GenerateBatch", "GenerateStream", "ListModels", "Predict"):
                assert f"rpc {rpc}" in result.stdout
        if "GenerateBatch" in line:
            assert len(json.loads(result.stdout)["results"]) == 3
        if "Health/Check" in line:
            assert "SERVING" in result.stdout
