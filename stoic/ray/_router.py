"""The Ray Serve request router of ``--routing prefix`` (:mod:`stoic.ray._routing` ranks).

Imported by Serve in the process that holds the replicas' deployment handle (the HTTP server),
by the path :data:`~stoic.ray._routing.ROUTER_CLASS`.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from ._routing import prefix_key, rank

__all__ = ["PrefixAffinityRouter"]


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """The replica a request's prefix key prefers first, then the others (see
    :func:`~stoic.ray._routing.rank`); Serve takes the first group's replica unless it refuses
    (at ``max_ongoing_requests``), then tries the next group."""

    def initialize_state(self, epsilon: float = 0.25, **_: Any) -> None:
        self._epsilon = epsilon

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is None or not pending_request.args:
            return [candidate_replicas]
        by_id = {str(r.replica_id): r for r in candidate_replicas}
        cache = self.replica_queue_len_cache
        loads = {rid: cache.get(r.replica_id) or 0 for rid, r in by_id.items()}
        order = rank(prefix_key(pending_request.args[0]), list(by_id), loads, self._epsilon)
        groups = [[by_id[order[0]]]]
        if len(order) > 1:
            groups.append([by_id[rid] for rid in order[1:]])
        return groups
