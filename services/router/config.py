from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config import require


@dataclass(frozen=True)
class RouterConfig:
    """llmserve router: serves llmserve.v1.LLMService and relays each call to an engine."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=50051, metadata={"help": "port to listen on (0 = pick a free one)"})
    engines: str = field(default="127.0.0.1:50052", metadata={"help": "static engine list host:port,host:port"})
    health_interval: float = field(default=1.0, metadata={"help": "seconds between engine health checks"})
    max_attempts: int = field(default=3, metadata={"help": "engines tried per request before giving up (before the first token)"})
    port_file: str = field(default="", metadata={"help": "write the bound port to this file once serving (for port 0)"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning, error"})

    def validate(self) -> None:
        require(0 <= self.port < 65536, "--port must be in [0, 65535]")
        require(bool(self.engine_addresses), "--engines must list at least one host:port")
        for address in self.engine_addresses:
            require(":" in address, f"--engines: {address!r} is not host:port")
        require(self.health_interval > 0, "--health-interval must be > 0")
        require(self.max_attempts > 0, "--max-attempts must be > 0")

    @property
    def engine_addresses(self) -> list[str]:
        return [a.strip() for a in self.engines.split(",") if a.strip()]
