"""`tide bench adapt --scenario horizon`'s pure parts (benchmarks.adapt_horizon) and its assembly by
run(): disjoint prompt sets, the version serving at a third's end, the trainer's CPU share, time to
recover, the checks, the JSON keys the issue names, the table and the plot. No stack is started."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import adapt as ba
from benchmarks import adapt_horizon as hz
from tools import cli


def rec(t0, t1, tokens, acc=0.0, steps=0):
    return {"t0": t0, "t1": t1, "phase": 0, "tokens": tokens, "accept_length": acc, "verify_steps": steps,
            "draft_version": "v1", "error": ""}


@pytest.fixture
def gsm8k_train(tmp_path, monkeypatch):
    d = tmp_path / "data"
    d.mkdir()
    rows = [{"question": f"Question {i}: how many apples? " + "x" * (i % 7), "answer": "#### 1"} for i in range(400)]
    rows += [rows[3], {"question": "a very long question " + "y" * 3000, "answer": "#### 2"}]  # a repeat, a long one
    (d / "gsm8k_train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("TIDE_DATA_DIR", str(d))
    return d


def test_served_heldout_and_warmup_questions_are_disjoint_and_never_repeat(gsm8k_train):
    served, held, warm = hz.horizon_prompts(0, 1500)
    texts = [p.text for p in served]
    assert len(texts) == len(set(texts)) == 400 - hz.HELDOUT_PROMPTS - hz.WARM_PROMPTS  # the repeat counted once
    assert not set(texts) & {p.text for p in held} and not set(texts) & {p.text for p in warm}
    assert not {p.text for p in held} & {p.text for p in warm} and len(held) == hz.HELDOUT_PROMPTS
    assert all(len(t) <= 1500 for t in texts) and all(p.chat for p in served)
    other = hz.horizon_prompts(1, 1500)
    assert [p.text for p in other[1]] == [p.text for p in held]  # every seed's drafts meet the same held-out set
    assert [p.text for p in other[0]] != texts  # but serves another order
    assert hz.mode_order(0, ["static", "online"]) == ["static", "online"]
    assert hz.mode_order(1, ["static", "online"]) == ["online", "static"] and hz.mode_order(3, ["online"]) == ["online"]


@pytest.fixture
def chat_and_code(tmp_path, monkeypatch):
    """Spec-Bench / Alpaca questions and HumanEval rows in the shared-data formats (CI has no ../shared)."""
    import gzip

    d = tmp_path / "data"
    d.mkdir()
    (d / "spec_bench_questions.jsonl").write_text("".join(
        json.dumps({"turns": [f"Chat question {i}?"], "category": "qa"}) + "\n" for i in range(110)))
    (d / "alpaca_seed_tasks.jsonl").write_text("".join(
        json.dumps({"instruction": f"Task {i}.", "instances": [{"input": ""}]}) + "\n" for i in range(30)))
    with gzip.open(d / "humaneval.jsonl.gz", "wt") as f:
        for i in range(150):
            f.write(json.dumps({"prompt": f"def f{i}(x):\n    ", "canonical_solution": "return x",
                                "entry_point": f"f{i}"}) + "\n")
    monkeypatch.setenv("TIDE_DATA_DIR", str(d))
    return d


def test_repetitive_traffic_repeats_across_requests_and_online_adds_the_memory(chat_and_code):
    served, held, warm = hz.horizon_prompts(0, 1500, traffic="repetitive")
    texts = [p.text for p in served]
    assert len(texts) == hz.REPETITIVE_REQUESTS and {p.domain for p in served} == {hz.REPETITIVE}
    kinds = [("agent" if "coding agent" in t else "extract" if "data-entry" in t else "faq") for t in texts]
    assert all(abs(kinds.count(k) / len(kinds) - 1 / 3) < 0.05 for k in ("agent", "extract", "faq"))
    faq = [t for t, k in zip(texts, kinds, strict=True) if k == "faq"]
    assert len(set(faq)) < len(faq) / 4  # popular questions recur ...
    extract = [t for t, k in zip(texts, kinds, strict=True) if k == "extract"]
    assert len(set(extract)) > 0.9 * len(extract)  # ... while records keep arriving
    # held out: no served question or module (agents' requests name their functions), the same for every seed
    assert not {p.text for p in held} & set(texts) and len(held) == hz.HELDOUT_PROMPTS
    assert not any(f"`f{i}`" in t for t in texts for i in range(120, 150))
    assert [p.text for p in hz.horizon_prompts(1, 1500, traffic="repetitive")[1]] == [p.text for p in held]
    assert not {p.text for p in warm} & set(texts)
    assert hz.bounds(60, "repetitive") == [(hz.REPETITIVE, 0.0, 60)]

    parser = cli.argparse.ArgumentParser()
    ba.add_arguments(parser)
    args = parser.parse_args(["--scenario", "horizon", "--traffic", "repetitive", "--memory-mb", "16"])
    online, static = (ba.mode_env(m, args, ba.Path("/x"))["inference"] for m in ("online", "static"))
    assert online["TIDE_SPECULATION_MEMORY_MB"] == "16" and static["TIDE_SPECULATION_MEMORY_MB"] == "0"
    gsm8k = ba.mode_env("online", parser.parse_args(["--scenario", "horizon"]), ba.Path("/x"))["inference"]
    assert "TIDE_SPECULATION_MEMORY_MB" not in gsm8k  # the GSM8K horizon measures the fine-tune alone


def test_thirds_take_the_version_serving_at_their_end_and_the_cpu_share():
    samples = [{"t": 0, "draft_version": "m/v1", "cpu_s": {"trainer": 10.0}},
               {"t": 40, "draft_version": "m/v1,m/v2", "cpu_s": {"trainer": 30.0}},  # mid-swap: not a version
               {"t": 50, "draft_version": "m/v2", "cpu_s": {"trainer": 40.0}},
               {"t": 95, "draft_version": "m/v3", "cpu_s": {"trainer": None}}]
    assert [hz.version_at(samples, t) for t in (-1, 30, 45, 60, 100)] == [None, "m/v1", "m/v1", "m/v2", "m/v3"]
    records = [rec(t, t + 10, 100, 2.0 if t < 60 else 3.0, 40) for t in range(0, 90, 10)]
    th = hz.thirds(records, samples, 90)
    assert [t["draft_version"] for t in th] == ["m/v1", "m/v2", "m/v2"] and [t["end_s"] for t in th] == [30, 60, 90]
    assert [t["tok_s"] for t in th] == [pytest.approx(10.0)] * 3
    assert th[0]["accept_length"] == pytest.approx(2.0) and th[2]["accept_length"] == pytest.approx(3.0)
    assert hz.cpu_share(samples) == [[20.0, 0.5], [45.0, 1.0]]  # per second between samples; None skipped
    assert hz.spaced(3, 8) == [0, 1, 2] and hz.spaced(20, 4) == [4, 9, 14, 19] and hz.spaced(0, 8) == []


def test_time_to_recover_needs_a_sustained_lead():
    static = [rec(t, t + 30, 60, 1.5, 30) for t in range(0, 600, 30)]
    # online leads by 1.2x from 120 s on, except one 30-s window at 210 s (90 s of lead is not 2
    # minutes); then for good from 240 s
    online = [rec(t, t + 30, 60, 1.8 if t >= 120 and t != 210 else 1.5, 30) for t in range(0, 600, 30)]
    assert hz.time_to_recover(static, online, 600) == 240.0
    assert hz.time_to_recover(static, static, 600) is None
    assert hz.time_to_recover(static, [rec(0, 600, 600)], 600) is None  # no speculation in online: no verdict


def test_checks_read_the_last_third_and_the_offline_reference():
    res = {"static": {"thirds": [{}, {}, {"tok_s": 40.0, "eval_accept_length_g3": 1.5}]},
           "online": {"thirds": [{}, {}, {"tok_s": 48.0, "eval_accept_length_g3": 1.9}]},
           "online_final_eval_accept_length_g3": 1.9, "offline_reference": {"eval_accept_length_g3": 2.0}}
    c = hz.checks(res)
    assert (c["last_third_tok_s_ratio"], c["online_vs_offline"]) == (1.2, 0.95)
    assert c["meets"] == {"tok_s_x1.15": True, "eval_x1.20": True, "vs_offline_x0.90": True}
    res["online"]["thirds"][-1]["eval_accept_length_g3"] = 1.7
    res["offline_reference"] = {"eval_accept_length_g3": None}
    assert hz.checks(res)["meets"] == {"tok_s_x1.15": True, "eval_x1.20": False, "vs_offline_x0.90": None}


def test_cpu_seconds_count_the_work_of_threads_that_ended():
    import threading

    from tide.resources import cpu_seconds

    before = cpu_seconds(os.getpid())

    def spin():
        t = os.times().elapsed
        while os.times().elapsed - t < 0.3:
            pass

    th = threading.Thread(target=spin)
    th.start()
    th.join()
    assert cpu_seconds(os.getpid()) - before >= 0.2
    assert cpu_seconds(2**22 + 12345) is None  # no such process


def test_the_trainers_accepted_tokens_are_read_from_its_exposition(monkeypatch):
    from benchmarks import adapt_stack

    text = "# TYPE tide_trainer_accepted_tokens counter\ntide_trainer_accepted_tokens_total 12345.0\n" \
           "tide_trainer_accepted_tokens_created 1.7e9\n"
    monkeypatch.setattr(adapt_stack, "_scrape", lambda port: text if port == 9 else None)
    ep = type("Ep", (), {"metrics": {"trainer": 9}})()
    assert adapt_stack.trainer_accepted_tokens(ep) == 12345
    assert adapt_stack.trainer_accepted_tokens(type("Ep", (), {"metrics": {}})()) is None


def fake_mode(mode: str, horizon_s: float) -> dict:
    """What run_mode returns for a horizon mode (records, samples, and the counters it adds)."""
    from benchmarks import adapt_stats as st

    online = mode == "online"
    records = [rec(t, t + 10, 120 if online and t >= horizon_s / 3 else 100,
                   2.4 if online and t >= horizon_s / 3 else 1.6, 50) for t in range(0, int(horizon_s), 10)]
    samples = [{"t": t, "draft_version": "m/v0002" if online and t >= horizon_s / 2 else "m/v0001",
                "collection": online, "cpu_s": {"trainer": 0.5 * t if online else 1.0}}
               for t in range(0, int(horizon_s) + 1, 5)]
    bnds = hz.bounds(horizon_s)
    return {**st.phase_table(records, bnds), "timeline": st.timeline(records, horizon_s, 10),
            "collection_intervals": st.intervals(samples, "collection", horizon_s),
            "promotions": [{"t_s": horizon_s / 2 - 3, "version": "m/v0002", "eval_accept_length": 2.3}] if online
            else [], "training": st.training_cycles([], 0), "chunk_bytes": 10**6 if online else 0,
            "starting_version": "m/v0001", "samples": samples, "requests": records,
            "trainer_cpu_s": 0.5 * horizon_s if online else 0.0, "collected_tokens": 50_000 if online else 0,
            **({"candidates": [{"version": "m/v0000", "t_s": -20.0, "parent": ""},  # a starter draft, before
                               {"version": "m/v0002", "t_s": horizon_s / 2 - 5, "parent": "m/v0001"},
                               {"version": "m/v0003", "t_s": horizon_s - 5, "parent": "m/v0002"}]} if online else {})}


def test_run_cli_writes_the_keys_the_issue_names(monkeypatch, tmp_path, capsys, gsm8k_train):
    """run() with the stacks, the evals and the offline training replaced by canned results: the
    order by seed, the warm-up prompts, each third's eval of the version serving then, the reference."""
    seen, evaluated = [], []

    def fake_run_mode(mode, args, draft_dir, prompts, bnds, work, warm=None):
        seen.append((mode, bnds, len(warm), args.ab_rounds))
        (work / mode / "draft-cache").mkdir(parents=True, exist_ok=True)
        if mode == "online":
            from tide.registry_client import target_key

            for v in ("m/v0002", "m/v0003"):
                (work / mode / "draft-cache" / target_key(v)).mkdir()
        return fake_mode(mode, bnds[0][2])

    def fake_eval(path, chunks, target):
        evaluated.append(path.name)
        return {"eval_accept_length_g3": {"draft": 1.5, "m%2Fv0002": 1.95}.get(path.name, 1.9), "rows": 100}

    monkeypatch.setattr(ba, "run_mode", fake_run_mode)
    monkeypatch.setattr(hz, "heldout_chunks", lambda d, t, p, n, c: (tmp_path / "held", {"eval_accept_length_g3": 1.5}))
    monkeypatch.setattr(hz, "evaluate_many", lambda paths, chunks, target: [fake_eval(p, chunks, target)
                                                                            for p in paths])
    monkeypatch.setattr(hz, "offline_reference", lambda *a, **k: {"eval_accept_length_g3": 2.0, "tokens": 50_000})
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    out = tmp_path / "out" / "horizon.json"
    parser = cli.argparse.ArgumentParser()
    ba.add_arguments(parser)
    args = parser.parse_args(["--scenario", "horizon", "--quick", "--seed", "1", "--draft", str(draft),
                              "--json", str(out), "--plots", str(tmp_path / "p"), "--work-dir", str(tmp_path / "w"),
                              "--online-env", "controller:TIDE_CONTROLLER_COLLECTION_LEARN=1"])
    assert ba.run_cli(args) == 0
    assert [s[0] for s in seen] == ["online", "static"]  # odd seed: online first
    assert seen[0][1] == [("gsm8k", 0.0, 900.0)] and seen[0][2] == hz.WARM_PROMPTS and seen[0][3] == 0
    got = json.loads(out.read_text())
    for mode in ("static", "online"):
        m = got[mode]
        assert len(m["thirds"]) == 3 and all({"tok_s", "eval_accept_length_g3"} <= set(t) for t in m["thirds"])
        assert {"trainer_cpu_s", "collected_tokens", "promotions"} <= set(m) and m["overall"]["tok_s"] > 0
    assert [t["draft_version"] for t in got["online"]["thirds"]] == ["m/v0001", "m/v0002", "m/v0002"]
    assert [t["eval_accept_length_g3"] for t in got["online"]["thirds"]] == [1.5, 1.95, 1.95]
    assert sorted(evaluated) == ["draft", "draft", "m%2Fv0002", "m%2Fv0003"]  # once per mode and version
    assert [(c["version"], c["eval_accept_length_g3"], c["promoted"]) for c in got["online"]["candidates"]] == [
        ("m/v0002", 1.95, True), ("m/v0003", 1.9, False)]  # every cycle's candidate on the held-out chunks
    assert got["online_final_eval_accept_length_g3"] == 1.95
    assert got["offline_reference"] == {"eval_accept_length_g3": 2.0, "tokens": 50_000}
    assert got["checks"]["meets"] == {"tok_s_x1.15": True, "eval_x1.20": True, "vs_offline_x0.90": True}
    assert got["time_to_recover_s"] == 300.0 and got["trainer_cpu_s"] == {"online": 450.0, "static": 0.0}
    assert [p.rsplit("/", 1)[-1] for p in got["plots"]] == ["horizon.png"]
    assert (tmp_path / "p" / "horizon.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "third 3" in printed and "offline reference 2.000" in printed and "time to recover 300 s" in printed


def test_heldout_chunks_evals_and_the_offline_reference_on_the_tiny_target(tmp_path_factory, tmp_path):
    """The real path on the tiny bootstrapped target: held-out chunks generated once, then read from
    the cache; several drafts scored in one pass, as one at a time; the offline reference fine-tunes
    the starting draft on collected chunks (here copies of the held-out ones) and scores the result."""
    import shutil

    from tests.support.bootstrap import tiny_bootstrap
    from tide.prompts import load_prompts
    from tools.draft.generation import torch_threads

    _, _, paths = tiny_bootstrap(tmp_path_factory)
    draft, target = paths["out"], str(paths["target"])
    prompts = load_prompts(paths["heldout"])[:6]
    with torch_threads(1):
        chunks, first = hz.heldout_chunks(draft, target, prompts, 24, tmp_path / "cache")
        again, cached = hz.heldout_chunks(draft, target, prompts, 24, tmp_path / "cache")
        assert again == chunks and cached == first and first["eval_accept_length_g3"] >= 1.0
        assert len(list((tmp_path / "cache").iterdir())) == 1  # the same prompts: the same cache entry
        many = hz.evaluate_many([draft, draft], chunks, target)
        assert many == [hz.evaluate_g3(draft, chunks, target)] * 2 and many[0] == first
        collected = tmp_path / "collected"
        collected.mkdir()
        for i, f in enumerate(sorted(p for p in chunks.rglob("*") if p.is_file())):
            shutil.copy(f, collected / f"{i:06d}.chunk")
        ref = hz.offline_reference(draft, collected, chunks, target, tmp_path / "ref", budget_s=20.0, lr=3e-3,
                                   batch_rows=2, max_len=64)
    assert ref["tokens"] > 0 and ref["steps"] > 0 and ref["eval_accept_length_g3"] >= 1.0
    assert hz.evaluate_g3(tmp_path / "ref", chunks, target) == {k: ref[k] for k in ("eval_accept_length_g3", "rows")}
    assert hz.offline_reference(draft, tmp_path / "nothing", chunks, target, tmp_path / "r2", 1.0, 1e-3, 2, 64)[
        "tokens"] == 0  # nothing collected: no reference, and no crash


def test_the_memorys_bound_is_read_from_the_pollers_samples():
    budget = 4 << 20
    samples = [{"t": 0.0, "rss_bytes": 5}, {"t": 2.0, "rss_bytes": 6}]
    assert hz.speculation_memory_held(samples) is None  # a stack without one
    samples += [{"t": 4.0 + i, "rss_bytes": 7 + i,
                 "speculation_memory": [{"bytes": b, "budget_bytes": budget, "tokens": b // 100}]}
                for i, b in enumerate([1 << 20, budget, budget - 10])]
    held = hz.speculation_memory_held(samples)
    assert held["within_budget"] and held["max_bytes"] == budget and held["final_tokens"] == (budget - 10) // 100
    assert held["rss_bytes_first_last"] == [7, 9]
    samples[-1]["speculation_memory"][0]["bytes"] = budget + 1
    assert not hz.speculation_memory_held(samples)["within_budget"]
