"""Start router + engine(s) (+ their workers) as real processes on loopback.

``make up`` runs this module: it starts the stack, prints one ready line with a grpcurl example
and stops everything on Ctrl-C; a service that dies meanwhile is started again with backoff on its
ports (``services.supervisor``), and the rest keep running. Tests use ``Stack`` the same way, with
port 0 everywhere (supervised only when they ask: most fault tests want a dead engine to stay dead).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from services.common import process
from services.common.process import ServiceProcess
from services.common.security import PLAINTEXT, TlsFiles
from services.supervisor import Supervised, Supervisor

__all__ = ["ServiceProcess", "Stack", "start_service", "start_stack"]


def start_service(module: str, args: list[str], ready_timeout: float = 600.0, port: int = 0,
                  log_path: Path | None = None, tls: TlsFiles = PLAINTEXT, metrics_port: int = 0,
                  cwd: Path | None = None) -> ServiceProcess:
    """Start ``python -m <module>`` on ``port`` (0 = free port), its output to ``log_path`` (else
    ours), in its own session, and wait until it is SERVING (``tls``: how to reach its health service
    when ``args`` turn TLS on).

    Its /metrics goes on ``metrics_port`` (0 = free port) unless ``args`` say ``--no-metrics``.
    ``cwd``: its working directory (default the repository root)."""
    out = open(log_path, "ab") if log_path else None
    return process.start_service(module, args, ready_timeout, port, stdout=out,
                                 stderr=subprocess.STDOUT if out else None, new_session=True, tls=tls,
                                 metrics_port=metrics_port, cwd=cwd)


@dataclass
class Stack:
    engines: list[ServiceProcess] = field(default_factory=list)
    router: ServiceProcess | None = None
    http_address: str = ""                  # the router's OpenAI-compatible HTTP API, host:port ("" = off)
    second_http_address: str = ""           # the same HTTP API on its second port (the seed's :8001; "" = off)
    log_dir: Path | None = None             # router.log, engine<i>.log (with its workers' lines)
    supervisor: Supervisor | None = None    # restarts services that die (None = not supervised)

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()  # first: a deliberate stop is not a crash to restart
        if self.router is not None:
            self.router.stop()
        for engine in self.engines:
            engine.stop()


def start_stack(engine_args: list[str], num_engines: int = 1, router_port: int = 0, engine_port: int = 0,
                router_args: list[str] = (), log_dir: Path | None = None,  # type: ignore[assignment]
                http_port: int = 0, tls: TlsFiles = PLAINTEXT,
                router_metrics_port: int = 0, engine_metrics_port: int = 0, supervise: bool = False,
                second_http_port: int = -1) -> Stack:
    """``http_port``: the router's OpenAI HTTP API (0 = a free port, -1 = off); ``second_http_port``: the
    same API on a second port (the seed's :8001; -1 = none). ``tls``: the files the
    services were given in their args, to check that they serve. ``*_metrics_port``: their /metrics
    (0 = a free port; engine ports count up from ``engine_metrics_port``). ``supervise``: restart a
    service that dies, on the ports it bound first."""
    stack = Stack(log_dir=log_dir, supervisor=Supervisor() if supervise else None)
    port_files = Path(tempfile.mkdtemp(prefix="llmserve-http-"))
    http_port_file, second_port_file = port_files / "port", port_files / "second-port"

    def engine_log(i: int) -> Path | None:
        return log_dir / f"engine{i}.log" if log_dir else None

    def start_engine(i: int) -> ServiceProcess:
        return start_service("services.engine", engine_args, port=engine_port + i if engine_port else 0,
                             metrics_port=engine_metrics_port + i if engine_metrics_port else 0,
                             log_path=engine_log(i), tls=tls)

    try:
        stack.engines = process.start_side_by_side([lambda i=i: start_engine(i) for i in range(num_engines)])
        for i, engine in enumerate(stack.engines):
            _supervise(stack, f"engine{i}", "services.engine", engine_args, engine, engine_log(i), tls,
                       lambda p, i=i: stack.engines.__setitem__(i, p))
        engines = ",".join(e.address for e in stack.engines)
        log_path = log_dir / "router.log" if log_dir else None
        stack.router = start_service("services.router", ["--engines", engines, "--http-port", str(http_port),
                                                         "--http-port-file", str(http_port_file),
                                                         "--second-http-port", str(second_http_port),
                                                         "--second-http-port-file", str(second_port_file),
                                                         *router_args],
                                     port=router_port, metrics_port=router_metrics_port, log_path=log_path, tls=tls)
        if http_port >= 0:
            stack.http_address = f"127.0.0.1:{http_port_file.read_text().strip()}"
        if second_http_port >= 0:
            stack.second_http_address = f"127.0.0.1:{second_port_file.read_text().strip()}"
        bound_http = stack.http_address.rsplit(":", 1)[1] if stack.http_address else "-1"
        bound_second = stack.second_http_address.rsplit(":", 1)[1] if stack.second_http_address else "-1"
        _supervise(stack, "router", "services.router", ["--engines", engines, "--http-port", bound_http,
                                                        "--second-http-port", bound_second, *router_args],
                   stack.router, log_path, tls, lambda p: setattr(stack, "router", p))
    except BaseException:
        stack.stop()
        raise
    if stack.supervisor is not None:
        stack.supervisor.watch()
    return stack


def _supervise(stack: Stack, name: str, module: str, args: list[str], first: ServiceProcess, log_path: Path | None,
               tls: TlsFiles, on_restart: Callable[[ServiceProcess], None]) -> None:
    """Register ``first`` with the stack's supervisor: started again with the same args and ports."""
    if stack.supervisor is None:
        return
    port = int(first.address.rsplit(":", 1)[1])
    metrics_port = int(first.metrics_url.split(":")[2].split("/")[0]) if first.metrics_url else 0
    stack.supervisor.add(Supervised(name, lambda: start_service(module, args, port=port, metrics_port=metrics_port,
                                                                log_path=log_path, tls=tls),
                                    first, on_restart))


def main() -> None:
    parser = argparse.ArgumentParser(description="Run router + engine (+ worker) on loopback until Ctrl-C.")
    parser.add_argument("--router-port", type=int, default=int(os.environ.get("LLMSERVE_ROUTER_PORT", 50051)))
    parser.add_argument("--engine-port", type=int, default=int(os.environ.get("LLMSERVE_ENGINE_PORT", 50052)))
    parser.add_argument("--router-metrics-port", type=int,
                        default=int(os.environ.get("LLMSERVE_ROUTER_METRICS_PORT", 9101)))
    parser.add_argument("--engine-metrics-port", type=int,
                        default=int(os.environ.get("LLMSERVE_ENGINE_METRICS_PORT", 9102)))
    parser.add_argument("--http-port", type=int, default=int(os.environ.get("LLMSERVE_HTTP_PORT", 8000)),
                        help="the router's OpenAI-compatible HTTP API; -1 = off")
    parser.add_argument("--second-http-port", type=int,
                        default=int(os.environ.get("LLMSERVE_SECOND_HTTP_PORT", 8001)),
                        help="the same HTTP API on a second port (the seed's multi-model half uses 8001); -1 = off")
    parser.add_argument("--num-engines", type=int, default=int(os.environ.get("ENGINES", 1)),
                        help="engines on this host (ENGINES=2 make up), each on its own ports counting up from "
                             "--engine-port and --engine-metrics-port, all behind the router")
    parser.add_argument("--model", default=os.environ.get("LLMSERVE_ENGINE_MODEL", ""),
                        help="serve only this model; default: the model store (models.yaml)")
    args, engine_args = parser.parse_known_args()
    if args.num_engines < 1:
        parser.error(f"--num-engines (ENGINES) must be at least 1, not {args.num_engines}")
    engines_said = "engine" if args.num_engines == 1 else f"{args.num_engines} engines"
    print(f"llmserve: starting {engines_said} ({args.model or 'model store models.yaml'}) and router; the first "
          "start converts the model, which takes a minute", flush=True)
    stack = start_stack([*(["--model", args.model] if args.model else []), *engine_args],
                        num_engines=args.num_engines, router_port=args.router_port, engine_port=args.engine_port,
                        http_port=args.http_port,
                        router_metrics_port=args.router_metrics_port, engine_metrics_port=args.engine_metrics_port,
                        supervise=True, second_http_port=args.second_http_port)
    host = f"localhost:{args.router_port}"
    engines = ", ".join(e.address for e in stack.engines)
    print(f"llmserve ready: router {host}, {'engine' if len(stack.engines) == 1 else 'engines'} {engines}. Try: "
          f"grpcurl -plaintext -d '{{\"prompt\":\"Hello, I am\"}}' {host} llmserve.v1.LLMService/Generate"
          " — Ctrl-C stops everything.", flush=True)
    for proc in [stack.router, *stack.engines]:
        if proc is not None and proc.metrics_url:
            what = "with its workers' metrics" if proc.name == "engine" else ""
            print(f"llmserve metrics: {proc.name} {proc.metrics_url} {what}".rstrip(), flush=True)
    if stack.http_address:
        print(f"llmserve: OpenAI-compatible API at http://localhost:{stack.http_address.rsplit(':', 1)[1]}/v1",
              flush=True)
    if stack.second_http_address:
        print(f"llmserve: the seed's HTTP API (/basic_generate, /generate, /generate_stream, /models, /predict) "
              f"also at http://localhost:{stack.second_http_address.rsplit(':', 1)[1]}", flush=True)
    if not args.model:
        print(f"llmserve: models of the store load on first use, e.g. grpcurl -plaintext -d "
              f"'{{\"model_id\":\"spam-detector\",\"input_data\":\"Win a free iPhone now!\"}}' {host} "
              "llmserve.v1.LLMService/Predict", flush=True)
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        while not stopping:  # a service that dies is restarted by the stack's supervisor meanwhile
            time.sleep(0.5)
    finally:
        print("llmserve: stopping", flush=True)
        stack.stop()


if __name__ == "__main__":
    main()
