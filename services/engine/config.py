from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config import KV_CACHE_DTYPES, ConfigError, require
from services.common.security import TlsConfig
from services.engine.core.speculation import SpeculativeConfig


@dataclass(frozen=True)
class EngineConfig(TlsConfig):
    """llmserve engine: the node daemon serving llmserve.v1.LLMService with its worker."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=50052, metadata={"help": "port to listen on (0 = pick a free one)"})
    model: str = field(default="", metadata={"help": "serve only this model (spec: 'smollm2', a .gguf file or a model "
                                                     "directory) instead of the model store; empty = use the store"})
    model_store: str = field(default="", metadata={"path": True, "help": "YAML file listing the models to serve; empty = models.yaml "
                                                           "at the repository root"})
    memory_budget_mb: int = field(default=4096, metadata={"help": "memory for loaded models (their workers' RSS), MiB; "
                                                                  "least recently used idle models are evicted to fit"})
    max_loaded_models: int = field(default=4, metadata={"help": "most models loaded at once"})
    warm_models: str = field(default="default", metadata={"help": "comma-separated models (names or ids) to load at "
                                                                  "start; 'default' = the store's default model; "
                                                                  "'none' = load on first use only"})
    model_wait_seconds: float = field(default=30.0, metadata={"help": "longest a request waits for room when the "
                                                                      "budget is held by models in use"})
    unload_drain_seconds: float = field(default=30.0, metadata={"help": "longest UnloadModel waits for the model's "
                                                                        "requests in flight to finish (a request's "
                                                                        "drain_timeout_ms overrides it); new requests for "
                                                                        "the model meanwhile get UNAVAILABLE with a retry "
                                                                        "hint at once"})
    load_failure_backoff_seconds: float = field(default=30.0, metadata={"help": "how long a model whose load failed "
                                                                                "is not tried again: its requests fail "
                                                                                "FAILED_PRECONDITION at once with the "
                                                                                "reason (LoadModel retries at once; "
                                                                                "0 = always retry)"})
    worker: str = field(default="", metadata={"help": "host:port of an external worker; empty = start one as a child process"})
    dtype: str = field(default="", metadata={"help": "worker dtype for every model: float32, bfloat16 or native (GGUF "
                                                    "models only: the file's own blocks); empty = each store "
                                                    "entry's own dtype (with --model: native for a .gguf, "
                                                    "float32 for a model directory)"})
    device: str = field(default="auto", metadata={"help": "worker device: auto, cpu or cuda"})
    kv_cache_mb: int = field(default=0, metadata={"help": "KV cache memory of the worker, MiB (0 = a quarter of "
                                                          "--memory-budget-mb, at most 4096, as vLLM's CPU "
                                                          "default)"})
    block_size: int = field(default=0, metadata={"help": "tokens per KV block (0 = 64 where the C++ attention "
                                                          "kernel runs, bfloat16 on an AVX-512 BF16 CPU, so a long "
                                                          "context in scattered blocks costs fewer cache misses; "
                                                          "else 16)"})
    kv_cache_dtype: str = field(default="auto", metadata={"help": "the KV pool of the workers that serve --dtype "
                                                                   "native models: auto or float16 (fp16 keys and "
                                                                   "values), or int8-values (fp16 keys, int8 values: "
                                                                   "about a third more tokens a pool, lower top-1 agreement; "
                                                                   "refused by a worker where the avx512 attention "
                                                                   "kernels do not run)"})
    worker_threads: int = field(default=0, metadata={"help": "torch threads in the worker (0 = all cores)"})
    max_num_seqs: int = field(default=64, metadata={"help": "most sequences in one step"})
    max_num_batched_tokens: int = field(default=512, metadata={"help": "most tokens (prefill + decode) in one step"})
    long_prefill_token_threshold: int = field(default=128, metadata={"help": "most prompt tokens one sequence prefills "
                                                                            "in one step while others run or wait, so a long "
                                                                            "prompt leaves room for decodes and short prompts "
                                                                            "(0 = no cap)"})
    max_long_partial_prefills: int = field(default=4, metadata={"help": "most long prompts (over the threshold) "
                                                                         "prefilling at once; short prompts behind a "
                                                                         "waiting long one go first"})
    speculative_method: str = field(default="suffix", metadata={"help": "speculative decoding without a draft model: "
                                                                    "none, ngram (prompt lookup in the sequence's own "
                                                                    "prompt and output) or suffix (that, plus the "
                                                                    "model's recent outputs across requests); it "
                                                                    "switches itself off where it does not pay"})
    num_speculative_tokens: int = field(default=7, metadata={"help": "most draft tokens a speculating sequence verifies "
                                                                     "in one step"})
    prompt_lookup_min: int = field(default=3, metadata={"help": "shortest suffix match (tokens) that proposes a draft"})
    prompt_lookup_max: int = field(default=4, metadata={"help": "the ngram method: longest suffix match (tokens) "
                                                                 "looked up (the suffix method matches up to 32)"})
    speculative_max_batch: int = field(default=8, metadata={"help": "speculate only while at most this many sequences "
                                                                    "run; below that the measured gate decides per "
                                                                    "batch size"})
    speculative_gate_steps: int = field(default=16, metadata={"help": "decode steps with a draft row and without at "
                                                                      "each batch size before the gate keeps the "
                                                                      "faster (0 = no gate: always speculate up to "
                                                                      "--speculative-max-batch)"})
    suffix_cache_tokens: int = field(default=65536, metadata={"help": "tokens of recent outputs the suffix method keeps "
                                                                      "per model"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse the KV blocks of prompt prefixes seen before"})
    max_queue: int = field(default=1024, metadata={"help": "most sequences waiting; more are refused with RESOURCE_EXHAUSTED"})
    max_batch_prompts: int = field(default=64, metadata={"help": "most prompts in one GenerateBatch"})
    default_max_tokens: int = field(default=64, metadata={"help": "max_tokens when a request leaves it unset"})
    max_worker_restarts: int = field(default=5, metadata={"help": "worker restarts in a row before requests fail UNAVAILABLE"})
    consul_addr: str = field(default="", metadata={"help": "Consul agent host:port to register with; also read from CONSUL_HTTP_ADDR; empty = no registration"})
    consul_token: str = field(default="", metadata={"help": "Consul ACL token; also read from CONSUL_HTTP_TOKEN"})
    advertise: str = field(default="", metadata={"help": "address registered in Consul (default: --host, or the hostname when --host is a wildcard)"})
    node_name: str = field(default="", metadata={"help": "node name registered in Consul (default: the hostname)"})
    consul_check_interval: float = field(default=1.0, metadata={"help": "seconds between Consul's gRPC health checks of this engine"})
    consul_check_timeout: float = field(default=2.0, metadata={"help": "timeout of one Consul gRPC health check, seconds (may exceed the interval; a surge of 1,300 new streams on 2 cores delayed one check 1.1 s)"})
    consul_deregister_after: float = field(default=60.0, metadata={"help": "Consul removes this engine after its check is critical this long, seconds (Consul's minimum is 60)"})
    consul_resync_interval: float = field(default=30.0, metadata={"help": "seconds between asks that the Consul agent still has this engine; registers again if it lost it (an agent restarted without its state)"})
    server_threads: int = field(default=512, metadata={"help": "threads for calls that block: waiting for a model load or unload, an embedding or classification worker's reply (streams need none: the server is asyncio)"})
    cluster_secret_file: str = field(default="", metadata={"help": "file holding the shared secret routers must "
                                                                   "present (their --cluster-secret-file); empty = "
                                                                   "none (mTLS with --tls-ca, or open)"})
    admin_keys_file: str = field(default="", metadata={"help": "file of SHA-256 hashes of the admin keys that "
                                                               "EngineAdmin/LoadModel and UnloadModel need "
                                                               "('authorization: Bearer <key>'); with a cluster "
                                                               "secret or mTLS but no admin keys, they are refused"})
    worker_secret_file: str = field(default="", metadata={"help": "with --worker: file holding the secret the external "
                                                                  "worker expects (its --secret-file); spawned workers "
                                                                  "get a fresh random one each"})
    drain_seconds: float = field(default=30.0, metadata={"help": "on SIGTERM, how long calls in flight may take to "
                                                                 "finish before they are cancelled"})
    port_file: str = field(default="", metadata={"help": "write the bound port to this file once serving (for port 0)"})
    metrics: bool = field(default=True, metadata={"help": "serve Prometheus metrics at http://HOST:METRICS_PORT/metrics; --no-metrics serves and records none"})
    metrics_port: int = field(default=9102, metadata={"help": "HTTP port of /metrics, with the spawned workers' metrics merged in (0 = pick a free one)"})
    metrics_port_file: str = field(default="", metadata={"help": "write the bound metrics port to this file (for --metrics-port 0)"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning, error"})

    @property
    def kv_pool_mb(self) -> int:
        """The KV pool of a generation worker: --kv-cache-mb, or a quarter of the memory budget (at most 4 GiB)."""
        return self.kv_cache_mb or max(64, min(4096, self.memory_budget_mb // 4))

    def validate(self) -> None:
        require(0 <= self.port < 65536, "--port must be in [0, 65535]")
        require(0 <= self.metrics_port < 65536, "--metrics-port must be in [0, 65535]")
        require(self.server_threads >= 8, "--server-threads must be >= 8")
        require(self.dtype in ("", "float32", "bfloat16", "native"),
                f"--dtype must be float32, bfloat16 or native, not {self.dtype!r}")
        require(self.max_num_seqs > 0, "--max-num-seqs must be > 0")
        require(self.max_num_batched_tokens > 0, "--max-num-batched-tokens must be > 0")
        require(self.long_prefill_token_threshold >= 0, "--long-prefill-token-threshold must be >= 0 (0 = no cap)")
        require(self.max_long_partial_prefills > 0, "--max-long-partial-prefills must be > 0")
        try:
            self.speculative().validate()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        require(self.max_queue > 0, "--max-queue must be > 0")
        require(self.max_batch_prompts > 0, "--max-batch-prompts must be > 0")
        require(self.default_max_tokens > 0, "--default-max-tokens must be > 0")
        require(self.kv_cache_mb >= 0, "--kv-cache-mb must be >= 0 (0 = from the memory budget)")
        require(self.block_size >= 0, "--block-size must be >= 0 (0 = chosen by the worker)")
        require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache_dtype!r}")
        require(self.consul_check_interval > 0, "--consul-check-interval must be > 0")
        require(self.consul_check_timeout > 0, "--consul-check-timeout must be > 0")
        require(self.consul_deregister_after > 0, "--consul-deregister-after must be > 0")
        require(self.consul_resync_interval > 0, "--consul-resync-interval must be > 0")
        require(self.memory_budget_mb > 0, "--memory-budget-mb must be > 0")
        require(self.max_loaded_models > 0, "--max-loaded-models must be > 0")
        require(self.model_wait_seconds >= 0, "--model-wait-seconds must be >= 0")
        require(self.unload_drain_seconds >= 0, "--unload-drain-seconds must be >= 0")
        require(self.load_failure_backoff_seconds >= 0, "--load-failure-backoff-seconds must be >= 0")
        require(not (self.worker and not self.model), "--worker (an external worker) needs --model: it serves one model")
        require(not (self.worker_secret_file and not self.worker), "--worker-secret-file is for an external --worker")
        require(self.drain_seconds >= 0, "--drain-seconds must be >= 0")
        self.tls.validate()

    def speculative(self) -> SpeculativeConfig:
        return SpeculativeConfig(method=self.speculative_method, num_speculative_tokens=self.num_speculative_tokens,
                                 prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max,
                                 max_batch=self.speculative_max_batch, gate_steps=self.speculative_gate_steps,
                                 suffix_cache_tokens=self.suffix_cache_tokens)
