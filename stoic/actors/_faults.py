"""Fault injection into executor steps (off unless the engine enables it)."""

from __future__ import annotations

import random
import threading
import time

import torch

from ..config import FaultSpec

__all__ = ["FaultInjector", "InjectedFault"]


class InjectedFault(RuntimeError):
    """The ``"error"`` kind: a plain RuntimeError raised inside the step."""


class FaultInjector:
    """Decides, step by step, whether the step fails and how. Thread-safe: specs are set from the
    event loop and consulted in the executor's worker thread.
    """

    def __init__(self, specs: tuple[FaultSpec, ...] = ()) -> None:
        self._lock = threading.Lock()
        self._armed: list[tuple[FaultSpec, int, random.Random | None]] = []
        self.injected = 0
        for spec in specs:
            self.add(spec)

    def add(self, spec: FaultSpec) -> None:
        with self._lock:
            rng = random.Random(spec.seed) if spec.probability is not None else None
            self._armed.append((spec, spec.after_steps or 0, rng))

    def clear(self) -> None:
        with self._lock:
            self._armed.clear()

    def before_step(self) -> None:
        """Called in the worker thread before each forward pass; raises or blocks on a fault."""
        if not self._armed:
            return
        fire: FaultSpec | None = None
        with self._lock:
            keep: list[tuple[FaultSpec, int, random.Random | None]] = []
            for spec, countdown, rng in self._armed:
                if rng is not None:
                    if fire is None and rng.random() < float(spec.probability or 0.0):
                        fire = spec
                    keep.append((spec, countdown, rng))
                elif countdown <= 1 and fire is None:
                    fire = spec  # after_steps: fires once, then disarmed
                else:
                    keep.append((spec, countdown - 1, rng))
            self._armed = keep
            if fire is not None:
                self.injected += 1
        if fire is None:
            return
        match fire.kind:
            case "oom":
                raise torch.OutOfMemoryError("injected fault: CUDA out of memory (simulated)")
            case "error":
                raise InjectedFault("injected fault: executor error")
            case "hang":
                time.sleep(fire.seconds)
