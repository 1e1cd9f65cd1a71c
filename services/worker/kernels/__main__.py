"""``python -m services.worker.kernels``: build the C++ kernels now (``make`` does), print where they are."""
from services.worker import kernels

if not kernels.cpu_supported():
    print(f"C++ kernels: not built (this CPU lacks one of {', '.join(kernels.CPU_FLAGS)}; torch's ops are used)")
else:
    print(f"C++ kernels: {kernels.build()}")
