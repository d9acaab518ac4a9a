"""Checkpoint files written to the store fast, and durable when the write returns.

Where a save's background write spent its time (bench/checkpoint_stall, 1.61 GB on this
machine's disk): about a quarter in torch.save's CRC-32 of every record, the rest in the write
itself; on ``s3://``, s3fs uploads a file's parts one after another. So:

  * ``torch.save`` without its per-record CRC-32 (``torch.serialization.set_crc32_options``):
    ``torch.load`` never checks it, so it protected nothing here; the memory tier checks its
    own digest (trainer.checkpoint.memtier), and the store's files have records of their own (below).
  * every file written with ``save_torch`` gets a record, its size and xxh3-64 digest, computed on
    the bytes as they go out (no second pass over them; xxh3 runs at 10-28 GB/s here, far
    above any store's write rate). The writer puts the records in ``meta.json``; a restore
    checks each file it reads against them (trainer.checkpoint.checkpointer), so a shard cut short, expired
    or deleted is found before it is loaded, and the restore falls back to the previous tag.
  * local and mounted file systems: the file is fsynced before the write returns, so a tag's
    ``done`` never names shards that a crash of the node could still lose from its page cache
    (DCP's file writer fsyncs too).
  * ``s3://``: one multipart upload whose parts (``PART_BYTES``) go up ``PARTS_IN_FLIGHT`` at a
    time while torch.save produces the next ones, through s3fs's own request path (credentials,
    endpoint, retries of transient errors). A failed part aborts the upload: no object, no
    partial object. Memory: at most ``PARTS_IN_FLIGHT + 1`` parts per writing rank (one being
    filled, the others on their way).

Other protocols use the file system's own ``open``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xxhash

PART_BYTES = 32 << 20  # S3 allows 5 MiB to 5 GiB per part and 10,000 parts: 312 GiB per file
PARTS_IN_FLIGHT = 4

_crc = {"lock": threading.Lock(), "users": 0, "before": True}


@contextlib.contextmanager
def _without_crc32():
    """torch.save without CRC-32s while any writer is inside (a process-wide option: the first
    writer in turns it off, the last one out restores it; a torch.save another thread makes
    meanwhile skips them too, which torch.load never minds)."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    if get is None:  # an older torch: CRCs stay on
        yield
        return
    with _crc["lock"]:
        if _crc["users"] == 0:
            _crc["before"] = get()
            torch.serialization.set_crc32_options(False)
        _crc["users"] += 1
    try:
        yield
    finally:
        with _crc["lock"]:
            _crc["users"] -= 1
            if _crc["users"] == 0:
                torch.serialization.set_crc32_options(_crc["before"])


def _protocols(fs) -> tuple:
    return fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)


def is_local(fs) -> bool:
    return "file" in _protocols(fs) or "local" in _protocols(fs)


def is_s3(fs) -> bool:
    return "s3" in _protocols(fs) and hasattr(fs, "call_s3")


