"""Hostile HTTP input gets a 400 with a message that says what is wrong, never a 500: JSON nested
too deeply, integers beyond the protobuf field they go into, lone surrogates, deadlines that would
overflow. And what current OpenAI clients send (role "developer") is accepted. In process, against
a relay that records what reaches it."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from llmserve.v1 import llm_pb2
from services.common.call_metadata import checked_request_id
from services.router.openai_http import OpenAIApp
from services.router.relay import Relayed


class RecordingRelay:
    def __init__(self) -> None:
        self.requests: list[llm_pb2.GenerateRequest] = []

    async def generate(self, request, scope):
        self.requests.append(request)
        return Relayed(llm_pb2.GenerateResponse(text="ok", request_id=request.request_id), ())

    async def predict(self, request, scope):
        return Relayed(llm_pb2.PredictResponse(embedding=llm_pb2.Embedding(values=[1.0], dimension=1)), ())


def _post(path: str, body: str | bytes, headers: dict[str, str] | None = None,
          relay: RecordingRelay | None = None) -> httpx.Response:
    app = OpenAIApp(relay or RecordingRelay()).app

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                     base_url="http://router") as http:
            return await http.post(path, content=body, headers={"content-type": "application/json", **(headers or {})})
    return asyncio.run(run())


CHAT = '"messages":[{"role":"user","content":"Hi"}]'
SURROGATE = "not valid Unicode"
# (field and value added to {"prompt": "Hi"}, what the message says, the param it names)
BEYOND_RANGE = [('"max_tokens":4294967296', "max_tokens"), ('"max_completion_tokens":-4294967296', "max_tokens"),
                ('"seed":1180591620717411303424', "seed"), ('"top_k":1099511627776', "top_k"),
                ('"logprobs":1099511627776', "logprobs"), ('"logprobs":-1', "logprobs"),
                ('"model":"\\ud800"', "model"), ('"stop":["\\ud800"]', "stop")]
BAD = [
    ("/v1/completions", '{"prompt":' + "[" * 100_000 + "]" * 100_000 + "}", "nests", None),
    ("/v1/completions", "[" * 100_000 + "]" * 100_000, "nests", None),
    *[("/v1/completions", '{"prompt":"Hi",' + extra + "}", SURROGATE if "ud800" in extra else param, param)
      for extra, param in BEYOND_RANGE],
    ("/v1/chat/completions", "{" + CHAT + ',"logprobs":true,"top_logprobs":1099511627776}', "top_logprobs",
     "top_logprobs"),
    ("/v1/completions", '{"prompt":"Hi","temperature":' + "9" * 400 + "}", "too large", "temperature"),
    ("/v1/completions", '{"prompt":"\\ud800"}', SURROGATE, "prompt"),
    ("/v1/completions", '{"prompt":["ok","a\\udfffb"]}', SURROGATE, "prompt"),
    *[("/v1/chat/completions", '{"messages":[' + m + "]}", SURROGATE, "messages")
      for m in ('{"role":"user","content":"\\ud800"}', '{"role":"\\ud800","content":"x"}',
                '{"role":"user","content":[{"type":"text","text":"\\ud800"}]}')],
    ("/v1/embeddings", '{"model":"e","input":"\\ud800"}', SURROGATE, "input"),
    ("/v1/completions", b'{"prompt":"\xff\xfe"}', "not valid JSON", None),
]


@pytest.mark.parametrize("path,body,says,param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_hostile_input_is_a_400_with_a_message(path, body, says, param):
    relay = RecordingRelay()
    resp = _post(path, body, relay=relay)
    assert resp.status_code == 400, resp.text[:300]
    error = resp.json()["error"]
    assert says in error["message"] and error["type"] == "invalid_request_error" and error["param"] == param
    assert relay.requests == []


@pytest.mark.parametrize("value", ["inf", "1e308", "nan", "-inf", "86401", "0"])
def test_a_timeout_that_would_overflow_is_a_400(value):
    resp = _post("/v1/completions", '{"prompt":"Hi"}', {"x-llmserve-timeout": value})
    assert resp.status_code == 400 and "x-llmserve-timeout" in resp.json()["error"]["message"]
    assert _post("/v1/completions", '{"prompt":"Hi"}', {"x-llmserve-timeout": "86400"}).status_code == 200


def test_the_largest_values_each_field_holds_are_accepted():
    relay = RecordingRelay()
    body = ('{"prompt":"Hi","max_tokens":4294967295,"seed":18446744073709551615,"top_k":2147483647,'
            '"logprobs":4294967295,"n":2}')
    assert _post("/v1/completions", body, relay=relay).status_code == 200
    first, second = relay.requests
    assert first.sampling.max_tokens == 4294967295 and first.sampling.top_k == 2147483647
    assert (first.sampling.seed, second.sampling.seed) == (2**64 - 1, 0)   # seed + 1 wraps, as the field does


def test_role_developer_is_the_system_message():
    relay = RecordingRelay()
    body = '{"messages":[{"role":"developer","content":"Be brief."},{"role":"user","content":"Hi"}]}'
    assert _post("/v1/chat/completions", body, relay=relay).status_code == 200
    assert [(m.role, m.content) for m in relay.requests[0].messages] == [("system", "Be brief."), ("user", "Hi")]


def test_a_longest_request_id_keeps_valid_with_its_choice_suffix():
    rid = "r" * 128
    relay = RecordingRelay()
    assert _post("/v1/completions", '{"prompt":"Hi","n":2}', {"x-request-id": rid}, relay).status_code == 200
    assert [checked_request_id(r.request_id) for r in relay.requests] == [f"{rid}-0", f"{rid}-1"]
    for bad in ("r" * 129, "r" * 129 + "-1", "a b", "r" * 128 + "-x"):
        with pytest.raises(Exception, match="printable ASCII"):
            checked_request_id(bad)
