"""What each data-parallel rank reads: prepared token shards against raw text, on loopback S3.

One epoch of a generated corpus is trained through at data parallel 1, 2, 4 and 8; for each
degree every rank's reader is built and stepped in this process (one at a time: a rank's own
cost, not the server's contention) against moto's S3 API server behind a counting proxy.
Per rank: object-store requests and bytes (what the proxy forwarded), tokenizer CPU seconds
(time inside ``encode_batch``), and wall time from nothing to the first batch. The peer is the
raw-text reader (every rank reads and tokenizes every shard), measured in the same run.

    python -m bench.data_reads [--docs 16000] [--batch 64] [--seq-len 256] [--dp 1,2,4,8]
                               [--format jsonl|jsonl.gz|jsonl.zst|parquet|arrow]

With --format the raw shards are written in that format (trainer.data.formats) before upload:
the raw reader reads it, and the prepared shards are made from it (the same tokens whatever the
format, so the prepared rows' figures do not change).
"""

from __future__ import annotations

import argparse
import http.client
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bench.common import free_port, table

ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


FORMATS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow")  # those convert() writes (trainer.data.formats reads them)


def convert(folder: str, fmt: str) -> None:
    """The generated .jsonl shards of ``folder`` rewritten as ``fmt`` (each with the same documents)."""
    import gzip
    import json
    import os
    from pathlib import Path

    import pyarrow as pa
    import pyarrow.parquet as pq

    if fmt == "jsonl":
        return
    for name in sorted(os.listdir(folder)):
        path = f"{folder}/{name}"
        data = Path(path).read_bytes()
        base = path[:-len(".jsonl")]
        if fmt == "jsonl.gz":
            Path(f"{base}.jsonl.gz").write_bytes(gzip.compress(data))
        elif fmt == "jsonl.zst":
            with pa.CompressedOutputStream(f"{base}.jsonl.zst", "zstd") as out:
                out.write(data)
        else:
            table_ = pa.table({"text": [json.loads(line)["text"] for line in data.splitlines() if line.strip()]})
            if fmt == "parquet":
                pq.write_table(table_, f"{base}.parquet")
            else:
                with pa.ipc.new_file(f"{base}.arrow", table_.schema) as writer:
                    writer.write_table(table_)
        os.remove(path)


