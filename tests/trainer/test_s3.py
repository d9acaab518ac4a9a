"""Data and checkpoints on a real S3 API server (moto in server mode) on loopback.

A small HTTP proxy owned by the test sits between the trainer and the server so the test can
make requests fail while a save is in flight, the way an object store outage looks to s3fs.
"""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from tests.conftest import (ROOT, data_overrides, eval_losses, held_out, read_losses, run_trainer, trainer_cmd,
                            trainer_env)
from trainium_api import checkpoints, exitcodes

pytestmark = [pytest.mark.trainer, pytest.mark.s3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FaultProxy:
    """Forwards every request to the S3 server; while ``failing`` is set, PUTs get 403
    AccessDenied, which s3fs does not retry (503s it rides out with its own retries)."""

    def __init__(self, upstream_port: int):
        proxy = self
        self.failing = threading.Event()
        self.failed_puts = 0
        self.requests: list[tuple[str, str, str | None, int]] = []  # (method, path, Range, body bytes)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                """Quiet: one line per S3 request would bury the test output."""

            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if self.command == "PUT" and proxy.failing.is_set():
                    proxy.failed_puts += 1
                    msg = b"<Error><Code>AccessDenied</Code><Message>injected fault</Message></Error>"
                    self.send_response(403)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = f"127.0.0.1:{upstream_port}"
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                proxy.requests.append((self.command, self.path, self.headers.get("Range"), len(data)))
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(k, v)
                # HEAD carries the object's size in Content-Length and no body.
                length = resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


@pytest.fixture
def s3(tmp_path, tiny_data):
    """A moto S3 server process plus the fault proxy; data uploaded to s3://data/tiny."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proxy = None
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        proxy = FaultProxy(port)
        env = trainer_env(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                          AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=f"http://127.0.0.1:{proxy.port}",
                          FSSPEC_S3_ENDPOINT_URL=f"http://127.0.0.1:{proxy.port}")
        import boto3
        client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                              aws_access_key_id="testing", aws_secret_access_key="testing")
        for bucket in ("data", "ckpt"):
            client.create_bucket(Bucket=bucket)
        base = Path(tiny_data["tokenizer"]).parent
        for f in base.rglob("*"):
            if f.is_file():
                client.upload_file(str(f), "data", f"tiny/{f.relative_to(base)}")
        yield {"env": env, "proxy": proxy, "port": port}
    finally:
        if proxy:
            proxy.close()
        server.terminate()
        server.wait(10)


def s3_overrides(tmp: Path, name: str, *extra: str) -> list[str]:
    return ["data.sources=[{uri: 's3://data/tiny/stories', weight: 3}, {uri: 's3://data/tiny/facts', weight: 1}]",
            "data.tokenizer=s3://data/tiny/tokenizer.json", f"checkpoint.uri=s3://ckpt/{name}",
            f"logging.lossesFile={tmp / (name + '.jsonl')}", "logging.interval=1", *extra]


def store_env(env):
    """Point this (test) process's s3fs at the server, for listing checkpoints."""
    import fsspec.config
    fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = env["FSSPEC_S3_ENDPOINT_URL"]
    import os
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        os.environ[k] = env[k]


def test_s3_data_checkpoints_and_exact_resume(s3, tmp_path, tiny_data):
    """...and TensorBoard scalars on S3 (logging.tensorboard), read back by TensorBoard's reader."""
    env = s3["env"]
    store_env(env)
    logged = ["logging.tensorboard=s3://ckpt/tensorboard/run", held_out(tiny_data), "data.evalIntervalSteps=3"]
    first = run_trainer(2, s3_overrides(tmp_path, "run", "training.steps=6", "checkpoint.intervalSteps=3", *logged),
                        env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert checkpoints.newest_complete("s3://ckpt/run").step == 6
    tag = checkpoints.newest_complete("s3://ckpt/run")
    assert tag.uri == "s3://ckpt/run/step_6" and tag.meta["layout"]["data"] == 2
    # Continue the same run to step 9 from S3, and compare with an uninterrupted 9-step run.
    cont = run_trainer(2, s3_overrides(tmp_path, "run", "training.steps=9", "checkpoint.intervalSteps=3", *logged),
                       env=env)
    assert cont.returncode == 0 and "resumed from s3://ckpt/run/step_6" in cont.stderr, cont.stderr[-3000:]
    ref = run_trainer(2, s3_overrides(tmp_path, "ref", "training.steps=9", "checkpoint.intervalSteps=0"), env=env)
    assert ref.returncode == 0, ref.stderr[-3000:]
    got, want = read_losses(tmp_path / "run.jsonl"), read_losses(tmp_path / "ref.jsonl")
    assert all(got[s]["loss"] == want[s]["loss"] for s in range(1, 10))

    # TensorBoard: the two processes' event files, downloaded from S3, read as one run
    import fsspec
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from trainer.loop import tensorboard as tb
    fs = fsspec.filesystem("s3")
    events = tmp_path / "tensorboard"
    fs.get("ckpt/tensorboard/run/", str(events), recursive=True)
    assert len(list(events.iterdir())) >= 2  # the first process's closed files, then the second's
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    assert [s for s, _ in scalars[tb.LOSS]] == list(range(1, 10))  # each step once, in order
    assert [v for _, v in scalars[tb.LOSS]] == [pytest.approx(got[s]["loss"], rel=1e-6) for s in range(1, 10)]
    assert [v for _, v in scalars[tb.GRAD_NORM]] == [pytest.approx(got[s]["gradNorm"], rel=1e-6)
                                                      for s in range(1, 10)]
    assert [v for _, v in scalars[tb.LEARNING_RATE]] == [pytest.approx(got[s]["lr"], rel=1e-6) for s in range(1, 10)]
    assert all(v > 0 for _, v in scalars[tb.TOKENS_PER_SECOND] + scalars[tb.STEP_SECONDS])
    held = eval_losses(tmp_path / "run.jsonl")
    assert [s for s, _ in scalars[tb.EVAL_LOSS]] == [3, 6, 9]
    assert [v for _, v in scalars[tb.EVAL_LOSS]] == [pytest.approx(held[s], rel=1e-6) for s in (3, 6, 9)]
    assert [s for s, _ in scalars[tb.EVAL_PERPLEXITY]] == [3, 6, 9]


def _run_with_fault(s3, tmp_path, name: str, steps: int, transient: bool):
    """Train; when step_4's save has begun, make PUTs fail. A transient fault clears as soon
    as the first PUT failed; a persistent one lasts until the trainer exits."""
    env, proxy = s3["env"], s3["proxy"]
    store_env(env)
    run = s3_overrides(tmp_path, name, f"training.steps={steps}", "checkpoint.intervalSteps=4")
    proc = subprocess.Popen(trainer_cmd(2, run), cwd=ROOT, env={**env, "TRAINER_FAULT_CKPT_WRITE_DELAY": "2"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not any(t.tag == "step_4" for t in checkpoints.list_tags(f"s3://ckpt/{name}")):
            assert proc.poll() is None and time.monotonic() < deadline, "no save of step_4 began"
            time.sleep(0.05)
        proxy.failing.set()
        if transient:
            while proxy.failed_puts == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            proxy.failing.clear()
        _, err = proc.communicate(timeout=300)
    finally:
        proxy.failing.clear()
        if proc.poll() is None:
            proc.kill()
    assert proxy.failed_puts > 0
    tags = {t.tag: t for t in checkpoints.list_tags(f"s3://ckpt/{name}")}
    return proc.returncode, err, tags


def test_prepared_data_on_s3_each_rank_reads_only_its_rows(s3, tmp_path, tiny_data):
    """trainer.data.prepare from s3:// to s3://, then four data-parallel ranks read it: together
    they rebuild the global batch of the local prepared copy bitwise, and the server saw one
    ranged GET per rank and step carrying exactly that rank's tokens."""
    from trainer.config import from_dict
    from trainer.data.packed import PackedDataset

    env, proxy = s3["env"], s3["proxy"]
    store_env(env)
    out = "s3://data/prepared/stories"
    res = subprocess.run([sys.executable, "-m", "trainer.data.prepare", "--source", "s3://data/tiny/stories",
                          "--tokenizer", "s3://data/tiny/tokenizer.json", "--out", out],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and f"{out}/prepared.json written" in res.stdout, res.stdout + res.stderr

    def stream(uri):
        data = from_dict({"data": {"sources": [{"uri": uri}], "tokenizer": tiny_data["tokenizer"]}}).data
        return PackedDataset(data, 64, 7, 512)

    local = stream(tiny_data["stories_prepared"])
    ref = [local.next_batch(16) for _ in range(4)]
    ranks = [stream(out) for _ in range(4)]
    proxy.requests.clear()
    for x, y in ref:
        parts = [r.next_batch(16, i, 4) for i, r in enumerate(ranks)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
    reads = [r for r in proxy.requests if r[0] == "GET" and r[2]]
    assert len(reads) == len(proxy.requests) == 4 * 4, proxy.requests
    assert all(r[1].startswith("/data/prepared/stories/part-") and r[3] == 4 * 65 * 2 for r in reads)


def test_transient_store_failure_mid_save_is_never_marked_done(s3, tmp_path):
    code, err, tags = _run_with_fault(s3, tmp_path, "flaky", steps=12, transient=True)
    assert "checkpoint step_4 FAILED" in err
    assert code == 0, err[-3000:]  # training went on and the later saves succeeded
    assert "step_4" not in tags or not tags["step_4"].complete
    assert tags["step_12"].complete and checkpoints.newest_complete("s3://ckpt/flaky").step == 12


def test_failed_final_checkpoint_exits_retryable(s3, tmp_path):
    code, err, tags = _run_with_fault(s3, tmp_path, "down", steps=4, transient=False)
    assert code == exitcodes.RETRYABLE, err[-3000:]
    assert "the final checkpoint step_4 was not written; exiting retryable" in err
    assert not tags["step_4"].complete and checkpoints.newest_complete("s3://ckpt/down") is None


def test_init_from_hugging_face_weights_on_s3_equals_local(s3, tmp_path, tiny_data):
    """init.from an s3:// Hugging Face directory (sharded safetensors, read by ranged requests
    through s3fs) gives the same first loss, bitwise, as the same directory on disk, at TP 2."""
    transformers = pytest.importorskip("transformers")
    import shutil

    import torch

    from tests.hf_models import MODELS
    torch.manual_seed(3)
    model_cfg, make = MODELS["llama"]
    local = tmp_path / "hf"
    transformers.LlamaForCausalLM(make()).save_pretrained(local, max_shard_size="400KB")
    shutil.copy(tiny_data["tokenizer"], local / "tokenizer.json")
    import boto3
    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{s3['port']}", region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    for f in local.iterdir():
        client.upload_file(str(f), "data", f"hf-llama/{f.name}")
    losses = {}
    for where, uri in (("local", str(local)), ("s3", "s3://data/hf-llama/")):
        res = run_trainer(2, [*data_overrides(tiny_data), f"init.from={uri}", "training.steps=1",
                              "parallelism.tensor=2", "checkpoint.uri=", "logging.interval=1",
                              f"logging.lossesFile={tmp_path / (where + '.jsonl')}"], env=s3["env"])
        assert res.returncode == 0, res.stderr[-3000:]
        assert f"initialised from {uri}" in res.stderr
        losses[where] = read_losses(tmp_path / f"{where}.jsonl")[1]["loss"]
    print(losses)
    assert losses["s3"] == losses["local"]


def _s3fs(s3):
    import fsspec
    store_env(s3["env"])
    return fsspec.filesystem("s3", endpoint_url=s3["env"]["FSSPEC_S3_ENDPOINT_URL"])


def test_multipart_checkpoint_writer_uploads_parts_concurrently_and_whole(s3):
    """store_write.S3PartsWriter: a file of several parts (5 MiB, S3's minimum) arrives whole,
    its parts sent while later bytes were still being written, and torch.load reads it."""
    from trainer.checkpoint import store_write
    fs, proxy = _s3fs(s3), s3["proxy"]
    payload = torch.arange(3 * 1024 * 1024 + 777, dtype=torch.float32)  # 12 MiB + a tail: 3 parts
    with store_write.S3PartsWriter(fs, "ckpt/parts/state.pt", part_bytes=5 << 20, in_flight=2) as fh, \
            store_write._without_crc32():
        torch.save({"x": payload}, fh)
        assert len(fh._parts) == 2, "full parts were not sent while the file was being written"
    uploads = [path for method, path, _, _ in proxy.requests if method == "PUT" and "partNumber=" in path]
    assert len(uploads) == 3, uploads
    with fs.open("ckpt/parts/state.pt", "rb") as fh:
        assert torch.equal(torch.load(fh)["x"], payload)
    assert torch.serialization.get_crc32_options(), "the process-wide CRC option was not restored"


def test_multipart_checkpoint_writer_leaves_nothing_when_a_part_fails(s3):
    """A part refused mid-file fails the write and aborts the upload: no object, no upload left."""
    from trainer.checkpoint import store_write
    fs, proxy = _s3fs(s3), s3["proxy"]
    writer = store_write.S3PartsWriter(fs, "ckpt/broken/state.pt", part_bytes=5 << 20, in_flight=2)
    with pytest.raises(Exception):
        with writer:
            writer.write(b"a" * (5 << 20))  # part 1 goes up
            proxy.failing.set()
            for _ in range(4):
                writer.write(b"b" * (5 << 20))
    proxy.failing.clear()
    assert proxy.failed_puts >= 1
    assert not fs.exists("ckpt/broken/state.pt")
    import boto3
    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{s3['port']}", region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    assert not client.list_multipart_uploads(Bucket="ckpt").get("Uploads"), "the failed upload was not aborted"


def test_small_files_and_local_store_round_trip(s3, tmp_path):
    """Below one part: one PUT. Locally: a plain file, fsynced; both load as torch.save wrote them."""
    import fsspec

    from trainer.checkpoint import store_write
    fs = _s3fs(s3)
    state = {"w": torch.randn(64, 64), "step": 3}
    store_write.save_torch(fs, "ckpt/small/state.pt", state)
    with fs.open("ckpt/small/state.pt", "rb") as fh:
        got = torch.load(fh)
    assert torch.equal(got["w"], state["w"]) and got["step"] == 3
    local = fsspec.filesystem("file")
    store_write.save_torch(local, str(tmp_path / "state.pt"), state)
    store_write.write_bytes(local, str(tmp_path / "done"), b"")
    assert torch.equal(torch.load(tmp_path / "state.pt")["w"], state["w"]) and (tmp_path / "done").exists()
