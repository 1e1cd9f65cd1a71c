"""The fuzzer: hypothesis over every field of every public request, through the router to a real stack.

Invariants, per call: never UNKNOWN, never INTERNAL (a per-sequence failure found by a fuzzer is a
bug to fix), never UNAVAILABLE (nothing here may take the engine down), and every error carries a
message. After the run: no process restarted (same router, engine and worker pids; the engine's
worker restart counter still 0) and nothing leaked (no sequence waiting or running, no KV block
used), with deadline-bounded waits.

Bounded in time: ``MAX_EXAMPLES`` per request type, and every example after ``TIME_CAP_SECONDS`` of
the whole run returns at once (FUZZ_SECONDS overrides the cap, FUZZ_EXAMPLES the count).
"""
from __future__ import annotations

import os
import time
from collections import Counter
from typing import Callable

import grpc
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


def test_fuzz_starts_from_a_settled_stack(fuzz: Fuzz, tiny_stack: Stack):
    fuzz.pids = pids(tiny_stack)  # type: ignore[attr-defined]


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
    assert sum(fuzz.statuses.values()) > 0
    assert load.worker_restarts == 0, "a fuzzed request restarted the worker"
    assert pids(tiny_stack) == fuzz.pids, "a process was replaced"  # type: ignore[attr-defined]
    assert tiny_stack.router.alive and engine.alive  # type: ignore[union-attr]
