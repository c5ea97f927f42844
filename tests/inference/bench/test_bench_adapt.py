"""`tide bench adapt`'s pure parts: attribution of requests to phases, ratios, intervals, A/B overhead,
promotions, the checks, the JSON shape, the table, the plots and the CLI wiring. No stack is started."""

from __future__ import annotations

import json

import pytest

from benchmarks import adapt as ba
from benchmarks import adapt_stats as st
from tools import cli
from tools.launcher import Endpoints, StackConfig, service_env

BOUNDS = [("chat", 0.0, 10.0), ("gsm8k", 10.0, 20.0), ("humaneval", 20.0, 30.0)]


def rec(t0, t1, tokens, acc=0.0, steps=0, error=""):
    return {"t0": t0, "t1": t1, "phase": 0, "tokens": tokens, "accept_length": acc, "verify_steps": steps,
            "draft_version": "v1", "error": error}


def test_tokens_and_steps_are_spread_over_the_request_and_straddlers_split():
    r = [rec(0, 10, 100, 2.0, 50), rec(5, 15, 40, 3.0, 10), rec(12, 12, 7, 1.5, 4), rec(1, 2, 999, error="HTTP 503")]
    chat, gsm = st.window(r, 0, 10), st.window(r, 10, 20)
    assert chat["tokens"] == pytest.approx(120) and chat["tok_s"] == pytest.approx(12.0)
    assert gsm["tokens"] == pytest.approx(27) and gsm["tok_s"] == pytest.approx(2.7)
    assert chat["accept_length"] == pytest.approx((2.0 * 50 + 3.0 * 5) / 55, abs=1e-4)  # step-weighted
    assert gsm["accept_length"] == pytest.approx((3.0 * 5 + 1.5 * 4) / 9, abs=1e-4)
    assert chat["drafted_share"] == pytest.approx((2.0 * 50 + 3.0 * 5) / 120, abs=1e-4)  # the rest decoded plainly
    assert (chat["completed"], chat["errors"], gsm["completed"]) == (0, 1, 3)  # by answer time; r[0] ends at 10
    assert st.window(r, 20, 30)["accept_length"] is None and st.window(r, 20, 30)["tok_s"] == 0
    table = st.phase_table(r, BOUNDS)
    assert set(table["phases"]) == {"chat", "gsm8k", "humaneval"}
    assert table["overall"]["tokens"] == pytest.approx(147) and table["overall"]["tok_s"] == pytest.approx(4.9)
    tl = st.timeline(r, 30, 10)
    assert [row[0] for row in tl] == [5.0, 15.0, 25.0] and tl[0][1] == pytest.approx(12.0) and tl[2][2] is None
    assert len(st.timeline(r, 25, 10)) == 3 and st.timeline(r, 25, 10)[-1][0] == 22.5  # a short last bin


def test_ratios_intervals_and_overhead():
    s = {"phases": {"chat": {"tok_s": 10.0, "accept_length": 2.0}, "gsm8k": {"tok_s": 0, "accept_length": None}},
         "overall": {"tok_s": 8.0, "accept_length": 2.0}}
    o = {"phases": {"chat": {"tok_s": 12.0, "accept_length": 2.5}, "gsm8k": {"tok_s": 5.0, "accept_length": 2.2}},
         "overall": {"tok_s": 10.0, "accept_length": 2.4}}
    r = st.ratios(s, o)
    assert r["phases"]["chat"] == {"tok_s": 1.2, "accept_length": 1.25}
    assert r["phases"]["gsm8k"] == {"tok_s": None, "accept_length": None}  # no division by zero / None
    assert r["overall"]["tok_s"] == 1.25
    samples = [{"t": 0, "collection": False}, {"t": 2, "collection": True}, {"t": 4, "collection": True},
               {"t": 6, "collection": False}, {"t": 8, "collection": True}, {"t": 31, "collection": True}]
    assert st.intervals(samples, "collection", 30) == [[2, 6], [8, 30]]
    assert st.intervals([{"t": 1}], "collection", 30) == []
    w = [{"collection": c, "tokens": n, "seconds": 10.0} for c, n in
         ((False, 200), (True, 190), (True, 180), (False, 210))]
    co = st.collection_overhead(w, "ABBA")
    assert (co["off_tok_s"], co["on_tok_s"]) == (20.5, 18.5) and co["method"] == "ABBA"
    assert co["cost_pct"] == pytest.approx(100 * (1 - 18.5 / 20.5), abs=0.01) and len(co["windows"]) == 4
    assert st.collection_overhead(w[:1], "x")["cost_pct"] is None  # no "on" window: no number, no crash


