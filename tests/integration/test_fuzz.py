"""The fuzzer: hypothesis over every field of every public request, through the router to a real stack.

Invariants, per call: never UNKNOWN, never INTERNAL (a per-sequence failure found by a fuzzer is a
bug to fix), never UNAVAILABLE (nothing here may take the engine down), and every error carries a
message. After the run: no process restarted (same router, engine and worker pids; the engine's
worker restart counter still 0) and nothing leaked (no sequence waiting or running, no KV block
used), with deadline-bounded waits.

Bounded in time: ``MAX_EXAMPLES`` per request type, and every example after ``TIME_CAP_SECONDS`` of
the whole run returns at once (FUZZ_SECONDS overrides the cap, FUZZ_EXAMPLES the count).

The other doors, each with its own examples and time cap (``FACE_SECONDS``): the HTTP face (every
route the app has, with arbitrary JSON, OpenAI-shaped bodies of arbitrary values, and raw bytes:
every reply 2xx or 4xx, never 5xx, an error event in no stream), and the gRPC ports given raw
bytes that are mostly not protobuf (truncated, corrupted, a string that is not UTF-8), on the router
and on the engine. Neither the router's nor the engine's log may gain an ERROR line or a traceback.
"""
from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc, llm_pb2, llm_pb2_grpc
from services.stack import Stack
from tests.helpers import child_pids, wait_until

# Batches of 40 kB prompts make long reprs; hypothesis warns about them, and they are what we want.
pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")
MAX_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "200"))
TIME_CAP_SECONDS = float(os.environ.get("FUZZ_SECONDS", "150"))
CALL_TIMEOUT = 20.0
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE}
SETTINGS = settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])

# -- strategies: every field, with extremes --------------------------------------------------

# Any Unicode a protobuf string can carry (no lone surrogates: they are not UTF-8), control
# characters, NUL, combining marks, emoji and right-to-left text included.
any_char = st.characters(exclude_categories=("Cs",))
texts = st.one_of(
    st.text(any_char, max_size=40),
    st.sampled_from(["", " ", "\x00", "\n" * 50, "<|im_start|>", "<|im_end|>", "{{ raise }}", "\u202e\u0301" * 20,
                     "🤖" * 100, "Hello, I am", "a" * 3000, "x" * 40_000]),
    st.builds(lambda s, n: s * n, st.text(any_char, min_size=1, max_size=4), st.integers(1, 600)),
)
f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
extreme_f32 = st.one_of(f32, st.sampled_from([0.0, -0.0, 1e-45, 1e-38, 3.4e38, 0.01, 0.0099, 1.0, 100.0, 100.1]))
uint32 = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2, 20, 21, 511, 512, 513, 2**31, 2**32 - 1]))
int32 = st.one_of(st.integers(-2**31, 2**31 - 1), st.sampled_from([-1, 0, 1, 49151, 49152, 2**31 - 1]))
uint64 = st.integers(0, 2**64 - 1)
models = st.one_of(st.just(""), st.just(""), st.just("tiny"), texts)   # mostly a served model


@st.composite
def sampling_params(draw: st.DrawFn) -> llm_pb2.SamplingParams:
    p = llm_pb2.SamplingParams(top_k=draw(int32), ignore_eos=draw(st.booleans()),
                               stop=draw(st.lists(texts, max_size=20)))
    # max_tokens mostly small, so valid requests finish fast; sometimes anything.
    for name, strategy in [("max_tokens", st.one_of(st.integers(0, 24), uint32)), ("temperature", extreme_f32),
                           ("top_p", extreme_f32), ("seed", uint64), ("repetition_penalty", extreme_f32),
                           ("logprobs", st.one_of(st.integers(0, 25), uint32))]:
        if draw(st.booleans()):
            setattr(p, name, draw(strategy))
    return p


chat_messages = st.lists(st.builds(llm_pb2.ChatMessage, role=st.one_of(
    st.sampled_from(["system", "user", "assistant", "tool", "", "USER"]), texts), content=texts), max_size=5)


@st.composite
def generate_requests(draw: st.DrawFn) -> llm_pb2.GenerateRequest:
    req = llm_pb2.GenerateRequest(model=draw(models), request_id=draw(st.one_of(texts, st.just("r" * 20_000))))
    if draw(st.booleans()):
        req.prompt = draw(texts)
    if draw(st.booleans()):
        req.messages.extend(draw(chat_messages))
    if draw(st.booleans()):
        req.sampling.CopyFrom(draw(sampling_params()))
    if draw(st.integers(0, 9)) == 0:  # internal fields: the router must refuse them
        req.resume_token_ids.extend(draw(st.lists(int32, max_size=5)))
        req.resume_text_chars = draw(uint32)
    return req


