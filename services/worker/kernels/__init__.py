"""The worker's C++ kernels, built into two shared libraries.

For bfloat16 on CPUs with AVX-512 BF16 (``library()``):

- ``paged_attention.cpp``: attention of every query row of a step over its paged context (``attention_kernel.py``);
- ``layer_ops.cpp``: the elementwise work between a layer's matmuls, fused (``layer_ops.py``);
- ``simd.h``: what both share (bfloat16 loads and stores, a 16-way fold, a vector e^x).

The library is compiled on first use (a few seconds with g++) into ``.cache/kernels``, named by a hash of its
sources and flags, and loaded with ctypes; ``make`` builds it ahead (``python -m services.worker.kernels``).
It is built with ``-fopenmp`` against libgomp.so.1, and torch has loaded its own libgomp.so.1 before it: the
kernels' OpenMP threads are torch's own team. Where it cannot be used (no AVX-512 BF16, no compiler) the
worker runs torch's ops and says so in its log.

For GGUF Q4_1 / Q8_0 weights (``quant_library()``), built the same way in two builds, the best this CPU runs
chosen at load (``$LLMSERVE_QUANT_ISA`` names one):

- ``avx512``, for CPUs with AVX-512 F/BW/VL and VNNI: the weights in 16-row vertical tiles, 12-bit activations
  (held in int16) multiplied with ``vpdpwssd`` (blocks.h); on CPUs with AMX (Sapphire Rapids and later), products
  of 16 rows and more on the tile registers, the same bits (amx.h);
- ``avx2``, for CPUs with AVX2, FMA and F16C: the same tiles read 8 rows at a time, ``vpmaddwd`` and ``vpaddd``,
  the same bits.

Their sources:

- ``quant.cpp``: the matmuls over the file's own blocks (``services/worker/quant_linear.py``);
- ``native_ops.cpp``: the native path's fp32 glue and decode attention (``services/worker/native_ops.py``);
- ``native_prefill.cpp``: the native path's prefill attention, 16-row tiles with bf16 products (the avx512 build
  only, and AVX-512 BF16 at run time: elsewhere a chunk's queries run as decode rows);
- ``native_step.cpp``: a whole decode step, every layer in one call (``services/worker/native_step.py``);
- ``blocks.h`` (the block formats and tiles) and ``native_glue.h`` (the glue's rows, the attention's parts):
  what those share, so the one-call step computes what the one-op calls do, bit for bit; the avx512 build's
  decode attention also uses ``simd.h``'s fold and e^x (its bfloat16 parts are left out without AVX-512 BF16).

Where it cannot be used the worker dequantizes those weights and runs torch's ops instead.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp.so.1 before the library needs one)

from services import REPO_ROOT

log = logging.getLogger("llmserve.worker.kernels")

SOURCES = [Path(__file__).with_name(name) for name in ("paged_attention.cpp", "layer_ops.cpp", "gemv.cpp")]
HEADERS = [Path(__file__).with_name("simd.h")]
CXX_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp",
             "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"]
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma")
QUANT_SOURCES = [Path(__file__).with_name(name) for name in ("quant.cpp", "native_ops.cpp", "native_step.cpp",
                                                               "native_prefill.cpp")]
QUANT_HEADERS = [Path(__file__).with_name(name) for name in ("blocks.h", "amx.h", "native_glue.h", "share.h", "simd.h")]
QUANT_CXX_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-mavx2", "-mfma", "-mf16c"]
QUANT_CPU_FLAGS = ("avx2", "fma", "f16c")
# the quant library's builds, best first: name → (extra compiler flags, /proc/cpuinfo flags it needs)
QUANT_BUILDS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "avx512": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
               QUANT_CPU_FLAGS + ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")),
    "avx2": ([], QUANT_CPU_FLAGS),
}


# from how many activation rows the avx512 build's products run on AMX tiles, where the CPU has them (amx.h: the
# same bits as vpdpwssd; at 16 rows and more the tiles are faster)
AMX_MIN_ROWS = 16


def cache_dir() -> Path:
    """``$LLMSERVE_KERNEL_DIR``, else ``.cache/kernels`` at the repository root."""
    return Path(os.environ.get("LLMSERVE_KERNEL_DIR") or REPO_ROOT / ".cache" / "kernels")


def cpu_supported(required: tuple[str, ...] = CPU_FLAGS) -> bool:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    have = set(flags.split(":", 1)[1].split())
    return all(f in have for f in required)


def build(compiler: str | None = None) -> Path:
    """The compiled library (compiled now if these sources and flags were not built before)."""
    return _build("llmserve_kernels", SOURCES + HEADERS, SOURCES, CXX_FLAGS, compiler)


def quant_isa() -> str | None:
    """The quant library build this machine runs: ``$LLMSERVE_QUANT_ISA`` if set, else the best its CPU supports
    (None: neither)."""
    wanted = os.environ.get("LLMSERVE_QUANT_ISA")
    if wanted:
        if wanted not in QUANT_BUILDS:
            raise ValueError(f"LLMSERVE_QUANT_ISA={wanted!r}: expected one of {', '.join(QUANT_BUILDS)}")
        return wanted
    return next((isa for isa, (_, need) in QUANT_BUILDS.items() if cpu_supported(need)), None)


def build_quant(compiler: str | None = None, isa: str | None = None) -> Path:
    """The compiled GGUF block kernels (``quant.cpp``) of build ``isa`` (default: ``quant_isa()``, else avx2)."""
    extra = QUANT_BUILDS[isa or quant_isa() or "avx2"][0]
    return _build("llmserve_quant", QUANT_SOURCES + QUANT_HEADERS, QUANT_SOURCES, QUANT_CXX_FLAGS + extra, compiler)


def _build(stem: str, inputs: list[Path], sources: list[Path], flags: list[str], compiler: str | None) -> Path:
    cxx = compiler or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in inputs) + " ".join([cxx, *flags]).encode())
    target = cache_dir() / f"{stem}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([cxx, *flags, "-o", str(out), *map(str, sources)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed to build the kernels: {proc.stderr.strip()[-2000:]}")
        os.replace(out, target)   # atomic: concurrent workers each build, one file wins
    return target


_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
# The C functions the library exports: (argument types, result type), as the .cpp files declare them.
SIGNATURES: dict[str, tuple[list[type], type | None]] = {
    "llmserve_paged_attention_supports": ([_I64, _I64], _INT),
    "llmserve_paged_attention": ([_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _F32,
                                  _PTR, _I64], _INT),
    "llmserve_add_rms_norm": ([_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _F32], None),
    "llmserve_rope_store": ([_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR], None),
    "llmserve_silu_mul": ([_PTR, _PTR, _I64, _I64], None),
    "llmserve_gemv_supports": ([_I64, _I64], _INT),
    "llmserve_gemv": ([_PTR, _PTR, _PTR, _I64, _I64], None),
}
_MATMUL = ([_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64], None)
_DEQUANT = ([_PTR, _I64, _PTR, _I64, _PTR], None)
QUANT_SIGNATURES: dict[str, tuple[list[type], type | None]] = {
    "llmserve_quant_cpu_ok": ([], _INT),
    "llmserve_quant_tile_rows": ([], _I64),
    "llmserve_quant_amx": ([_I64], _INT),
    "llmserve_q4_1_matmul_i16": _MATMUL,
    "llmserve_q8_0_matmul_i16": _MATMUL,
    "llmserve_q4_1_dequant_rows": _DEQUANT,
    "llmserve_q8_0_dequant_rows": _DEQUANT,
    "llmserve_f32_add_rms_norm": ([_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _F32], None),
    "llmserve_f32_rope_store": ([_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR], None),
    "llmserve_f16_rope_store": ([_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR], None),
    "llmserve_f16q8_rope_store": ([_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR], None),
    "llmserve_f32_silu_mul": ([_PTR, _PTR, _I64, _I64], None),
    "llmserve_f32_paged_decode": ([_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _F32,
                                   _PTR, _I64], _INT),
    "llmserve_f16_paged_decode": ([_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _F32,
                                   _PTR, _I64], _INT),
    "llmserve_f16q8_paged_decode": ([_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _F32,
                                  _PTR, _I64], _INT),
    "llmserve_native_prefill_ok": ([], _INT),
    "llmserve_native_prefill_amx": ([_INT], _INT),
    "llmserve_f16_paged_prefill": ([_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _F32,
                                    _PTR, _I64], _INT),
    "llmserve_f16q8_paged_prefill": ([_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _F32,
                                   _PTR, _I64], _INT),
    "llmserve_f32_paged_prefill": ([_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _F32,
                                    _PTR, _I64], _INT),
    "llmserve_native_step_supports": ([_PTR], _INT),
    "llmserve_native_step": ([_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR], None),
}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library with its functions' signatures declared, or None (with a log line saying why)
    where this machine cannot run it."""
    if not cpu_supported():
        log.info("C++ kernels: not used (this CPU lacks one of %s); torch's ops run instead", ", ".join(CPU_FLAGS))
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as exc:
        log.warning("C++ kernels: unavailable (%s); torch's ops run instead", exc)
        return None
    return _declare(lib, SIGNATURES)