def test_promotions_training_and_checks():
    hist = [{"action": "promote", "to_version": "m/v0002", "time_unix_s": 1060.0, "actor": "trainer"},
            {"action": "promote", "to_version": "m/v0001", "time_unix_s": 990.0, "actor": "bench-adapt"},
            {"action": "promote", "to_version": "m/v0000", "time_unix_s": 980.0, "actor": "registry"},  # set-up
            {"action": "rollback", "to_version": "m/v0001", "time_unix_s": 1100.0, "actor": "controller"}]
    outcomes = {"m/v0002": {"run_id": "r1", "candidate_version": "m/v0002", "eval_accept_length_candidate": 2.1,
                            "eval_accept_length_base": 1.7, "duration_s": 30.0, "finished_unix_s": 1055.0}}
    p = st.promotions(hist, {"m/v0002": {"accept_length": 2.0}}, outcomes, 1000.0, "m/v0001")
    assert p == [{"t_s": 60.0, "version": "m/v0002", "actor": "trainer", "eval_accept_length": 2.1,
                  "eval_accept_length_base": 1.7, "eval_metrics": {"accept_length": 2.0}}]
    assert st.promotions(hist, {"m/v0002": {"accept_length": 2.0}}, {}, 1000.0, "m/v0001")[0][
        "eval_accept_length"] == 2.0  # the registry's eval metrics when no outcome was seen
    tr = st.training_cycles(list(outcomes.values()) + [{"run_id": "r0", "duration_s": 10.0, "finished_unix_s": 1020}],
                            1000.0)
    assert tr["count"] == 2 and [c["run_id"] for c in tr["cycles"]] == ["r0", "r1"] and tr["mean_duration_s"] == 20.0
    assert st.training_cycles([], 0)["mean_duration_s"] is None
    static = [rec(t, t + 5, 50, 1.8, 25) for t in range(0, 30, 5)]
    online = [rec(t, t + 5, 60, 1.7 if t % 10 == 0 else 2.4, 25) for t in range(0, 30, 5)]
    s = {**st.phase_table(static, BOUNDS), "requests": static}
    o = {**st.phase_table(online, BOUNDS), "requests": online}
    c = st.checks(s, o, BOUNDS)
    assert c["accept_length_second_half"]["gsm8k"] == {"static": 1.8, "online": 2.4, "online_higher": True}
    assert c["overall_tok_s_ratio"] == pytest.approx(1.2)
    assert c["meets"] == {"accept_above_static_after_each_shift": True, "tok_s_x1.10": True}
    assert not st.checks(o, s, BOUNDS)["meets"]["tok_s_x1.10"]


def fake_mode(tok: float, acc: float) -> dict:
    records = [rec(t, t + 5, int(tok * 5), acc, 20) for t in range(0, 30, 5)]
    return {**st.phase_table(records, BOUNDS), "timeline": st.timeline(records, 30, 10), "requests": records,
            "collection_intervals": [[3.0, 14.0]],
            "samples": [{"t": 0, "chunk_bytes": 0, "buffered_tokens": 0, "policy": {}},
                        {"t": 20, "chunk_bytes": 2e6, "buffered_tokens": 900,
                         "policy": {"alpha_global": 0.3, "kappa_draft[batch=2]": 1.2, "kappa_draft[batch=1]": 0.9}}],
            "promotions": [], "chunk_bytes": 2_000_000}