batch_requests = st.builds(llm_pb2.GenerateBatchRequest, model=models, prompts=st.lists(texts, max_size=10),
                           sampling=sampling_params(), request_id=texts)
predict_requests = st.builds(llm_pb2.PredictRequest, model_id=models, input_data=texts)


# -- the harness -------------------------------------------------------------------------------


class Fuzz:
    """Sends requests, checks each status in the test thread, counts what happened."""

    def __init__(self, router: llm_pb2_grpc.LLMServiceStub):
        self.router = router
        self.statuses: Counter[str] = Counter()
        self.started = time.monotonic()
        self.faces: dict[str, Counter[str]] = {"http": Counter(), "grpc raw bytes": Counter()}
        self.face_started: dict[str, float] = {}
        self.log_offsets: dict[Path, int] = {}

    def face_out_of_time(self, face: str) -> bool:
        started = self.face_started.setdefault(face, time.monotonic())
        return time.monotonic() - started > FACE_SECONDS

    def out_of_time(self) -> bool:
        return time.monotonic() - self.started > TIME_CAP_SECONDS

    def call(self, what: str, request: object, send: Callable[[object], object]) -> None:
        try:
            send(request)
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()  # type: ignore[attr-defined]
        self.statuses[code.name] += 1
        assert code not in FORBIDDEN, f"{what} got {code.name}: {details}\nrequest: {str(request)[:2000]!r}"
        assert code is grpc.StatusCode.OK or details, f"{what} got {code.name} without a message"


@pytest.fixture(scope="module")
def fuzz(router: llm_pb2_grpc.LLMServiceStub) -> Fuzz:
    return Fuzz(router)


def pids(stack: Stack) -> tuple[int, int, tuple[int, ...]]:
    engine = stack.engines[0]
    return stack.router.proc.pid, engine.proc.pid, tuple(child_pids(engine.proc.pid))  # type: ignore[union-attr]


def service_logs(stack: Stack) -> list[Path]:
    assert stack.log_dir is not None
    return [stack.log_dir / "router.log", *(stack.log_dir / f"engine{i}.log" for i in range(len(stack.engines)))]


def test_fuzz_starts_from_a_settled_stack(fuzz: Fuzz, tiny_stack: Stack):
    fuzz.pids = pids(tiny_stack)  # type: ignore[attr-defined]
    fuzz.log_offsets = {log: log.stat().st_size for log in service_logs(tiny_stack)}


@SETTINGS
@given(request=generate_requests())
def test_fuzz_generate(fuzz: Fuzz, request: llm_pb2.GenerateRequest):
    if fuzz.out_of_time():
        return
    fuzz.call("Generate", request, lambda r: fuzz.router.Generate(r, timeout=CALL_TIMEOUT))


@SETTINGS
@given(request=generate_requests())
def test_fuzz_generate_stream(fuzz: Fuzz, request: llm_pb2.GenerateRequest):
    if fuzz.out_of_time():
        return
    fuzz.call("GenerateStream", request, lambda r: list(fuzz.router.GenerateStream(r, timeout=CALL_TIMEOUT)))


@SETTINGS
@given(request=batch_requests)
def test_fuzz_generate_batch(fuzz: Fuzz, request: llm_pb2.GenerateBatchRequest):
    if fuzz.out_of_time():
        return
    fuzz.call("GenerateBatch", request, lambda r: fuzz.router.GenerateBatch(r, timeout=CALL_TIMEOUT))


@SETTINGS
@given(request=predict_requests)
def test_fuzz_predict(fuzz: Fuzz, request: llm_pb2.PredictRequest):
    if fuzz.out_of_time():
        return
    fuzz.call("Predict", request, lambda r: fuzz.router.Predict(r, timeout=CALL_TIMEOUT))


@settings(SETTINGS, max_examples=5)
@given(request=st.just(llm_pb2.ListModelsRequest()))
def test_fuzz_list_models(fuzz: Fuzz, request: llm_pb2.ListModelsRequest):
    fuzz.call("ListModels", request, lambda r: fuzz.router.ListModels(r, timeout=CALL_TIMEOUT))


