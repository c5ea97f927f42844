"""Output constraints: a GrammarSpec compiled against the target's tokenizer, and per-sequence matchers.

Backed by llguidance (chosen over xgrammar by measurement on the serving CPU: grammars compile in
about a millisecond instead of up to 850 ms, masks take ~10-20 us a token, 8 MB installed against
1 GB; docs/results/structured-outputs). The tokenizer's token table is built once per compiler (one
per engine, ~0.2 s, lazily at the first constrained request); compiled grammars are cached per spec
(LRU). Compiling is thread-safe: the worker compiles on the request's thread, before the request
reaches the engine thread, so a bad schema is refused up front and the loop never pays for it.

A matcher tracks one sequence's output: `allowed()` is the mask of tokens the grammar allows next
(EOS only where the output so far is complete), `accept` advances it, `rollback` undoes the last n
accepted tokens (speculation: the engine walks the drafts to mask each verification row, then rolls
back and accepts what was really emitted), `validate` counts how many tokens of a draft chain the
grammar allows without changing the state.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from tide.engine.sequence import GrammarKind, GrammarSpec

log = logging.getLogger(__name__)

# JSON is generated with fixed separators (json.dumps' defaults, the style small models write):
# flexible whitespace would let a model pad with spaces or newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 128  # compiled grammars kept per compiler (each is the grammar's text: a few KB)


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated grammar for one tokenizer; `matcher()` starts a sequence at its beginning."""

    spec: GrammarSpec
    grammar: str  # llguidance's serialized grammar
    compile_ms: float  # what compiling took for this request: 0 when it came from the cache
    _compiler: GrammarCompiler

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._compiler, self.grammar)


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer. `vocab_size` is the target's logits width (may exceed
    the tokenizer's: ids past it are never allowed); `eos_ids` the tokens that may end a complete output."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int], cache_size: int = CACHE_SIZE) -> None:
        if tokenizer is None:
            raise ValueError("output constraints need the target's tokenizer, and this engine has none")
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._tokenizer = None  # llguidance.LLTokenizer, built at the first compile
        self._cache: collections.OrderedDict[GrammarSpec, CompiledGrammar] = collections.OrderedDict()

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = _ll_tokenizer(self._hf, self.vocab_size, tuple(self.eos_ids))
            return self._tokenizer

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar of `spec` (cached); raises ValueError with the reason when the
        schema / regex / grammar is invalid."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return dataclasses.replace(hit, compile_ms=0.0)  # this request compiled nothing
        import llguidance

        tokenizer = self.ll_tokenizer
        t0 = time.perf_counter()
        try:
            grammar = _grammar_text(spec)
            # Validating builds the grammar against the tokenizer once: the work a matcher does.
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        except (ValueError, TypeError, RuntimeError) as e:
            raise ValueError(f"invalid {spec.kind.value} constraint: {e}") from None
        if is_error:
            raise ValueError(f"invalid {spec.kind.value} constraint: {messages[0].strip()}")
        compiled = CompiledGrammar(spec, grammar, (time.perf_counter() - t0) * 1e3, self)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled


# llguidance token tables per (HF tokenizer, vocab size, EOS ids): ~0.2 s each to build, shared by
# every compiler (engine) over the same tokenizer object.
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TABLES_LOCK = threading.Lock()


def _ll_tokenizer(hf_tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
    import llguidance.hf

    with _TABLES_LOCK:
        per = _TABLES.setdefault(hf_tokenizer, {})
        table = per.get((vocab_size, eos_ids))
        if table is None:
            t0 = time.perf_counter()
            table = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))
            per[(vocab_size, eos_ids)] = table
            log.info("grammar token table built in %.0f ms", (time.perf_counter() - t0) * 1e3)
        return table


def _grammar_text(spec: GrammarSpec) -> str:
    import llguidance

    match spec.kind:
        case GrammarKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        case GrammarKind.JSON_SCHEMA:
            try:
                schema = json.loads(spec.value)
            except json.JSONDecodeError as e:
                raise ValueError(f"not JSON ({e})") from None
            if not isinstance(schema, dict):
                raise ValueError("the schema must be a JSON object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        case GrammarKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(spec.value)
        case GrammarKind.GRAMMAR:  # Lark syntax (llguidance's dialect, which GBNF converts to)
            return llguidance.LLMatcher.grammar_from_lark(spec.value)
    raise ValueError(f"unknown constraint kind {spec.kind}")


class GrammarMatcher:
    """One sequence's position in its grammar. Not thread-safe: the engine thread owns it."""

    def __init__(self, compiler: GrammarCompiler, grammar: str) -> None:
        import llguidance

        self.vocab_size = compiler.vocab_size
        self.eos_ids = frozenset(compiler.eos_ids)
        # EOS is kept out of llguidance: a consumed EOS is not counted by its rollback, which would
        # then undo one real token too many. Here an accepted EOS just ends the matcher.
        self._ended = False
        self._m = llguidance.LLMatcher(compiler.ll_tokenizer, grammar)
        if self._m.is_error():  # validated at compile time; this is a bug, not a bad request
            raise RuntimeError(f"grammar matcher failed: {self._m.get_error()}")
        # One bit per token in int32 words (llguidance's layout, little-endian bit order).
        self._words = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)

    def allowed(self) -> torch.Tensor:
        """bool [vocab_size]: the tokens the grammar allows next (only EOS once it is complete and
        cannot continue)."""
        if self._ended:
            return torch.zeros(self.vocab_size, dtype=torch.bool)
        self._m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")[:self.vocab_size]
        return torch.from_numpy(bits.view(np.bool_))

    def accept(self, token: int) -> bool:
        """Advance by one token; False (and the matcher unusable) if the grammar forbids it."""
        if self._ended:
            return False
        if token in self.eos_ids:
            self._ended = self._m.is_accepting()
            return self._ended
        return self._m.consume_token(token)

    def validate(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar allows from here (the state is not changed); an
        allowed EOS is the last one counted (nothing follows it)."""
        if self._ended or not tokens:
            return 0
        end = next((j for j, t in enumerate(tokens) if t in self.eos_ids), len(tokens))
        k = self._m.validate_tokens(tokens[:end]) if end else 0
        if k < end or end == len(tokens):
            return k
        if not self._m.consume_tokens(tokens[:end]):  # validated above
            raise RuntimeError(f"grammar matcher refused validated tokens: {self._m.get_error()}")
        complete = self._m.is_accepting()
        self.rollback(end)
        return end + 1 if complete else end

    def rollback(self, n: int) -> None:
        if n > 0 and self._ended:
            self._ended = False
            n -= 1
        if n > 0 and not self._m.rollback(n):
            raise RuntimeError(f"grammar matcher could not roll back {n} tokens: {self._m.get_error()}")

    @property
    def ended(self) -> bool:
        """An EOS was accepted: nothing may follow (the mask is empty)."""
        return self._ended

    @property
    def is_complete(self) -> bool:
        """The output so far is a complete sentence of the grammar (EOS is allowed here)."""
        return self._m.is_accepting()

    @property
    def is_terminated(self) -> bool:
        """Nothing but EOS may follow (the grammar is complete and cannot be extended), or EOS was accepted."""
        return self._ended or self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()
