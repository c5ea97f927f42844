"""Incremental detokenization and stop-string matching for one sequence."""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a decoder returns for bytes that are not (yet) a whole UTF-8 character


class IncrementalText:
    """Turns a growing list of output ids into text deltas, honouring stop strings.

    The text is what `tokenizer.decode(all ids, skip_special_tokens=True)` returns, however many
    tokens each call adds (one per plain step, several per speculative step): each call decodes the
    tokens after the last *settled* boundary with the window before it (so byte-level BPE and
    SentencePiece pieces merge as in a full decode). A boundary settles where the decoded window
    ends in a whole character. When the window ends in U+FFFD (a multi-byte character whose bytes
    are split across tokens) the characters before it are still given out, and the boundary stays
    where it was until a later token completes the character; `flush` at the end decodes what is
    left, as a full decode would (a character cut by max_tokens becomes U+FFFD there too). With stop
    strings, the last len(longest stop) - 1 characters are held back until it is clear they do not
    start a stop string.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        # vLLM's min_tokens: stop strings are looked for only once the output has more than this many
        # tokens, and only in the text new since the last look (an earlier occurrence never stops it).
        self.min_tokens = min_tokens
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all text decoded so far (truncated at a stop string once hit)
        self.matched: str | None = None  # the stop string that was hit
        self._settled = ""  # the text of output_ids[:_read_offset]: `text` is it plus the unsettled tail
        self._emitted = 0  # chars of `text` already returned
        self._prefix_offset = 0
        self._read_offset = 0
        self._ids: list[int] = []  # the output ids of the last update (flush decodes their tail)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _tail(self, final: bool) -> tuple[str, bool]:
        """(text of the ids after the settled boundary, whether it ends in a whole character). Not
        final: without the trailing U+FFFD of a character still being spelt."""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        tail = full[len(prefix):]
        whole = not tail.endswith(REPLACEMENT)
        return (tail if whole or final else tail.rstrip(REPLACEMENT)), whole

    def update(self, output_ids: list[int]) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was hit)."""
        if self.matched is not None:
            return "", True
        self._ids = output_ids
        search_from = max(0, len(self.text) - self._hold)
        tail, whole = self._tail(final=False)
        if whole and tail:  # a settled boundary: decode from here on
            self._settled += tail
            self._prefix_offset, self._read_offset = self._read_offset, len(output_ids)
            tail = ""
        self.text = self._settled + tail
        if self.stop and len(output_ids) > self.min_tokens and self._find_stop(search_from):
            return self.flush(), True
        safe_end = max(self._emitted, len(self.text) - self._hold) if self.stop else len(self.text)
        delta = self.text[self._emitted:safe_end]
        self._emitted = safe_end
        return delta, False

    def _find_stop(self, search_from: int) -> bool:
        hits = [(h, s) for s in self.stop if (h := self.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        cut, self.matched = min(hits)
        self.text = self.text[:cut]
        return True

    def flush(self) -> str:
        """The rest of the text, at the end of generation: the unsettled tail decoded as a full
        decode of every id would (U+FFFD for a character whose last bytes never came)."""
        if self.matched is None and self._ids:
            search_from = max(0, len(self.text) - self._hold)
            tail, _ = self._tail(final=True)
            self.text = self._settled + tail
            if self.stop and len(self._ids) > self.min_tokens:
                self._find_stop(search_from)
            self._ids = []
        delta = self.text[self._emitted:]
        self._emitted = len(self.text)
        return delta
