from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config import require
from services.common.security import TlsConfig


@dataclass(frozen=True)
class RouterConfig(TlsConfig):
    """llmserve router: serves llmserve.v1.LLMService and relays each call to an engine."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=50051, metadata={"help": "port to listen on (0 = pick a free one)"})
    http_port: int = field(default=8000, metadata={"help": "port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/embeddings, /v1/models); 0 = pick a free one, -1 = off"})
    http_read_timeout: float = field(default=30.0, metadata={"help": "seconds an HTTP client has to send a whole request (headers and body) on a new or kept-alive connection; a slower one is closed (slowloris)"})
    http_port_file: str = field(default="", metadata={"help": "write the bound HTTP port to this file once serving (for --http-port 0)"})
    second_http_port: int = field(default=-1, metadata={"help": "the same HTTP API on a second port (the seed's multi-model walkthrough calls /models and /predict on 8001; `make up` sets 8001); 0 = pick a free one, -1 = off"})
    second_http_port_file: str = field(default="", metadata={"help": "write the second bound HTTP port to this file once serving"})
    engines: str = field(default="127.0.0.1:50052", metadata={"help": "static engine list host:port,host:port (used when no Consul is configured)"})
    consul_addr: str = field(default="", metadata={"help": "Consul agent host:port to discover engines from; also read from CONSUL_HTTP_ADDR; empty = static --engines"})
    consul_token: str = field(default="", metadata={"help": "Consul ACL token; also read from CONSUL_HTTP_TOKEN"})
    datacenters: str = field(default="", metadata={"help": "Consul datacenters (clusters) to route to, local first, in spill-over order; empty = all the agent knows"})
    consul_wait: float = field(default=30.0, metadata={"help": "seconds one Consul blocking query may wait for a change"})
    health_interval: float = field(default=1.0, metadata={"help": "seconds between engine health checks"})
    load_interval_ms: int = field(default=100, metadata={"help": "shortest time between two load reports an engine streams, ms"})
    max_attempts: int = field(default=3, metadata={"help": "engines tried per request before giving up (before the first token)"})
    max_resumes: int = field(default=3, metadata={"help": "times one stream may be resumed on another engine after its engine died mid-stream"})
    spill_load: float = field(default=1.0, metadata={"help": "engine load (1.0 = a full batch) at which it is overloaded; a cluster whose engines all are spills to the next"})
    affinity_slack: float = field(default=0.25, metadata={"help": "prefix affinity may choose an engine this much more loaded than the least loaded (0 = off)"})
    affinity_prefix_chars: int = field(default=256, metadata={"help": "characters of the prompt that make up its prefix for affinity"})
    breaker_failures: int = field(default=3, metadata={"help": "failed calls in a row that open an engine's circuit breaker"})
    breaker_cooldown: float = field(default=1.0, metadata={"help": "seconds an open breaker waits before a trial call (doubles per failed trial, up to 30)"})
    api_keys_file: str = field(default="", metadata={"help": "file of SHA-256 hashes of the API keys clients send as "
                                                             "'authorization: Bearer <key>' (python -m "
                                                             "services.common.security hash-key); empty = no keys"})
    key_max_concurrent: int = field(default=0, metadata={"help": "calls one API key may have in flight at once, on both faces (a key's line in --api-keys-file may say max_concurrent=N); past it: RESOURCE_EXHAUSTED / HTTP 429; 0 = no limit"})
    key_tokens_per_minute: int = field(default=0, metadata={"help": "prompt + completion tokens one API key may use per 60 s (its line may say tokens_per_minute=N); past it: RESOURCE_EXHAUSTED / HTTP 429 with the time until tokens free up; 0 = no limit"})
    cluster_secret_file: str = field(default="", metadata={"help": "file holding the shared secret this router "
                                                                   "presents to engines (their --cluster-secret-file)"})
    tls_client_auth: bool = field(default=True, metadata={"help": "with --tls-ca: require this router's clients to "
                                                                  "present a certificate the CA signed; "
                                                                  "--no-tls-client-auth = clients use API keys, the CA "
                                                                  "only verifies engines"})
    drain_seconds: float = field(default=30.0, metadata={"help": "on SIGTERM, how long calls in flight may take to "
                                                                 "finish before they are cancelled"})
    port_file: str = field(default="", metadata={"help": "write the bound port to this file once serving (for port 0)"})
    metrics: bool = field(default=True, metadata={"help": "serve Prometheus metrics at http://HOST:METRICS_PORT/metrics; --no-metrics serves and records none"})
    metrics_port: int = field(default=9101, metadata={"help": "HTTP port of /metrics (0 = pick a free one; -1 = no "
                                                              "port of its own: /metrics only on the HTTP API, "
                                                              "behind its API keys and TLS)"})
    metrics_host: str = field(default="", metadata={"help": "address the metrics port listens on (e.g. a private "
                                                            "interface for Prometheus); empty = --host"})
    metrics_port_file: str = field(default="", metadata={"help": "write the bound metrics port to this file (for --metrics-port 0)"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning, error"})

    def validate(self) -> None:
        require(0 <= self.port < 65536, "--port must be in [0, 65535]")
        require(-1 <= self.metrics_port < 65536, "--metrics-port must be in [0, 65535], or -1 for none")
        require(-1 <= self.http_port < 65536, "--http-port must be in [0, 65535], or -1 for no HTTP API")
        require(-1 <= self.second_http_port < 65536, "--second-http-port must be in [0, 65535], or -1 for none")
        for address in self.engine_addresses:
            require(":" in address, f"--engines: {address!r} is not host:port")
        require(self.health_interval > 0, "--health-interval must be > 0")
        require(self.max_attempts > 0, "--max-attempts must be > 0")
        require(self.max_resumes >= 0, "--max-resumes must be >= 0")
        require(self.consul_wait > 0, "--consul-wait must be > 0")
        require(self.load_interval_ms > 0, "--load-interval-ms must be > 0")
        require(self.spill_load > 0, "--spill-load must be > 0")
        require(self.affinity_slack >= 0, "--affinity-slack must be >= 0")
        require(self.affinity_prefix_chars > 0, "--affinity-prefix-chars must be > 0")
        require(self.breaker_failures > 0, "--breaker-failures must be > 0")
        require(self.breaker_cooldown > 0, "--breaker-cooldown must be > 0")
        require(self.drain_seconds >= 0, "--drain-seconds must be >= 0")
        require(self.http_read_timeout > 0, "--http-read-timeout must be > 0")
        require(self.key_max_concurrent >= 0, "--key-max-concurrent must be >= 0")
        require(self.key_tokens_per_minute >= 0, "--key-tokens-per-minute must be >= 0")
        require(bool(self.api_keys_file) or not (self.key_max_concurrent or self.key_tokens_per_minute),
                "--key-max-concurrent and --key-tokens-per-minute limit API keys: they need --api-keys-file")
        self.tls.validate()
        require(self.tls_client_auth or bool(self.tls_ca), "--no-tls-client-auth is for a router with --tls-ca")

    @property
    def engine_addresses(self) -> list[str]:
        return [a.strip() for a in self.engines.split(",") if a.strip()]

    @property
    def datacenter_list(self) -> list[str]:
        return [d.strip() for d in self.datacenters.split(",") if d.strip()]
