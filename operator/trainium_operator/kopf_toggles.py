"""kopf's start-up barrier made linear in the objects it indexes.

kopf holds every handler back until each indexed object has been indexed once (its
``operator_indexed`` ToggleSet, kopf._core.reactor.queueing/processing): the watch adds a toggle
per object, each object's worker drops its toggle once indexed and then waits for the set to
turn on. kopf 1.45 (and its main branch) wakes every waiter on every add and drop, so N indexed
objects cost about N x N wake-ups: at 4,096 nodes and 4,096 pods a restarted operator made no
pass for more than 12 minutes (bench/operator_scale.py --finished at 16 x 256; bench/kopf_toggles.py
measures the barrier alone). A waiter waits for the set's state (on or off); a membership change
that leaves the state as it was wakes no one, so only a change of state notifies here. A
toggle turned on or off by itself (Toggle.turn_to) still wakes the set's waiters, as in kopf.
"""

from __future__ import annotations

from collections.abc import Iterable

from kopf._cogs.aiokits import aiotoggles

_STOCK = {name: getattr(aiotoggles.ToggleSet, name) for name in ("make_toggle", "drop_toggle", "drop_toggles")}


async def make_toggle(self: aiotoggles.ToggleSet, __val: bool = False, *, name: str | None = None) -> aiotoggles.Toggle:
    toggle = aiotoggles.Toggle(__val, name=name, condition=self._condition)
    async with self._condition:
        was = self.is_on()
        self._toggles.add(toggle)
        if self.is_on() != was:
            self._condition.notify_all()
    return toggle


async def drop_toggle(self: aiotoggles.ToggleSet, toggle: aiotoggles.Toggle) -> None:
    await drop_toggles(self, (toggle,))


async def drop_toggles(self: aiotoggles.ToggleSet, toggles: Iterable[aiotoggles.Toggle]) -> None:
    async with self._condition:
        was = self.is_on()
        self._toggles.difference_update(toggles)
        if self.is_on() != was:
            self._condition.notify_all()


def install() -> None:
    """Replace ToggleSet's membership methods (idempotent; kopf's own are kept in _STOCK)."""
    aiotoggles.ToggleSet.make_toggle = make_toggle
    aiotoggles.ToggleSet.drop_toggle = drop_toggle
    aiotoggles.ToggleSet.drop_toggles = drop_toggles


def uninstall() -> None:
    """kopf's own methods back (the benchmark's peer)."""
    for name, method in _STOCK.items():
        setattr(aiotoggles.ToggleSet, name, method)
