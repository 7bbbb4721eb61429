"""A scriptable stand-in for :class:`stoic.Engine`, for failure paths the real engine cannot be
made to take on demand (overload, a failed engine, an unexpected exception)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import structlog

from stoic import Delta, EngineConfig, EngineStats, FaultSpec, Health, Request
from stoic.errors import EngineFailed, PartialOutput


class FakeStream:
    """Yields ``tokens`` one-character deltas ("a", "b", ...), then finishes or raises ``error``;
    with a ``script``, yields its pieces as deltas and finishes with ``script_finish``."""

    def __init__(
        self,
        request_id: str,
        tokens: int,
        error: BaseException | None,
        delay: float = 0.0,
        script: tuple[str, ...] | None = None,
        script_finish: str = "stop",
    ) -> None:
        self.request_id = request_id
        self.prompt_tokens = 3
        self.cached_tokens = 0
        self.closed = False
        self._tokens = tokens
        self._error = error
        self._delay = delay
        self._script = script
        self._script_finish = script_finish

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._run()

    async def _run(self) -> AsyncIterator[Delta]:
        if self._script is not None:
            for i, piece in enumerate(self._script):
                yield Delta(
                    request_id=self.request_id,
                    text=piece,
                    token_ids=(i,),
                    logprobs=None,
                    finish_reason=self._script_finish if i == len(self._script) - 1 else None,
                    prompt_tokens=self.prompt_tokens,
                    completion_tokens=i + 1,
                )
            return
        for i in range(self._tokens):
            await asyncio.sleep(self._delay)
            last = i == self._tokens - 1 and self._error is None
            yield Delta(
                request_id=self.request_id,
                text=chr(ord("a") + i % 26),
                token_ids=(i,),
                logprobs=None,
                finish_reason="length" if last else None,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=i + 1,
            )
        if self._error is not None:
            raise self._error

    async def aclose(self) -> None:
        self.closed = True


@dataclass
class FakeEngine:
    """Scriptable: ``submit_error`` is raised by submit, ``stream_error`` after the tokens."""

    model_name: str = "fake-model"
    max_model_len: int = 128
    chat_template: str | None = None
    kv_sizing: None = None  # as behind Ray: no one process sized a cache
    #: the text pieces every stream yields (instead of ``tokens`` letters)
    script: tuple[str, ...] | None = None
    #: how a script ends ("length": as if max_tokens cut it)
    script_finish: str = "stop"
    #: the request of each admitted submit call
    submitted: list[Request] = field(default_factory=list)
    config: EngineConfig = field(default_factory=lambda: EngineConfig(model="fake"))
    tokens: int = 4
    #: seconds between two deltas
    delay: float = 0.0
    submit_error: BaseException | None = None
    stream_error: BaseException | None = None
    health_state: Health = field(default_factory=lambda: Health("serving"))
    streams: list[FakeStream] = field(default_factory=list)
    #: the structlog context variables seen by each submit call
    contexts: list[dict[str, Any]] = field(default_factory=list)
    failed: asyncio.Event = field(default_factory=asyncio.Event)

    async def submit(self, request: Request) -> FakeStream:
        self.contexts.append(structlog.contextvars.get_contextvars())
        request.params.validate()
        if self.submit_error is not None:
            raise self.submit_error
        self.submitted.append(request)
        stream = FakeStream(
            request.request_id,
            self.tokens,
            self.stream_error,
            self.delay,
            self.script,
            self.script_finish,
        )
        self.streams.append(stream)
        return stream

    def stats(self) -> EngineStats:
        """An engine serving nothing; a fake has no model, so no ``stoic_model_info``."""
        return dataclasses.replace(
            EngineStats.idle("serving", token_budget=256), kv_blocks_total=64
        )

    def health(self) -> Health:
        return self.health_state

    async def inject_fault(self, spec: FaultSpec) -> None:
        pass

    async def clear_faults(self) -> None:
        pass

    async def wait_failed(self) -> EngineFailed:
        await self.failed.wait()
        return EngineFailed("engine failed: fake")


def partial(text: str) -> PartialOutput:
    return PartialOutput(text=text, token_ids=tuple(range(len(text))))
