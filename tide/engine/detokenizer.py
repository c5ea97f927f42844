"""Incremental detokenization and stop-string matching for one sequence."""

from __future__ import annotations


class IncrementalText:
    """Turns a growing list of output ids into text deltas, honouring stop strings.

    Each call decodes only the tokens since the last complete decode plus the previous window
    (so byte-level BPE pieces merge correctly), and waits while the text ends in U+FFFD (a
    multi-byte character split across tokens). With stop strings, the last len(longest stop) - 1
    characters are held back until it is clear they do not start a stop string.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all text decoded so far (truncated at a stop string once hit)
        self.matched: str | None = None  # the stop string that was hit
        self._emitted = 0  # chars of `text` already returned
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, output_ids: list[int]) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was hit)."""
        prefix = self._decode(output_ids[self._prefix_offset:self._read_offset])
        full = self._decode(output_ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            search_from = max(0, len(self.text) - self._hold)
            self.text += full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(output_ids)
            if self.stop:
                hits = [(h, s) for s in self.stop if (h := self.text.find(s, search_from)) >= 0]
                if hits:
                    cut, self.matched = min(hits)
                    self.text = self.text[:cut]
                    return self.flush(), True
        safe_end = max(self._emitted, len(self.text) - self._hold) if self.stop else len(self.text)
        delta = self.text[self._emitted:safe_end]
        self._emitted = safe_end
        return delta, False

    def flush(self) -> str:
        """The rest of the text, at the end of generation."""
        delta = self.text[self._emitted:]
        self._emitted = len(self.text)
        return delta
