"""The launcher's wiring without starting anything: every variable `service_env` sets is one the
service reads, the addresses line up, the CLI parses, and the health probes answer truthfully."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from launcher.envkeys import SERVICES, keys_read

from services.controller.decisions import StaticDecision
from tide.grpcutil import GrpcServer
from tide.probe import grpc_serving, http_ok
from tide.servers import free_port
from tools import cli
from tools.launcher import SERVICES as LAUNCHED
from tools.launcher import Endpoints, StackConfig, service_command, service_env

EP = Endpoints(redis_url="redis://127.0.0.1:1/0", s3_endpoint="127.0.0.1:2", s3_access_key="a", s3_secret_key="s",
               admin_token="t", registry="127.0.0.1:3", trainer="127.0.0.1:4", controller="127.0.0.1:5",
               workers=("127.0.0.1:6", "127.0.0.1:7"), gateway_host="127.0.0.1", gateway_port=8000,
               metrics={"registry": 9, "inference-1": 10})


def test_every_variable_the_launcher_sets_is_read_by_its_service():
    assert LAUNCHED == SERVICES
    cfg = StackConfig(workers=2)
    for name in SERVICES:
        env = service_env(name, cfg, EP, index=1)
        assert set(env) <= keys_read(name), (name, set(env) - keys_read(name))
        assert all(isinstance(v, str) for v in env.values())
        assert service_command(name)[1:] == ["-m", f"services.{name}"]
    with pytest.raises(ValueError):
        service_env("scheduler", cfg, EP)


def test_the_services_point_at_each_other():
    cfg = StackConfig(workers=2, collection=False, drafter="none", target="/models/x")
    env = {name: service_env(name, cfg, EP, index=1) for name in SERVICES}
    assert env["inference"]["TIDE_LISTEN"] == "127.0.0.1:7" and env["inference"]["TIDE_METRICS_PORT"] == "10"
    assert env["inference"]["TIDE_COLLECTION"] == "0" and env["inference"]["TIDE_DRAFTER"] == "none"
    assert env["gateway"]["TIDE_WORKERS"] == env["controller"]["TIDE_CONTROLLER_WORKERS"] == "127.0.0.1:6,127.0.0.1:7"
    assert env["trainer"]["TIDE_CONTROLLER_ADDR"] == env["controller"]["TIDE_CONTROLLER_LISTEN"]
    assert env["controller"]["TIDE_REGISTRY_ADDR"] == env["registry"]["TIDE_REGISTRY_LISTEN"]  # rollbacks
    assert env["controller"]["TIDE_CONTROLLER_COLLECTION"] == "off"  # --no-collection: the controller keeps it off
    assert service_env("controller", StackConfig(), EP)["TIDE_CONTROLLER_COLLECTION"] == "auto"  # Algorithm 1
    assert {env[n]["TIDE_TARGET"] for n in ("inference", "gateway", "trainer")} == {"/models/x"}
    assert "TIDE_WEIGHTS" not in env["inference"]  # unset: the worker's own environment decides
    assert service_env("inference", StackConfig(weights="int4"), EP)["TIDE_WEIGHTS"] == "int4"  # tide up --weights
    assert env["registry"]["TIDE_REGISTRY_METRICS_PORT"] == "9" and env["trainer"]["TIDE_TRAINER_METRICS_PORT"] == "0"
    decision = StaticDecision.from_json(env["controller"]["TIDE_CONTROLLER_DECISION"])  # valid for the controller
    assert decision.speculation[0].enabled and (decision.collection_enabled, decision.drafter, decision.policy) == (
        None, None, None)  # the workers' own settings stay
    for name in ("registry", "trainer", "controller", "inference"):
        assert env[name]["TIDE_ADMIN_TOKEN"] == "t"
    assert "TIDE_ADMIN_TOKEN" not in env["gateway"] and json.dumps(env)  # the gateway needs no admin token


def test_cli_parses_up(monkeypatch):
    seen = {}
    monkeypatch.setattr("tools.launcher.up", lambda cfg: seen.setdefault("cfg", cfg) and 0)
    assert cli.main(["up", "--port", "0", "--workers", "2", "--target", "t", "--no-collection",
                     "--data-dir", "/tmp/x"]) == 0
    cfg = seen["cfg"]
    assert (cfg.port, cfg.workers, cfg.target, cfg.collection, str(cfg.data_dir)) == (0, 2, "t", False, "/tmp/x")
    assert cli.main(["up", "--workers", "0"]) == 2
    with pytest.raises(SystemExit):
        cli.main(["up", "--drafter", "medusa"])


def test_probes_tell_the_truth():
    closed = f"127.0.0.1:{free_port()}"
    assert not grpc_serving(closed, timeout_s=0.5) and not http_ok(f"http://{closed}/ready", timeout_s=0.5)
    with GrpcServer() as server:
        assert grpc_serving(server.target)
        probe = [sys.executable, "-m", "tide.probe", "grpc"]
        assert subprocess.run([*probe, server.target], timeout=30).returncode == 0
        server.set_serving("", False)
        assert not grpc_serving(server.target)
    assert subprocess.run([*probe, closed], timeout=30).returncode == 1
    assert subprocess.run([sys.executable, "-m", "tide.probe"], timeout=30,
                          capture_output=True).returncode == 2


def test_the_operators_admin_token_is_kept(monkeypatch, tmp_path):
    """`TIDE_ADMIN_TOKEN=... tide up`: the services and tidectl get that token, not a generated one."""
    from types import SimpleNamespace

    from tools.launcher import Stack

    s3 = SimpleNamespace(endpoint="127.0.0.1:1", access_key="a", secret_key="s")
    stack = Stack(StackConfig(data_dir=tmp_path))
    monkeypatch.setenv("TIDE_ADMIN_TOKEN", "operator-secret")
    ep = stack._endpoints("redis://127.0.0.1:1", s3)
    assert ep.admin_token == "operator-secret"
    assert all(service_env(name, stack.cfg, ep)["TIDE_ADMIN_TOKEN"] == "operator-secret"
               for name in ("registry", "trainer", "controller", "inference"))
    monkeypatch.delenv("TIDE_ADMIN_TOKEN")
    generated = stack._endpoints("redis://127.0.0.1:1", s3).admin_token
    assert len(generated) >= 24 and generated != stack._endpoints("redis://127.0.0.1:1", s3).admin_token


def test_tide_up_creates_a_data_key_file_once_and_gives_it_to_the_trainer_and_workers(tmp_path, monkeypatch):
    """Encryption at rest by default: the first start writes <data dir>/data-keys (mode 0600), a later
    one reuses it; never printed; only the services that seal or open chunks get it."""
    import io
    import stat
    from dataclasses import replace
    from pathlib import Path

    from tide.datakeys import Keyring
    from tools.launcher import Stack

    for var in ("TIDE_DATA_KEYS", "TIDE_DATA_KEY_FILE"):
        monkeypatch.delenv(var, raising=False)
    out = io.StringIO()
    cfg = StackConfig(data_dir=tmp_path / "var")
    path = Stack(cfg, out=out)._data_key_file()
    assert path == str((tmp_path / "var" / "data-keys").resolve())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    ring = Keyring.load(path=path)
    assert len(ring.keys) == 1 and ring.current
    assert Stack(cfg, out=out)._data_key_file() == path and Keyring.load(path=path) == ring  # reused
    assert "created" in out.getvalue() and "reused" in out.getvalue()
    b64 = Path(path).read_text().split(":")[-1].strip()
    assert b64 not in out.getvalue() and ring.keys[0][1].hex() not in out.getvalue()  # the key is never printed
    ep = replace(EP, data_key_file=path)
    for name in SERVICES:
        got = service_env(name, cfg, ep).get("TIDE_DATA_KEY_FILE")
        assert got == (path if name in ("trainer", "inference") else None), name
    assert "TIDE_DATA_KEY_FILE" not in service_env("trainer", cfg, EP)  # none: the operator's environment decides
    # the operator's keys win: no file is made, nothing is set
    mine = StackConfig(data_dir=tmp_path / "other", env={"inference": {"TIDE_DATA_KEYS": "k:" + "A" * 43 + "="}})
    assert Stack(mine, out=out)._data_key_file() == "" and not (tmp_path / "other" / "data-keys").exists()
    monkeypatch.setenv("TIDE_DATA_KEY_FILE", str(tmp_path / "theirs"))
    assert Stack(StackConfig(data_dir=tmp_path / "third"), out=out)._data_key_file() == ""


def test_a_data_key_file_without_a_key_is_refused(tmp_path, monkeypatch):
    import io

    from tools.launcher import Stack, StackError

    for var in ("TIDE_DATA_KEYS", "TIDE_DATA_KEY_FILE"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "data-keys").write_text("# emptied by mistake\n")
    with pytest.raises(StackError, match="holds no key"):
        Stack(StackConfig(data_dir=tmp_path), out=io.StringIO())._data_key_file()