@SETTINGS
@given(interval_ms=uint32, model=texts)
def test_fuzz_engine_admin(fuzz: Fuzz, tiny_stack: Stack, interval_ms: int, model: str):
    """EngineAdmin is for routers and operators, on the engine's port: its load calls take any
    interval, and Load/UnloadModel any name (never the served model's: unloading it is allowed)."""
    if fuzz.out_of_time() or model.strip() in ("", "tiny"):
        return
    with grpc.insecure_channel(tiny_stack.engines[0].address) as channel:
        admin = engine_admin_pb2_grpc.EngineAdminStub(channel)
        served = {m.id for m in fuzz.router.ListModels(llm_pb2.ListModelsRequest(), timeout=CALL_TIMEOUT).models}
        if model in served:
            return
        fuzz.call("WatchLoad", interval_ms, lambda i: _first_load(admin, i))
        fuzz.call("LoadModel", model, lambda m: admin.LoadModel(engine_admin_pb2.LoadModelRequest(model=m),
                                                                timeout=CALL_TIMEOUT))
        fuzz.call("UnloadModel", model, lambda m: admin.UnloadModel(engine_admin_pb2.UnloadModelRequest(model=m),
                                                                    timeout=CALL_TIMEOUT))


def _first_load(admin: engine_admin_pb2_grpc.EngineAdminStub, interval_ms: int) -> engine_admin_pb2.EngineLoad:
    call = admin.WatchLoad(engine_admin_pb2.WatchLoadRequest(interval_ms=interval_ms), timeout=CALL_TIMEOUT)
    try:
        return next(call)
    finally:
        call.cancel()


# -- the other doors: the HTTP face, and gRPC given bytes that are not protobuf -------------------

FACE_SECONDS = float(os.environ.get("FUZZ_FACE_SECONDS", "15"))
FACE_SETTINGS = settings(SETTINGS, max_examples=int(os.environ.get("FUZZ_FACE_EXAMPLES", "500")))
lone_surrogates = st.sampled_from(["\ud800", "a\udfffb", "\udbff\udc00\ud800"])
json_strings = st.one_of(st.text(max_size=20), lone_surrogates, st.sampled_from(["", "tiny", "user", "system",
                                                                                 "developer", "text", "base64"]))
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), json_strings,
    st.sampled_from([0, -1, 1, 2**31, 2**32, 2**32 - 1, 2**63, 2**64, 2**70, 2**40, -2**70, 10**400]))
any_json = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(json_strings, inner, max_size=4), max_leaves=10)
small_ints = st.integers(0, 8)
message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant", "developer"]),
                                                   any_json),
                                 "content": st.one_of(texts, lone_surrogates, any_json)})
# OpenAI-shaped bodies: every field the face reads, each a plausible value or anything at all.
FIELDS: dict[str, Any] = {
    "model": st.one_of(st.just(""), st.just("tiny"), json_strings, any_json),
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.text(max_size=10), max_size=3), lone_surrogates, any_json),
    "messages": st.one_of(st.lists(message, min_size=1, max_size=3), any_json),
    "input": st.one_of(st.text(max_size=30), st.lists(json_strings, max_size=3), any_json),
    **{key: st.one_of(small_ints, any_json) for key in ("max_tokens", "max_completion_tokens", "n", "logprobs",
                                                        "top_logprobs", "top_k", "seed")},
    **{key: st.one_of(st.floats(0, 2), any_json) for key in ("temperature", "top_p", "repetition_penalty")},
    **{key: st.one_of(st.booleans(), any_json) for key in ("stream", "ignore_eos")},
    "stop": st.one_of(json_strings, st.lists(json_strings, max_size=3), any_json),
    "stream_options": st.one_of(st.just({"include_usage": True}), any_json),
    "encoding_format": st.one_of(st.sampled_from(["float", "base64"]), any_json),
}
shaped_bodies = st.fixed_dictionaries({}, optional=FIELDS).map(lambda d: json.dumps(d).encode())
http_bodies = st.one_of(
    shaped_bodies, shaped_bodies,
    any_json.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),
    st.sampled_from([b"", b"{", b"[" * 100_000 + b"]" * 100_000, b'{"prompt":' + b"[" * 50_000 + b"]" * 50_000 + b"}",
                     b'{"prompt":"\\ud800"}', b'{"prompt":"\xff\xfe"}', b"null", b"1e999", b"9" * 5000]))
http_headers = st.fixed_dictionaries({}, optional={
    "x-llmserve-timeout": st.sampled_from(["inf", "1e308", "nan", "-1", "0", "soon", "30"]),
    "x-request-id": st.sampled_from(["r" * 128, "r" * 129, "a b", "ok-id", "\xe9".encode("latin-1")]),
    "content-type": st.sampled_from(["application/json", "text/plain", "multipart/form-data; boundary=x"]),
})


