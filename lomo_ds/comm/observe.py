"""Where the transports that bypass deepspeed.comm and torch.distributed (the shared-memory ones)
report what they carry, so that a profiler counts them as the collectives they replace
(lomo_ds.profiling.count_comm subscribes here). Nobody listening: a report costs a loop over
an empty list."""
from __future__ import annotations

from typing import Callable

Observer = Callable[[str, int], None]  # (the collective replaced, bytes this rank sent)
_observers: list[Observer] = []


def record(op: str, nbytes: int) -> None:
    """One collective carried outside deepspeed.comm and torch.distributed."""
    for observer in _observers:
        observer(op, nbytes)


def subscribe(observer: Observer) -> None:
    _observers.append(observer)


def unsubscribe(observer: Observer) -> None:
    _observers.remove(observer)
