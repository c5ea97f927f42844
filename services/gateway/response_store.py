"""Stored responses for the Responses API: what `previous_response_id` continues and GET retrieves.

Each entry keeps a finished response and its conversation (the chat messages a next turn starts from:
every earlier turn's input and output, without `instructions`, which OpenAI does not carry over).
Bounded two ways, so that clients cannot grow the gateway without end: entries expire `ttl_s` after
they were stored, and the entries' sizes (their JSON, in bytes) stay within `max_bytes`, the oldest
evicted first. In memory, per gateway process: a restart forgets them, and behind several gateways
a client must keep its turns on one (or send the whole conversation with `store: false`).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object as returned
    conversation: list[dict]  # chat messages ({role, content, tool_calls?, tool_call_id?})
    input_items: list[dict]  # this turn's input items, with ids (GET /v1/responses/{id}/input_items)
    size: int  # bytes of both as JSON
    expires_at: float  # time.monotonic() seconds


class ResponseStore:
    def __init__(self, max_bytes: int, ttl_s: float, clock=time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self._bytes = 0
        self._lock = threading.Lock()
        self.evicted = 0  # entries dropped for space or age

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, response: dict, conversation: list[dict], input_items: list[dict] = ()) -> bool:
        """Store a response; False when it alone is larger than the whole budget (it is not kept)."""
        input_items = list(input_items)
        size = sum(len(json.dumps(part, ensure_ascii=False)) for part in (response, conversation, input_items))
        if size > self.max_bytes:
            return False
        entry = StoredResponse(response, conversation, input_items, size, self.clock() + self.ttl_s)
        with self._lock:
            self._drop(response_id)
            self._entries[response_id] = entry
            self._bytes += size
            self._expire()
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
                self.evicted += 1
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            self._expire()
            return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True

    def _expire(self) -> None:
        now = self.clock()
        while self._entries:
            oldest_id, oldest = next(iter(self._entries.items()))
            if oldest.expires_at > now:
                break
            self._drop(oldest_id)
            self.evicted += 1
