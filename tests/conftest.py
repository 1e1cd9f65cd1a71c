"""Fixtures: a tiny random-weight model, and real router/engine/worker processes on loopback."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from llmserve.v1 import engine_admin_pb2_grpc, llm_pb2_grpc
from services.stack import Stack, start_stack


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama with random weights and SmolLM2's tokenizer: fast, same code path as the real model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.common.model_source import resolve_model
    from services.engine.models.tokenizer import _tokenizer_dir

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path)
    for f in _tokenizer_dir(resolve_model("smollm2")).iterdir():
        shutil.copy(f, path / f.name)
    return path


TINY_ENGINE_ARGS = ["--worker-threads", "1", "--kv-cache-mb", "16", "--max-batch-prompts", "8",
                    "--max-queue", "256"]


@pytest.fixture(scope="session")
def tiny_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("tiny-stack-logs")
    stack = start_stack(["--model", str(tiny_model_dir), *TINY_ENGINE_ARGS], log_dir=logs)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def router_channel(tiny_stack: Stack) -> Iterator[grpc.Channel]:
    assert tiny_stack.router is not None
    with grpc.insecure_channel(tiny_stack.router.address) as channel:
        yield channel


@pytest.fixture(scope="session")
def router(router_channel: grpc.Channel) -> llm_pb2_grpc.LLMServiceStub:
    return llm_pb2_grpc.LLMServiceStub(router_channel)


@pytest.fixture(scope="session")
def engine_admin(tiny_stack: Stack) -> Iterator[engine_admin_pb2_grpc.EngineAdminStub]:
    with grpc.insecure_channel(tiny_stack.engines[0].address) as channel:
        yield engine_admin_pb2_grpc.EngineAdminStub(channel)
