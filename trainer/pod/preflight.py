"""python -m trainer.pod.preflight FACTOR TIMEOUT [BACKEND]: the gang's pre-flight check (faultTolerance.preflight).

trainer.pod.launch runs it under torchrun, with the run's own torchrun arguments, before the real
run: every rank of every pod takes part, on the device and with the collectives the trainer
will use (the run's backend's: Backend.check_collectives). In order: the rendezvous and the
skip decision on the host's gloo group; on Neuron the device checks of trainer.model.neuron, before
any rank starts a device; each rank starts its device, and all agree that every rank could
before any device group is made; then the timings. Checks:

- compute: timed matmuls on every rank (samples of 30 512x512 matmuls, the median of 5); a
  node is as slow as its slowest rank;
- links: a timed all-reduce across the gang, and with 3 nodes or more a timed all-reduce between
  pairs of nodes' local rank 0 (ring pairs (0,1),(2,3),... then (1,2),(3,4),...,(n-1,0): each
  node is in two pairs, so a slow link names the node both of its pairs share, DLRover-style,
  rather than blaming the gang);
- devices (Neuron): neuron-ls's device count against the instance type, and nccom-test on the
  node's cores.

A node slower than FACTOR x the median node, or failing a device check, is named. Every rank
computes the same verdict from the same gathered results; the ranks of a named node exit
PREFLIGHT (76) and its local rank 0 writes the reason into the container's termination message;
the other ranks wait (the operator tears the gang down once it sees the named pod fail) and
exit RETRYABLE if that takes longer than TIMEOUT. No node named: exit 0, the real run starts.
Most nodes named is no one node's fault (naming one would leave a healthy node out per
restart): every rank exits FATAL when most nodes' failures name the run's own configuration
(its backend, image or instance type: :func:`names_configuration`), RETRYABLE otherwise (slow
or failing devices and links on most nodes at once: the cluster's network or a transient).

A rank that hangs cannot take part in a verdict: each rank beats (trainer.pod.liveness) and its own
pod's launcher names the node. The peers' collectives then fail as its ranks are killed; they
wait to be stopped, as above, until TIMEOUT has passed since the check began.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING

from trainium_api import exitcodes, preflight
from trainium_api.launch import node_token

from ..contract import termination
from ..contract.podenv import PodEnv
from .liveness import Heartbeat, node_name

if TYPE_CHECKING:
    from ..model.backends import CheckCollectives

MATMUL_SIZE = 512
MATMULS_PER_SAMPLE = 30  # one sample ~0.1 s on a CPU core: long enough that a slowdown shows in each
REPEATS = 5
ALLREDUCE_FLOATS = 1 << 18  # 1 MiB
ALLREDUCES_PER_SAMPLE = 10  # a sample spans tens of ms: one lucky or unlucky all-reduce decides nothing
MIN_SECONDS = 1e-4  # below this a median is noise, not a baseline
MESSAGE_GRACE_SECONDS = 10.0  # how long a named node's other ranks wait for local rank 0's reason
DEVICE_TOOLS_SHARE = 0.4  # of the timeout, for neuron-ls and nccom-test together: inside the devices stage's budget


def log(msg: str) -> None:
    print(f"trainer.pod.preflight: {msg}", file=sys.stderr, flush=True)


def timed(fn, repeats: int = REPEATS, warm: bool = True) -> float:
    if warm:
        fn()  # warm-up: the first call pays allocation, connection setup, a lazy device's compile
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def pairings(nodes: int) -> list[tuple[int, int]]:
    """Ring pairs: (0,1),(2,3),... then (1,2),(3,4),...,(n-1,0); every node in two pairs."""
    first = [(i, i + 1) for i in range(0, nodes - 1, 2)]
    second = [(i, (i + 1) % nodes) for i in range(1, nodes, 2)]
    if nodes % 2:  # the odd one out of the first round
        first.append((nodes - 1, 0))
    return first + second


def verdict(results: list[dict], links: dict[tuple[int, int], float], factor: float) -> dict[int, str]:
    """node rank -> why it fails the check. Pure: every rank computes the same from the same
    gathered results. ``results``: one per rank ({node, node_rank, matmul, errors});
    ``links``: pair -> all-reduce seconds."""
    named: dict[int, str] = {}
    by_node: dict[int, list[dict]] = {}
    for r in results:
        by_node.setdefault(r["node_rank"], []).append(r)
    for node_rank, ranks in sorted(by_node.items()):
        errors = [e for r in ranks for e in r["errors"]]
        if errors:
            named[node_rank] = f"node {ranks[0]['node']}: {errors[0]}"
    slowest = {n: max(r["matmul"] for r in ranks) for n, ranks in by_node.items()}
    if len(slowest) >= 2:
        for n, t in sorted(slowest.items()):
            others = [v for k, v in slowest.items() if k != n]
            base = statistics.median(others)
            if base >= MIN_SECONDS and t > factor * base and n not in named:
                named[n] = (f"node {by_node[n][0]['node']}: matmul {t * 1e3:.1f} ms, {t / base:.1f}x the other "
                            f"nodes' median {base * 1e3:.1f} ms")
    compute_named = set(named)
    for n in sorted(by_node):
        # a node whose every pair is slow against the pairs it is not in: its link, not a
        # partner's. A pair with a node already named is no evidence about the other (that node's
        # slowness explains it; with 3 nodes it would name a healthy node too)
        mine = [pair for pair in links if n in pair and not (set(pair) - {n}) & compute_named]
        others = [t for pair, t in links.items() if n not in pair and not set(pair) & compute_named]
        if len(mine) < 2 or not others or n in named:
            continue
        base = statistics.median(others)
        if base >= MIN_SECONDS and all(links[pair] > factor * base for pair in mine):
            worst = max(links[pair] for pair in mine)
            named[n] = (f"node {by_node[n][0]['node']}: all-reduce with each of its pair partners up to "
                        f"{worst * 1e3:.1f} ms, more than {factor:g}x the other pairs' median {base * 1e3:.1f} ms")
    return named


BACKEND_CANNOT_START = "the run's backend"  # start_device's words for a backend the image or the nodes lack
# trainer.model.neuron.preflight_devices' words for an image without the Neuron tools, and for a node
# whose devices differ from what the run's instance type has (on most nodes: the spec is wrong)
CONFIG_WORDS = ("is not on PATH", "Neuron devices in the container, the instance type has")


def names_configuration(error: str) -> bool:
    """Whether a rank's error names the run's configuration rather than the node or the network."""
    return error.startswith(BACKEND_CANNOT_START) or any(words in error for words in CONFIG_WORDS)


def most_failed(named: dict[int, str], results: list[dict]) -> int | None:
    """The gang's exit code when most nodes failed the check (None when not): FATAL when the
    failures of most nodes name the run's configuration, else RETRYABLE. Pure, as verdict."""
    nodes = len({r["node_rank"] for r in results})
    if nodes < 2 or len(named) <= nodes // 2:
        return None
    config = {r["node_rank"] for r in results if any(names_configuration(e) for e in r["errors"])} & set(named)
    return exitcodes.FATAL if len(config) > nodes // 2 else exitcodes.RETRYABLE


