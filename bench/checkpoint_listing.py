"""What finding the newest complete checkpoint costs per report, by the number of tags in the store.

A store of our layout (each tag: the ``checkpoint`` begin marker, ``meta.json`` with its step,
``done``; one fence, as a gang raises it) on moto's S3 API server on loopback, read through
s3fs as a pod reads it. For each size, in the same run:

- the peer, the old way (the operator's CheckpointLister until commit a3b7afb, every 15 s per
  run): ``checkpoints.newest_complete`` lists the root, lists every tag and reads every complete
  tag's ``meta.json``;
- ours, ``checkpoints.StoreView.newest()`` as ``trainer.pod.watch`` calls it once per progress
  interval: its steady state (one new complete tag added between calls, as a save would) and
  its first call (which reads every tag once, as the old way does).

Requests are S3 HTTP requests as botocore sends them (its ``before-send.s3`` event on the s3fs
client: retries and each page of a paginated listing count; ListObjectsV2 returns at most 1,000
names a page). moto finds a listing's keys by scanning the whole bucket, so its seconds grow
with the bucket where S3's do not: compare requests across sizes, seconds within a row.

    python -m bench.checkpoint_listing [--sizes 10,1000,10000] [--repeats 3] [--workers 8] [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from bench.common import loopback_s3, stop_cleanly_on_signals, table

BUCKET, PREFIX = "bench-checkpoints", "run"
ROOT = f"s3://{BUCKET}/{PREFIX}"
STEPS_PER_TAG = 100
CREATED = 1_790_000_000  # the run's creation time in the writer epoch (meta.json, the fence)
OLD_REPEAT_MAX_TAGS = 1000  # above this the old way is measured once (minutes per call on moto)


def step_of(i: int) -> int:
    return (i + 1) * STEPS_PER_TAG


class RequestCounter:
    """Counts the S3 HTTP requests the s3fs client sends (listings apart from object reads)."""

    def __init__(self, fs):
        self.lists = self.reads = self.other = 0
        fs.connect()  # the client exists from here on: the hook sees every request
        fs.s3.meta.events.register("before-send.s3", self._sent)

    def _sent(self, request, **_):
        # returns None: a handler that returns a response would stand in for the request
        if request.method == "GET" and "list-type=2" in request.url:
            self.lists += 1
        elif request.method in ("GET", "HEAD"):
            self.reads += 1
        else:
            self.other += 1

    @property
    def total(self) -> int:
        return self.lists + self.reads + self.other


def put_tag(client, i: int) -> None:
    """One complete tag as a save leaves it: begin marker, meta.json, then done."""
    step = step_of(i)
    base = f"{PREFIX}/step_{step}"
    client.put_object(Bucket=BUCKET, Key=f"{base}/checkpoint", Body=b"")
    client.put_object(Bucket=BUCKET, Key=f"{base}/meta.json",
                      Body=json.dumps({"step": step, "writer": [CREATED, 0]}).encode())
    client.put_object(Bucket=BUCKET, Key=f"{base}/done", Body=b"")


def populate(client, start: int, stop: int, workers: int) -> None:
    """Tags start..stop-1, from a small thread pool, with progress every few seconds."""
    if stop <= start:
        return
    t0 = last = time.monotonic()
    done = 0
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for _ in pool.map(lambda i: put_tag(client, i), range(start, stop)):
            done += 1
            if time.monotonic() - last > 5:
                last = time.monotonic()
                print(f"  populating: {start + done}/{stop} tags ({done / (last - t0):.0f} tags/s)", flush=True)
    print(f"  populated {stop} tags ({stop - start} new in {time.monotonic() - t0:.1f}s)", flush=True)


def timed(counter: RequestCounter, call):
    """(seconds, requests, result) of one call."""
    before = counter.total
    t0 = time.perf_counter()
    result = call()
    return time.perf_counter() - t0, counter.total - before, result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10,1000,10000", help="tags in the store, comma separated")
    ap.add_argument("--repeats", type=int, default=3,
                    help=f"steady calls per size (one tag added before each); the old way as often up to "
                         f"{OLD_REPEAT_MAX_TAGS} tags, once above")
    ap.add_argument("--workers", type=int, default=8, help="threads putting the tags")
    ap.add_argument("--quick", action="store_true", help="sizes 10,50 and 2 repeats (the unit test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats = "10,50", 2
    sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    if not sizes or sizes[0] < 1 or args.repeats < 1:
        ap.error("sizes and repeats must be positive")
    stop_cleanly_on_signals()  # a timed-out or cancelled run still stops its S3 server
    # S3's one-second modification times make equal `done` times of tags put in the same second,
    # on which newest_complete warns at every call: not what is measured here
    logging.getLogger("trainium_api.checkpoints").setLevel(logging.ERROR)
    import boto3

    from trainium_api import checkpoints
    rows = []
    with loopback_s3(BUCKET) as endpoint:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{checkpoints.FENCE}/run_{CREATED}_attempt_0",
                          Body=json.dumps({"run": CREATED, "attempt": 0, "time": CREATED, "complete": []}).encode())
        fs, _ = checkpoints.store_fs(ROOT)
        counter = RequestCounter(fs)
        have = 0
        for size in sizes:
            populate(client, have, size, args.workers)
            tags = have = max(have, size)
            expected = step_of(have - 1)
            old = []
            for _ in range(args.repeats if size <= OLD_REPEAT_MAX_TAGS else 1):
                seconds, requests, tag = timed(counter, lambda: checkpoints.newest_complete(ROOT))
                assert tag is not None and tag.step == expected, (tag, expected)
                old.append((seconds, requests))
                print(f"  {tags} tags: old way {seconds:.3f}s, {requests} requests", flush=True)
            view = checkpoints.StoreView(ROOT)
            first_s, first_n, tag = timed(counter, view.newest)
            assert tag is not None and tag.step == expected, (tag, expected)
            steady = []
            for _ in range(args.repeats):
                put_tag(client, have)  # a save completes between two calls
                have += 1
                seconds, requests, tag = timed(counter, view.newest)
                assert tag is not None and tag.step == step_of(have - 1), (tag, have)
                steady.append((seconds, requests))
            print(f"  {tags} tags: first call {first_s:.3f}s, {first_n} requests; steady "
                  f"{', '.join(f'{s:.3f}s/{n}' for s, n in steady)}", flush=True)
            old_s, old_n = statistics.median(s for s, _ in old), statistics.median(n for _, n in old)
            new_s, new_n = statistics.median(s for s, _ in steady), statistics.median(n for _, n in steady)
            rows.append([tags, f"{old_s:.3f}", f"{old_n:.0f}", f"{new_s:.3f}", f"{new_n:.0f}", f"{first_s:.3f}",
                         first_n, f"{old_s / new_s:.1f}", f"{old_n / new_n:.1f}"])
    print(f"\nnewest complete tag of a store on moto's S3 server (loopback, s3fs), median of {args.repeats} "
          f"(the old way once above {OLD_REPEAT_MAX_TAGS} tags); requests: S3 HTTP requests sent "
          f"(botocore before-send); steady: one new tag saved since the last call\n")
    print(table(["tags", "old s (newest_complete)", "old requests", "new steady s (StoreView)", "new steady requests",
                 "new first s", "new first requests", "old/new s", "old/new requests"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
