"""Predict on the default store's real models, through router → engine → workers."""
from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

from llmserve.v1 import llm_pb2
from tests.helpers import child_pids, grpcurl, pid_alive, wait_until

SPAM = "Win a free iPhone now!"
HAM = "I will be at the library until six, then heading home"


def test_the_spam_example_with_grpcurl_through_the_router(smol_stack):
    router = smol_stack.router.address
    for text, expected in ((SPAM, "spam"), (HAM, "ham")):
        result = grpcurl("-plaintext", "-d", json.dumps({"model_id": "spam-detector", "input_data": text}), router,
                         "llmserve.v1.LLMService/Predict")
        assert result.returncode == 0, result.stderr
        labels = json.loads(result.stdout)["classification"]["labels"]
        assert [l["label"] for l in labels][0] == expected and labels[0]["score"] > 0.5, result.stdout
        assert {l["label"] for l in labels} == {"spam", "ham"}


def test_embedding_is_a_unit_vector_and_similar_texts_are_close(smol):
    def embed(text: str) -> list[float]:
        resp = smol.Predict(llm_pb2.PredictRequest(model_id="all-MiniLM-L6-v2", input_data=text), timeout=120)
        assert resp.embedding.dimension == len(resp.embedding.values) == 384
        return list(resp.embedding.values)

    a, b, c = embed("The cat sits on the mat"), embed("A cat is sitting on a mat"), embed("Stock markets fell today")
    assert math.isclose(sum(x * x for x in a), 1.0, rel_tol=1e-4)
    cos = lambda u, v: sum(x * y for x, y in zip(u, v))  # noqa: E731 - unit vectors
    assert cos(a, b) > 0.7 > cos(a, c)


def test_a_killed_classifier_worker_is_restarted_on_the_next_call(smol, smol_stack):
    request = llm_pb2.PredictRequest(model_id="spam-detector", input_data=SPAM)
    assert smol.Predict(request, timeout=120).classification.labels[0].label == "spam"
    engine_pid = smol_stack.engines[0].proc.pid
    cmdlines = {p: Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace") for p in child_pids(engine_pid)}
    # spam-detector's worker (spam-detector-onnx, on ONNX Runtime, may be loaded too)
    (worker,) = [p for p, cmd in cmdlines.items() if "text-classification" in cmd and "onnxruntime" not in cmd]
    os.kill(worker, signal.SIGKILL)
    wait_until(lambda: not pid_alive(worker), 30, "the killed worker to exit")
    assert smol.Predict(request, timeout=120).classification.labels[0].label == "spam"