class CountingProxy:
    """Forwards every request to the S3 server and counts requests and response bytes."""

    def __init__(self, upstream: int):
        self.requests, self.bytes = 0, 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                """Quiet: one line per request would bury the table."""

            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                conn = http.client.HTTPConnection("127.0.0.1", upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = f"127.0.0.1:{upstream}"
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                proxy.requests += 1
                proxy.bytes += len(data)
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", resp.getheader("Content-Length", "0") if self.command == "HEAD"
                                 else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def reset(self) -> None:
        self.requests, self.bytes = 0, 0


class TimedTokenizer:
    """The bench's stand-in around the real tokenizer: counts CPU seconds spent encoding."""

    def __init__(self, inner):
        self.inner, self.cpu = inner, 0.0

    def encode_batch(self, texts):
        began = time.process_time()
        try:
            return self.inner.encode_batch(texts)
        finally:
            self.cpu += time.process_time() - began

    def __getattr__(self, name):
        return getattr(self.inner, name)


def measure(cfg, seq_len: int, batch: int, steps: int, dp: int, rank: int, proxy: CountingProxy) -> dict:
    import fsspec

    from trainer.data.packed import PackedDataset
    fsspec.filesystem("s3").invalidate_cache()  # each rank starts with nothing listed or cached
    proxy.reset()
    began = time.perf_counter()
    ds = PackedDataset(cfg, seq_len, 0, 512)
    timed = TimedTokenizer(ds.tokenizer)
    for src in ds.sources:
        if hasattr(src, "tokenizer"):
            src.tokenizer = timed
    ds.next_batch(batch, rank, dp)
    first = time.perf_counter() - began
    for _ in range(steps - 1):
        ds.next_batch(batch, rank, dp)
    return {"requests": proxy.requests, "bytes": proxy.bytes, "tokenizer_cpu": timed.cpu, "first": first}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=16000, help="stories in the generated corpus (4 raw shards)")
    ap.add_argument("--batch", type=int, default=64, help="global batch, rows")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--dp", default="1,2,4,8")
    ap.add_argument("--format", choices=FORMATS, default="jsonl", help="the raw shards' format")
    args = ap.parse_args()
    import os

    import boto3
    import fsspec.config

    from trainer.data import tinydata
    from trainer.config import from_dict
    from trainer.data.tokenizer import read_tokenizer
    from trainer.data.prepare import main as prepare
    from trainer.data.prepared import PreparedSource

    degrees = [int(d) for d in args.dp.split(",")]
    work = tempfile.mkdtemp(prefix="bench-data-")
    print(f"generating {args.docs} stories in {work} ...", flush=True)
    paths = tinydata.generate(work, docs=args.docs)
    convert(paths["stories"], args.format)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(2)
        proxy = CountingProxy(port)
        endpoint = f"http://127.0.0.1:{proxy.port}"
        os.environ.update(ENV, AWS_ENDPOINT_URL=endpoint, FSSPEC_S3_ENDPOINT_URL=endpoint)
        fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = endpoint
        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1", **{
            "aws_access_key_id": "testing", "aws_secret_access_key": "testing"})
        s3.create_bucket(Bucket="corpus")
        raw_bytes = 0
        for name in sorted(os.listdir(paths["stories"])):
            s3.upload_file(f"{paths['stories']}/{name}", "corpus", f"raw/{name}")
            raw_bytes += os.path.getsize(f"{paths['stories']}/{name}")
        s3.upload_file(paths["tokenizer"], "corpus", "tokenizer.json")
        began = time.perf_counter()
        cpu0 = time.process_time()
        assert prepare(["--source", "s3://corpus/raw/", "--tokenizer", "s3://corpus/tokenizer.json",
                        "--out", "s3://corpus/prepared/"]) == 0
        prep_wall, prep_cpu = time.perf_counter() - began, time.process_time() - cpu0

        def config(uri):
            return from_dict({"data": {"sources": [{"uri": uri}], "tokenizer": paths["tokenizer"]}}).data
        raw_cfg, prep_cfg = config("s3://corpus/raw/"), config("s3://corpus/prepared/")
        eos = raw_cfg.eos_token
        probe = PreparedSource(0, "s3://corpus/prepared/", seed=0, shuffle=True, eos_token=eos,
                               tokenizer_sha256=read_tokenizer(paths["tokenizer"], eos)[1],
                               tokenizer_uri=paths["tokenizer"], packing=True, vocab_size=512)
        tokens = probe.tokens_per_epoch
        prepared_bytes = tokens * probe.dtype.itemsize
        steps = -(-tokens // (args.batch * (args.seq_len + 1)))  # one epoch
        print(f"corpus: {raw_bytes / 1e6:.1f} MB raw text ({args.format}) in 4 shards, {tokens} tokens "
              f"({prepared_bytes / 1e6:.1f} MB prepared, made in {prep_wall:.1f} s, {prep_cpu:.1f} CPU s); "
              f"one epoch = {steps} steps of {args.batch} x {args.seq_len + 1} tokens\n", flush=True)

        rows = []
        result: dict = {}
        for dp in degrees:
            for kind, cfg in (("raw text (peer)", raw_cfg), ("prepared", prep_cfg)):
                per_rank = [measure(cfg, args.seq_len, args.batch, steps, dp, r, proxy) for r in range(dp)]
                worst = max(per_rank, key=lambda m: m["bytes"])
                share = prepared_bytes / dp
                result[kind, dp] = worst
                rows.append([kind, dp, worst["requests"], f"{worst['bytes'] / 1e6:.2f}",
                             f"{worst['bytes'] / share:.2f}", f"{worst['tokenizer_cpu']:.2f}",
                             f"{worst['first']:.2f}"])
        print(table(["reader", "DP", "requests/rank", "MB/rank", "x (1/DP of prepared)", "tokenizer CPU s/rank",
                     "first batch s"], rows))
        print("\nrows: the rank that read most at each degree, over one epoch. 'x (1/DP of prepared)': bytes "
              "read / (prepared corpus / DP); the goal for prepared is <= 1.1 (the index is not read when packing).")
        ratios = []
        for dp in degrees:
            raw, prep = result["raw text (peer)", dp], result["prepared", dp]
            ratios.append([dp, f"{raw['bytes'] / max(prep['bytes'], 1):.1f}x",
                           f"{raw['requests'] / max(prep['requests'], 1):.2f}x",
                           f"{prep['first'] / result['prepared', degrees[0]]['first']:.2f}",
                           f"{raw['first'] / max(prep['first'], 1e-9):.1f}x"])
        print("\n" + table(["DP", "bytes raw/prepared", "requests raw/prepared",
                            f"prepared first batch vs DP {degrees[0]}", "first batch raw/prepared"], ratios))
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
