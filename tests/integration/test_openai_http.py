"""The router's OpenAI-compatible HTTP API, driven by the real `openai` package and by curl, against real
router → engine → worker processes (tiny random-weight model)."""
from __future__ import annotations

import json
import socket
import subprocess
import uuid
from typing import Callable

import httpx
import openai
import pytest

from llmserve.v1 import engine_admin_pb2, llm_pb2
from tests.helpers import wait_until

GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def base_url(tiny_stack) -> str:
    assert tiny_stack.http_address, "the stack's router serves no HTTP API"
    return f"http://{tiny_stack.http_address}/v1"


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    # No retries: a 429/503 must reach the test, not be retried away.
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_engines_models(client, router):
    names = [m.id for m in client.models.list()]
    grpc_names = [m.name for m in router.ListModels(llm_pb2.ListModelsRequest(), timeout=30).models]
    assert names == grpc_names and len(names) == 1


def test_completion_matches_grpc_generate(client, router):
    resp = client.completions.create(model="", prompt="Hello, I am", **GREEDY)
    grpc_resp = router.Generate(llm_pb2.GenerateRequest(prompt="Hello, I am", sampling=llm_pb2.SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True)), timeout=60)
    assert resp.object == "text_completion" and len(resp.choices) == 1
    assert resp.choices[0].text == grpc_resp.text and resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == 4 and resp.usage.completion_tokens == 12 and resp.usage.total_tokens == 16


def test_streamed_completion_concatenates_to_the_unary_one_and_reports_usage(client):
    unary = client.completions.create(model="", prompt="The weather is", **GREEDY)
    chunks = list(client.completions.create(model="", prompt="The weather is", stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 2
    assert "".join(c.choices[0].text for c in text_chunks) == unary.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in text_chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_goes_through_the_chat_template(client, router):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    resp = client.chat.completions.create(model="", messages=messages, **GREEDY)
    grpc_resp = router.Generate(llm_pb2.GenerateRequest(
        messages=[llm_pb2.ChatMessage(**m) for m in messages],
        sampling=llm_pb2.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)), timeout=60)
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant" and resp.choices[0].message.content == grpc_resp.text
    assert resp.usage.prompt_tokens == grpc_resp.usage.prompt_tokens > 10  # the template's tokens count

    stream = client.chat.completions.create(model="", messages=messages, stream=True, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == grpc_resp.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sampling_fields_are_mapped(client):
    seeded = {"model": "", "prompt": "I want to", "temperature": 1.0, "top_p": 0.9, "seed": 7, "max_tokens": 10,
              "extra_body": {"ignore_eos": True}}
    a = client.completions.create(**seeded)
    b = client.completions.create(**seeded)
    assert a.choices[0].text == b.choices[0].text  # same seed, same text
    many = client.completions.create(n=3, **seeded)
    assert [c.index for c in many.choices] == [0, 1, 2] and many.choices[0].text == a.choices[0].text
    assert many.usage.completion_tokens == 30 and many.usage.prompt_tokens == a.usage.prompt_tokens
    short = client.completions.create(model="", prompt="I want to", max_tokens=3, temperature=0)
    assert short.usage.completion_tokens <= 3
    chat = client.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}], logprobs=True,
                                          top_logprobs=2, max_completion_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    legacy = client.completions.create(model="", prompt="Hi", logprobs=1, max_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert len(legacy.choices[0].logprobs.tokens) == 3
    assert "".join(legacy.choices[0].logprobs.tokens) == legacy.choices[0].text


def test_stop_strings_string_or_list(client):
    full = client.completions.create(model="", prompt="The best way to", **GREEDY).choices[0].text
    word = full.strip().split()[1] if len(full.strip().split()) > 1 else full.strip()[:2]
    for stop in (word, [word, "\u0000never"]):
        got = client.completions.create(model="", prompt="The best way to", stop=stop, **GREEDY)
        assert word not in got.choices[0].text and full.startswith(got.choices[0].text)
        assert got.choices[0].finish_reason == "stop"


def test_unknown_fields_are_ignored(client):
    resp = client.completions.create(model="", prompt="Hi", max_tokens=2, temperature=0,
                                     extra_body={"frobnicate": {"x": 1}, "presence_penalty": 0.5})
    assert resp.choices[0].text is not None


@pytest.mark.parametrize("body,param", [
    ({"prompt": "Hi", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "Hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "Hi", "stream": "yes"}, "stream"),
    ({"prompt": "Hi", "stop": 3}, "stop"),
    ({"prompt": "Hi", "n": 9}, "n"),
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"prompt": None}, "prompt"),
])
def test_wrong_types_are_400(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="", **body)  # type: ignore[call-overload]
    assert err.value.status_code == 400
    assert err.value.body["type"] == "invalid_request_error" and err.value.body["param"] == param
    assert err.value.body["message"]


def test_engine_errors_map_to_http_statuses(client):
    with pytest.raises(openai.BadRequestError) as bad:  # INVALID_ARGUMENT from the engine
        client.completions.create(model="", prompt="Hi", temperature=-1)
    assert bad.value.body["code"] == "invalid_argument" and "temperature" in bad.value.body["message"]
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt="Hi")
    assert missing.value.body["code"] == "not_found" and "no-such-model" in missing.value.body["message"]
    with pytest.raises(openai.APIStatusError) as late:
        # 480 tokens (the tiny model's context is 512) take ~0.25 s even where its bfloat16 matmuls run on AMX tiles
        client.completions.create(model="", prompt="Hi", max_tokens=480, temperature=0,
                                  extra_body={"ignore_eos": True}, extra_headers={"x-llmserve-timeout": "0.05"})
    assert late.value.status_code == 504 and late.value.body["code"] == "deadline_exceeded"
    with pytest.raises(openai.BadRequestError) as stream_bad:  # before the first token: a real status
        list(client.completions.create(model="", prompt="Hi", top_p=5.0, stream=True))
    assert "top_p" in stream_bad.value.body["message"]


