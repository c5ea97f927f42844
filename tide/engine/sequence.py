"""Request and sequence bookkeeping: torch-free, so the scheduler can be reasoned about alone."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # most top alternatives per token (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one token given its prefix (log_softmax of the raw logits),
    and the `top` most likely tokens there as (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


MAX_LOGIT_BIAS = 100.0  # OpenAI's logit_bias range is [-100, 100]
MAX_PENALTY = 2.0  # OpenAI's presence / frequency penalty range is [-2, 2]
# repetition_penalty's range. vLLM takes any value > 0; the bounds keep the penalised logits finite in
# float32 (a logit of 100 divided by 1e-3 is 1e5, not inf, which would make softmax NaN).
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-3, 1e3


class GrammarKind(enum.Enum):
    """What language a constrained request's output must belong to (tide.engine.constraints)."""

    JSON_OBJECT = "json_object"  # any JSON object; `value` unused
    JSON_SCHEMA = "json_schema"  # `value`: a JSON Schema document as JSON text
    REGEX = "regex"  # `value`: a regular expression the whole output matches
    GRAMMAR = "grammar"  # `value`: a context-free grammar in the engine's grammar dialect


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    value: str = ""


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. temperature == 0 means greedy (argmax) decoding."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # The target's log-probabilities (raw distribution: before temperature / top-k / top-p) of every
    # emitted token with this many top alternatives; None = not computed. `prompt_logprobs`: the same
    # for every prompt token after the first (needs the logits of every prompt position).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Logits processing, applied to the target's logits (verification rows included) before
    # temperature / top-k / top-p and before greedy argmax; logprobs stay the raw distribution's.
    # `logit_bias`: (token id, bias) pairs added to the logits. Penalties count the output tokens
    # so far (never the prompt): presence subtracts once per distinct token, frequency per occurrence.
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's extensions. `min_tokens`: EOS (unless ignore_eos) and stop_token_ids are masked while the
    # output has fewer tokens, and stop strings are looked for only in the text of later tokens.
    # `repetition_penalty` (CTRL / HF / vLLM): the logit of every token in the prompt or the output so
    # far is divided by it when positive, multiplied when negative; 1 = off.
    # `min_p`: after temperature, tokens less probable than min_p * the most probable one's
    # probability are dropped (sampling only: greedy's argmax keeps the most probable token anyway).
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    grammar: GrammarSpec | None = None  # None = unconstrained

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        for token, bias in self.logit_bias:
            if token < 0 or not (math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias entries must be token id >= 0: bias in "
                                 f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {token}: {bias}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and abs(value) <= MAX_PENALTY):
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:  # (False for NaN)
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                             f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, no KV slot yet
    PREFILLING = "prefilling"  # has a slot, prompt partly in the cache
    RUNNING = "running"  # decoding / verifying
    FINISHED = "finished"

    def is_finished(self) -> bool:
        return self is SequenceStatus.FINISHED


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass
class Sequence:
    """One request's tokens and progress.

    Invariant while RUNNING: the target's KV cache holds `num_cached = len(token_ids) - 1`
    tokens; the last token has been sampled but not yet fed to the target (it is the first
    input of the next verification step).
    """

    request_id: str
    token_ids: list[int]
    num_prompt: int
    params: SamplingParams
    speculative: bool | None = None  # None = the γ policy decides; True = always drafts; False = never
    workload: str = ""
    arrival_s: float = 0.0
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int = -1
    num_cached: int = 0
    num_reused: int = 0  # prompt tokens whose cache entries an earlier request left (prefix cache)
    finish_reason: FinishReason | None = None
    # Speculation accounting, for the per-response `speculation` stats.
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0  # decode steps that drafted (γ > 0)
    plain_steps: int = 0  # decode steps without drafts (γ = 0)
    matched_stop: str | int | None = None  # the stop string or stop token id that ended it
    # Recent per-step history for the γ policy: (gamma, accepted) pairs, newest last.
    recent: list[tuple[int, int]] = field(default_factory=list)
    last_gamma: int = 0
    # With params.logprobs: one entry per output token; with params.prompt_logprobs: one per prompt
    # token after the first (filled as the prompt is prefilled).
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # With params.grammar: its tide.engine.constraints.GrammarMatcher at the output so far (set by the
    # engine; the EAGLE-3 drafter walks it to mask its proposals and rolls it back).
    matcher: object | None = None
    # A sampled request that draws coupled (tide.engine.sampling.position_uniform): the key of its
    # draws, its seed or one the engine chose. None: greedy, or rejection sampling.
    sample_seed: int | None = None
    # The speculation memory (tide.engine.drafters.memory) this request reads and, when it finishes
    # and `remember` holds, is added to: a scope per API key unless the operator shares one.
    memory_scope: str = ""
    remember: bool = True
    key_id: str = ""  # the API key id that sent it ("" without keys): the memory's owner tag, for forget

    RECENT_STEPS = 16  # how many steps of history a policy sees per request

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def remaining_prefill(self) -> int:
        return self.num_prompt - self.num_cached

    @property
    def accept_length(self) -> float:
        """Mean tokens emitted per speculative step, bonus included (0.0 if it never speculated)."""
        if self.verify_steps == 0:
            return 0.0
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps

    def record_step(self, gamma: int, accepted: int, drafted: int | None = None) -> None:
        """`gamma`: the most drafts the step could accept (a chain's length, a tree's depth);
        `drafted`: draft tokens verified (a tree's node count; default gamma)."""
        if gamma > 0:
            self.verify_steps += 1
        else:
            self.plain_steps += 1
        self.draft_tokens += gamma if drafted is None else drafted
        self.accepted_tokens += accepted
        self.last_gamma = gamma
        self.recent.append((gamma, accepted))
        if len(self.recent) > self.RECENT_STEPS:
            del self.recent[0]
