"""tide.servers: real local Redis / SeaweedFS processes, and the shared fixtures built on them."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from minio import Minio
from minio.error import S3Error
from redis.backoff import NoBackoff
from redis.retry import Retry

from tide.servers import BinaryNotFound, RedisServer, S3Server, ServerError, find_redis_server, free_port


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_redis_server_lifecycle_without_persistence(tmp_path):
    with RedisServer(workdir=tmp_path) as server:
        assert server.running and server.startup_s is not None
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        assert client.config_get("save")["save"] == ""
        assert client.config_get("appendonly")["appendonly"] == "no"
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        client.xadd("s", {"k": "v"})
        assert client.xlen("s") == 1
        client.close()
        port = server.port
    assert not server.running
    assert not _port_open(port)
    assert server.log_path.exists()  # workdir was ours to keep


def test_redis_with_appendonly_keeps_streams_and_groups_through_a_kill_9_and_restart(tmp_path):
    """What the launcher runs: stream entries, consumer groups and pending entries survive a crash
    (SIGKILL, no chance to save) and come back on a restart at the same address."""
    with RedisServer(workdir=tmp_path, appendonly=True) as server:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("appendonly")["appendonly"] == "yes"
        assert client.config_get("appendfsync")["appendfsync"] == "everysec"
        ids = [client.xadd("tide:chunks", {"n": str(i)}) for i in range(5)]
        client.xgroup_create("tide:chunks", "trainer", id="0")
        client.xreadgroup("trainer", "c1", {"tide:chunks": ">"}, count=2)  # 2 pending, unacked
        client.xadd("tide:dead-letter", {"why": "corrupt"})
        client.close()
        time.sleep(1.5)  # appendfsync everysec: what is a second old is on disk
        port = server.port
        os.kill(server.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while server.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server.running
        server.restart()
        assert server.port == port and server.running
        client = redis.Redis.from_url(server.url)
        assert [e[0] for e in client.xrange("tide:chunks")] == ids
        assert client.xlen("tide:dead-letter") == 1
        assert client.xpending("tide:chunks", "trainer")["pending"] == 2
        client.close()


def test_redis_server_with_password(tmp_path):
    with RedisServer(workdir=tmp_path, password="s3cret") as server:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port, retry=Retry(NoBackoff(), 0)).ping()
        assert redis.Redis.from_url(server.url).ping()


def test_startup_failure_names_the_log(tmp_path):
    with RedisServer(workdir=tmp_path / "a") as first:
        clash = RedisServer(port=first.port, workdir=tmp_path / "b", startup_timeout_s=5)
        with pytest.raises(ServerError) as err:
            clash.start()
        assert str(clash.log_path) in str(err.value)
        assert "in use" in str(err.value).lower()
        assert not clash.running


def test_missing_binary_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TIDE_REDIS_SERVER_BIN", "/nonexistent/redis-server")
    with pytest.raises(BinaryNotFound, match="/nonexistent/redis-server"):
        find_redis_server()
    with pytest.raises(BinaryNotFound, match="weed"):
        S3Server(binary="/nonexistent/weed")


def test_s3_server_authenticates_and_stops(tmp_path):
    server = S3Server(workdir=tmp_path, access_key="tideaccess", secret_key="tidesecret123")
    with server:
        assert server.startup_s is not None and server.startup_s < 30
        client = server.endpoint.client()
        client.make_bucket("b-lifecycle")
        client.put_object("b-lifecycle", "k", io.BytesIO(b"x" * 1000), 1000)
        assert client.stat_object("b-lifecycle", "k").size == 1000
        wrong = Minio(server.endpoint.endpoint, access_key="tideaccess", secret_key="wrong", secure=False)
        with pytest.raises(S3Error):
            wrong.list_buckets()
        port = server.port
    assert not server.running
    assert not _port_open(port)


def test_shared_fixtures(redis_client, s3_client, s3_bucket, unique_prefix):
    assert unique_prefix.startswith("t-test-shared-fixtures-")
    redis_client.set(f"{unique_prefix}:k", b"v")
    assert redis_client.get(f"{unique_prefix}:k") == b"v"
    s3_client.put_object(s3_bucket, "a/b", io.BytesIO(b"hello"), 5)
    assert [o.object_name for o in s3_client.list_objects(s3_bucket, recursive=True)] == ["a/b"]


ORPHANING_PARENT = """
import os
from tide.servers import RedisServer
server = RedisServer().start()
print(server.pid, flush=True)
os._exit(0)  # no stop(), no atexit: only PR_SET_PDEATHSIG can take the server down
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()  # a zombie is dead, only not reaped yet
    except FileNotFoundError:
        return False


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux-only")
def test_server_dies_with_its_parent():
    out = subprocess.run([sys.executable, "-c", ORPHANING_PARENT], capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_relative_workdirs_work(tmp_path, monkeypatch):
    """`tide up` passes var/run-.../redis and var/s3 (relative to the checkout): both servers start."""
    monkeypatch.chdir(tmp_path)
    with RedisServer(workdir=Path("var/run/redis")) as r, S3Server(workdir=Path("var/s3")) as s:
        assert redis.Redis.from_url(r.url).ping()
        assert s.endpoint.client().list_buckets() is not None
    assert (tmp_path / "var/run/redis").is_dir() and (tmp_path / "var/s3").is_dir()


def test_free_ports_stay_free_while_clients_open_connections():
    """The launcher chooses every service's ports before it starts them; in between, the stack's
    clients open connections, each taking a local port. A chosen port must not be one of those
    (CI once lost a worker to EADDRINUSE on its metrics port)."""
    chosen = [free_port() for _ in range(50)]
    assert len(set(chosen)) == len(chosen), "a port was handed out twice"
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert all(p < low for p in chosen), "ports come from below the ephemeral range"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1024)
        clients = []
        try:
            for _ in range(800):  # connections the kernel completes in the backlog, never accepted
                c = socket.socket()
                c.connect(listener.getsockname())
                clients.append(c)
            taken = {c.getsockname()[1] for c in clients}
            assert not taken & set(chosen)
            for port in chosen:  # a server (SO_REUSEADDR, as HTTP and gRPC servers set) can bind each
                with socket.socket() as server:
                    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    server.bind(("127.0.0.1", port))
                    server.listen()
        finally:
            for c in clients:
                c.close()
