"""Request bytes that are not the method's message end INVALID_ARGUMENT, not UNKNOWN, on a real
grpc.aio server built by ``create_server`` (unary and server-streaming methods)."""
from __future__ import annotations

import asyncio

import grpc

from llmserve.v1 import llm_pb2, llm_pb2_grpc
from services.common.server import create_server

VALID = llm_pb2.GenerateRequest(prompt="héllo").SerializeToString()
MALFORMED = {
    "truncated": VALID[:-2],
    "bad UTF-8 in a string field": VALID.replace("é".encode(), b"\xff\xfe"),
    "corrupt wire format": b"\xff\xff\xff\xff",
}


class Echo(llm_pb2_grpc.LLMServiceServicer):
    async def Generate(self, request, context):
        return llm_pb2.GenerateResponse(text=request.prompt)

    async def GenerateStream(self, request, context):
        yield llm_pb2.GenerateStreamResponse(text=request.prompt)


def test_malformed_requests_are_invalid_argument():
    async def run() -> dict[str, tuple[str, str]]:
        handle = await create_server([lambda s: llm_pb2_grpc.add_LLMServiceServicer_to_server(Echo(), s)],
                                     [], "127.0.0.1", 0)
        out = {}
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
                unary = ch.unary_unary("/llmserve.v1.LLMService/Generate")
                stream = ch.unary_stream("/llmserve.v1.LLMService/GenerateStream")
                ok = llm_pb2.GenerateResponse.FromString(await unary(VALID, timeout=10))
                out["valid"] = ("OK", ok.text)
                first = [llm_pb2.GenerateStreamResponse.FromString(m) async for m in stream(VALID, timeout=10)]
                out["valid stream"] = ("OK", first[0].text)
                for name, raw in MALFORMED.items():
                    for kind, call in (("unary", lambda r: unary(r, timeout=10)),
                                       ("stream", lambda r: _drain(stream(r, timeout=10)))):
                        try:
                            await call(raw)
                            out[f"{name} {kind}"] = ("OK", "")
                        except grpc.aio.AioRpcError as exc:
                            out[f"{name} {kind}"] = (exc.code().name, exc.details() or "")
        finally:
            await handle.server.stop(0)
        return out

    out = asyncio.run(run())
    assert out.pop("valid") == ("OK", "héllo") and out.pop("valid stream") == ("OK", "héllo")
    assert len(out) == 6
    for name, (code, details) in out.items():
        assert code == "INVALID_ARGUMENT", (name, code, details)
        assert "not a valid protobuf message" in details, (name, details)


async def _drain(call) -> None:
    async for _ in call:
        pass
