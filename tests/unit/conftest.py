"""Fixtures of the unit tests."""
from __future__ import annotations

import pytest

from services.worker import kernels


@pytest.fixture(params=list(kernels.QUANT_BUILDS))
def each_quant_build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test once on each build of the GGUF block kernels (``$LLMSERVE_QUANT_ISA``), skipped where this CPU or
    compiler cannot run it: the builds differ in more than their matmuls (the avx512 one has a decode attention
    of its own)."""
    if kernels.quant_build(request.param) is None:
        pytest.skip(f"the {request.param} build of the block kernels does not run here")
    monkeypatch.setenv("LLMSERVE_QUANT_ISA", request.param)
    return request.param
