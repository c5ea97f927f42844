"""What a training run holds in memory, and how much data a run may take under TIDE_TRAINER_MEMORY_MB.

A run holds, besides the process itself:
- fixed: the target's head as the trainer reads it (tide.target.load_head_tensors: the embedding
  and, untied, the lm_head in float32; plus the greedy head's bf16 weight and its packed copy),
  the draft's trainable parameters with their gradients and AdamW's two moments (4 float32 values
  each), and one batch's activations (`ACTIVATION_ROW_BYTES` per packed token position);
- per token of data: what a loaded piece keeps (services.trainer.training.data.Piece): the aux
  states (3 x hidden) and the final state (hidden) in bf16, and four small per-row tensors.

`plan` gives the most tokens a run may load so that fixed + tokens x per-token stays within the
budget; a cycle takes its oldest buffered chunks up to that (the rest stay buffered for the next
run), and refuses to start a run whose fixed part alone does not fit, naming both numbers. At the
reference model's size (hidden 576, 49152 tokens, an 8192-token draft vocabulary, 8 x 512-token
batches) the fixed part is 2.5 GiB (2.1 of it activations) and a token 4.5 KiB; at Llama 3.1 8B's
(hidden 4096, 128k tokens) 16.7 GiB and 32 KiB. The activation term is an upper estimate from the
tensors a step makes, not calibrated against a measured peak; the trainer's RSS is reported apart
(the status page, benchmarks.model_sizes) to check it against.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20
DEFAULT_BUDGET_SHARE = 0.5  # of the memory available when a run starts, where TIDE_TRAINER_MEMORY_MB is unset
# A packed token position's activations in one training step and unroll step, in bytes: the draft
# logits over the draft vocabulary with their softmax, gradient and soft targets (float32), and the
# layer's hidden-sized intermediates; an upper estimate, not an exact count (see the module doc).
ACTIVATION_ROW_BYTES_PER_VOCAB = 4 * 4  # logits, probabilities, their gradient, soft targets
ACTIVATION_ROW_BYTES_PER_HIDDEN = 4 * 24  # ~24 float32 hidden-sized vectors per position and unroll step
PIECE_ROW_BYTES = 8 + 8 + 1 + 8  # input id, position, loss mask, greedy token


@dataclass(frozen=True)
class RunMemory:
    """Bytes a run holds whatever its data (`fixed_bytes`), and per token of data it loads."""

    fixed_bytes: int
    per_token_bytes: int
    parts: dict[str, int]  # the fixed part's components, bytes (for the refusal's message and logs)

    def max_tokens(self, budget_bytes: int) -> int:
        return max(0, (budget_bytes - self.fixed_bytes) // self.per_token_bytes)

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / MiB:.0f}" for k, v in self.parts.items())
        return f"{self.fixed_bytes / MiB:.0f} MiB fixed ({parts}) + {self.per_token_bytes / 1024:.1f} KiB a token"


def draft_parameters(target_config: dict, draft_vocab: int) -> int:
    """Trainable parameters of the EAGLE-3 draft for this target (built on the meta device)."""
    import torch

    from tide.eagle3 import Eagle3Config, Eagle3Draft

    cfg = Eagle3Config.for_target(target_config, draft_vocab_size=draft_vocab)
    with torch.device("meta"):
        draft = Eagle3Draft(cfg)
    return sum(p.numel() for p in draft.parameters())


def run_memory(target_config: dict, draft_vocab: int, batch_rows: int, max_len: int, ttt_steps: int = 3) -> RunMemory:
    from tide.eagle3.config import target_facts

    facts = target_facts(target_config)
    hidden, vocab = facts.hidden_size, facts.vocab_size
    draft_vocab = min(draft_vocab, vocab)
    tied = bool(target_config.get("tie_word_embeddings", False))
    head = (1 if tied else 2) * vocab * hidden * 4 + 2 * vocab * hidden * 2  # float32 tables + bf16 greedy head
    params = draft_parameters(target_config, draft_vocab) * 4 * 4  # weights, gradients, AdamW's m and v
    rows = batch_rows * max_len * ttt_steps
    activations = rows * (draft_vocab * ACTIVATION_ROW_BYTES_PER_VOCAB + hidden * ACTIVATION_ROW_BYTES_PER_HIDDEN)
    per_token = 4 * hidden * 2 + PIECE_ROW_BYTES  # aux (3 x hidden) + final, bf16
    parts = {"target head": head, "draft + optimizer": params, "activations": activations}
    return RunMemory(head + params + activations, per_token, parts)


def take_within(entries: list, max_tokens: int) -> list:
    """The oldest entries whose tokens add up to at most `max_tokens` (at least one is never forced:
    a chunk larger than the whole allowance is left for an operator to see, not loaded over budget)."""
    out, total = [], 0
    for e in entries:
        if total + e.num_tokens > max_tokens:
            break
        out.append(e)
        total += e.num_tokens
    return out