def main(argv: list[str]) -> int:
    env = PodEnv.from_environ()
    beat = Heartbeat(env=env)  # first, before torch's import: a rank stuck importing is seen too
    try:
        return check(argv, beat, env)
    finally:
        beat.close()


def check(argv: list[str], beat: Heartbeat, env: PodEnv) -> int:
    import torch
    import torch.distributed as dist

    factor, timeout = float(argv[0]), float(argv[1])
    requested = argv[2] if len(argv) > 2 else "auto"  # an older operator's pods name no backend
    limit = timedelta(seconds=timeout)
    started = time.perf_counter()
    local_rank = env.local_rank
    node_rank = env.group_rank if env.group_rank is not None else int(env.node_rank)
    node = node_name(env)
    passed = env.preflight_passed
    beat.enter("rendezvous")
    try:
        # the host's gloo group first: the rendezvous, the skip, the device tools and every
        # verdict need no device, and a node that skips or fails them never starts one
        dist.init_process_group("gloo", timeout=limit)
        rank, world = dist.get_rank(), dist.get_world_size()
        trusted: list = [None] * world
        dist.all_gather_object(trusted, node_token(node) in passed)
    except RuntimeError as exc:
        if not lost_a_peer(dist, exc):
            raise
        return peer_left(exc, beat, timeout - (time.perf_counter() - started))
    if all(trusted):  # every node passed this run's check recently (faultTolerance.preflightSkipMinutes)
        if rank == 0:
            log("skipped: every node of the gang passed the check within the last preflightSkipMinutes")
        dist.destroy_process_group()
        return exitcodes.OK
    torch.set_num_threads(1)  # one thread a rank: the node's ranks must not time each other's contention
    errors = device_tools(beat, env, timeout)
    matmul, results, links, coll = 0.0, None, {}, None
    try:
        beat.enter("device tools barrier")
        dist.barrier()  # no rank starts its device while a node's tools still run (a held core is no other's)
        if not errors:
            errors, coll = start_device(beat, requested, env)
        failed: list = [None] * world  # every rank learns which could not start before any device group
        dist.all_gather_object(failed, bool(errors))
        if not any(failed):
            matmul = time_matmuls(torch, coll, beat, rank, errors)
        results, links = measure_links(dist, torch, coll if not any(failed) else None, beat, limit, node, node_rank,
                                       local_rank, matmul, errors)
    except RuntimeError as exc:
        if not lost_a_peer(dist, exc):
            raise
        return peer_left(exc, beat, timeout - (time.perf_counter() - started))
    described = coll.described if coll is not None else "devices not started"
    beat.enter("verdict")
    named = verdict(results, links, factor)
    took = time.perf_counter() - started
    nodes = len({r["node_rank"] for r in results})
    gang_code = most_failed(named, results)
    if gang_code is not None:  # no one node's fault: naming one would leave out a healthy node per restart
        if rank == 0 and gang_code == exitcodes.FATAL:
            log(f"the check failed on {len(named)} of {nodes} nodes: {next(iter(named.values()))}; this is not one "
                "node's fault but the run's configuration (its backend, image or instance type): not retried")
        elif rank == 0:
            log(f"the check failed on {len(named)} of {nodes} nodes: {next(iter(named.values()))}; this is neither "
                "one node's fault nor the run's configuration (slow or failing devices or links on most nodes at "
                f"once): exiting {exitcodes.RETRYABLE}, retried without leaving a node out")
        return gang_code
    if rank == 0:
        nodes = {r["node_rank"]: r for r in results}
        log(f"{len(nodes)} nodes, {world} ranks, {described}, {took:.1f}s: matmul median "
            f"{statistics.median(r['matmul'] for r in results) * 1e3:.1f} ms, gang all-reduce "
            f"{max(r['allreduce'] for r in results) * 1e3:.1f} ms"
            + (f", {len(links)} node pairs" if links else "") + ("; failed: " + "; ".join(named.values()) if named
                                                                    else "; passed"))
    if not named:
        dist.destroy_process_group()
        return exitcodes.OK
    if node_rank in named:
        path = env.termination_log
        if local_rank == 0 and path:
            termination.write(path, preflight.format_message(named[node_rank]), log)
        elif path:
            # the first rank to exit makes torchrun stop the others: the node's other ranks give
            # local rank 0 time to write the reason (CI saw it killed mid-write: an empty message)
            deadline = time.monotonic() + MESSAGE_GRACE_SECONDS
            while time.monotonic() < deadline and not (os.path.exists(path) and os.path.getsize(path)):
                time.sleep(0.05)
        log(f"this node failed: {named[node_rank]}")
        return exitcodes.PREFLIGHT
    # a healthy node: the operator stops the gang once the named node's pod has failed
    beat.enter("waiting")
    log(f"another node failed ({'; '.join(named.values())}); waiting to be stopped")
    time.sleep(timeout)
    return exitcodes.RETRYABLE


