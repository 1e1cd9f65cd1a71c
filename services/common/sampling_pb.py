"""``SamplingOptions`` on the engine→worker wire (``WorkerSampling``): both directions, in one place."""
from __future__ import annotations

from llmserve.worker.v1 import worker_pb2
from services.common.sampling import SamplingOptions


def sampling_to_pb(s: SamplingOptions) -> worker_pb2.WorkerSampling:
    return worker_pb2.WorkerSampling(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, has_seed=s.seed is not None,
        seed=s.seed or 0, repetition_penalty=s.repetition_penalty,
        num_logprobs=-1 if s.logprobs is None else s.logprobs,
    )


def sampling_from_pb(p: worker_pb2.WorkerSampling) -> SamplingOptions:
    """What the sampler needs (the engine-side fields keep their defaults)."""
    return SamplingOptions(
        temperature=p.temperature, top_p=p.top_p or 1.0, top_k=p.top_k, seed=p.seed if p.has_seed else None,
        repetition_penalty=p.repetition_penalty or 1.0, logprobs=None if p.num_logprobs < 0 else p.num_logprobs)