def quant_library() -> ctypes.CDLL | None:
    """The GGUF block kernels this machine runs (``quant_isa()``) with their signatures declared, or None (with a
    log line saying why) where it cannot run them, or where ``$LLMSERVE_QUANT_KERNELS`` is 0 (the portable path,
    for tests)."""
    if os.environ.get("LLMSERVE_QUANT_KERNELS", "1") == "0":
        log.info("GGUF block kernels: off ($LLMSERVE_QUANT_KERNELS=0); quantized weights are dequantized")
        return None
    isa = quant_isa()
    if isa is None:
        log.info("GGUF block kernels: not used (this CPU lacks one of %s); quantized weights are dequantized",
                 ", ".join(QUANT_CPU_FLAGS))
        return None
    return quant_build(isa)


def quant_builds() -> list[str]:
    """The builds of the GGUF block kernels this machine runs, best first (tests run each)."""
    return [isa for isa in QUANT_BUILDS if quant_build(isa) is not None]


@functools.cache
def quant_build(isa: str) -> ctypes.CDLL | None:
    """Build ``isa`` of the GGUF block kernels, loaded, or None (logged) where this CPU or compiler cannot run it."""
    if not cpu_supported(QUANT_BUILDS[isa][1]):
        log.info("GGUF block kernels (%s): not used (this CPU lacks one of %s); quantized weights are dequantized",
                 isa, ", ".join(QUANT_BUILDS[isa][1]))
        return None
    try:
        path = build_quant(isa=isa)
        lib = _declare(ctypes.CDLL(str(path)), QUANT_SIGNATURES)
    except (RuntimeError, OSError) as exc:
        log.warning("GGUF block kernels: unavailable (%s); quantized weights are dequantized", exc)
        return None
    if not lib.llmserve_quant_cpu_ok():
        log.info("GGUF block kernels: this CPU lacks what the %s build uses; quantized weights are dequantized", isa)
        return None
    amx = isa == "avx512" and lib.llmserve_quant_amx(AMX_MIN_ROWS) == 1
    log.info("GGUF block kernels and native layer ops: %s, %d-row tiles%s (%s)", isa, lib.llmserve_quant_tile_rows(),
             f"; products of {AMX_MIN_ROWS}+ rows on the AMX tiles" if amx else "", path.name)
    return lib


def _declare(lib: ctypes.CDLL, signatures: dict[str, tuple[list[type], type | None]]) -> ctypes.CDLL:
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name, None)    # a build may leave some out (the quant library's avx2/avx512 builds)
        if fn is not None:
            fn.argtypes, fn.restype = argtypes, restype
    return lib
