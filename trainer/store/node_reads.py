"""One reader per node: the start-up reads every local rank makes alike are made once per node.

At 1,000 nodes x 32 ranks, every start of a gang would send 32,000 GETs of one tokenizer object
(and as many HEADs and listings of each data source) to one S3 prefix at once, which S3 answers
with SlowDown. So local rank 0 (torchrun's ``LOCAL_RANK``) makes each such read, with the
store's retries (trainer.store.errors), and publishes the result in a node-local directory; the
other local ranks of the same launch wait for it (at most :data:`WAIT_SECONDS`, longer than
the leader's retries take) and read the published copy, or, if nothing comes, read the store
themselves. A node sends one request where it sent 32.

- :func:`read_object`: a small object (a tokenizer, a manifest, a config). The leader asks the
  store for the object's size and ETag (or mtime), and keeps the bytes under ``objects/``, keyed
  by the URI and that version: a restart on the same node reads the copy after one HEAD, and an
  object replaced on the store is fetched again.
- :func:`query` (and :func:`exists`): a listing or a yes/no every rank asks: published for this
  launch only, never reused by a later one.

Where: ``$TRAINER_STORE_CACHE``, else ``<TMPDIR>/trainium-store-cache``: a pod's own disk, not
``/dev/shm``, which counts against the pod's memory limit and is the checkpoint memory tier's.
A launch is this node's ranks of one torchrun start: the same parent process (torchrun's agent,
or a warm launcher's fork server) and restart count. Files are written aside and renamed, so a
reader sees a whole file or none. Local paths are read directly: the node's page cache already
shares them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import fsspec

from ..contract.podenv import STORE_CACHE_ENV, PodEnv
from .errors import RETRY, StoreConfigError, StoreUnavailable, retry

log = logging.getLogger("trainer.store")

CACHE_ENV = STORE_CACHE_ENV
WAIT_SECONDS = RETRY.total_seconds + 60.0  # the leader's retries, and a minute more
POLL_SECONDS = (0.02, 0.5)  # first and longest wait between looks for the leader's file
LAUNCH_KEEP_SECONDS = 3600.0  # a launch's files are read within its start-up
OBJECT_KEEP_SECONDS = 7 * 86400.0  # an object copy no launch used for a week is removed
# errors the leader hands to the other ranks, re-raised there as the same type
_PUBLISHED = {cls.__name__: cls for cls in (FileNotFoundError, NotADirectoryError, IsADirectoryError)}


@dataclass(frozen=True)
class Node:
    """This process's place among its node's ranks, and where they share reads."""

    local_rank: int
    local_world: int
    launch: str  # the same for every local rank of one launch, different for the next
    root: Path

    @classmethod
    def from_env(cls, env: PodEnv | None = None) -> "Node | None":
        """None outside torchrun, or where the cache directory cannot be written."""
        env = env or PodEnv.from_environ()
        if not env.has_local_rank:
            return None
        root = Path(env.store_cache or Path(tempfile.gettempdir()) / "trainium-store-cache")
        try:
            (root / "objects").mkdir(parents=True, exist_ok=True)
            (root / "launches").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("store cache %s cannot be made (%s): every rank reads the store itself", root, exc)
            return None
        if not os.access(root, os.W_OK):
            return None
        return cls(env.local_rank, env.local_world_size or 1, _launch_id(env), root)

    @property
    def leads(self) -> bool:
        return self.local_rank == 0

    def launch_dir(self) -> Path:
        return self.root / "launches" / _digest(self.launch)[:24]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _start_ticks(pid: int) -> str:
    """A process's start time (clock ticks since boot), which tells a pid reused from another."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


def _launch_id(env: PodEnv) -> str:
    parent = os.getppid()
    return (f"{socket.gethostname()}/{parent}/{_start_ticks(parent)}/"
            f"{env.torchelastic_run_id}/{env.torchelastic_restart_count}")


def _write(path: Path, data: bytes) -> None:
    """Whole or not at all: written aside, then renamed over."""
    aside = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    aside.write_bytes(data)
    os.replace(aside, path)


def _publish(path: Path, data: bytes) -> None:
    """Best effort: a node-local disk that is full or read-only costs the other ranks their wait
    (they then read the store themselves), never the run."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write(path, data)
    except OSError as exc:
        log.warning("store cache: cannot write %s (%s); the node's other ranks will read the store", path, exc)


def _prune(directory: Path, older_than: float) -> None:
    """Remove what nobody used for ``older_than`` seconds (best effort: another leader sharing
    the directory may be removing it too)."""
    cutoff = time.time() - older_than
    try:
        entries = list(directory.iterdir())
    except OSError:
        return
    for entry in entries:
        try:
            if entry.stat().st_mtime < cutoff:
                if entry.is_dir():
                    for inner in entry.iterdir():
                        inner.unlink(missing_ok=True)
                    entry.rmdir()
                else:
                    entry.unlink(missing_ok=True)
        except OSError:
            continue


# --------------------------------------------------------------------------------------------
# Leader and followers
# --------------------------------------------------------------------------------------------


def _error_record(exc: BaseException) -> bytes:
    if isinstance(exc, StoreUnavailable):
        record = {"type": "StoreUnavailable", "message": exc.message}
    elif isinstance(exc, StoreConfigError):
        record = {"type": "StoreConfigError", "message": str(exc), "kind": exc.kind}
    else:
        record = {"type": type(exc).__name__, "message": str(exc)}
    return json.dumps(record).encode()


def _raise_published(record: dict, key: str) -> None:
    """The leader's error, raised here as the same type (so the caller names the same field)."""
    message = str(record.get("message", ""))
    kind = record.get("type")
    if kind == "StoreUnavailable":
        log.error("%s (local rank 0's read of %s)", message, key)
        raise StoreUnavailable(message)
    if kind == "StoreConfigError":
        raise StoreConfigError(message, str(record.get("kind", "")))
    if kind in _PUBLISHED:
        raise _PUBLISHED[kind](message)
    raise RuntimeError(f"local rank 0 failed to read {key}: {kind}: {message}")


