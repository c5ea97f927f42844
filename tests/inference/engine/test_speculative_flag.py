"""A request's `speculative` flag, carried on its Sequence: None = the γ policy decides, True =
drafts every step (`EngineConfig.forced_gamma` where the policy says 0), False = never drafts.
Whatever the flag, greedy output equals plain decoding."""

from __future__ import annotations

from support.engine import RandomDrafter

from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.sequence import SamplingParams
from tide.policies import FixedGamma

VOCAB = 96
PROMPTS = [[5, 6, 7, 8], [9, 3, 9, 4, 1], [11, 12, 13]]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _run(model, gamma: int) -> dict:
    engine = LLMEngine(model, EngineConfig(max_batch=4, max_seq_len=64, forced_gamma=2),
                       drafter=RandomDrafter(VOCAB), policy=FixedGamma(gamma))
    seqs = {flag: engine.add_request(f"r-{flag}", p, GREEDY, speculative=flag)
            for flag, p in zip((None, True, False), PROMPTS, strict=True)}
    while engine.has_work():
        engine.step()
    return seqs


def test_the_flag_overrides_the_policy_both_ways(tiny_model):
    plain = [s.output_ids for s in LLMEngine(tiny_model, EngineConfig(max_batch=4, max_seq_len=64)).generate(
        PROMPTS, GREEDY)]
    off = _run(tiny_model, gamma=0)  # the policy never drafts
    assert off[None].verify_steps == 0 and off[False].verify_steps == 0
    forced = off[True]
    assert forced.verify_steps > 0 and max(g for g, _ in forced.recent) == 2  # (but at the max_tokens edge)
    on = _run(tiny_model, gamma=3)  # the policy always drafts
    assert on[None].verify_steps > 0 and on[True].verify_steps > 0
    assert on[False].verify_steps == 0 and on[False].draft_tokens == 0
    for run in (off, on):
        assert [run[f].output_ids for f in (None, True, False)] == plain
