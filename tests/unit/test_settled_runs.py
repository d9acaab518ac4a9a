"""A finished run costs nothing (issue 48): once a pass of it changes nothing and asks for
nothing (reconcile.Result.settled), its loop (watcher.Watcher.loop) has no tick and passes
again only when woken: by its pods, a node its status names, its Workload or its own object.
A live run keeps its one-second tick. The loop runs on asyncio as under kopf, with kopf's own
stop flag; the pass is a counter (the loop is under test, not the pass)."""

from __future__ import annotations

import asyncio

from kopf._cogs.aiokits.aioenums import AsyncFlagWaiter, FlagSetter

from trainium_operator.metrics import Metrics
from trainium_operator.applier import Pools
from trainium_operator.reconcile import Result
from trainium_api.status import TrainingRunStatus
from trainium_operator.watcher import RECONCILE_INTERVAL, Settled, Watcher

KEY = ("ns", "done")


def node(name: str, taints: tuple[str, ...] = ()) -> dict:
    return {"metadata": {"name": name, "uid": "u-" + name},
            "spec": {"taints": [{"key": t, "effect": "NoSchedule"} for t in taints]},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


class Passes:
    """The loop's one_pass: counts calls and answers as told."""

    def __init__(self, settled: Settled | None, body: dict):
        self.count, self.settled, self.body = 0, settled, body
        self.bump_once = False
        self.during = None  # called on the pass's thread, mid-pass

    def __call__(self) -> tuple[bool, Settled | None]:
        self.count += 1
        if self.during is not None:
            self.during()
        if self.bump_once:  # the run changed while this pass read it
            self.bump_once = False
            self.body["metadata"]["resourceVersion"] = str(int(self.body["metadata"]["resourceVersion"]) + 1)
        return False, self.settled


async def until(predicate, timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_a_settled_run_passes_only_when_woken_and_a_live_one_ticks():
    async def scenario():
        watcher = Watcher(None, Metrics(), Pools())  # (the loop uses neither the API nor the pools)
        setter = FlagSetter()
        stopped = AsyncFlagWaiter(setter)
        body = {"metadata": {"resourceVersion": "1"}}
        passes = Passes(Settled(frozenset({"quarantined-1"})), body)
        task = asyncio.ensure_future(watcher.loop(stopped, body, KEY, passes))
        await until(lambda: passes.count == 1)
        await asyncio.sleep(3 * RECONCILE_INTERVAL)
        assert passes.count == 1 and KEY in watcher.settled  # no tick

        watcher.run_changed(*KEY)  # its object changed
        await until(lambda: passes.count == 2)
        watcher.node_changed(False, "quarantined-1", node("quarantined-1", ("trainium.dev/quarantined",)), {})
        watcher.node_changed(False, "quarantined-1", node("quarantined-1"), {})  # an admin removed the taint
        await until(lambda: passes.count == 3)
        watcher.node_changed(False, "other", node("other"), {})
        watcher.node_changed(False, "other", node("other", ("x",)), {})  # a node it does not name
        watcher.wake_run(*KEY)  # its Workload changed
        await until(lambda: passes.count == 4)

        passes.bump_once = True  # changed during a pass: passed again at once, then settled
        watcher.run_changed(*KEY)
        await until(lambda: passes.count == 6)
        await asyncio.sleep(2 * RECONCILE_INTERVAL)
        assert passes.count == 6

        passes.settled = None  # a live run (e.g. its spec edited back to life): the tick returns
        watcher.run_changed(*KEY)
        await until(lambda: passes.count == 7)
        await until(lambda: passes.count >= 9, timeout=4 * RECONCILE_INTERVAL)
        assert KEY not in watcher.settled

        setter.set()  # kopf stops the daemon: the loop ends, settled or not
        passes.settled = Settled(frozenset())
        await asyncio.wait_for(task, 3 * RECONCILE_INTERVAL)

    asyncio.run(scenario())


def test_a_settled_loop_ends_when_kopf_stops_it():
    async def scenario():
        watcher = Watcher(None, Metrics(), Pools())
        setter = FlagSetter()
        body = {"metadata": {"resourceVersion": "1"}}
        passes = Passes(Settled(frozenset()), body)
        task = asyncio.ensure_future(watcher.loop(AsyncFlagWaiter(setter), body, KEY, passes))
        await until(lambda: KEY in watcher.settled)
        setter.set()
        await asyncio.wait_for(task, 1.0)
        assert KEY not in watcher.settled and KEY not in watcher.wake

    asyncio.run(scenario())


def test_only_a_finished_pass_that_changed_and_asked_nothing_is_settled():
    done = TrainingRunStatus(phase="Succeeded")
    assert Result({}, [], None, done).settled
    assert not Result({"phase": "Succeeded"}, [], None, done).settled  # it wrote: one more pass reads it
    assert not Result({}, [object()], None, done).settled  # a pod still to delete, a Workload to finish
    assert not Result({}, [], None, TrainingRunStatus(phase="Running")).settled


def test_a_wake_during_a_settled_runs_pass_is_not_lost_and_time_alone_wakes_it():
    """Found by review: a node event that arrived while a woken settled run was passing was
    dropped (the run was not registered as settled during the pass), and a change time alone
    brings (an avoided node's window ending) never came."""
    async def scenario():
        watcher = Watcher(None, Metrics(), Pools())
        setter = FlagSetter()
        body = {"metadata": {"resourceVersion": "1"}}
        loop = asyncio.get_running_loop()
        passes = Passes(Settled(frozenset({"q-1", "q-2"})), body)
        task = asyncio.ensure_future(watcher.loop(AsyncFlagWaiter(setter), body, KEY, passes))
        await until(lambda: KEY in watcher.settled and passes.count == 1)
        watcher.node_changed(False, "q-2", node("q-2", ("trainium.dev/quarantined",)), {})  # (its shape first seen)

        def node_event_mid_pass():  # kopf's event loop delivers it while the pass runs on its thread
            passes.during = None
            loop.call_soon_threadsafe(watcher.node_changed, False, "q-2", node("q-2"), {})
            import time
            time.sleep(0.2)
        passes.during = node_event_mid_pass
        watcher.node_changed(False, "q-1", node("q-1"), {})
        watcher.node_changed(False, "q-1", node("q-1", ("x",)), {})  # wakes it: pass 2, during which q-2 changes
        await until(lambda: passes.count == 3)  # the wake-up during pass 2 gave pass 3
        await asyncio.sleep(RECONCILE_INTERVAL)
        assert passes.count == 3

        import time
        passes.settled = Settled(frozenset(), wake_at=time.time() + 1.0)  # e.g. an avoided node's window ends
        watcher.run_changed(*KEY)
        await until(lambda: passes.count == 4)
        await until(lambda: passes.count == 5, timeout=3.0)  # by time alone
        passes.settled = Settled(frozenset())
        await until(lambda: passes.count >= 6, timeout=3.0)  # (the pass at wake_at's own wake_at is past)
        settled_at = passes.count
        await asyncio.sleep(2 * RECONCILE_INTERVAL)
        assert passes.count == settled_at
        setter.set()
        await asyncio.wait_for(task, 1.0)

    asyncio.run(scenario())


def test_time_alone_is_when_a_finished_runs_avoided_node_is_tried_again():
    """reconcile gives a finished run's settled pass the moment its status changes by itself."""
    from tests.unit.test_operator_core import RUN
    from trainium_operator.reconcile import reconcile_objects
    import copy
    run = copy.deepcopy(RUN)
    run["status"] = {"phase": "Failed", "attempt": 2,
                     "avoidedNodes": [{"node": "n9", "time": 1000.0, "reason": "slow"}]}
    first = reconcile_objects(run, [], {}, now=1100.0)
    assert not first.settled  # it wrote (observedGeneration, conditions): one more pass reads that
    run["status"] = {**run["status"], **first.status}
    r = reconcile_objects(run, [], {}, now=1101.0)
    assert r.settled and r.wake_at == 1000.0 + 60 * 60  # budgetWindowMinutes (60) after it was avoided
    run["status"]["avoidedNodes"] = []
    assert reconcile_objects(run, [], {}, now=1102.0).wake_at is None


def test_a_deadline_already_past_does_not_spin_a_settled_run():
    """Found by review: a finished run's pod Terminating past its deadline (its node does not
    answer) gave a wake_at in the past, and the loop passed every 50 ms. reconcile leaves past
    times out, and the loop never waits less than a tick for one."""
    import time

    async def scenario():
        watcher = Watcher(None, Metrics(), Pools())
        setter = FlagSetter()
        body = {"metadata": {"resourceVersion": "1"}}
        passes = Passes(Settled(frozenset(), wake_at=time.time() - 30), body)
        task = asyncio.ensure_future(watcher.loop(AsyncFlagWaiter(setter), body, KEY, passes))
        await asyncio.sleep(2.5 * RECONCILE_INTERVAL)
        assert passes.count <= 4, passes.count
        setter.set()
        await asyncio.wait_for(task, 3.0)

    asyncio.run(scenario())
    from tests.unit.test_operator_core import RUN
    from trainium_operator.observe import pod_view
    from trainium_operator.reconcile import reconcile_objects
    from tests.unit.test_judge import pod
    import copy
    run = copy.deepcopy(RUN)
    run["status"] = {"phase": "Failed", "attempt": 1}
    stuck = pod(0)
    stuck["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"  # long past: gone_by passed
    view = pod_view(stuck)
    assert view.deleting and view.gone_by is not None
    r = reconcile_objects(run, [view], {}, now=view.gone_by + 600)
    assert r.wake_at is None
