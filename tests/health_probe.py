"""A health prober in its own process, as Consul's gRPC check is: ``python -m tests.health_probe
ADDRESS...`` checks each address's gRPC health every ``--interval`` seconds over one channel each
and prints one JSON line per check ({"address", "status", "seconds"}) until its stdin closes.

A test that loads a server from its own asyncio loop measures health from here, so that a check's
time is the server's answer and not the test client's own loop, busy with the load it is making."""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("addresses", nargs="+")
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    channels = {a: grpc.insecure_channel(a) for a in args.addresses}
    stubs = {a: health_pb2_grpc.HealthStub(ch) for a, ch in channels.items()}
    print(json.dumps({"ready": True}), flush=True)
    while not stop.is_set():
        for address, stub in stubs.items():
            started = time.monotonic()
            try:
                status: object = health_pb2.HealthCheckResponse.ServingStatus.Name(
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=args.timeout).status)
            except grpc.RpcError as exc:
                status = exc.code().name
            print(json.dumps({"address": address, "status": status,
                              "seconds": time.monotonic() - started}), flush=True)
        stop.wait(args.interval)
    for channel in channels.values():
        channel.close()


if __name__ == "__main__":
    main()
