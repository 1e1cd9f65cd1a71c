"""A model that cannot load evicts nothing, and its failure is remembered: the load guard and the
preflight of model files (real GGUF and safetensors files, fake models in the manager)."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from services.common.errors import FailedPrecondition
from services.common.model_source import resolve_model
from services.engine.models.load_guard import LoadGuard
from services.engine.models.manager import ModelManager
from services.engine.models.preflight import check_gguf, check_model_files, check_safetensors
from services.engine.models.store import ModelEntry, ModelStore
from tests.unit.test_admission import Clock
from tests.unit.test_model_manager import FakeModel, entry, use

MiB = 2**20


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return resolve_model("smollm2").path


def truncated_copy(src: Path, dst: Path, size: int) -> Path:
    with open(src, "rb") as f, open(dst, "wb") as out:
        out.write(f.read(size))
    return dst


def test_a_whole_gguf_passes_the_preflight(gguf_file):
    check_gguf(gguf_file)


@pytest.mark.parametrize("cut", [16, 2 * MiB, 50_000_000, -32])
def test_a_truncated_gguf_is_refused_naming_the_file(gguf_file, tmp_path, cut):
    size = gguf_file.stat().st_size
    path = truncated_copy(gguf_file, tmp_path / "cut.gguf", cut if cut > 0 else size + cut)
    with pytest.raises(ValueError, match="cut.gguf.*(truncated|too short)"):
        check_gguf(path)


def test_not_a_gguf_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="not a GGUF file"):
        check_gguf(path)


def test_safetensors_header_and_coverage_are_checked(tmp_path):
    whole = tmp_path / "whole.safetensors"
    save_file({"w": np.zeros((256, 256), np.float32)}, str(whole))
    check_safetensors(whole)
    cut = truncated_copy(whole, tmp_path / "cut.safetensors", whole.stat().st_size // 2)
    with pytest.raises(ValueError, match="cut.safetensors.*not fully covered"):
        check_safetensors(cut)


def test_check_model_files_gives_failed_precondition_for_a_missing_or_corrupt_model(tmp_path):
    missing = ModelEntry(id="m", name="gone", task="text-generation", format="gguf",
                         source=str(tmp_path / "gone.gguf"), dtype="float32", context_length=1, memory_estimate_bytes=1)
    with pytest.raises(FailedPrecondition, match="gone.gguf"):
        check_model_files(missing)
    model_dir = tmp_path / "broken"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": ')
    broken = ModelEntry(id="b", name="broken", task="text-generation", format="safetensors",
                        source=str(model_dir), dtype="float32", context_length=1, memory_estimate_bytes=1)
    with pytest.raises(FailedPrecondition, match="config.json is not valid JSON.*nothing was evicted"):
        check_model_files(broken)


def guarded(sizes: dict[str, int], budget_mb: int, broken: set[str], fails_in_worker: set[str],
            clock: Clock, fingerprints: dict[str, object] | None = None):
    entries = [entry(n, mb) for n, mb in sizes.items()]
    log: list[str] = []

    def preflight(e: ModelEntry) -> None:
        log.append(f"preflight {e.name}")
        if e.name in broken:
            raise FailedPrecondition(f"model {e.name} cannot be loaded: truncated")

    def load(e: ModelEntry) -> FakeModel:
        log.append(f"load {e.name}")
        if e.name in fails_in_worker:
            raise FailedPrecondition(f"model {e.name} could not be loaded: worker exited with code 2")
        return FakeModel(e, log)

    fp = fingerprints if fingerprints is not None else {}
    guard = LoadGuard(backoff_seconds=30, preflight=preflight, fingerprint=lambda e: fp.get(e.name), clock=clock)
    return ModelManager(ModelStore(entries, entries[0].name), load, budget_mb * MiB, 8, wait_seconds=1,
                        clock=clock, guard=guard), log


def test_a_model_that_fails_its_preflight_evicts_nothing_and_is_remembered():
    clock = Clock()
    m, log = guarded({"good": 600, "bad": 600}, 1000, broken={"bad"}, fails_in_worker=set(), clock=clock)
    use(m, "good")
    for _ in range(3):
        with pytest.raises(FailedPrecondition, match="truncated"):
            use(m, "bad")
    # One preflight, then the memory answers; the good model was never closed.
    assert log == ["preflight good", "load good", "preflight bad"]
    assert {s.entry.name for s in m.snapshot() if s.loaded} == {"good"}
    m.check_invariants()


def test_a_load_that_fails_in_the_worker_is_remembered_until_the_back_off_passes():
    clock = Clock()
    m, log = guarded({"good": 600, "bad": 600}, 1000, broken=set(), fails_in_worker={"bad"}, clock=clock)
    use(m, "good")
    with pytest.raises(FailedPrecondition, match="worker exited"):
        use(m, "bad")
    assert log[-3:] == ["preflight bad", "close good", "load bad"]  # it passed the preflight: room was made
    log.clear()
    clock.now += 10
    with pytest.raises(FailedPrecondition, match=r"worker exited.*failed 10.0s ago.*another 20.0s") as err:
        use(m, "bad")
    assert err.value.retry_after_ms == 20_000
    assert log == []  # answered from memory: no preflight, no eviction, no worker
    clock.now += 21
    with pytest.raises(FailedPrecondition, match="worker exited"):
        use(m, "bad")
    assert log == ["preflight bad", "load bad"]  # the back-off passed: tried again


def test_an_explicit_load_or_a_changed_file_clears_the_memory():
    clock = Clock()
    fingerprints: dict[str, object] = {"bad": (100, 1)}
    broken = {"bad"}
    m, log = guarded({"good": 100, "bad": 100}, 1000, broken=broken, fails_in_worker=set(), clock=clock,
                     fingerprints=fingerprints)
    with pytest.raises(FailedPrecondition):
        use(m, "bad")
    with pytest.raises(FailedPrecondition, match="not retried"):
        use(m, "bad")
    fingerprints["bad"] = (200, 2)          # the file was copied again
    broken.clear()                          # and this time whole
    use(m, "bad")
    assert log[-2:] == ["preflight bad", "load bad"]
    m2, log2 = guarded({"good": 100, "bad": 100}, 1000, broken={"bad"}, fails_in_worker=set(), clock=clock)
    for _ in range(2):
        with pytest.raises(FailedPrecondition):
            m2.load("bad")                  # LoadModel: tried each time (the preflight runs again)
    assert log2 == ["preflight bad", "preflight bad"]


def test_a_real_guard_refuses_a_truncated_gguf_before_evicting(gguf_file, tmp_path):
    cut = truncated_copy(gguf_file, tmp_path / "cut.gguf", 3 * MiB)
    good = entry("good", 600)
    bad = ModelEntry(id="bad", name="bad", task="text-generation", format="gguf", source=str(cut),
                     dtype="float32", context_length=512, memory_estimate_bytes=600 * MiB)
    log: list[str] = []
    # The good model is a fake (no files): only the bad one meets the real preflight.
    guard = LoadGuard(backoff_seconds=30, preflight=lambda e: None if e is good else check_model_files(e))
    m = ModelManager(ModelStore([good, bad], "good"), lambda e: (log.append(f"load {e.name}"), FakeModel(e, log))[1],
                     1000 * MiB, 8, guard=guard)
    use(m, "good")
    with pytest.raises(FailedPrecondition, match="cut.gguf.*truncated"):
        use(m, "bad")
    assert log == ["load good"]
    shutil.copy(gguf_file, cut)  # replaced by a whole copy: the memory ends with the old file
    assert guard.failure(bad) == ""