def http_routes() -> list[tuple[str, str]]:
    """(method, path) of every route of the HTTP app, those added after this test too, and /metrics."""
    from services.router.openai_http import OpenAIApp
    routes = [(method, route.path) for route in OpenAIApp(None).app.routes  # type: ignore[arg-type]
              for method in sorted(getattr(route, "methods", None) or {"GET"}) if method != "HEAD"]
    return [*routes, ("GET", "/metrics")]


@pytest.fixture(scope="module")
def http(tiny_stack: Stack) -> httpx.Client:
    assert tiny_stack.http_address
    with httpx.Client(base_url=f"http://{tiny_stack.http_address}", timeout=CALL_TIMEOUT) as client:
        yield client  # type: ignore[misc]


@FACE_SETTINGS
@given(route=st.sampled_from(http_routes()), body=http_bodies, headers=http_headers)
def test_fuzz_http_face(fuzz: Fuzz, http: httpx.Client, route: tuple[str, str], body: bytes,
                        headers: dict[str, Any]):
    if fuzz.face_out_of_time("http"):
        return
    method, path = route
    resp = http.request(method, path, content=body, headers=headers)
    fuzz.faces["http"][str(resp.status_code)] += 1
    shown = f"{method} {path} {headers} {body[:300]!r}"
    assert resp.status_code < 500, f"{shown}\n{resp.status_code} {resp.text[:1000]}"
    if resp.status_code >= 400 and path.startswith("/v1/"):
        assert resp.json()["error"]["message"], shown
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in resp.text.splitlines()
                  if line.startswith("data: {")]
        errors = [e["error"] for e in events if "error" in e]
        assert not [e for e in errors if e["type"] not in ("invalid_request_error", "not_found_error")], \
            f"{shown}\n{errors}"


def _mutations(valid: bytes, cut: int, at: int, byte: int) -> list[bytes]:
    """Ways a valid message's bytes go wrong: cut short, one byte changed, 0xff spliced in."""
    return [valid[:cut % (len(valid) + 1)], valid[:at % (len(valid) + 1)] + bytes([byte]) + valid[at % (len(valid) + 1) + 1:],
            valid[:at % (len(valid) + 1)] + b"\xff\xfe" + valid[at % (len(valid) + 1):]]


not_utf8 = st.binary(min_size=1, max_size=8).filter(lambda b: not _is_utf8(b))


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _string_field(number: int, raw: bytes) -> bytes:
    """A length-delimited field ``number`` carrying ``raw`` (a short one: one-byte tag and length)."""
    return bytes([number << 3 | 2, len(raw)]) + raw


RAW_METHODS = [  # (service, method, response streams, request message; state-changing ones get no valid bytes)
    ("router", "/llmserve.v1.LLMService/Generate", False, llm_pb2.GenerateRequest),
    ("router", "/llmserve.v1.LLMService/GenerateStream", True, llm_pb2.GenerateRequest),
    ("router", "/llmserve.v1.LLMService/GenerateBatch", False, llm_pb2.GenerateBatchRequest),
    ("router", "/llmserve.v1.LLMService/Predict", False, llm_pb2.PredictRequest),
    ("router", "/llmserve.v1.LLMService/ListModels", False, llm_pb2.ListModelsRequest),
    ("engine", "/llmserve.v1.LLMService/Generate", False, llm_pb2.GenerateRequest),
    ("engine", "/llmserve.v1.LLMService/GenerateStream", True, llm_pb2.GenerateRequest),
    ("engine", "/llmserve.v1.EngineAdmin/GetLoad", False, engine_admin_pb2.GetLoadRequest),
    ("engine", "/llmserve.v1.EngineAdmin/WatchLoad", True, engine_admin_pb2.WatchLoadRequest),
    ("engine", "/llmserve.v1.EngineAdmin/LoadModel", False, None),
    ("engine", "/llmserve.v1.EngineAdmin/UnloadModel", False, None),
]
VALID_BYTES = [llm_pb2.GenerateRequest(model="tiny", prompt="Hi", sampling=llm_pb2.SamplingParams(max_tokens=2))
               .SerializeToString(),
               llm_pb2.GenerateBatchRequest(prompts=["a", "b"], request_id="x").SerializeToString(),
               engine_admin_pb2.WatchLoadRequest(interval_ms=20).SerializeToString()]
