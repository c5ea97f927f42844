"""TriggerTraining runs the training cycle on the manifest's buffered chunks (tiny target, a few
steps, a real registry): admin auth, the data threshold, one run at a time, the run record, the
outcome reported to a real controller, and the refusals (wrong target, library missing). Plus the
service as a process: metrics, SIGTERM, its priority and CPUs, a bad CPU list. (The register /
promote decisions themselves: test_cycle.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import grpc
import pytest
from trainer.service.svc import ADMIN_TOKEN, chunk_blob, publish, wait_for

from services.controller.app import build as build_controller
from services.controller.settings import ControllerSettings
from tide import blobs
from tide.grpcutil import channel
from tide.proto.tide.v1 import trainer_pb2, trainer_pb2_grpc
from tide.servers import free_port


def stub(svc, token=ADMIN_TOKEN):
    return trainer_pb2_grpc.TrainerServiceStub(channel(svc.target, token=token))


def trigger(svc, token=ADMIN_TOKEN, **kw):
    return stub(svc, token).TriggerTraining(trainer_pb2.TriggerTrainingRequest(**kw), timeout=30)


@pytest.mark.timeout(300)
def test_trigger_trains_on_buffered_chunks_and_reports(make_trainer, tiny_dir, redis_client, s3_client, s3_bucket,
                                                       unique_prefix, trainer_storage, draft_registry):
    controller = build_controller(ControllerSettings(listen="127.0.0.1:0", metrics_port=0, admin_token=ADMIN_TOKEN,
                                                     storage=trainer_storage))
    try:
        svc = make_trainer(controller_addr=controller.target, registry_addr=draft_registry.address)
        target = tiny_dir.name
        assert not trigger(svc, force=True).accepted  # nothing buffered yet
        for i in range(4):
            publish(redis_client, s3_client, s3_bucket, unique_prefix, target, f"c{i}",
                    chunk_blob(target, f"c{i}", n_tokens=96, seed=i))
        wait_for(lambda: svc.manifest.buffered_totals(target) == (4, 384), what="4 buffered chunks")

        with pytest.raises(grpc.RpcError) as err:
            trigger(svc, token=None, force=True)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        r = trigger(svc, reason="test")  # 384 tokens < min_tokens 1000
        assert not r.accepted and "384 tokens buffered, 1000 needed" in r.detail
        with pytest.raises(grpc.RpcError) as err:
            trigger(svc, target_model="another-model", force=True)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        r = trigger(svc, target_model=target, reason="test", force=True)
        assert r.accepted and r.run_id.startswith("run-")
        again = trigger(svc, force=True)
        if not again.accepted and again.run_id:  # the run may already be over on a fast machine
            assert again.run_id == r.run_id and "already" in again.detail
        svc.runner.wait(240)

        st = stub(svc).GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=5)
        assert st.state == trainer_pb2.TrainerStatus.STATE_IDLE and st.buffered_chunks == 0
        out = st.last_outcome
        assert out.run_id == r.run_id and out.target_model == target and not out.detail.startswith("failed"), out
        assert out.train_tokens > 0 and out.duration_s > 0 and out.candidate_version.startswith(f"{target}/v")
        # random data, 3 steps: promoted exactly when it beats no draft (1.0) by the default margin
        assert out.promoted == (out.eval_accept_length_candidate - 1.0 >= 0.02), out
        draft = svc.runner.settings.work_dir + f"/runs/{r.run_id}/draft"
        assert os.path.exists(f"{draft}/model.safetensors") and os.path.exists(f"{draft}/config.json")
        record = json.loads(s3_client.get_object(s3_bucket, svc.manifest.run_key(target, r.run_id)).read())
        assert sorted(record["chunk_ids"]) == ["c0", "c1", "c2", "c3"] and record["reason"] == "test"
        assert len(blobs.list_keys(s3_client, s3_bucket, "trainer/")) == 5  # 4 entries + the run record
        assert "no chunks" in trigger(svc, force=True).detail  # trained on nothing twice
        wait_for(lambda: controller.controller.outcomes.last(target), what="the outcome at the controller")
        assert controller.controller.outcomes.last(target).run_id == r.run_id

        restarted = make_trainer(consumer="t-again")  # the run record keeps its chunks out of the buffer
        assert restarted.manifest.buffered(target) == []
    finally:
        controller.stop(grace_s=0.2)


def test_missing_training_library_is_failed_precondition(make_trainer, monkeypatch):
    svc = make_trainer()
    monkeypatch.setitem(sys.modules, "services.trainer.training", None)  # `import` now raises ImportError
    with pytest.raises(grpc.RpcError) as err:
        trigger(svc, force=True)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "training library" in err.value.details()


@pytest.mark.timeout(180)
def test_process_serves_metrics_and_stops_on_sigterm(tiny_dir, trainer_storage, tmp_path):
    port, metrics_port, st = free_port(), free_port(), trainer_storage
    env = {**os.environ, "TIDE_TRAINER_LISTEN": f"127.0.0.1:{port}", "TIDE_TRAINER_METRICS_PORT": str(metrics_port),
           "TIDE_TARGET": str(tiny_dir), "TIDE_TRAINER_WORK_DIR": str(tmp_path), "TIDE_REDIS_URL": st.redis_url,
           "TIDE_S3_ENDPOINT": st.s3_endpoint, "TIDE_S3_ACCESS_KEY": st.s3_access_key,
           "TIDE_S3_SECRET_KEY": st.s3_secret_key, "TIDE_S3_BUCKET": st.s3_bucket,
           "TIDE_STREAM_PREFIX": st.stream_prefix, "TIDE_ADMIN_TOKEN": ADMIN_TOKEN, "TIDE_TRAINER_NICE": "5",
           "TIDE_TRAINER_CPUS": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "services.trainer"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        client = trainer_pb2_grpc.TrainerServiceStub(channel(f"127.0.0.1:{port}"))

        def up():
            assert proc.poll() is None, proc.stderr.read()
            try:
                return client.GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=1)
            except grpc.RpcError:
                return None

        assert wait_for(up, 60, "the trainer process").state == trainer_pb2.TrainerStatus.STATE_IDLE
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/", timeout=5).read().decode()
        assert 'tide_trainer_chunks_total{fate="accepted"} 0.0' in text
        assert 'tide_trainer_runs_total{result="failed"} 0.0' in text
        # every thread of the process runs at the configured priority, on the configured CPU
        threads = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        assert len(threads) > 1
        for tid in threads:
            with open(f"/proc/{proc.pid}/task/{tid}/stat") as f:
                nice = int(f.read().rsplit(")", 1)[1].split()[16])  # field 19
            assert nice == min(os.nice(0) + 5, 19) and os.sched_getaffinity(tid) == {0}, tid
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        lines = [json.loads(line) for line in proc.stderr.read().splitlines() if line.startswith("{")]
        assert any(line["msg"] == "stopped" for line in lines)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_process_refuses_cpus_it_does_not_have(tiny_dir, tmp_path):
    env = {**os.environ, "TIDE_TRAINER_CPUS": "0,100000", "TIDE_TARGET": str(tiny_dir),
           "TIDE_TRAINER_WORK_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "services.trainer"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "TIDE_TRAINER_CPUS='0,100000': CPUs [100000] are not available" in proc.stderr
