"""kopf's start-up barrier alone: N indexed objects pass kopf's ``operator_indexed`` ToggleSet the
way kopf's watcher and workers do (kopf._core.reactor.queueing and processing), with kopf's own
ToggleSet methods and with ours (trainium_operator.kopf_toggles: a membership change notifies only
when it changes the set's state).

    python -m bench.kopf_toggles [--objects 500,1000,2000,4000,8000] [--peer-max 4000]

The watcher adds a toggle per object as the initial listing arrives (an "orchestration blocker"
toggle is there first and dropped once every resource kind has listed); each object's worker
then indexes it, drops its toggle and waits for the whole set to turn on, as kopf's processing
does before any handler runs. Timed: from the first toggle to every worker released, in one
asyncio loop (kopf's). A restarted operator at 4,096 nodes indexes its nodes and labelled pods:
about 8,200 objects.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from bench.common import table


async def barrier(objects: int) -> float:
    from kopf._cogs.aiokits import aiotoggles

    indexed = aiotoggles.ToggleSet(all)
    blocker = await indexed.make_toggle(name="orchestration blocker")
    released = 0

    async def worker(toggle) -> None:
        nonlocal released
        await asyncio.sleep(0)  # the worker starts after the watcher fed it
        await indexed.drop_toggle(toggle)  # indexed
        await indexed.wait_for(True)  # other objects and kinds
        released += 1

    began = time.perf_counter()
    tasks = []
    for i in range(objects):  # the initial listing, object by object
        toggle = await indexed.make_toggle(name=f"object {i}")
        tasks.append(asyncio.create_task(worker(toggle)))
        await asyncio.sleep(0)  # kopf's watcher awaits the queue and the spawn per object: others run
    await indexed.drop_toggle(blocker)  # every kind listed
    await asyncio.gather(*tasks)
    assert released == objects
    return time.perf_counter() - began


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", default="500,1000,2000,4000,8000")
    ap.add_argument("--peer-max", type=int, default=4000, help="largest N kopf's own methods are run at (quadratic)")
    args = ap.parse_args()
    from trainium_operator import kopf_toggles
    rows = []
    for n in (int(x) for x in args.objects.split(",")):
        kopf_toggles.install()
        ours = asyncio.run(barrier(n))
        stock = None
        if n <= args.peer_max:
            kopf_toggles.uninstall()
            stock = asyncio.run(barrier(n))
        rows.append([n, f"{ours:.3f}", f"{stock:.2f}" if stock is not None else "not run",
                     f"{stock / ours:.0f}x" if stock is not None else ""])
        print(f"[bench] {n} objects: ours {ours:.3f} s, kopf's {stock if stock is not None else 'not run'}", flush=True)
    kopf_toggles.install()
    print("\nkopf's start-up barrier: every indexed object released (seconds)")
    print(table(["objects", "ours s", "kopf 1.45 s", "kopf / ours"], rows))


if __name__ == "__main__":
    main()
