"""``python -m services.worker.kernels``: build the C++ kernels (both libraries) now (``make`` does), print where they are."""
from services.worker import kernels

if not kernels.cpu_supported():
    print(f"C++ kernels: not built (this CPU lacks one of {', '.join(kernels.CPU_FLAGS)}; torch's ops are used)")
else:
    print(f"C++ kernels: {kernels.build()}")

# every build of the GGUF block kernels this CPU runs (the tests compare them)
built = [isa for isa, (_, need) in kernels.QUANT_BUILDS.items() if kernels.cpu_supported(need)]
if not built:
    print(f"GGUF block kernels: not built (this CPU lacks one of {', '.join(kernels.QUANT_CPU_FLAGS)}; "
          "quantized weights are dequantized)")
for isa in built:
    print(f"GGUF block kernels ({isa}): {kernels.build_quant(isa=isa)}")
