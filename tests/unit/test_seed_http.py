"""The seed's HTTP routes in process, against relays that answer or fail (the e2e walkthrough test runs the
real stack): the reference code's shapes, bad input as 400, gRPC statuses in the HTTP face's error shape."""
from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

from llmserve.v1 import llm_pb2
from services.router.openai_http import OpenAIApp
from services.router.relay import Relayed
from services.router.seed_http import predict_reply


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class EchoRelay:
    """Answers as an engine would, from the request (the text is the prompt reversed); ``error`` fails
    every call, a stream after ``good`` messages."""

    def __init__(self, error: BaseException | None = None, good: int = 0):
        self.error = error
        self.good = good
        self.requests: list[object] = []

    def _check(self, request: object) -> None:
        self.requests.append(request)
        if self.error is not None:
            raise self.error

    async def generate(self, request, scope):
        self._check(request)
        return Relayed(llm_pb2.GenerateResponse(text=request.prompt[::-1], sequence_id=7), ())

    async def generate_batch(self, request, scope):
        self._check(request)
        return Relayed(llm_pb2.GenerateBatchResponse(results=[
            llm_pb2.GenerateResponse(text=p[::-1], sequence_id=i) for i, p in enumerate(request.prompts)]), ())

    async def generate_stream(self, request, scope, metadata=None):
        self.requests.append(request)
        words = request.prompt.split()
        for i, word in enumerate(words[:self.good] if self.error else words):
            yield llm_pb2.GenerateStreamResponse(sequence_id=42, text=word)
        if self.error is not None:
            raise self.error
        yield llm_pb2.GenerateStreamResponse(sequence_id=42, finish_reason=llm_pb2.FINISH_REASON_STOP)

    async def predict(self, request, scope):
        self._check(request)
        ham, spam = llm_pb2.Label(label="ham", score=0.1), llm_pb2.Label(label="spam", score=0.9)
        return Relayed(llm_pb2.PredictResponse(model_id=request.model_id, classification=llm_pb2.Classification(
            labels=[spam, ham], classes=[ham, spam])), ())

    async def list_models(self, request, scope):
        self._check(request)
        return llm_pb2.ListModelsResponse(models=[
            llm_pb2.ModelInfo(id="7e083728-92bb-5cb5-af8d-7a2c04fcdd9b", name="spam-detector", format="safetensors",
                              task="text-classification", aliases=["6ba7b810-9dad-11d1-80b4-00c04fd430c8"],
                              loaded=True),
            llm_pb2.ModelInfo(id="e13d5280-156b-5d7d-a113-50451d287dfe", name="SmolLM2-135M-Instruct", format="gguf",
                              task="text-generation")])


def _call(relay, method: str, path: str, body: object = None, raw: bytes | None = None) -> httpx.Response:
    async def run() -> httpx.Response:
        app = OpenAIApp(relay).app
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
            if raw is not None:
                return await http.request(method, path, content=raw)
            return await http.request(method, path, json=body)
    return asyncio.run(run())


def test_generation_routes_answer_the_reference_shapes():
    relay = EchoRelay()
    assert _call(relay, "POST", "/basic_generate", {"prompt": "Hello"}).json() == {"generated_text": "olleH"}
    resp = _call(relay, "POST", "/generate", {"prompts": ["ab", "cd", "ef"], "max_tokens": 5})
    assert resp.json() == {"generated_texts": ["ba", "dc", "fe"]}
    assert relay.requests[-1].sampling.max_tokens == 5 and list(relay.requests[-1].prompts) == ["ab", "cd", "ef"]
    assert not relay.requests[-1].sampling.HasField("temperature")  # the engine's default
    _call(relay, "POST", "/basic_generate", {"prompt": "Hi", "temperature": 0})
    assert relay.requests[-1].sampling.HasField("temperature") and relay.requests[-1].sampling.max_tokens == 20
    resp = _call(relay, "POST", "/generate_stream", {"prompt": "Hello I am"})
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[len("data: "):]) for line in resp.text.split("\n\n") if line]
    assert events == [{"token": w, "sequence_id": "42"} for w in ("Hello", "I", "am")]


def test_predict_answers_class_probabilities_in_class_order_and_models_the_reference_dicts():
    relay = EchoRelay()
    resp = _call(relay, "POST", "/predict", {"model_id": "6ba7b810-9dad-11d1-80b4-00c04fd430c8",
                                             "input_data": "Win a free iPhone now!"}).json()
    assert resp["predictions"] == [[pytest.approx(0.1), pytest.approx(0.9)]] and resp["labels"] == ["ham", "spam"]
    models = _call(relay, "GET", "/models").json()
    assert set(models) == {"available_models", "loaded_models"}
    assert models["loaded_models"] == {"7e083728-92bb-5cb5-af8d-7a2c04fcdd9b": "spam-detector"}
    spam = models["available_models"]["7e083728-92bb-5cb5-af8d-7a2c04fcdd9b"]
    assert spam["aliases"] == ["6ba7b810-9dad-11d1-80b4-00c04fd430c8"] and spam["framework"] == "transformers"
    assert spam["type"] == "text-classification"


