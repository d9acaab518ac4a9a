"""trainium_operator.kopf_toggles: kopf's start-up barrier (ToggleSet) notifies its waiters only
when a membership change changes the set's state; waiters are released exactly as with kopf's
own methods. (Its speed: bench/kopf_toggles.py.)"""

from __future__ import annotations

import asyncio

from kopf._cogs.aiokits import aiotoggles

from trainium_operator import kopf_toggles


def _counting(toggles: aiotoggles.ToggleSet) -> list[int]:
    calls = [0]
    notify = toggles._condition.notify_all

    def counted() -> None:
        calls[0] += 1
        notify()
    toggles._condition.notify_all = counted
    return calls


def test_the_barrier_releases_its_waiters_when_the_last_object_is_indexed_and_not_before():
    kopf_toggles.install()

    async def scenario() -> None:
        indexed = aiotoggles.ToggleSet(all)
        calls = _counting(indexed)
        blocker = await indexed.make_toggle(name="orchestration blocker")  # on -> off: notifies
        toggles = [await indexed.make_toggle(name=f"object {i}") for i in range(50)]  # off stays off
        assert calls[0] == 1
        waiters = [asyncio.create_task(indexed.wait_for(True)) for _ in range(20)]
        for t in toggles:
            await indexed.drop_toggle(t)
            await asyncio.sleep(0)
        assert not any(w.done() for w in waiters) and calls[0] == 1  # the blocker still holds them
        await indexed.drop_toggles([blocker])  # off -> on
        await asyncio.wait_for(asyncio.gather(*waiters), 5)
        assert calls[0] == 2
        # off again: a waiter for off is released by the toggle that turns the set off
        waiting_off = asyncio.create_task(indexed.wait_for(False))
        await asyncio.sleep(0)
        late = await indexed.make_toggle(name="late")
        await asyncio.wait_for(waiting_off, 5)
        # a toggle turned by itself (kopf's peering, its pause) still wakes the set's waiters
        waiting_on = asyncio.create_task(indexed.wait_for(True))
        await asyncio.sleep(0)
        await late.turn_to(True)
        await asyncio.wait_for(waiting_on, 5)
        assert indexed.is_on() and len(indexed) == 1
    asyncio.run(scenario())


def test_install_and_uninstall_swap_kopfs_own_methods():
    kopf_toggles.uninstall()
    assert aiotoggles.ToggleSet.make_toggle is kopf_toggles._STOCK["make_toggle"]
    kopf_toggles.install()
    kopf_toggles.install()  # idempotent
    assert aiotoggles.ToggleSet.make_toggle is kopf_toggles.make_toggle
    assert aiotoggles.ToggleSet.drop_toggles is kopf_toggles.drop_toggles
