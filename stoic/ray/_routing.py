"""Prefix-aware routing: a request goes to the replica most likely to hold its prompt's prefix
in its prefix cache, bounded by load.

Requests that share a long system prompt or document share their first KV blocks; routed by
load alone they land on every replica in turn, and each replica prefills the same prefix again.
:func:`rank` puts the replicas in order for a request by *rendezvous hashing* of its prefix key
(:func:`prefix_key`: the same key always prefers the same replica, and a replica joining or
leaving moves only the keys it wins or held), with *bounded loads* (consistent hashing with
bounded loads, Mirrokni, Thorup and Zadimoghaddam 2018): a replica whose ongoing requests exceed
``(1 + epsilon)`` times the mean (plus one) is moved behind the others, so a popular prefix
spreads before it overloads one replica.

Why hashing rather than the replicas' reports of what they cache: the router needs no message
per request and no state that a replica's death invalidates, and the same prefix keeps landing
where its blocks were computed; what a replica evicted under pressure it computes again, as any
replica would.

:class:`PrefixAffinityRouter` is the Ray Serve request router (``--routing prefix``) that applies
it; the ranking itself needs no Ray.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["PREFIX_CHARS", "ROUTER_CLASS", "ROUTINGS", "prefix_key", "rank"]

#: ``--routing``'s choices: Serve's own power-of-two-choices on load, or by prefix
ROUTINGS = ("least-loaded", "prefix")
#: what a deployment's ``request_router_config`` names for ``--routing prefix``
ROUTER_CLASS = "stoic.ray._router:PrefixAffinityRouter"

#: how much of a prompt keys its replica: enough to tell system prompts and documents apart,
#: little enough that requests sharing a long prefix with different questions share the key
PREFIX_CHARS = 1024


def prefix_key(request: Any) -> bytes:
    """The routing key of ``request`` (a :class:`~stoic.request.Request`): a digest of the first
    :data:`PREFIX_CHARS` characters of its prompt (text; token ids as numbers) or of its chat
    messages as JSON, in order."""
    prompt = getattr(request, "prompt", None)
    messages = getattr(request, "messages", None)
    if isinstance(prompt, str):
        text = prompt
    elif prompt is not None:
        text = " ".join(str(t) for t in list(prompt)[: PREFIX_CHARS // 4])
    elif messages is not None:
        text = json.dumps(list(messages), sort_keys=True, default=str)
    else:
        text = ""
    return hashlib.blake2b(text[:PREFIX_CHARS].encode(), digest_size=16).digest()


def _score(key: bytes, replica: str) -> bytes:
    return hashlib.blake2b(key + replica.encode(), digest_size=8).digest()


def rank(
    key: bytes, replicas: Sequence[str], loads: Mapping[str, int], epsilon: float = 0.25
) -> list[str]:
    """``replicas`` in the order a request with ``key`` should try them: by rendezvous score,
    those whose ``loads`` (ongoing requests; missing: 0) exceed the bound ``(1 + epsilon) *
    (mean + 1)`` after the rest, in score order too."""
    by_score = sorted(replicas, key=lambda r: _score(key, r), reverse=True)
    if not by_score:
        return []
    mean = sum(loads.get(r, 0) for r in by_score) / len(by_score)
    bound = (1.0 + epsilon) * (mean + 1.0)
    under = [r for r in by_score if loads.get(r, 0) <= bound]
    return under + [r for r in by_score if loads.get(r, 0) > bound]