def _lead(path: Path, compute: Callable[[], bytes]) -> bytes:
    if path.exists():  # read earlier in this launch (a held-out set naming the same tokenizer)
        return path.read_bytes()
    if not path.parent.exists():  # this launch's first read: the leader clears out old launches
        _prune(path.parent.parent, LAUNCH_KEEP_SECONDS)
    try:
        data = compute()
    except BaseException as exc:
        if isinstance(exc, (Exception, StoreUnavailable)):  # not a KeyboardInterrupt
            _publish(path.with_name(path.name + ".error"), _error_record(exc))
        raise
    _publish(path, data)
    return data


def _follow(path: Path, compute: Callable[[], bytes], key: str) -> bytes:
    deadline, pause = time.monotonic() + WAIT_SECONDS, POLL_SECONDS[0]
    error = path.with_name(path.name + ".error")
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_bytes()
        if error.exists():
            _raise_published(json.loads(error.read_text()), key)
        time.sleep(pause)
        pause = min(pause * 2, POLL_SECONDS[1])
    log.warning("local rank 0 did not publish %s within %.0f s: reading it from the store here", key, WAIT_SECONDS)
    return compute()


def shared(key: str, compute: Callable[[], bytes], node: Node | None = None) -> bytes:
    """``compute()`` made once per node and launch: by local rank 0, whose result (or error)
    the other local ranks take. ``key`` names the read (the same on every rank)."""
    node = node if node is not None else Node.from_env()
    if node is None or node.local_world <= 1:
        return compute()
    path = node.launch_dir() / _digest(key)
    return _lead(path, compute) if node.leads else _follow(path, compute, key)


def _local(uri: str) -> bool:
    return fsspec.core.split_protocol(uri)[0] in (None, "file", "local")


def query(uri: str, what: str, compute: Callable[[], Any]) -> Any:
    """``compute()``, a listing or a yes/no about ``uri`` whose answer is JSON, retried
    (trainer.store.errors) and made once per node and launch; ``what`` says what it does ("list").
    Local paths are asked here, on every rank."""
    ask = lambda: retry(compute, f"{what} {uri}")  # noqa: E731
    if _local(uri):
        return ask()
    return json.loads(shared(f"{what} {uri}", lambda: json.dumps(ask()).encode()))


def _exists(fs, path: str) -> bool:
    try:
        fs.info(path)
        return True
    except (FileNotFoundError, NotADirectoryError):  # the store answered: not there (a path under a
        return False                                 # local file: ENOTDIR). Anything else is retried


def exists(uri: str) -> bool:
    """Whether the object exists: False only when the store says it is not there. A refusal that
    persists raises StoreConfigError (the caller decides what a refusal means); a store that
    fails past the retries ends the process retryable."""
    fs, path = fsspec.core.url_to_fs(uri)
    return query(uri, "look up", lambda: _exists(fs, path))


# --------------------------------------------------------------------------------------------
# Objects
# --------------------------------------------------------------------------------------------


def _version(info: dict) -> str:
    """What changes when the object is replaced: its size and ETag (S3), or mtime (others)."""
    tag = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or ""
    return f"{info.get('size')}:{tag}"


def _fetch_versioned(fs, path: str, uri: str, root: Path) -> bytes:
    """The object's bytes, from this node's copy of the same version when there is one."""
    info = retry(lambda: fs.info(path), f"look up {uri}")
    if info.get("type") == "directory":
        raise IsADirectoryError(f"{uri} is a directory, not a file")
    copy = root / "objects" / f"{_digest(uri)[:32]}-{_digest(_version(info))[:16]}"
    if copy.exists() and copy.stat().st_size == info.get("size"):
        try:
            os.utime(copy)  # in use: kept by the pruning below
        except OSError:
            pass  # at worst pruned a week from now and fetched again
        return copy.read_bytes()
    size = info.get("size")
    if not isinstance(size, int):
        return retry(lambda: fs.cat_file(path), f"read {uri}")
    # one ranged GET, a byte past the size just looked up (s3fs's plain cat_file would look the
    # size up again): an object replaced in between comes back longer or shorter
    data = retry(lambda: fs.cat_file(path, start=0, end=size + 1), f"read {uri}") if size else b""
    if len(data) != size:  # another version than the key names: read it whole, keep no copy
        return retry(lambda: fs.cat_file(path), f"read {uri}")
    _prune(root / "objects", OBJECT_KEEP_SECONDS)
    _publish(copy, data)
    return data


def read_object(uri: str) -> bytes:
    """A small object every rank reads, fetched once per node (retried; see trainer.store.errors
    for what it raises)."""
    fs, path = fsspec.core.url_to_fs(uri)
    if _local(uri):
        return retry(lambda: fs.cat_file(path), f"read {uri}")
    node = Node.from_env()
    if node is None:
        return retry(lambda: fs.cat_file(path), f"read {uri}")
    return shared(f"object {uri}", lambda: _fetch_versioned(fs, path, uri, node.root), node)
