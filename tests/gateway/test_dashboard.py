"""GET /dashboard in a real headless Chromium against a real stack under load: an inference worker
(its telemetry on a real Redis), a real registry with trained versions, promotions and a rollback, a
real controller pushing decisions from the worker's telemetry (collection forced off: the tiny test
target is too shallow to capture hidden states), a real trainer (idle), and the gateway. Every number
the page shows (`[data-k]` elements) is read in the browser together with the JSON document it
rendered and compared with it; the stable parts are compared with
a fresh GET /v1/status, and the history with GET /v1/status/history. A screenshot is saved under
pytest's tmp dir and copied to $TIDE_DASHBOARD_SCREENSHOT (default /tmp/tide-dashboard.png).

Chromium comes from Debian (`chromium`, `chromium-driver`), installed here with apt-get when missing."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from registry.harness import TOKEN, start_registry, write_draft

from gateway.harness import MODEL_NAME, serve_gateway, worker_status
from services.controller.app import build as build_controller
from services.controller.settings import ControllerSettings
from services.gateway import dashboard
from services.trainer.app import build as build_trainer
from services.trainer.settings import TrainerSettings
from tide.blobs import StorageSettings

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
CHROME_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--hide-scrollbars", "--window-size=1440,1000")
SCREENSHOT_COPY = Path(os.environ.get("TIDE_DASHBOARD_SCREENSHOT", "/tmp/tide-dashboard.png"))


def ensure_chromium() -> None:
    """Debian's chromium + chromium-driver, installed with apt-get when missing (CI runs as root)."""
    if CHROMIUM.exists() and CHROMEDRIVER.exists():
        return
    if shutil.which("apt-get") is None:
        pytest.skip("chromium/chromedriver missing and apt-get is not available to install them")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", "chromium", "chromium-driver"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(cmd, env=env, capture_output=True, timeout=900).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=600)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"apt-get install chromium chromium-driver failed:\n{done.stderr[-3000:]}"
    assert CHROMIUM.exists() and CHROMEDRIVER.exists()


