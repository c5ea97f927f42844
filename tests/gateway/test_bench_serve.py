"""`tide bench serve` (benchmarks.serve) against a real OpenAI-compatible server on loopback: the
gateway with a real inference worker on a tiny model (the session fixtures of this folder), so the
benchmark parses real SSE streams, real `usage` and TIDE's `speculation` (the worker's n-gram drafter)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.serve import main
from gateway.harness import MODEL_NAME, REPO

PCT = {"p50", "p90", "p99"}
ROW_KEYS = {
    "concurrency",
    "request_rate",
    "output_tok_s",
    "ttft_ms",
    "itl_ms",
    "tpot_ms",
    "e2e_ms",
    "request_throughput",
    "requests_ok",
    "requests_failed",
    "accept_length",
    "goodput",
}
PROMPTS = [
    "1 2 3 1 2 3 1 2 3",
    "Count from one to twenty.",
    "a b c a b c a b c a b c",
    "Write a haiku about the sea.",
    "What is 17 times 3?",
    "List three colours.",
]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bench-serve") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def bench(gateway: str, out: Path, prompts: str, args: str, extra_body: str | None = None, model: bool = True) -> dict:
    """Run `tide bench serve` in this process (`args` split on spaces); its JSON document."""
    argv = ["--base-url", gateway, "--prompts", prompts, "--json", str(out), *args.split()]
    argv += ["--model", MODEL_NAME] if model else []  # else the first of GET /v1/models
    assert main(argv + (["--extra-body", extra_body] if extra_body else [])) == 0
    return json.loads(out.read_text())


def test_concurrency_sweep_reports_vllm_metrics_and_tide_accept_length(gateway, prompt_file, tmp_path, capsys):
    args = f"--concurrency 1 4 --max-tokens 24 --warmup 1 --slo ttft_ms=60000 tpot_ms=60000 --plots {tmp_path}/plots"
    # speculative: the workers' adaptive policy would leave the n-gram drafter off on this random model
    extra = '{"ignore_eos": true, "speculative": true}'
    res = bench(gateway, tmp_path / "serve.json", f"{prompt_file}[:5]", args, extra)
    rows = res["results"]
    assert [r["concurrency"] for r in rows] == [1, 4]
    for r in rows:
        assert set(r) >= ROW_KEYS
        assert r["request_rate"] is None
        assert r["requests_ok"] == 5 and r["requests_failed"] == 0 and r["errors"] == {}
        for metric in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            assert set(r[metric]) >= PCT and all(r[metric][p] > 0 for p in PCT), (metric, r[metric])
        assert r["ttft_ms"]["p50"] <= r["e2e_ms"]["p50"]
        assert r["output_tokens"] == 5 * 24  # usage.completion_tokens (ignore_eos: every request runs to 24)
        assert r["output_tok_s"] > 0 and r["request_throughput"] > 0
        assert r["goodput"] == r["request_throughput"]  # SLOs no request misses
        assert isinstance(r["accept_length"], float) and r["accept_length"] >= 1.0  # the n-gram drafter verified
        assert r["speculation"]["verify_steps"] > 0 and r["speculation"]["responses"] == 5
    assert res["config"]["model"] == MODEL_NAME and res["config"]["slo"] == {"ttft_ms": 60000, "tpot_ms": 60000}
    assert sorted(Path(p).name for p in res["plots"]) == ["latency.png", "throughput.png"]
    assert all(Path(p).stat().st_size > 0 for p in res["plots"])
    # the server's resident memory: this gateway is not under tide up, so its local listener's processes
    (memory,) = res["memory"].values()
    assert memory["source"] == "listener" and memory["rss_bytes"] > 50 * 2**20
    assert memory["rss_bytes"] == sum(memory["processes"].values())
    table = capsys.readouterr().out
    assert "TTFT p50" in table and "accept" in table and len(table.strip().splitlines()) >= 4
    assert "resident memory after the runs" in table


def test_open_loop_rates_cycle_prompts_and_plain_decode_has_no_accept_length(gateway, prompt_file, tmp_path):
    args = (
        f"--request-rate inf 20 --max-concurrency 2 --num-prompts 8 --max-tokens 8 --api completions --plots {tmp_path}"
    )
    res = bench(gateway + "/v1", tmp_path / "serve.json", str(prompt_file), args, '{"speculative": false}', model=False)
    assert res["config"]["model"] == MODEL_NAME and res["config"]["endpoint"] == gateway + "/v1/completions"
    rows = res["results"]
    assert [r["request_rate"] for r in rows] == ["inf", 20.0]
    for r in rows:
        assert set(r) >= ROW_KEYS
        assert r["concurrency"] == 2 and r["num_prompts"] == 8  # 6 prompts cycled to 8
        assert r["requests_ok"] == 8 and r["requests_failed"] == 0
        assert r["output_tok_s"] > 0 and r["ttft_ms"]["p50"] <= r["e2e_ms"]["p50"]
        assert r["goodput"] is None  # no --slo
        assert r["accept_length"] is None and r["speculation"]["verify_steps"] == 0  # speculative: false
    assert sorted(Path(p).name for p in res["plots"]) == ["latency_rate.png", "throughput_rate.png"]


def test_conversations_resend_their_history_and_report_the_servers_cache(gateway, prompt_file, tmp_path):
    """--turns 3: every prompt a conversation of three requests, each resending the answers so far;
    the prompts grow turn by turn, the TTFT is reported per turn, and the server's
    usage.prompt_tokens_details.cached_tokens is summed (the test worker caches whole 256-token
    chunks, which these short conversations never fill: 0, not null)."""
    res = bench(gateway, tmp_path / "turns.json", f"{prompt_file}[:2]", "--concurrency 2 --max-tokens 12 --turns 3")
    (row,) = res["results"]
    assert row["requests_ok"] == 6 and row["requests_failed"] == 0
    assert set(row["ttft_ms_by_turn"]) == {"1", "2", "3"}
    assert all(v["p50"] > 0 for v in row["ttft_ms_by_turn"].values())
    assert row["cached_prompt_tokens"] == 0
    assert res["config"]["turns"] == 3
    single = bench(gateway, tmp_path / "one.json", f"{prompt_file}[:2]", "--concurrency 2 --max-tokens 12")
    # three turns send the first turn's prompt tokens and more again twice
    assert row["input_tokens"] > 3 * single["results"][0]["input_tokens"]
    assert single["results"][0]["ttft_ms_by_turn"] is None


def test_refused_and_timed_out_requests_count_as_failed(gateway, prompt_file, tmp_path):
    mixed = tmp_path / "mixed.jsonl"  # the middle prompt is longer than the context (4096 tokens): a 400
    mixed.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Hi there.", "word " * 6000, "1 2 3")))
    r = bench(gateway, tmp_path / "a.json", str(mixed), "--concurrency 2 --max-tokens 8")["results"][0]
    assert (r["requests_ok"], r["requests_failed"]) == (2, 1)
    assert [m[:8] for m in r["errors"]] == ["HTTP 400"] and sum(r["errors"].values()) == 1
    assert r["ttft_ms"]["p50"] > 0 and r["output_tokens"] > 0  # the good ones still measured

    refused = '{"web_search_options": {}}'  # the server answers 400
    r = bench(gateway, tmp_path / "b.json", f"{prompt_file}[:3]", "--concurrency 3", refused)["results"][0]
    assert (r["requests_ok"], r["requests_failed"]) == (0, 3)
    assert "web_search_options" in next(iter(r["errors"]))
    assert r["output_tok_s"] == 0 and r["accept_length"] is None and r["ttft_ms"]["p50"] is None

    args = "--concurrency 2 --max-tokens 3000 --timeout 0.3"
    r = bench(gateway, tmp_path / "c.json", f"{prompt_file}[:2]", args, '{"ignore_eos": true}')["results"][0]
    assert (r["requests_ok"], r["requests_failed"]) == (0, 2)
    assert all(m.startswith("timeout") for m in r["errors"])


def test_two_servers_in_one_command_alternate_rounds_and_compare(gateway, prompt_file, tmp_path, capsys):
    """Two endpoints (here the same gateway under two names) measured by one command: each run goes to
    both, the order reversed every other round; `comparison` holds the medians and the ratio to the first."""
    argv = ["--base-url", gateway, gateway + "/v1", "--label", "a", "b", "--prompts", f"{prompt_file}[:3]",
            "--concurrency", "1", "2", "--rounds", "2", "--max-tokens", "12", "--json", str(tmp_path / "c.json"),
            "--plots", str(tmp_path / "plots"),
            "--extra-body", '{"speculative": false}', '{"speculative": true, "ignore_eos": true}']
    assert main(argv) == 0
    res = json.loads((tmp_path / "c.json").read_text())
    order = [(r["concurrency"], r["round"], r["server"]) for r in res["results"]]
    assert order == [(1, 0, "a"), (1, 0, "b"), (1, 1, "b"), (1, 1, "a"),
                     (2, 0, "a"), (2, 0, "b"), (2, 1, "b"), (2, 1, "a")]
    assert all(r["requests_ok"] == 3 and r["requests_failed"] == 0 for r in res["results"])
    for r in res["results"]:  # each server got its own extra body
        if r["server"] == "a":  # speculative: false
            assert r["accept_length"] is None and r["speculation"]["verify_steps"] == 0
        else:  # ignore_eos: true
            assert r["output_tokens"] == 3 * 12
    assert sum(r["speculation"]["verify_steps"] for r in res["results"] if r["server"] == "b") > 0
    assert [s["label"] for s in res["config"]["servers"]] == ["a", "b"]
    assert all(s["model"] == MODEL_NAME for s in res["config"]["servers"])  # asked of each server
    comp = {(c["concurrency"], c["server"]): c for c in res["comparison"]}
    assert set(comp) == {(1, "a"), (1, "b"), (2, "a"), (2, "b")}
    for (conc, server), c in comp.items():
        mine = sorted(r["output_tok_s"] for r in res["results"] if (r["concurrency"], r["server"]) == (conc, server))
        assert c["rounds"] == 2 and c["output_tok_s"] == pytest.approx(sum(mine) / 2, abs=1e-3)
        first = comp[(conc, "a")]["output_tok_s"]
        assert c["tok_s_vs_first"] == pytest.approx(c["output_tok_s"] / first, abs=1e-3)
    assert sorted(Path(p).name for p in res["plots"]) == ["latency.png", "throughput.png"]
    out = capsys.readouterr().out
    assert out.count("a: ") >= 1 and out.count("b: ") >= 1 and "ratio" in out


def test_mismatched_labels_and_models_exit_2(prompt_file, capsys):
    base = ["--base-url", "http://127.0.0.1:9", "http://127.0.0.1:10", "--prompts", str(prompt_file),
            "--concurrency", "1"]
    assert main([*base, "--label", "only-one"]) == 2
    assert "--label" in capsys.readouterr().err
    assert main([*base, "--label", "x", "x"]) == 2
    assert main([*base, "--model", "a", "b", "c"]) == 2
    assert "--model" in capsys.readouterr().err
    assert main([*base, "--extra-body", "{}", "{}", "{}"]) == 2
    assert "--extra-body" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompts", "no-such-file.jsonl", "--concurrency", "1"], "no-such-file.jsonl"),
        (["--prompts", "{good}"], "--concurrency"),
        (["--prompts", "{good}", "--concurrency", "0"], "--concurrency"),
        (["--prompts", "{good}", "--concurrency", "1", "--extra-body", "{not json"], "--extra-body"),
        (["--prompts", "{good}", "--concurrency", "1", "--extra-body", "[1]"], "--extra-body"),
        (["--prompts", "{good}", "--concurrency", "1", "--slo", "latency=5"], "--slo"),
        (["--prompts", "{good}", "--concurrency", "1", "--slo", "ttft_ms=-1"], "--slo"),
        (["--prompts", "{bad}", "--concurrency", "1"], "cannot read"),
        (["--prompts", "{good}", "--concurrency", "1", "--max-tokens", "0"], "--max-tokens"),
        (["--prompts", "{good}", "--concurrency", "1", "--turns", "0"], "--turns"),
        (["--prompts", "{good}", "--request-rate", "1", "--turns", "2"], "--turns"),
        (["--prompts", "{good}", "--concurrency", "1", "--turns", "2", "--api", "completions"], "--turns"),
    ],
)
def test_bad_arguments_exit_2_before_sending(args, message, prompt_file, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"neither": 1}\n')
    args = [a.replace("{good}", str(prompt_file)).replace("{bad}", str(bad)) for a in args]
    # a closed port: had anything been sent, the run would finish with failed requests and exit 0
    assert main(["--base-url", "http://127.0.0.1:9", "--model", "m", *args]) == 2
    assert message in capsys.readouterr().err


def test_module_entry_point_exit_status(prompt_file, tmp_path):
    """The exit status seen from a shell: 2 for a bad argument (here a bad --base-url, and argparse's own)."""
    cmd = [sys.executable, "-m", "benchmarks.serve", "--model", "m", "--prompts", str(prompt_file)]
    done = subprocess.run(
        [*cmd, "--base-url", "localhost:8000", "--concurrency", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--base-url" in done.stderr
    done = subprocess.run(
        [*cmd, "--base-url", "http://x", "--request-rate", "-1"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "--request-rate" in done.stderr