def test_json_shape_table_and_plots(tmp_path, capsys):
    res = {"phases": [{"name": n, "start_s": a, "end_s": b, "prompts": 3} for n, a, b in BOUNDS],
           "static": fake_mode(10, 1.8), "online": fake_mode(12, 2.2), "bin_s": 10, "concurrency": 4,
           "promotions": [{"t_s": 12.0, "version": "m/v0002", "eval_accept_length": 2.3}],
           "collection_overhead": st.collection_overhead([], "ABBA"), "chunk_bytes": {"static": 0, "online": 2e6},
           "training": {"count": 1, "mean_duration_s": 30.0}}
    res["ratio"] = st.ratios(res["static"], res["online"])
    res["checks"] = st.checks(res["static"], res["online"], BOUNDS)
    doc = json.loads(json.dumps(res))  # JSON-serialisable as written
    for mode in ba.MODES:
        for name, _, _ in BOUNDS:
            assert {"tok_s", "accept_length"} <= set(doc[mode]["phases"][name])
    assert doc["ratio"]["overall"]["tok_s"] == pytest.approx(1.2)
    ba.print_table(res)
    out = capsys.readouterr().out
    assert "online/static" in out and "online drafted" in out and "promotion at 12 s" in out and "checks:" in out
    from benchmarks.adapt_plots import plot

    paths = plot(res, tmp_path / "plots")
    assert [p.rsplit("/", 1)[-1] for p in paths] == ["adapt.png", "loop.png", "policy.png"]
    for p in paths:
        assert ba.Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_pollers_policy_estimates_are_read_from_the_workers_exposition():
    """What the worker exports (services.inference.metrics, the process's default registry) is what
    the bench reads back: names keyed with their scope, and nothing of other metrics."""
    from prometheus_client import REGISTRY, generate_latest

    from benchmarks.adapt_stack import policy_estimates
    from services.inference import metrics

    metrics.POLICY_ESTIMATE.clear()
    metrics.POLICY_ESTIMATE.labels("adaptive", "alpha_global", "").set(0.31)
    metrics.POLICY_ESTIMATE.labels("adaptive", "kappa_draft", "batch=2").set(2.5)
    try:
        got = policy_estimates(generate_latest(REGISTRY).decode())
    finally:
        metrics.POLICY_ESTIMATE.clear()
    assert got == {"alpha_global": 0.31, "kappa_draft[batch=2]": 2.5}
    assert policy_estimates(None) == {}


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    """A TIDE_DATA_DIR with small files in the shared-data formats (CI's checkout has no ../shared)."""
    import gzip

    d = tmp_path / "data"
    d.mkdir()
    cats = ["writing", "math", "qa", "coding", "roleplay"]
    rows = [{"turns": [f"chat question {i} " + "x" * 30], "category": cats[i % 5]} for i in range(40)]
    rows.append({"turns": ["a very long question " + "y" * 2000], "category": "writing"})
    (d / "spec_bench_questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "gsm8k_test.jsonl").write_text("".join(json.dumps({"question": f"How many {i} apples are there?",
                                                            "answer": "#### 1"}) + "\n" for i in range(30)))
    with gzip.open(d / "humaneval.jsonl.gz", "wt") as f:
        for i in range(30):
            f.write(json.dumps({"prompt": f"def f{i}(x):\n    ", "canonical_solution": "return x"}) + "\n")
    (d / "alpaca_seed_tasks.jsonl").write_text("".join(json.dumps({"instruction": f"Give me a recipe number {i}.",
                                                                   "instances": [{"input": ""}]}) + "\n"
                                                       for i in range(5)))
    monkeypatch.setenv("TIDE_DATA_DIR", str(d))
    return d