class S3PartsWriter:
    """A write-only file object over one S3 multipart upload, parts uploaded concurrently.

    ``close`` returns once the object exists whole; ``abort`` (or an error in any part, raised
    by the next ``write`` or by ``close``) leaves no object behind."""

    def __init__(self, fs, path: str, part_bytes: int = PART_BYTES, in_flight: int = PARTS_IN_FLIGHT):
        self.fs, self.path = fs, path
        self.bucket, self.key, _ = fs.split_path(path)
        self.part_bytes = part_bytes
        self._buf = bytearray()
        self._pos = 0
        self._upload_id: str | None = None
        self._parts: list[Future] = []
        self._slots = threading.BoundedSemaphore(in_flight)
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight = in_flight
        self.closed = False

    # -- file object ---------------------------------------------------------------------

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        """Parts go up when full; a flush does not cut a short part (S3's minimum is 5 MiB)."""

    def write(self, data) -> int:
        """Cut parts as the bytes come (torch.save hands over a whole tensor's storage in one
        call): at most one part is buffered here, besides those in flight."""
        self._raise_failed()
        view = memoryview(data).cast("B")
        i = 0
        while i < len(view):
            take = min(self.part_bytes - len(self._buf), len(view) - i)
            if not self._buf and take == self.part_bytes:
                self._send(bytes(view[i:i + take]))  # a whole part straight from the caller's bytes
            else:
                self._buf += view[i:i + take]
                if len(self._buf) == self.part_bytes:
                    self._send(bytes(self._buf))
                    self._buf = bytearray()
            i += take
        self._pos += len(view)
        return len(view)

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._upload_id is None:  # small: one PUT
                self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=bytes(self._buf))
            else:
                if self._buf:
                    self._send(bytes(self._buf))
                parts = [{"PartNumber": n, "ETag": f.result()} for n, f in enumerate(self._parts, 1)]
                self.fs.call_s3("complete_multipart_upload", Bucket=self.bucket, Key=self.key,
                                UploadId=self._upload_id, MultipartUpload={"Parts": parts})
        except BaseException:
            self.abort()
            raise
        finally:
            self._buf = bytearray()
            self._shutdown()
        self.closed = True
        self.fs.invalidate_cache(self.path)

    def abort(self) -> None:
        """Drop the upload: S3 discards its parts (idempotent; errors here are not the cause)."""
        self.closed = True
        self._shutdown()
        if self._upload_id is not None:
            upload, self._upload_id = self._upload_id, None
            with contextlib.suppress(Exception):
                self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=upload)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # -- parts ---------------------------------------------------------------------------

    def _send(self, body: bytes) -> None:
        if self._upload_id is None:
            self._upload_id = self.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key)["UploadId"]
            self._pool = ThreadPoolExecutor(self._in_flight, thread_name_prefix="ckpt-part")
        self._slots.acquire()  # bounded memory: wait while PARTS_IN_FLIGHT parts are on their way
        self._raise_failed()
        number = len(self._parts) + 1
        future = self._pool.submit(self._upload, number, body)
        future.add_done_callback(lambda _: self._slots.release())
        self._parts.append(future)

    def _upload(self, number: int, body: bytes) -> str:
        out = self.fs.call_s3("upload_part", Bucket=self.bucket, Key=self.key, UploadId=self._upload_id,
                              PartNumber=number, Body=body)
        return out["ETag"]

    def _raise_failed(self) -> None:
        for f in self._parts:
            if f.done() and f.exception() is not None:
                raise f.exception()

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def _fsync_dir(path: str) -> None:
    """The new file's directory entry too (where the file system allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(path or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def opened(fs, path: str):
    """A file to write ``path`` in the store; when the block exits cleanly the bytes are
    durable (fsynced, or the S3 object complete); when it raises, nothing is left on S3."""
    if is_s3(fs):
        with S3PartsWriter(fs, path) as fh:
            yield fh
    elif is_local(fs):
        with open(path, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(os.path.dirname(path))
    else:
        with fs.open(path, "wb") as fh:
            yield fh


class _Recording:
    """A write-only file that hands every byte on to ``inner`` and keeps their count and xxh3
    digest: the record of exactly the bytes written, taken as they pass."""

    def __init__(self, inner):
        self.inner, self.size, self._hash = inner, 0, xxhash.xxh3_64()

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.size  # the file is new: its position is what went through here

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        written = self.inner.write(data)
        if written is not None and written != len(view):  # raw files may write less; ours never do
            raise OSError(f"short write: {written} of {len(view)} bytes")
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        self.inner.flush()

    def record(self) -> dict:
        return {"size": self.size, "xxh3": self._hash.hexdigest()}


def save_torch(fs, path: str, obj) -> dict:
    """``torch.save(obj)`` streamed to the store (no second in-memory copy), durable on return.
    Returns the file's record (:func:`record_of`'s form) for ``meta.json``."""
    with opened(fs, path) as fh, _without_crc32():
        out = _Recording(fh)
        torch.save(obj, out)
    return out.record()


def write_bytes(fs, path: str, data: bytes) -> None:
    """A small file (meta.json, markers), durable on return."""
    if is_local(fs):
        with opened(fs, path) as fh:
            fh.write(data)
    else:
        fs.pipe_file(path, data)


# -- records: what a restore checks before it loads a file ------------------------------------

def record_of(data) -> dict:
    """The record of bytes in memory (a file read whole): size and xxh3-64."""
    view = memoryview(data).cast("B")
    return {"size": len(view), "xxh3": xxhash.xxh3_64_hexdigest(view)}


def local_record(path: str, size: int | None = None) -> dict:
    """The record of a local file, digested through a mapping (no copy; the pages it pulls in are
    the ones a mapped torch.load then reads). With ``size`` (the recorded one), a file of
    another size is not digested: the size alone tells it apart."""
    with open(path, "rb") as fh:
        actual = os.fstat(fh.fileno()).st_size
        if actual == 0 or (size is not None and actual != size):
            return {"size": actual, "xxh3": xxhash.xxh3_64_hexdigest(b"") if actual == 0 else None}
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return {"size": actual, "xxh3": xxhash.xxh3_64_hexdigest(mm)}


def mismatch(name: str, recorded: dict, actual: dict) -> str | None:
    """Why a file is not what its record says (one line), or None when it is."""
    if actual["size"] != recorded["size"]:
        return f"{name} is {actual['size']} bytes, {recorded['size']} when written"
    if actual["xxh3"] != recorded["xxh3"]:
        return f"{name} has xxh3 {actual['xxh3']}, {recorded['xxh3']} when written (changed since)"
    return None