raw_requests = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda valid, cut, at, byte, pick: _mutations(valid, cut, at, byte)[pick], st.sampled_from(VALID_BYTES),
              st.integers(0, 64), st.integers(0, 64), st.integers(0, 255), st.integers(0, 2)),
    st.builds(_string_field, st.integers(1, 15), not_utf8),
)


def _parses(message: Any, raw: bytes) -> bool:
    try:
        message.FromString(raw)
        return True
    except Exception:  # noqa: BLE001 - DecodeError: what this fuzz sends
        return False


@pytest.fixture(scope="module")
def raw_channels(tiny_stack: Stack) -> dict[str, grpc.Channel]:
    channels = {"router": grpc.insecure_channel(tiny_stack.router.address),  # type: ignore[union-attr]
                "engine": grpc.insecure_channel(tiny_stack.engines[0].address)}
    yield channels  # type: ignore[misc]
    for channel in channels.values():
        channel.close()


@FACE_SETTINGS
@given(target=st.sampled_from(RAW_METHODS), raw=raw_requests)
def test_fuzz_grpc_raw_bytes(fuzz: Fuzz, raw_channels: dict[str, grpc.Channel], target: tuple[str, str, bool, Any],
                             raw: bytes):
    """Bytes as they come off the wire: a server answers INVALID_ARGUMENT when they are not the
    method's message (never UNKNOWN). LoadModel/UnloadModel get only bytes that do not parse."""
    if fuzz.face_out_of_time("grpc raw bytes"):
        return
    service, method, streams, message = target
    if message is None and (_parses(engine_admin_pb2.UnloadModelRequest, raw)
                            or _parses(engine_admin_pb2.LoadModelRequest, raw)):
        return
    channel = raw_channels[service]
    received = 0
    try:
        if streams:
            call = channel.unary_stream(method)(raw, timeout=CALL_TIMEOUT)
            try:
                for received, _ in enumerate(call, 1):
                    break  # a stream that answers has parsed its request (WatchLoad's next may be minutes away)
            finally:
                call.cancel()
        else:
            channel.unary_unary(method)(raw, timeout=CALL_TIMEOUT)
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details()  # type: ignore[attr-defined]
    if code is grpc.StatusCode.CANCELLED and received:
        code = grpc.StatusCode.OK  # our own cancel after the first messages
    fuzz.faces["grpc raw bytes"][f"{service} {code.name}"] += 1
    assert code not in FORBIDDEN, f"{service} {method} got {code.name}: {details}\nbytes: {raw!r}"
    if message is not None and not _parses(message, raw):
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "not a valid protobuf message" in details, \
            f"{service} {method} {code.name}: {details}\nbytes: {raw!r}"


def test_fuzz_left_nothing_behind(fuzz: Fuzz, tiny_stack: Stack):
    """Runs last: no process restarted, no sequence or KV block leaked."""
    engine = tiny_stack.engines[0]
    with grpc.insecure_channel(engine.address) as channel:
        admin = engine_admin_pb2_grpc.EngineAdminStub(channel)

        def drained() -> engine_admin_pb2.EngineLoad | None:
            load = admin.GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=10)
            return load if not (load.num_waiting or load.num_running or load.num_kv_blocks_used) else None
        load = wait_until(drained, 60, "every sequence and KV block of the fuzzed requests to be freed")
    print(f"\nfuzzer: {sum(fuzz.statuses.values())} requests in {time.monotonic() - fuzz.started:.0f}s, "
          f"statuses {dict(fuzz.statuses)}; worker restarts {load.worker_restarts}; leaked: "
          f"{load.num_waiting} waiting, {load.num_running} running, {load.num_kv_blocks_used} KV blocks")
    for face, statuses in fuzz.faces.items():
        print(f"fuzzer, {face}: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}")
    errors = [f"{log.name}: {line}" for log, offset in fuzz.log_offsets.items()
              for line in log.read_bytes()[offset:].decode(errors="replace").splitlines()
              if " ERROR " in line or "Traceback" in line or " CRITICAL " in line]
    print(f"fuzzer: {len(errors)} ERROR lines or tracebacks in the router's and engine's logs")
    assert not errors, "\n".join(errors[:20])
    assert sum(fuzz.statuses.values()) > 0 and all(sum(c.values()) > 0 for c in fuzz.faces.values())
    assert load.worker_restarts == 0, "a fuzzed request restarted the worker"
    assert pids(tiny_stack) == fuzz.pids, "a process was replaced"  # type: ignore[attr-defined]
    assert tiny_stack.router.alive and engine.alive  # type: ignore[union-attr]
