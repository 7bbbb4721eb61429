"""Scale-out on Ray Serve: engine replicas (each a :class:`stoic.Engine`) behind one
OpenAI-compatible endpoint, which is stoic's own HTTP application driving the replicas through
Serve deployment handles (docs/scale-out.md).

    async with run_replicas(EngineConfig(model="default"), ReplicaOptions(replicas=2)) as engine:
        await stoic.http.serve(engine, port=8000)

Needs the ``stoic[ray]`` extra; ``import stoic.ray`` itself does not import Ray (the names are
loaded on first use), so ``stoic serve --help`` works without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._app import HttpIngress, build_app
    from ._ingress import MigratingStream, RayEngine
    from ._launch import ReplicaOptions, engine_deployment, run_replicas
    from ._replica import EngineReplica, check_engine_health

__all__ = [
    "EngineReplica",
    "HttpIngress",
    "MigratingStream",
    "RayEngine",
    "ReplicaOptions",
    "build_app",
    "check_engine_health",
    "engine_deployment",
    "run_replicas",
]

_HOMES = {
    "HttpIngress": "._app",
    "build_app": "._app",
    "EngineReplica": "._replica",
    "check_engine_health": "._replica",
    "MigratingStream": "._ingress",
    "RayEngine": "._ingress",
    "ReplicaOptions": "._launch",
    "engine_deployment": "._launch",
    "run_replicas": "._launch",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home, __name__), name)
