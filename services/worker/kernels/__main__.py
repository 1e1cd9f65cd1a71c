"""``python -m services.worker.kernels``: build the C++ kernels (both libraries) now (``make`` does), print where they are."""
from services.worker import kernels

if not kernels.cpu_supported():
    print(f"C++ kernels: not built (this CPU lacks one of {', '.join(kernels.CPU_FLAGS)}; torch's ops are used)")
else:
    print(f"C++ kernels: {kernels.build()}")

if not kernels.cpu_supported(kernels.QUANT_CPU_FLAGS):
    print(f"GGUF block kernels: not built (this CPU lacks one of {', '.join(kernels.QUANT_CPU_FLAGS)}; "
          "quantized weights are dequantized)")
else:
    print(f"GGUF block kernels: {kernels.build_quant()}")
