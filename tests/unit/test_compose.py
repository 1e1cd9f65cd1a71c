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


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())["services"]


def flags_of(cls) -> set[str]:
    return {"--" + f.name.replace("_", "-") for f in dataclasses.fields(cls)}


def test_consul_uses_the_official_image_as_a_dev_agent(compose):
    assert compose["consul"]["image"].startswith("hashicorp/consul")
    assert "-dev" in compose["consul"]["command"]
    assert "8500:8500" in compose["consul"]["ports"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_commands_flags_and_env_exist_in_the_code(compose, name):
    cls, prefix = CONFIGS[name]
    cmd = compose[name]["command"]
    assert cmd[:3] == ["python", "-m", f"services.{name}"]
    assert (REPO_ROOT / "services" / name / "__main__.py").is_file()
    used = {arg for arg in cmd[3:] if arg.startswith("--")}
    assert used <= flags_of(cls), used - flags_of(cls)
    for var in compose[name].get("environment", {}):
        if var.startswith("LLMSERVE_") and var != "LLMSERVE_CACHE_DIR":
            assert var.startswith(prefix + "_"), var
            field = var[len(prefix) + 1:].lower()
            assert field in {f.name for f in dataclasses.fields(cls)}, var


def test_ports_match_the_defaults_and_the_wiring(compose):
    def flag(name: str, flag_name: str) -> str:
        cmd = compose[name]["command"]
        return cmd[cmd.index(flag_name) + 1]

    assert int(flag("router", "--port")) == RouterConfig().port == 50051
    assert int(flag("engine", "--port")) == EngineConfig().port == 50052
    assert int(flag("worker", "--port")) == WorkerConfig().port == 50061
    assert flag("router", "--engines") == "engine:50052"
    assert flag("engine", "--worker") == "worker:50061"
    assert "50051:50051" in compose["router"]["ports"]


def test_dockerfile_builds_the_stubs_and_ships_the_services():
    text = (REPO_ROOT / "Dockerfile").read_text()
    assert re.search(r"make protos", text) and "COPY services" in text and "COPY protos" in text
