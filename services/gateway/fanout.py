"""Fan-in of the `n` choices' engine streams into one, and speculation stats summed over choices."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from services.gateway.engine_client import EngineClient, GenerationFinal, GenerationRequest, TokenDelta
from tide.speculation import SpeculationStats

Event = TokenDelta | GenerationFinal


async def merged(engine: EngineClient, requests: list[GenerationRequest]) -> AsyncIterator[tuple[int, Event]]:
    """Events of all choices as they come, tagged with the choice index. Closing this (or
    cancelling its consumer) closes every choice's stream, which cancels them upstream."""
    if len(requests) == 1:
        async with contextlib.aclosing(engine.generate(requests[0])) as stream:
            async for event in stream:
                yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, req: GenerationRequest) -> None:
        try:
            async with contextlib.aclosing(engine.generate(req)) as stream:
                async for event in stream:
                    queue.put_nowait((index, event))
            queue.put_nowait((index, done))
        except Exception as err:
            queue.put_nowait((index, err))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def aggregate_speculation(stats: list[SpeculationStats]) -> SpeculationStats:
    """Totals over the choices; accept_length is the verify-step-weighted mean; draft versions and
    drafters are the distinct non-empty ones, sorted and comma-joined."""
    steps = sum(s.verify_steps for s in stats)
    if steps:
        accept_length = sum(s.accept_length * s.verify_steps for s in stats) / steps
    else:
        spec = [s.accept_length for s in stats if s.accept_length > 0]
        accept_length = sum(spec) / len(spec) if spec else 0.0
    versions = sorted({s.draft_version for s in stats if s.draft_version})
    drafters = sorted({s.drafter for s in stats if s.drafter})
    return SpeculationStats(
        accept_length=accept_length,
        draft_tokens=sum(s.draft_tokens for s in stats),
        accepted_tokens=sum(s.accepted_tokens for s in stats),
        verify_steps=steps,
        plain_steps=sum(s.plain_steps for s in stats),
        draft_version=",".join(versions),
        drafter=",".join(drafters),
    )
