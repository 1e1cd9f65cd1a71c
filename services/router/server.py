"""gRPC face of the router: the public LLMService, relayed to engines (see ``relay``).

The servicer runs on an asyncio server: a relay spends its life waiting on engines. The engine
pool's health checks and load watches stay on threads. Each call's id comes from the request's
``request_id`` or ``x-llmserve-request-id`` metadata (else a new one); what the engine said about
the call (``x-llmserve-*``) goes back as trailers, and a stream's also as its initial metadata.
"""
from __future__ import annotations

from typing import Any, AsyncIterator

import grpc

from llmserve.v1 import llm_pb2, llm_pb2_grpc
from services.common.call_metadata import request_id_of
from services.common.server import time_remaining
from services.router.relay import CallScope, Relay, Relayed, StreamMetadata


def scope_of(request: Any, context: grpc.aio.ServicerContext) -> CallScope:
    return CallScope.within(time_remaining(context), context.cancelled, request_id_of(request, context))


def _answer(relayed: Relayed, context: grpc.aio.ServicerContext) -> object:
    # Pass on what the engine said about the call (e.g. x-llmserve-load-seconds after a cold start).
    context.set_trailing_metadata(relayed.metadata)
    return relayed.response


class RouterServicer(llm_pb2_grpc.LLMServiceServicer):
    def __init__(self, relay: Relay):
        self.relay = relay

    async def Generate(self, request: llm_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> llm_pb2.GenerateResponse:
        return _answer(await self.relay.generate(request, scope_of(request, context)), context)

    async def GenerateBatch(self, request: llm_pb2.GenerateBatchRequest,
                            context: grpc.aio.ServicerContext) -> llm_pb2.GenerateBatchResponse:
        return _answer(await self.relay.generate_batch(request, scope_of(request, context)), context)

    async def Predict(self, request: llm_pb2.PredictRequest,
                      context: grpc.aio.ServicerContext) -> llm_pb2.PredictResponse:
        return _answer(await self.relay.predict(request, scope_of(request, context)), context)

    async def GenerateStream(self, request: llm_pb2.GenerateRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[llm_pb2.GenerateStreamResponse]:
        metadata = StreamMetadata()
        announced = False
        async for msg in self.relay.generate_stream(request, scope_of(request, context), metadata):
            if not announced:  # the engine, queue time and TTFT, before the first token
                announced = True
                await context.send_initial_metadata(metadata.initial)
            yield msg
        context.set_trailing_metadata(metadata.trailing)

    async def ListModels(self, request: llm_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> llm_pb2.ListModelsResponse:
        return await self.relay.list_models(request, scope_of(request, context))
