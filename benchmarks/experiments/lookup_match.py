"""How well a copy is accepted by the length of the n-gram match it comes from: the default hybrid
(copies from 1-3 matching tokens, else the EAGLE-3 chain) at a fixed γ, batch 1, on the held-out
mix; each step's accepted drafts grouped by the longest suffix of the context seen before
(0: none, the draft proposed).

    python -m benchmarks.experiments.lookup_match --draft tide/starter_drafts/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import collections

from benchmarks.engine import decode_all
from benchmarks.experiments.lookup_ab import PROMPTS, load
from tide.engine.drafters.hybrid import HybridDrafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.policies import FixedGamma


def match_length(tokens: list[int], max_n: int = 3) -> int:
    """The longest suffix (up to max_n tokens) of `tokens` that occurred earlier; 0 if none."""
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        if any(tokens[s:s + n] == suffix for s in range(len(tokens) - n - 1, -1, -1)):
            return n
    return 0


class _Recording(HybridDrafter):
    def propose(self, seqs, gammas, features, generators):
        self.matched = {s.request_id: match_length(s.token_ids) for s in seqs}
        return super().propose(seqs, gammas, features, generators)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True, help="EAGLE-3 checkpoint directory")
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--per-file", type=int, default=21)
    args = ap.parse_args()
    model, eagle, prompts = load(args.draft, PROMPTS, args.per_file)
    drafter = _Recording(eagle)
    engine = LLMEngine(model, EngineConfig(max_batch=1, max_seq_len=2048), drafter=drafter,
                       policy=FixedGamma(args.gamma))
    by_length: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0, 0])  # steps, accepted, γ

    def on_step(rec) -> None:
        for rid, g, a in zip(rec.request_ids, rec.gammas, rec.accepted, strict=True):
            if g > 0:
                row = by_length[drafter.matched.get(rid, -1)]
                row[0], row[1], row[2] = row[0] + 1, row[1] + a, row[2] + g

    engine.step_listeners.append(on_step)
    print(decode_all(engine, prompts, 96))
    for n, (steps, accepted, gammas) in sorted(by_length.items()):
        print(f"match {n}: {steps} steps, {accepted / steps:.2f} drafts accepted of {gammas / steps:.1f}")


if __name__ == "__main__":
    main()
