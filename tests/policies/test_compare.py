"""Oracle and the headline simulator check on the low ↔ high concurrency trace."""

from tide.policies.compare import compare, format_table, oracle
from tide.policies.profile import synthetic_profile
from tide.policies.workload import low_high

PROFILE = synthetic_profile()


def test_oracle_takes_the_best_static_gamma_per_phase():
    wl = low_high(phase_s=10.0)
    orc, runs = oracle(wl, PROFILE, max_gamma=4)
    assert set(runs) == {0, 1, 2, 3, 4}
    for i, ph in enumerate(orc["phases"]):
        assert ph["tokens_per_s"] == max(r.phases[i].tokens_per_s for r in runs.values())
        assert runs[ph["gamma"]].phases[i].tokens_per_s == ph["tokens_per_s"]
    assert orc["phases"][0]["gamma"] >= 2  # low load: speculate deep
    assert orc["phases"][1]["gamma"] <= 1  # 64 concurrent: shallow or off


def test_adaptive_beats_static_and_holds_high_load():
    """Simulator check (not a timing test): the default trace, adaptive vs static γ = 3 and γ = 0."""
    wl = low_high()
    report = compare(wl, PROFILE, policies=["adaptive"], max_gamma=8)
    res = report["results"]
    adaptive, static3, nospec = res["adaptive"], res["static-3"], res["no-spec"]
    assert adaptive["overall"]["tokens_per_s"] >= static3["overall"]["tokens_per_s"]
    high = report["phases"].index("high")
    assert adaptive["phases"][high]["tokens_per_s"] >= 0.97 * nospec["phases"][high]["tokens_per_s"]
    assert adaptive["overall"]["tokens_per_s"] >= 0.97 * report["oracle"]["tokens_per_s"]
    text = format_table(report)
    assert "adaptive" in text and "oracle" in text