def test_the_starting_draft_is_bootstrapped_on_no_prompt_a_phase_serves(data_dir, tmp_path):
    """Greedy decoding of a prompt the starting draft was bootstrapped on regenerates a sequence it
    memorised: the static mode would read memorisation, and the trainer's held-out chunks favour it."""
    from tide.prompts import load_prompts

    # Spec-Bench's math_reasoning questions are GSM8K test questions, which the gsm8k phase serves
    with (data_dir / "spec_bench_questions.jsonl").open("a") as f:
        f.write(json.dumps({"turns": ["How many 3 apples are there?"], "category": "math_reasoning"}) + "\n")
    path = ba.bootstrap_prompt_file(tmp_path / "drafts")
    boot = [p.text for p in load_prompts(path)]
    served = {p.text for phase in ba.phase_prompts(0, 10**6) for p in phase}
    assert boot and not set(boot) & served and "How many 3 apples are there?" in served
    # Alpaca, and the Spec-Bench categories no phase serves (math, coding), are all there
    assert {f"Give me a recipe number {i}." for i in range(5)} <= set(boot)
    assert sum(t.startswith("chat question") for t in boot) == 16
    assert all(p.chat for p in load_prompts(path))  # chat-templated like the originals
    assert ba.bootstrap_prompt_file(tmp_path / "drafts") == path  # same prompts, same file: same cached draft


def test_phases_prompts_env_and_cli(monkeypatch, data_dir):
    prompts = ba.phase_prompts(0, 1500)
    assert [len(p) > 20 for p in prompts] == [True] * 3
    assert {p.domain for p in prompts[0]} <= set(ba.PHASES[0][2]) and not prompts[2][0].chat  # HumanEval: raw
    assert ba.phase_prompts(0, 1500)[1][:5] == prompts[1][:5] and max(len(p.text) for p in prompts[0]) <= 1500
    assert ba.bounds(60) == [("chat", 0, 60), ("gsm8k", 60, 120), ("humaneval", 120, 180)]
    parser = cli.argparse.ArgumentParser()
    ba.add_arguments(parser)
    args = parser.parse_args(["--quick", "--min-tokens", "999", "--env", "inference:TIDE_MAX_BATCH=8",
                              "--online-env", "trainer:TIDE_TRAINER_EPOCHS=4"])
    static, online = ba.mode_env("static", args, ba.Path("/x")), ba.mode_env("online", args, ba.Path("/x"))
    assert static["trainer"]["TIDE_TRAINER_AUTO_TRAIN"] == "0" and "controller" not in static
    assert online["controller"]["TIDE_CONTROLLER_COLLECTION"] == "auto"
    assert online["trainer"]["TIDE_TRAINER_MIN_TOKENS"] == "999" and online["trainer"]["TIDE_TRAINER_EPOCHS"] == "4"
    assert "TIDE_TRAINER_EPOCHS" not in static["trainer"] and static["inference"]["TIDE_MAX_BATCH"] == "8"
    with pytest.raises(SystemExit):
        ba.parse_env(["trainer-no-colon"])
    ep = Endpoints(redis_url="redis://127.0.0.1:1/0", s3_endpoint="127.0.0.1:2", s3_access_key="a", s3_secret_key="s",
                   admin_token="t", registry="127.0.0.1:3", trainer="127.0.0.1:4", controller="127.0.0.1:5",
                   workers=("127.0.0.1:6",), gateway_host="127.0.0.1", gateway_port=8000)
    cfg = StackConfig(env=online)  # the launcher merges a mode's overrides last
    assert service_env("trainer", cfg, ep)["TIDE_TRAINER_AUTO_TRAIN"] == "1"
    assert service_env("inference", cfg, ep)["TIDE_DRAFT_CACHE_DIR"] == "/x/draft-cache"
    assert service_env("registry", cfg, ep) == service_env("registry", StackConfig(), ep)
    seen = {}
    monkeypatch.setattr(ba, "run_cli", lambda a: seen.setdefault("args", a) and 0)
    assert cli.main(["bench", "adapt", "--quick", "--json", "/tmp/x.json", "--plots", "/tmp/p"]) == 0
    assert seen["args"].quick and seen["args"].concurrency == 4 and seen["args"].modes == ["static", "online"]


