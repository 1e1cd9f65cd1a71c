from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config import KV_CACHE_DTYPES, require
from services.common.security import TlsConfig


@dataclass(frozen=True)
class WorkerConfig(TlsConfig):
    """llmserve worker: loads one model and executes forward steps for an engine."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=50061, metadata={"help": "port to listen on (0 = pick a free one)"})
    model: str = field(default="smollm2", metadata={"help": "model spec: 'smollm2', a .gguf file or a model directory"})
    task: str = field(default="text-generation", metadata={"help": "text-generation, embedding or text-classification"})
    runtime: str = field(default="transformers", metadata={"help": "transformers (torch) or onnxruntime (embedding "
                                                                    "and text-classification: the model exported to "
                                                                    "ONNX once, or --onnx-file)"})
    onnx_file: str = field(default="", metadata={"help": "with --runtime onnxruntime: this ONNX file instead of the "
                                                         "model exported into the cache"})
    train_data: str = field(default="", metadata={"path": True, "help": "text-classification: labelled 'label<TAB>text' file for the head"})
    dtype: str = field(default="float32", metadata={"help": "float32 (exact greedy), bfloat16 (faster prefill on AVX-512 "
                                                            "BF16 CPUs) or native (a GGUF's own Q4_1/Q8_0 blocks through "
                                                            "the block kernels, 12-bit activations; bfloat16 for other "
                                                            "models)"})
    device: str = field(default="auto", metadata={"help": "cpu, cuda or auto (cuda when available)"})
    kv_cache_mb: int = field(default=512, metadata={"help": "memory for the paged KV cache, MiB"})
    kv_cache_dtype: str = field(default="auto", metadata={"help": "KV pool of --dtype native: auto or float16 (fp16 keys "
                                                                   "and values), or int8-values (fp16 keys, int8 values "
                                                                   "with a scale per head: about a third more tokens a pool, "
                                                                   "lower top-1 agreement; needs the avx512 attention "
                                                                   "kernels, refused elsewhere)"})
    block_size: int = field(default=0, metadata={"help": "tokens per KV block (0 = 64 where the C++ attention "
                                                          "kernel runs, bfloat16 on an AVX-512 BF16 CPU, so a long "
                                                          "context in scattered blocks costs fewer cache misses; "
                                                          "else 16)"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0 = all cores)"})
    secret_file: str = field(default="", metadata={"help": "file holding the secret its engine must present (the "
                                                           "engine's --worker-secret-file); a worker the engine "
                                                           "spawns gets one in the environment instead"})
    drain_seconds: float = field(default=30.0, metadata={"help": "on SIGTERM, how long calls in flight may take to "
                                                                 "finish before they are cancelled"})
    port_file: str = field(default="", metadata={"help": "write the bound port to this file once serving (for port 0)"})
    exit_with_parent: bool = field(default=False, metadata={"help": "exit when the process that started this worker dies"})
    parent_pid: int = field(default=0, metadata={"help": "with --exit-with-parent: the parent's pid (0 = this worker's "
                                                         "parent at start); a worker whose parent is already gone "
                                                         "when it starts exits at once"})
    metrics: bool = field(default=True, metadata={"help": "serve Prometheus metrics at http://HOST:METRICS_PORT/metrics; --no-metrics serves and records none"})
    metrics_port: int = field(default=0, metadata={"help": "HTTP port of /metrics (0 = pick a free one)"})
    metrics_port_file: str = field(default="", metadata={"help": "write the bound metrics port to this file (for --metrics-port 0)"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning, error"})

    def validate(self) -> None:
        require(self.task in ("text-generation", "embedding", "text-classification"),
                f"--task must be text-generation, embedding or text-classification, not {self.task!r}")
        require(self.task != "text-classification" or bool(self.train_data),
                "--train-data is required with --task text-classification")
        require(self.runtime in ("transformers", "onnxruntime"),
                f"--runtime must be transformers or onnxruntime, not {self.runtime!r}")
        require(self.runtime == "transformers" or self.task != "text-generation",
                "--runtime onnxruntime serves embedding and text-classification models")
        require(self.dtype in ("float32", "bfloat16", "native"),
                f"--dtype must be float32, bfloat16 or native, not {self.dtype!r}")
        require(self.device in ("auto", "cpu", "cuda"), f"--device must be auto, cpu or cuda, not {self.device!r}")
        require(self.kv_cache_mb > 0, "--kv-cache-mb must be > 0")
        require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache_dtype!r}")
        require(self.kv_cache_dtype == "auto" or self.dtype == "native",
                "--kv-cache-dtype applies to --dtype native (float32 and bfloat16 keep their KV in their dtype)")
        require(self.block_size >= 0, "--block-size must be >= 0 (0 = chosen by the worker)")
        require(0 <= self.port < 65536, "--port must be in [0, 65535]")
        require(0 <= self.metrics_port < 65536, "--metrics-port must be in [0, 65535]")
        require(self.drain_seconds >= 0, "--drain-seconds must be >= 0")
        require(self.parent_pid >= 0, "--parent-pid must be >= 0")
        require(not self.parent_pid or self.exit_with_parent, "--parent-pid needs --exit-with-parent")
        self.tls.validate()