def test_embeddings_on_a_generation_model_is_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=client.models.list().data[0].id, input="hello")
    assert "not an embedding model" in err.value.body["message"]


def test_response_headers_carry_request_id_engine_and_timing(client, tiny_stack):
    raw = client.completions.with_raw_response.create(model="", prompt="Hi", max_tokens=3, temperature=0,
                                                      extra_headers={"x-request-id": "http-hdr-1"})
    headers = raw.headers
    assert headers["x-request-id"] == "http-hdr-1"
    assert headers["x-llmserve-request-id"] == "http-hdr-1"
    assert headers["x-llmserve-engine"] == tiny_stack.engines[0].address
    assert float(headers["x-llmserve-queue-seconds"]) >= 0 and float(headers["x-llmserve-ttft-seconds"]) > 0
    with client.completions.with_streaming_response.create(model="", prompt="Hi", max_tokens=3, temperature=0,
                                                           stream=True) as streamed:
        assert streamed.headers["x-llmserve-engine"] == tiny_stack.engines[0].address
        assert float(streamed.headers["x-llmserve-ttft-seconds"]) > 0 and streamed.headers["x-request-id"]


def _curl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["curl", "-sS", *args], capture_output=True, text=True, timeout=120)


def test_curl_completion_chat_and_stream(base_url):
    done = _curl(f"{base_url}/completions", "-H", "Content-Type: application/json",
                 "-d", '{"prompt": "Hello, I am", "max_tokens": 5, "temperature": 0}')
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["choices"][0]["text"]
    chat = _curl(f"{base_url}/chat/completions", "-H", "Content-Type: application/json",
                 "-d", '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}')
    assert json.loads(chat.stdout)["choices"][0]["message"]["role"] == "assistant"
    stream = _curl("-N", f"{base_url}/completions", "-H", "Content-Type: application/json",
                   "-d", '{"prompt": "Hello", "max_tokens": 5, "stream": true}')
    lines = [line for line in stream.stdout.splitlines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    assert json.loads(lines[0][6:])["object"] == "text_completion"
    bad = _curl("-w", "%{http_code}", "-o", "/dev/null", f"{base_url}/completions", "-d", "not json")
    assert bad.stdout == "400"


def _engine_load(engine_admin) -> Callable[[], engine_admin_pb2.EngineLoad]:
    return lambda: engine_admin.GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=5)


def _engine_idle(engine_admin) -> Callable[[], bool]:
    """True when the engine runs, queues and holds nothing."""
    load = _engine_load(engine_admin)

    def idle() -> bool:
        now = load()
        return now.num_running == 0 and now.num_waiting == 0 and now.num_kv_blocks_used == 0
    return idle


def _engine_lines(stack, rid: str) -> list[str]:
    assert stack.log_dir is not None
    return [line for path in stack.log_dir.glob("engine*.log")
            for line in path.read_text(errors="replace").splitlines() if f"request {rid}:" in line]


def test_client_disconnect_mid_stream_frees_the_kv_blocks(base_url, engine_admin, tiny_stack):
    load, idle = _engine_load(engine_admin), _engine_idle(engine_admin)
    wait_until(idle, 60, "the engine to be idle before the test")
    body = {"prompt": "Hello", "max_tokens": 500, "temperature": 0, "ignore_eos": True, "stream": True}
    rid = f"gone-{uuid.uuid4().hex[:12]}"
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{base_url}/completions", json=body, headers={"x-request-id": rid}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [line for _, line in zip(range(6), lines)]
            assert sum(line.startswith("data: ") for line in got) >= 3
            during = load()
    # The stream is closed without reading to the end: the client left.
    assert during.num_running == 1 and during.num_kv_blocks_used > 0
    wait_until(idle, 30, "the abandoned sequence to release its KV blocks")
    lines = _engine_lines(tiny_stack, rid)
    assert any("queued" in line for line in lines) and not any("finished" in line for line in lines), lines
    wait_until(lambda: any("cancelled" in line for line in _engine_lines(tiny_stack, rid)), 30,
               f"the engine's log to say {rid} was cancelled")


def test_client_leaving_a_non_streamed_request_frees_the_kv_blocks(base_url, engine_admin, tiny_stack):
    load, idle = _engine_load(engine_admin), _engine_idle(engine_admin)
    wait_until(idle, 60, "the engine to be idle before the test")
    rid = f"leave-{uuid.uuid4().hex[:12]}"
    body = json.dumps({"prompt": "Hello", "max_tokens": 500, "temperature": 0, "ignore_eos": True}).encode()
    host, port = tiny_stack.http_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                     + f"x-request-id: {rid}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_until(lambda: load().num_running == 1, 30, "the request's sequence to run")
    # The client closed its connection before the reply: the sequence is cancelled, not run to the end.
    wait_until(idle, 30, "the abandoned request's sequence to release its KV blocks")
    engine_lines = _engine_lines(tiny_stack, rid)
    assert any("queued" in line for line in engine_lines)
    assert not any("finished" in line for line in engine_lines), engine_lines
    wait_until(lambda: any("cancelled" in line for line in _engine_lines(tiny_stack, rid)), 30,
               f"the engine's log to say {rid} was cancelled")