def test_predict_reply_answers_each_task_in_the_seed_shape():
    vector = llm_pb2.PredictResponse(model_id="e", embedding=llm_pb2.Embedding(values=[0.6, 0.8], dimension=2))
    assert predict_reply(vector) == {"model_id": "e", "predictions": [[pytest.approx(0.6), pytest.approx(0.8)]],
                                     "dimension": 2}
    assert predict_reply(llm_pb2.PredictResponse(model_id="g", text="Hi there")) == {"model_id": "g",
                                                                                    "generated_text": "Hi there"}


@pytest.mark.parametrize("path,body,param", [
    ("/basic_generate", {}, "prompt"),
    ("/basic_generate", {"prompt": 3}, "prompt"),
    ("/basic_generate", {"prompt": "Hi", "max_tokens": "many"}, "max_tokens"),
    ("/basic_generate", {"prompt": "Hi", "max_tokens": -3}, "max_tokens"),
    ("/generate", {"prompts": ["Hi"], "temperature": "hot"}, "temperature"),
    ("/generate", {"prompts": "Hello"}, "prompts"),
    ("/generate", {"prompts": []}, "prompts"),
    ("/generate_stream", {"prompt": ["Hi"]}, "prompt"),
    ("/predict", {"model_id": "m"}, "input_data"),
    ("/predict", {"input_data": {"shape": [1]}}, "model_id"),
])
def test_bad_input_is_a_400_naming_the_field(path, body, param):
    relay = EchoRelay()
    resp = _call(relay, "POST", path, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and param in error["message"]
    assert relay.requests == []


def test_a_body_that_is_not_json_is_a_400():
    resp = _call(EchoRelay(), "POST", "/predict", raw=b"{model_id: spam")
    assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]["message"]


@pytest.mark.parametrize("code,status,err_type", [
    (grpc.StatusCode.NOT_FOUND, 404, "not_found_error"),
    (grpc.StatusCode.FAILED_PRECONDITION, 400, "invalid_request_error"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable"),
])
def test_grpc_statuses_are_the_http_face_error_shape_on_every_route(code, status, err_type):
    relay = EchoRelay(_rpc_error(code, "the engine said why"))
    for method, path, body in (("POST", "/basic_generate", {"prompt": "Hi"}), ("POST", "/generate", {"prompts": ["a"]}),
                               ("POST", "/generate_stream", {"prompt": "Hi"}), ("GET", "/models", None),
                               ("POST", "/predict", {"model_id": "m", "input_data": "x"})):
        resp = _call(relay, method, path, body)
        assert resp.status_code == status, (path, resp.text)
        assert resp.json() == {"error": {"message": "the engine said why", "type": err_type, "param": None,
                                         "code": code.name.lower()}}, path


def test_an_error_after_the_first_token_ends_the_stream_with_an_error_event():
    resp = _call(EchoRelay(_rpc_error(grpc.StatusCode.UNAVAILABLE, "engine died"), good=2), "POST",
                 "/generate_stream", {"prompt": "one two three"})
    assert resp.status_code == 200
    events = [json.loads(line[len("data: "):]) for line in resp.text.split("\n\n") if line]
    assert events[:2] == [{"token": "one", "sequence_id": "42"}, {"token": "two", "sequence_id": "42"}]
    assert events[2]["error"]["message"] == "engine died" and events[2]["error"]["type"] == "service_unavailable"


def test_unknown_paths_and_methods_are_json_errors():
    resp = _call(EchoRelay(), "POST", "/nowhere", {})
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"
    assert "/basic_generate" in resp.json()["error"]["message"]
    resp = _call(EchoRelay(), "GET", "/predict")
    assert resp.status_code == 405 and "POST" in resp.headers["allow"] and resp.json()["error"]["message"]


@pytest.mark.parametrize("path, body, field", [
    ("/basic_generate", '{"prompt": "\\ud800"}', "prompt"),
    ("/basic_generate", '{"prompt": "a", "model": "\\udfff"}', "model"),
    ("/generate", '{"prompts": ["ok", "\\ud800"]}', "prompts"),
    ("/generate_stream", '{"prompt": "a", "max_tokens": 4294967296}', "max_tokens"),
    ("/predict", '{"model_id": "spam-detector", "input_data": "\\ud800"}', "input_data"),
    ("/predict", '{"model_id": "\\ud800", "input_data": "a"}', "model_id"),
])
def test_seed_routes_check_fields_as_the_openai_face_does(path, body, field):
    """Lone surrogates and out-of-range integers are 400 naming the field (they were 500s: found by the
    HTTP fuzzer once the seed routes joined the app)."""
    relay = EchoRelay()
    resp = _call(relay, "POST", path, raw=body.encode())
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == field and not relay.requests