def device_tools(beat: Heartbeat, env: PodEnv, timeout: float) -> list[str]:
    """On Neuron, the device files and tools (trainer.model.neuron.preflight_devices, local rank 0),
    run before any rank of the gang starts its device: a NeuronCore one process holds, no other
    can use, and nccom-test needs the node's. What is wrong names this node."""
    if not env.preflight_devices:
        return []
    local_rank = env.local_rank
    beat.enter("devices")
    try:
        from ..model.neuron import preflight_devices
        tool_timeout = timeout * DEVICE_TOOLS_SHARE / 2  # two tools, inside the stage's budget
        return preflight_devices(int(env.preflight_devices), local_rank, tool_timeout, env.neuron_rt_num_cores)
    except Exception as exc:  # noqa: BLE001 (whatever broke, it is this node's)
        return [f"the device check failed on local rank {local_rank}: {type(exc).__name__}: {exc}"[:200]]


def start_device(beat: Heartbeat, requested: str, env: PodEnv) -> tuple[list[str], CheckCollectives | None]:
    """The run's backend and this rank's device: (errors, collectives). An error names this
    node, or, on most nodes, the image (the verdict's FATAL)."""
    from trainium_api.exitcodes import FatalError

    from ..model.backends import pick
    from ..config import ConfigError
    beat.enter("device start")
    try:
        return [], pick(requested).check_collectives(env)
    except (ConfigError, FatalError) as exc:
        return [f"{BACKEND_CANNOT_START} {requested} cannot start: {exc}"[:200]], None
    except Exception as exc:  # noqa: BLE001 (whatever broke, it is this node's)
        return [f"the device did not start on local rank {env.local_rank}: {type(exc).__name__}: {exc}"[:200]], None


