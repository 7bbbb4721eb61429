"""Load generator: C closed-loop streaming clients against an OpenAI-compatible
``/v1/chat/completions`` endpoint (aiohttp, SSE parsing), and the statistics of one pass."""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from .report import quantile


@dataclass
class RequestRecord:
    ok: bool
    start: float
    e2e: float
    ttft: float | None = None
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str | None = None
    status: int | None = None  # the HTTP status (None: no response)
    finish_reason: str | None = None  # the last one a choice carried
    retry_after: str | None = None  # a refusal's ``Retry-After`` header
    retry_after_s: float | None = None  # its wait in seconds (``retry-after-ms`` if sent)


@dataclass
class Result:
    system: str
    concurrency: int
    planned: int
    records: list[RequestRecord]
    seconds: float
    other_cpu: float | None = None  # share of the machine's CPU used by other processes
    note: str = ""
    # per server thread: (OS thread id, share of wall on a CPU, share runnable but waiting)
    sched: list[tuple[int, float, float]] = field(default_factory=list)
    steps: dict[str, Any] | None = None  # stoic's step timings (see timed_serve)
    steps_wall: float | None = None  # the window they cover (default: the whole pass)

    @property
    def execute_share(self) -> float | None:
        """Share of the wall time stoic's executor spent inside ``ModelRunner.execute``."""
        if not self.steps:
            return None
        wall = float(self.steps.get("window_s") or self.steps_wall or self.seconds)
        return float(self.steps["execute_s"]) / wall if wall else None

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]

    @property
    def errors(self) -> int:
        return len(self.records) - len(self.ok)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.ok)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def requests_per_s(self) -> float:
        return len(self.ok) / self.seconds if self.seconds else 0.0

    def ttft(self, q: float) -> float | None:
        return quantile([r.ttft for r in self.ok if r.ttft is not None], q)

    def itl(self, q: float) -> float | None:
        return quantile([x for r in self.ok for x in r.itls], q)

    def tpot(self, q: float) -> float | None:
        values = [
            (r.e2e - r.ttft) / (r.output_tokens - 1)
            for r in self.ok
            if r.ttft is not None and r.output_tokens > 1
        ]
        return quantile(values, q)

    def e2e(self, q: float) -> float | None:
        return quantile([r.e2e for r in self.ok], q)

    def summary(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "concurrency": self.concurrency,
            "requests": len(self.ok),
            "planned": self.planned,
            "errors": self.errors,
            "output_tokens": self.output_tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "requests_per_s": round(self.requests_per_s, 3),
            "ttft_p50": self.ttft(0.5),
            "ttft_p90": self.ttft(0.9),
            "ttft_p99": self.ttft(0.99),
            "itl_p50": self.itl(0.5),
            "itl_p99": self.itl(0.99),
            "tpot_p50": self.tpot(0.5),
            "e2e_p50": self.e2e(0.5),
            "e2e_p99": self.e2e(0.99),
            "other_cpu": self.other_cpu,
            "first_error": next((r.error for r in self.records if r.error), None),
            "note": self.note,
        }


#: every pooled connection may be stale at once: one retry per client, plus the first try
_STALE_RETRIES = 33


async def _post(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    limit_s: float,
    headers: dict[str, str] | None = None,
) -> aiohttp.ClientResponse:
    """POST, retried on another connection while kept-alive ones turn out closed.

    Servers may close idle or much-used keep-alive connections (llama.cpp's cpp-httplib closes
    each after 5 requests); aiohttp then fails the next request on that connection before
    anything was sent ("Can not write request body"), which says nothing about the server.
    """
    timeout = aiohttp.ClientTimeout(total=limit_s)
    for _ in range(_STALE_RETRIES):
        try:
            return await session.post(url, json=body, timeout=timeout, headers=headers)
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
            continue  # that connection is dropped from the pool; the next try takes another
    return await session.post(url, json=body, timeout=timeout, headers=headers)


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    limit_s: float,
    headers: dict[str, str] | None = None,
) -> RequestRecord:
    start = time.perf_counter()
    rec = RequestRecord(ok=False, start=start, e2e=0.0)
    usage_tokens: int | None = None
    chunks = 0
    last = 0.0
    try:
        async with await _post(session, url, body, limit_s, headers) as resp:
            rec.status = resp.status
            if resp.status != 200:
                rec.retry_after = resp.headers.get("Retry-After")
                ms = resp.headers.get("retry-after-ms")
                rec.retry_after_s = float(ms) / 1000 if ms else _seconds(rec.retry_after)
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                rec.e2e = time.perf_counter() - start
                return rec
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if "error" in event:
                    rec.error = json.dumps(event["error"])[:200]
                    break
                usage = event.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                for choice in event.get("choices") or ():
                    if choice.get("finish_reason"):
                        rec.finish_reason = choice["finish_reason"]
                    if (choice.get("delta") or {}).get("content"):
                        chunks += 1
                        if rec.ttft is None:
                            rec.ttft = now - start
                        else:
                            rec.itls.append(now - last)
                        last = now
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    rec.e2e = time.perf_counter() - start
    rec.output_tokens = usage_tokens if usage_tokens is not None else chunks
    rec.ok = rec.error is None and rec.output_tokens > 0
    return rec


def _seconds(header: str | None) -> float | None:
    """A ``Retry-After`` header's seconds (None for a date or nothing)."""
    try:
        return float(header) if header is not None else None
    except ValueError:
        return None


async def run_load(
    url: str,
    bodies: Sequence[dict[str, Any]],
    concurrency: int,
    *,
    budget: float,
    request_timeout: float = 300.0,
    headers: dict[str, str] | None = None,
    backoff: bool = False,
) -> tuple[list[RequestRecord], float]:
    """C closed-loop clients over ``bodies`` in order; no new request starts after ``budget`` s.
    ``headers`` go with every request (e.g. a tenant's). With ``backoff``, a client refused
    (429, 503) waits what the refusal's ``retry-after-ms`` / ``Retry-After`` says before its
    next request, as the OpenAI SDKs do.

    Returns the records and the wall time from the first request to the last response.
    """
    queue = collections.deque(bodies)
    records: list[RequestRecord] = []
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()

        async def client() -> None:
            while queue and time.perf_counter() - start < budget:
                body = queue.popleft()
                rec = await one_request(session, url, body, request_timeout, headers)
                records.append(rec)
                if backoff and rec.status in (429, 503) and rec.retry_after_s:
                    # as the OpenAI SDKs do: wait what the refusal says (within the budget)
                    left = budget - (time.perf_counter() - start)
                    await asyncio.sleep(max(0.0, min(rec.retry_after_s, left)))

        await asyncio.gather(*(client() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return records, seconds