def test_the_trainer_gets_cores_of_its_own_in_both_modes(monkeypatch):
    """Separate hardware on one machine: worker and trainer never share a CPU, and the static mode's
    worker runs on exactly the CPUs the online mode's worker gets."""
    def split(n):
        monkeypatch.setattr(ba.os, "sched_getaffinity", lambda pid: set(range(n)))
        return ba.placement("auto", "auto")

    assert split(2) == ("0", "1") and split(8) == ("0,1,2,3", "4,5,6,7") and split(3) == ("0,1", "2")
    assert split(1) == ("", "")  # nothing to split on one CPU
    assert ba.placement("auto", "3") == ("", "3")
    assert split(4) == ("0,1", "2,3") and ba.placement("auto", "3") == ("0,1", "3")
    assert ba.placement("0", "") == ("0", "") and split(2) == ("0", "1")
    parser = cli.argparse.ArgumentParser()
    ba.add_arguments(parser)
    args = parser.parse_args(["--quick"])
    static, online = ba.mode_env("static", args, ba.Path("/x")), ba.mode_env("online", args, ba.Path("/x"))
    assert static["inference"]["TIDE_CPUS"] == online["inference"]["TIDE_CPUS"] == "0"
    assert static["trainer"]["TIDE_TRAINER_CPUS"] == online["trainer"]["TIDE_TRAINER_CPUS"] == "1"
    # both modes run the same γ policy; a non-static one gets no static γ it would refuse as a parameter
    for mode in (static, online):
        assert (mode["inference"]["TIDE_POLICY"], mode["inference"]["TIDE_POLICY_PARAMS"]) == ("adaptive", "{}")
    static3 = ba.mode_env("static", parser.parse_args(["--policy", "static"]), ba.Path("/x"))["inference"]
    assert json.loads(static3["TIDE_POLICY_PARAMS"]) == {"gamma": 3}


def test_run_cli_assembles_both_modes_without_a_stack(monkeypatch, tmp_path, capsys, data_dir):
    """run() → JSON + plots with run_mode replaced by canned modes (the stack path is exercised by hand)."""
    seen = []

    def fake_run_mode(mode, args, draft_dir, prompts, bnds, work, warm=None):
        assert warm is None  # each phase's first prompt warms up
        seen.append((mode, [b[0] for b in bnds], args.phase_s, args.ab_requests))
        res = fake_mode(10 if mode == "static" else 12, 1.8 if mode == "static" else 2.2)
        if mode == "static":
            res["collection_ab"] = st.collection_overhead(
                [{"collection": c, "tokens": 100, "seconds": s} for c, s in ((False, 10), (True, 10.5))], "ABBA")
        else:
            res["promotions"] = [{"t_s": 15.0, "version": "m/v0002", "eval_accept_length": 2.0}]
            res["training"] = st.training_cycles([{"run_id": "r", "duration_s": 40.0, "finished_unix_s": 5}], 0)
        return res

    monkeypatch.setattr(ba, "run_mode", fake_run_mode)
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    out = tmp_path / "out" / "adapt.json"
    parser = cli.argparse.ArgumentParser()
    ba.add_arguments(parser)
    args = parser.parse_args(["--quick", "--draft", str(draft), "--json", str(out), "--plots", str(tmp_path / "p"),
                              "--work-dir", str(tmp_path / "work")])
    assert ba.run_cli(args) == 0
    assert seen == [("static", ["chat", "gsm8k", "humaneval"], 150.0, 4), ("online", ["chat", "gsm8k", "humaneval"],
                                                                           150.0, 4)]
    got = json.loads(out.read_text())
    assert got["static"]["phases"]["gsm8k"]["tok_s"] == pytest.approx(10) and got["quick"]
    assert got["ratio"]["phases"]["humaneval"]["tok_s"] == pytest.approx(1.2)
    assert got["promotions"][0]["version"] == "m/v0002" and got["training"]["mean_duration_s"] == 40.0
    assert got["collection_overhead"]["cost_pct"] == pytest.approx(100 * (1 - 10 / 10.5), abs=0.01)
    assert got["chunk_bytes"] == {"static": 2_000_000, "online": 2_000_000} and len(got["plots"]) == 3
    assert "wrote" in capsys.readouterr().out
