"""docker-compose.yml agrees with the code (there is no Docker engine here to run it)."""
from __future__ import annotations

import dataclasses
import re

import pytest
import yaml

from services.engine.config import EngineConfig
from services.router.config import RouterConfig
from services.worker.config import WorkerConfig
from tests.helpers import REPO_ROOT

CONFIGS = {"router": (RouterConfig, "LLMSERVE_ROUTER"), "engine": (EngineConfig, "LLMSERVE_ENGINE"),
           "worker": (WorkerConfig, "LLMSERVE_WORKER")}
# Consul's standard variables, read by engine and router besides their own LLMSERVE_* ones.
CONSUL_ENV = {"CONSUL_HTTP_ADDR", "CONSUL_HTTP_TOKEN"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())["services"]


def kind(service: dict) -> str:
    return service["command"][2].rsplit(".", 1)[-1]


def of_kind(compose: dict, name: str) -> dict[str, dict]:
    return {k: v for k, v in compose.items() if k not in ("consul", "prometheus") and kind(v) == name}


def flag(service: dict, flag_name: str) -> str:
    cmd = service["command"]
    return cmd[cmd.index(flag_name) + 1]


def flags_of(cls) -> set[str]:
    return {"--" + f.name.replace("_", "-") for f in dataclasses.fields(cls)}


def test_consul_uses_the_official_image_as_a_dev_agent_listening_for_containers(compose):
    assert compose["consul"]["image"].startswith("hashicorp/consul:")
    assert "-dev" in compose["consul"]["command"] and "-client=0.0.0.0" in compose["consul"]["command"]
    assert "8500:8500" in compose["consul"]["ports"]


def test_one_router_two_engines_each_with_its_worker(compose):
    assert len(of_kind(compose, "router")) == 1
    engines, workers = of_kind(compose, "engine"), of_kind(compose, "worker")
    assert len(engines) == 2 and len(workers) == 2
    assert {flag(e, "--worker").split(":")[0] for e in engines.values()} == set(workers)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_commands_flags_and_env_exist_in_the_code(compose, name):
    cls, prefix = CONFIGS[name]
    assert (REPO_ROOT / "services" / name / "__main__.py").is_file()
    for service in of_kind(compose, name).values():
        cmd = service["command"]
        assert cmd[:3] == ["python", "-m", f"services.{name}"]
        used = {arg for arg in cmd[3:] if arg.startswith("--")}
        assert used <= flags_of(cls), used - flags_of(cls)
        for var in service.get("environment", {}):
            if var in CONSUL_ENV:
                assert name in ("engine", "router"), var
                continue
            if var.startswith("LLMSERVE_") and var != "LLMSERVE_CACHE_DIR":
                assert var.startswith(prefix + "_"), var
                field = var[len(prefix) + 1:].lower()
                assert field in {f.name for f in dataclasses.fields(cls)}, var


def test_engines_register_in_consul_under_their_hostname_and_the_router_discovers_them(compose):
    for name, engine in of_kind(compose, "engine").items():
        assert engine["environment"]["CONSUL_HTTP_ADDR"] == "consul:8500"
        assert flag(engine, "--advertise") == name  # the address the agent's gRPC check and the router dial
    (router,) = of_kind(compose, "router").values()
    assert router["environment"]["CONSUL_HTTP_ADDR"] == "consul:8500"
    assert "--engines" not in router["command"]


def test_ports_match_the_defaults_and_the_wiring(compose):
    (router,) = of_kind(compose, "router").values()
    assert int(flag(router, "--port")) == RouterConfig().port == 50051
    assert "50051:50051" in router["ports"]
    for engine in of_kind(compose, "engine").values():
        assert int(flag(engine, "--port")) == EngineConfig().port == 50052
        assert flag(engine, "--worker").endswith(":50061")
    for worker in of_kind(compose, "worker").values():
        assert int(flag(worker, "--port")) == WorkerConfig().port == 50061
    host_ports = [p.split(":")[0] for e in of_kind(compose, "engine").values() for p in e["ports"]]
    assert len(host_ports) == len(set(host_ports))


def test_gpu_override_names_existing_workers(compose):
    gpu = yaml.safe_load((REPO_ROOT / "docker-compose.gpu.yml").read_text())["services"]
    assert set(gpu) == set(of_kind(compose, "worker"))


def test_dockerfile_builds_the_stubs_and_ships_the_services():
    text = (REPO_ROOT / "Dockerfile").read_text()
    assert re.search(r"make protos", text) and "COPY services" in text and "COPY protos" in text
    # the worker's C++ kernels are compiled in the image, after their sources are in it
    assert "g++" in text and text.index("COPY services") < text.index("make kernels")


def test_makefile_has_compose_targets():
    text = (REPO_ROOT / "Makefile").read_text()
    assert re.search(r"^compose-up:\n\tdocker compose up", text, re.M)
    assert re.search(r"^compose-down:\n\tdocker compose down", text, re.M)


def test_prometheus_scrapes_every_service_on_its_metrics_port(compose):
    prom = compose["prometheus"]
    assert prom["image"].startswith("prom/prometheus:")
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]
    scrape = yaml.safe_load((REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    expected = {f"{name}:{RouterConfig().metrics_port}" for name in of_kind(compose, "router")}
    expected |= {f"{name}:{EngineConfig().metrics_port}" for name in of_kind(compose, "engine")}
    expected |= {f"{name}:{w['environment']['LLMSERVE_WORKER_METRICS_PORT']}" for name, w in of_kind(compose, "worker").items()}
    assert targets == expected