def time_matmuls(torch, coll: CheckCollectives, beat: Heartbeat, rank: int, errors: list[str]) -> float:
    """Seconds of one sample of chained matmuls on the device (the median of REPEATS), after a
    warm-up that pays the device's first compile outside the stage's budget."""
    torch.manual_seed(rank)
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE).to(coll.device)
    out = [a]

    def matmuls() -> None:
        # a chain, so a lazy device (XLA) cannot drop unused products; scaled to stay finite
        x = a
        for _ in range(MATMULS_PER_SAMPLE):
            x = (a @ x) * MATMUL_SIZE ** -0.5
        out[0] = x
        coll.sync()
    try:
        beat.enter("warm-up")  # a first compile may take long on Trainium; only a stale beat counts
        matmuls()
        beat.enter("compute")
        seconds = timed(matmuls, warm=False)
        if not bool(torch.isfinite(out[0]).all()):
            errors.append("matmul produced non-finite values")
        return seconds
    except Exception as exc:  # noqa: BLE001 (a device that fails here is this node's)
        errors.append(f"the matmuls failed on this rank: {type(exc).__name__}: {exc}"[:200])
        return 0.0


# gloo's transport says a peer went away in a plain RuntimeError ("Connection reset by peer",
# "Connection closed by peer" from gloo/transport/tcp/pair.cc), not in torch's DistError
GLOO_TRANSPORT = "gloo/transport/"


def lost_a_peer(dist, exc: RuntimeError) -> bool:
    """Whether a collective failed because another rank went away or timed out (a DistError, or
    gloo's transport), rather than because of this rank's own device or code."""
    return isinstance(exc, dist.DistError) or GLOO_TRANSPORT in str(exc)


def peer_left(exc: Exception, beat: Heartbeat, remaining: float) -> int:
    """A collective failed: a peer left (a node whose launcher found its rank hung, or one that
    crashed: its pod's failure says which, and the operator stops this one) or never came (the
    check's timeout, after which nothing is left to wait for)."""
    first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    beat.enter("waiting")
    if remaining > 0:
        log(f"a peer left the check ({first}); waiting to be stopped")
        time.sleep(remaining)
    else:
        log(f"the check's collectives timed out ({first})")
    return exitcodes.RETRYABLE


def measure_links(dist, torch, coll: CheckCollectives | None, beat: Heartbeat, limit: timedelta, node: str,
                  node_rank: int, local_rank: int, matmul: float, errors: list[str]
                  ) -> tuple[list[dict], dict[tuple[int, int], float]]:
    """The gang all-reduce on the device's collectives, every rank's results gathered on gloo,
    and the pairs of nodes' all-reduces: (results, pair -> seconds). ``coll`` None: a rank could
    not start its device, and only the results are gathered. Every group is made by every rank,
    in order, with the check's timeout (a group's own default is 30 minutes)."""
    world = dist.get_world_size()
    allreduce = 0.0
    if coll is not None:
        group = None if coll.collectives == "gloo" else dist.new_group(backend=coll.collectives, timeout=limit)

        def all_reduces(buf, group, sync):
            for _ in range(ALLREDUCES_PER_SAMPLE):
                dist.all_reduce(buf, group=group)
            sync()
        beat.enter("gang all-reduce")
        buf = torch.zeros(ALLREDUCE_FLOATS, device=coll.device)  # zeros: sums stay finite
        allreduce = timed(lambda: all_reduces(buf, group, coll.sync))
    mine = {"node": node, "node_rank": node_rank, "local_rank": local_rank, "matmul": matmul,
            "allreduce": allreduce, "errors": errors}
    beat.enter("gather")
    results: list = [None] * world
    dist.all_gather_object(results, mine)
    # pairs of nodes, through each node's local rank 0
    leaders = sorted({r["node_rank"]: i for i, r in enumerate(results) if r["local_rank"] == 0}.items())
    links: dict[tuple[int, int], float] = {}
    if coll is not None and len(leaders) >= 3 and not any(r["errors"] for r in results):
        beat.enter("node pairs")
        ranks_of = dict(leaders)
        on_host = coll.pair_backend == "gloo"
        groups = {pair: dist.new_group([ranks_of[pair[0]], ranks_of[pair[1]]], timeout=limit,
                                       backend=None if on_host else coll.pair_backend)
                  for pair in pairings(len(leaders))}
        timings: dict = {}
        for pair, pgroup in groups.items():
            if node_rank in pair and local_rank == 0:
                pbuf = torch.zeros(ALLREDUCE_FLOATS, device="cpu" if on_host else coll.device)
                timings[pair] = timed(lambda: all_reduces(pbuf, pgroup, (lambda: None) if on_host else coll.sync))
        gathered: list = [None] * world
        dist.all_gather_object(gathered, timings)
        for t in gathered:
            for pair, seconds in (t or {}).items():
                links[pair] = max(links.get(pair, 0.0), seconds)
    return results, links


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # a verdict against the gang leaves the process group up while the peers wait or have gone:
    # gloo's threads can abort the interpreter's teardown, turning PREFLIGHT into a signal
    os._exit(code)
