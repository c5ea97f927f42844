"""The controller pushes its decision to real inference workers (`python -m services.inference` on
a tiny target): applied exactly once, applied again after the worker restarts, and workers that
register themselves get it too. The controller runs as a process here (`python -m services.controller`:
env settings, health, metrics, SIGTERM) and in process for the registration test."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from controller.svc import ADMIN_TOKEN, serving, wait_for
from support.engine import save_tiny_target

from services.controller.app import build
from services.controller.settings import ControllerSettings
from tide.blobs import StorageSettings
from tide.grpcutil import channel
from tide.proto.tide.v1 import controller_pb2, controller_pb2_grpc, inference_pb2, inference_pb2_grpc
from tide.servers import free_port

DECISION = '{"gamma_policy": {"name": "static", "params": {"gamma": 2}}, "speculation": true, "reason": "test"}'


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("push-target")
    save_tiny_target(path)
    return path


@pytest.fixture
def stack_env(redis_server, s3_server, s3_bucket, unique_prefix) -> dict[str, str]:
    return {**os.environ, "TIDE_REDIS_URL": redis_server.url, "TIDE_S3_ENDPOINT": s3_server.endpoint,
            "TIDE_S3_ACCESS_KEY": s3_server.access_key, "TIDE_S3_SECRET_KEY": s3_server.secret_key,
            "TIDE_S3_BUCKET": s3_bucket, "TIDE_STREAM_PREFIX": unique_prefix, "TIDE_ADMIN_TOKEN": ADMIN_TOKEN,
            "TIDE_SHUTDOWN_GRACE_S": "1"}


class Procs:
    """Processes started by a test, each logging to a file; all killed at teardown."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir, self.procs = log_dir, []

    def start(self, module: str, env: dict, name: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen([sys.executable, "-m", module], env=env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append((proc, log))
        return proc

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")[-3000:]

    def stop_all(self) -> None:
        for proc, log in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            log.close()


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.stop_all()


def start_worker(procs, env, tiny_dir, port, metrics_port, name):
    env = {**env, "TIDE_TARGET": str(tiny_dir), "TIDE_DTYPE": "fp32", "TIDE_MAX_SEQ_LEN": "256",
           "TIDE_LISTEN": f"127.0.0.1:{port}", "TIDE_METRICS_PORT": str(metrics_port)}
    proc = procs.start("services.inference", env, name)
    wait_for(lambda: serving(f"127.0.0.1:{port}") or proc.poll() is not None, 120, f"{name} to serve")
    assert proc.poll() is None, procs.log(name)
    return proc


def decisions_seen(metrics_port: int) -> dict[str, float]:
    """The worker's decision counter by outcome (ApplyDecision calls it answered)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/", timeout=5).read().decode()
    return {m[0]: float(m[1]) for m in re.findall(r'^tide_inference_decisions_total\{outcome="(\w+)"\} (\S+)$',
                                                   text, re.M)}


def worker_status(port: int) -> inference_pb2.WorkerStatus:
    stub = inference_pb2_grpc.InferenceServiceStub(channel(f"127.0.0.1:{port}"))
    return stub.GetStatus(inference_pb2.GetWorkerStatusRequest(), timeout=10)


@pytest.mark.timeout(300)
def test_controller_process_pushes_once_and_again_after_worker_restart(procs, stack_env, tiny_dir):
    wport, wmetrics, cport, cmetrics = free_port(), free_port(), free_port(), free_port()
    start_worker(procs, stack_env, tiny_dir, wport, wmetrics, "worker")
    controller = procs.start("services.controller", {
        **stack_env, "TIDE_CONTROLLER_LISTEN": f"127.0.0.1:{cport}", "TIDE_CONTROLLER_METRICS_PORT": str(cmetrics),
        "TIDE_CONTROLLER_WORKERS": f"127.0.0.1:{wport}", "TIDE_CONTROLLER_DECISION": DECISION,
        "TIDE_CONTROLLER_RECONCILE_S": "0.2", "TIDE_CONTROLLER_CONSUMER": "c-push"}, "controller")
    wait_for(lambda: serving(f"127.0.0.1:{cport}", "tide.v1.ControllerService") or controller.poll() is not None, 60,
             "the controller to serve")
    assert controller.poll() is None, procs.log("controller")
    # the controller's decision id: unique per content change and controller process (ctl-<nonce>-...)
    st = wait_for(lambda: (s := worker_status(wport)).last_decision_id.startswith("ctl-") and s, 30, "the decision")
    decision_id = st.last_decision_id
    assert st.gamma_policy.name == "static" and st.gamma_policy.params["gamma"] == 2
    time.sleep(1.5)  # several reconcile rounds: nothing is pushed again
    assert decisions_seen(wmetrics) == {"applied": 1.0}  # one call, nothing repeated
    assert "tide_controller_pushes_total{outcome=\"applied\"} 1.0" in \
        urllib.request.urlopen(f"http://127.0.0.1:{cmetrics}/", timeout=5).read().decode()

    procs.procs[0][0].kill()  # the worker crashes and comes back on the same address
    procs.procs[0][0].wait(10)
    start_worker(procs, stack_env, tiny_dir, wport, wmetrics, "worker2")
    wait_for(lambda: worker_status(wport).last_decision_id == decision_id, 30, "the decision after the restart")
    time.sleep(1.0)
    assert decisions_seen(wmetrics) == {"applied": 1.0}  # once in the new process too

    cstub = controller_pb2_grpc.ControllerServiceStub(channel(f"127.0.0.1:{cport}"))
    state = cstub.GetState(controller_pb2.GetControllerStateRequest(), timeout=5)
    (rec,) = state.recent_decisions
    assert rec.decision.decision_id == decision_id and len(rec.applied_to) == 2  # both worker processes
    assert [w.last_decision_id for w in state.workers] == [decision_id]

    controller.send_signal(signal.SIGTERM)
    assert controller.wait(15) == 0, procs.log("controller")


@pytest.mark.timeout(300)
def test_registered_worker_gets_the_decision(procs, stack_env, tiny_dir, redis_server, unique_prefix):
    wport, wmetrics = free_port(), free_port()
    start_worker(procs, stack_env, tiny_dir, wport, wmetrics, "worker")
    svc = build(ControllerSettings(listen="127.0.0.1:0", metrics_port=0, reconcile_s=30.0, admin_token=ADMIN_TOKEN,
                                   storage=StorageSettings(redis_url=redis_server.url, stream_prefix=unique_prefix)))
    try:
        stub = controller_pb2_grpc.ControllerServiceStub(channel(svc.target, token=ADMIN_TOKEN))
        st = worker_status(wport)
        current = stub.RegisterWorker(controller_pb2.RegisterWorkerRequest(
            worker_id=st.worker_id, address=f"127.0.0.1:{wport}", target_model=st.model_id), timeout=5).current
        # the registration wakes the reconcile loop at once (its period here is 30 s)
        wait_for(lambda: worker_status(wport).last_decision_id == current.decision_id, 10, "the pushed decision")
        assert decisions_seen(wmetrics) == {"applied": 1.0}  # one call, nothing repeated
    finally:
        svc.stop(grace_s=0.2)