@pytest.fixture
def browser(tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the dev extras: pip install -e .[dev]")
    ensure_chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*CHROME_FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=str(CHROMEDRIVER)))
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def fmt(value, f: str) -> str | float:
    """What the page shows for `value` in format `f` (dashboard.js fmt): a string, or a float to compare."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if f == "str":
        return str(value)
    if f == "int":
        return str(math.floor(value + 0.5))
    if f == "bytes":
        return fmt_bytes(value)
    return float(value) * (100 if f == "pct" else 1)


def fmt_bytes(n: float) -> str:
    """dashboard.js fmt(x, "bytes"): binary units, two decimals under 10, one above."""
    units, i = ("B", "KiB", "MiB", "GiB", "TiB"), 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.{2 if n < 10 else 1}f} {units[i]}" if i else f"{math.floor(n + 0.5)} {units[i]}"


def shown_number(text: str, f: str) -> float:
    return float(text.removesuffix("%").removesuffix(" s"))


def lookup(doc: dict, history: list[dict], path: str):
    node = history[-1] if path.startswith("history.") else doc
    for part in path.split(".")[1:] if path.startswith("history.") else path.split("."):
        if part == "length":
            node = len(node)
        elif isinstance(node, list):
            node = node[int(part)]
        else:
            node = node[part]
    return node


READ_PAGE = """return {doc: window.tideStatus, history: window.tideHistory || [],
    shown: [...document.querySelectorAll('[data-k]')].map(e => [e.dataset.k, e.dataset.f, e.textContent])};"""


def load(url: str, stop: threading.Event, outcomes: list[int], clients: int = 3) -> list[threading.Thread]:
    """`clients` closed-loop chat clients until `stop`; each answer's HTTP status goes into `outcomes`."""
    def run(i: int) -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            while not stop.is_set():
                r = c.post("/v1/chat/completions", json={
                    "model": MODEL_NAME, "max_tokens": 48, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Count the days of the week, take {i}: monday"}]})
                outcomes.append(r.status_code)
                if i == 0:  # one client also opts out (store: false): the page's opt-out counts
                    r = c.post("/v1/chat/completions", json={
                        "model": MODEL_NAME, "max_tokens": 4, "store": False,
                        "messages": [{"role": "user", "content": "not for training"}]})
                    outcomes.append(r.status_code)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    return threads


def test_dashboard_shows_the_live_stack(browser, spawn_worker, chat_target, tokenizer, redis_server, s3_server,
                                        s3_client, s3_bucket, unique_prefix, tmp_path, monkeypatch, capsys):
    started = time.monotonic()
    storage = StorageSettings(s3_endpoint=s3_server.endpoint, s3_access_key=s3_server.access_key,
                              s3_secret_key=s3_server.secret_key, s3_bucket=s3_bucket,
                              redis_url=redis_server.url, stream_prefix=unique_prefix)
    registry = start_registry(s3_client, s3_bucket)  # one admin token for every service (TOKEN)
    worker = spawn_worker(env={
        "TIDE_REDIS_URL": storage.redis_url, "TIDE_STREAM_PREFIX": unique_prefix,
        "TIDE_S3_ENDPOINT": storage.s3_endpoint,
        "TIDE_S3_ACCESS_KEY": storage.s3_access_key, "TIDE_S3_SECRET_KEY": storage.s3_secret_key,
        "TIDE_S3_BUCKET": s3_bucket,
        "TIDE_REGISTRY_ADDR": registry.address, "TIDE_TELEMETRY_INTERVAL_S": "0.2",
        "TIDE_ADMIN_TOKEN": TOKEN})
    target = worker_status(worker.address).model_id

    # the registry: two trained versions (as the trainer registers them), both promoted, the second rolled back
    client = registry.client()
    versions = []
    for i, (after, before, tokens, seconds) in enumerate(((1.84, 1.52, 4096, 12.5), (2.11, 1.84, 8192, 21.0))):
        v = client.register_dir(write_draft(tmp_path / f"draft-{i}", seed=i), target, s3=s3_client, bucket=s3_bucket,
                                eval_metrics={"accept_length": after, "accept_length_base": before,
                                              "train_tokens": tokens, "eval_tokens": 512},
                                provenance={"run_id": f"run-{i}", "train": {"seconds": seconds}},
                                parent_version=versions[-1] if versions else "")
        client.promote(v.version, target, reason=f"eval {after} > {before} + margin")
        versions.append(v.version)
    client.rollback(target, reason="live acceptance fell below the previous draft's")

    controller = build_controller(ControllerSettings(
        listen="127.0.0.1:0", metrics_port=0, consumer="dash", workers=(worker.address,), reconcile_s=0.5,
        tokens_needed=4096, admin_token=TOKEN, collection_mode="off",  # the tiny target cannot collect
        storage=StorageSettings(redis_url=redis_server.url, stream_prefix=unique_prefix)))
    trainer = build_trainer(TrainerSettings(
        listen="127.0.0.1:0", metrics_port=0, target=str(chat_target), device="cpu", consumer="t-dash",
        work_dir=str(tmp_path / "trainer"), storage=storage, auto_train=False, registry_addr=registry.address,
        admin_token=TOKEN, chunk_bucket_bytes=3 << 30),  # the data store's budget, shown against the bucket
        storage_timeout_s=10)
    monkeypatch.setattr(dashboard, "SAMPLE_INTERVAL_S", 1.0)  # a chart's worth of samples within the test
    stop = threading.Event()
    try:
        with serve_gateway(tokenizer, (worker.address,), registry_addr=registry.address,
                           controller_addr=controller.target, trainer_addr=trainer.target) as url:
            outcomes: list[int] = []
            threads = load(url, stop, outcomes)
            browser.get(f"{url}/dashboard")

            def page():
                return browser.execute_script(READ_PAGE)

            deadline = time.monotonic() + 45
            while True:  # until the page shows the stack at work: output, telemetry, a decision, chunks, history
                seen = page()
                doc = seen["doc"] or {}
                ready = (doc.get("fleet", {}).get("tokens_per_s", 0) > 0 and len(seen["history"]) >= 6
                         and (doc["controller"].get("last_decision") or {}).get("applied_to")
                         and doc["controller"].get("drafts") and doc["trainer"].get("available")
                         and any(s.get("acceptance_rate") is not None for s in seen["history"])
                         and doc.get("opt_out", {}).get("excluded", {}).get("store_false"))
                if ready:
                    break
                assert time.monotonic() < deadline, f"the page never showed the stack at work ({outcomes[:5]}): {doc}"
                time.sleep(0.5)
            fresh = httpx.get(f"{url}/v1/status", timeout=30).json()
            history = httpx.get(f"{url}/v1/status/history", timeout=30).json()
            for secret in (TOKEN, storage.s3_secret_key, storage.s3_access_key):  # every service has them
                assert secret not in json.dumps(fresh) and secret not in json.dumps(history)
            height = browser.execute_script("return document.documentElement.scrollHeight")
            browser.set_window_size(1440, height)
            time.sleep(0.3)
            seen = page()  # what is on screen now, with the document it was rendered from
            shot = tmp_path / "dashboard.png"
            assert browser.save_screenshot(str(shot))
            stop.set()
            for t in threads:
                t.join(timeout=60)
            assert outcomes and set(outcomes) == {200}
    finally:
        stop.set()
        controller.stop(grace_s=0.2)
        trainer.stop(grace_s=0.2)
        registry.stop()

    # every number on the page is the one in the JSON it rendered
    doc, shown = seen["doc"], seen["shown"]
    paths = {k for k, _, _ in shown}
    for k, f, text in shown:
        expected = fmt(lookup(doc, seen["history"], k), f)
        if isinstance(expected, float) and text != "—":
            decimals = {"f1": 1, "f2": 2, "f3": 3, "pct": 1, "s": 1}[f]
            assert abs(shown_number(text, f) - expected) <= 0.5 * 10 ** -decimals + 1e-9, (k, text, expected)
        else:
            assert text == expected, (k, text, expected)
    for k in ("fleet.tokens_per_s", "workers.0.tokens_per_s", "workers.0.running", "workers.0.waiting",
              "workers.0.acceptance.0.acceptance_rate", "workers.0.acceptance.0.accept_length",
              "workers.0.gamma.0.mean_gamma", "workers.0.speculation.why", "workers.0.memory.rss_bytes",
              "registry.pointer.effective",
              "registry.versions.0.eval_metrics.accept_length", "controller.collection.reason",
              "controller.last_decision.reason", "controller.drafts.0.acceptance_rate_short",
              "training.cycles.0.eval_after", "training.cycles.0.duration_s", "training.rollbacks",
              "backlog.buffered_chunks", "backlog.dead_letters", "history.acceptance_rate", "history.mean_gamma",
              "trainer.data.bucket_chunk_bytes", "trainer.data.bucket_budget_bytes", "trainer.data.chunks_quarantined",
              "trainer.data.chunk_bytes_deleted", "trainer.data.stream_entries_trimmed", "opt_out.eligible",
              "opt_out.excluded.store_false", "opt_out.excluded_total"):
        assert k in paths, f"{k} is not shown"
    # the data store: the bucket against its budget, deletions by reason (every reason listed), opt-outs
    assert dict((k, text) for k, _, text in shown)["trainer.data.bucket_budget_bytes"] == "3.00 GiB"
    reasons = browser.execute_script("return [...document.querySelectorAll('#data [data-reason]')]"
                                     ".map(e => e.dataset.reason)")
    assert {"retention_consumed", "retention_unconsumed", "budget", "forget"} <= set(reasons)
    assert doc["trainer"]["data"]["chunks_quarantined"] == 0 and doc["opt_out"]["eligible"] > 0

    # the page's document is the gateway's: stable parts equal a fresh GET /v1/status, live parts agree
    assert fresh["time_unix_s"] - doc["time_unix_s"] < 15 and fresh["fleet"]["tokens_per_s"] > 0
    assert doc["registry"] == fresh["registry"] and doc["registry"]["pointer"]["effective"] == versions[0]
    assert doc["registry"]["pointer"]["is_pinned"] is False
    assert [e["action"] for e in doc["registry"]["events"]] == ["rollback", "promote", "promote"]
    assert [c["eval_after"] for c in doc["training"]["cycles"]] == [2.11, 1.84]
    assert doc["training"]["promotions"] == 2 and doc["training"]["rollbacks"] == 1
    assert {n: s["healthy"] for n, s in doc["services"].items()} == {
        "registry": True, "trainer": True, "controller": True, "inference-0": True} == \
        {n: s["healthy"] for n, s in fresh["services"].items()}
    w = doc["workers"][0]
    assert w["address"] == worker.address and w["tokens_per_s"] > 0 and w["acceptance"][0]["verify_rows"] > 0
    assert w["speculation"]["on"] and "controller:" in w["speculation"]["why"]
    assert doc["controller"]["last_decision"]["decision_id"] == w["speculation"]["decision_id"]
    assert doc["trainer"]["state"] == "idle" and doc["backlog"]["dead_letters"] == 0
    samples = history["samples"]
    assert history["interval_s"] == 1.0 and len(samples) >= 6
    assert seen["history"][-1] in samples  # the charts' last point is the gateway's
    assert all(0 <= s["acceptance_rate"] <= 1 for s in samples if s["acceptance_rate"] is not None)

    SCREENSHOT_COPY.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, SCREENSHOT_COPY)
    with capsys.disabled():
        print(f"\ndashboard screenshot: {shot} (copied to {SCREENSHOT_COPY}); {time.monotonic() - started:.0f} s")
