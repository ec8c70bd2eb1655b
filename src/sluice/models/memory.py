"""The memory guard's arithmetic: which idle models make room for a load, or why none can.

Pure (no llama.cpp, no event loop): the registry gives it the models that
hold memory now and the bytes the new load needs.

Example::

    victims = plan_room("gemma", need, holders, budget=8 * 2**30, max_loaded=4,
                        available=mem_available())
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, TypeVar

from sluice.core.errors import InsufficientMemory, ModelTooLarge, ServerBusy
from sluice.core.model import ModelSpec

# A model in use is usually idle again within one response: worth a retry soon.
RETRY_AFTER = 5


class Holder(Protocol):
    """A model that holds memory: loaded, or loading."""

    @property
    def spec(self) -> ModelSpec: ...

    def held(self) -> int:
        """Bytes it holds or is about to hold."""
        ...

    def idle(self) -> bool:
        """Loaded with nothing in flight: it may be unloaded to make room."""
        ...

    def last_used(self) -> float:
        """Monotonic time of its last use (least recently used goes first)."""
        ...

    def activity(self) -> str:
        """What it is doing, for messages ("loading", "2 requests in flight")."""
        ...


H = TypeVar("H", bound=Holder)


def mem_available(path: Path = Path("/proc/meminfo")) -> int | None:
    """Linux's ``MemAvailable`` in bytes; ``None`` where it cannot be read."""
    try:
        with path.open() as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def size_text(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def plan_room(
    name: str,
    need: int,
    holders: Sequence[H],
    *,
    budget: int,
    max_loaded: int,
    available: int | None,
) -> list[H]:
    """The idle holders to unload (least recently used first) so that ``need`` fits
    the budget, the available RAM and the loaded-model limit.

    Raises :class:`ModelTooLarge` if it exceeds the whole budget,
    :class:`InsufficientMemory` if busy models hold the memory it needs, and
    :class:`ServerBusy` if every loaded model is busy at the model limit.
    """
    if need > budget:
        raise ModelTooLarge(
            f"Model '{name}' needs {size_text(need)} of memory, more than the whole "
            f"budget of {size_text(budget)} (--memory-budget-mb), even with every "
            "other model unloaded.",
            param="model",
        )
    idle = sorted((h for h in holders if h.idle()), key=lambda h: h.last_used())
    used = sum(h.held() for h in holders)
    victims: list[H] = []
    freed = 0
    while True:
        over_budget = used - freed + need > budget
        over_ram = available is not None and need > available + freed
        over_count = len(holders) - len(victims) + 1 > max_loaded
        if not (over_budget or over_ram or over_count):
            return victims
        if not idle:
            break
        victim = idle.pop(0)
        victims.append(victim)
        freed += victim.held()
    busy = [h for h in holders if h not in victims]
    if over_budget or over_ram:
        raise InsufficientMemory(
            _memory_message(name, need, used - freed, budget, available, busy),
            retry_after=RETRY_AFTER,
        )
    names = ", ".join(f"'{h.spec.name}' ({h.activity()})" for h in busy)
    raise ServerBusy(
        f"Cannot load '{name}': {max_loaded} models are loaded, the limit "
        f"set by --max-loaded-models, and all are in use: {names}. Retry later, or "
        "unload one.",
        retry_after=RETRY_AFTER,
    )


def _memory_message(
    name: str,
    need: int,
    used: int,
    budget: int,
    available: int | None,
    busy: Sequence[Holder],
) -> str:
    holders = ", ".join(f"'{h.spec.name}' ({size_text(h.held())}, {h.activity()})" for h in busy)
    if used + need > budget:
        where = f"the memory budget is {size_text(budget)} and {size_text(used)} of it is held"
    else:
        where = f"only {size_text(available or 0)} of RAM is available, with memory held"
    return (
        f"Cannot load '{name}' (needs {size_text(need)}): {where} by models in use: "
        f"{holders or 'none'}. Retry when they are idle, or unload one."
    )
