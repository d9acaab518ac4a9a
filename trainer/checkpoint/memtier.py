"""Checkpoints in node memory (checkpoint.memory): the newest save of every rank kept in its
node's memory, and one peer node's kept beside it, so that a restart restores from memory (an
in-place restart keeps the pod and its /dev/shm), a replaced node from its peer, and only
otherwise from the store.

    <root>/<run key>/own/rank_<r>/state.pt      this rank's model and optimizer state
    <root>/<run key>/own/rank_<r>/manifest.json  written last (by rename): what, which save, digest
    <root>/<run key>/peer/rank_<r>/...           the same from rank r of the previous node

``<root>`` is /dev/shm/trainium-checkpoints (the pod's memory volume: the pod contract mounts
an emptyDir of medium Memory there) or TRAINER_MEMORY_DIR; outside a pod (no TRAINING_RUN)
the tier is on only where TRAINER_MEMORY_DIR names a directory, so that local runs leave
nothing in a shared /dev/shm. ``<run key>`` is a digest of the run's identity (its store,
name and creation time): copies of another run are never read.

The store stays the truth. A save keeps its memory copy (writer thread, once every rank's store
shards are written, so memory never delays durability) with the save's identity: tag, step and
save id (trainium_api.checkpoints.save_id, in the store's meta.json too). A restore (collective) loads a memory copy only for the tag the
store says is complete, written by the same save (tag, step, save id, this rank's layout
coordinates) and with its digest intact; otherwise the peer's copy, checked the same way; else
the store. A copy is deleted before its replacement is written, so a torn write leaves none
(its manifest comes last). Peers form a ring over the nodes: node n keeps node n-1's copies.

Auto decides at every save, on every rank, and the ranks agree (a MIN all-reduce): on while
this node's copies (own and peer, each rank's state x ranks on the node) fit in half of what
is free for them (the memory volume's free space and the node's MemAvailable, counting what the
tier already holds as free).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import xxhash

from trainium_api.checkpoints import RESTORE_SOURCES
from trainium_api.spec import MEMORY_ALIASES

from ..contract.podenv import MEMORY_DIR_ENV, PodEnv
from ..model.parallel import ParallelState, RankGrid, all_agree

log = logging.getLogger(__name__)

DIR_ENV = MEMORY_DIR_ENV
POD_DIR = "/dev/shm/trainium-checkpoints"
STATE, MANIFEST = "state.pt", "manifest.json"
FIT_FRACTION = 0.5  # of the free memory the copies may take
MEMORY, PEER, STORE = RESTORE_SOURCES


def root_dir(env: PodEnv) -> Path | None:
    """Where the tier lives, or None where it is off by placement (outside a pod, no TRAINER_MEMORY_DIR)."""
    if env.memory_dir:
        return Path(env.memory_dir)
    return Path(POD_DIR) if env.training_run else None


def run_key(uri: str, env: PodEnv) -> str:
    """The run's identity: its store, its name and creation time under the operator."""
    ident = json.dumps([uri.rstrip("/"), env.training_run, env.training_run_created])
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def digest_of(path: Path) -> str:
    """xxh3-64 of the file (about 28 GB/s here, 7x zlib's crc32): what a restore checks first."""
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            return xxhash.xxh3_64_hexdigest(b"")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return xxhash.xxh3_64_hexdigest(mm)


def _remove(folder: Path) -> None:
    """Manifest first: a copy counts only while its manifest is there, and its state file is
    written only while it is not (a removal cut short never leaves a manifest over another
    save's state)."""
    with contextlib.suppress(OSError):  # gone already, or not removable: nothing here may stop a collective
        (folder / MANIFEST).unlink()
    shutil.rmtree(folder, ignore_errors=True)


def _held_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # removed meanwhile
                total += os.stat(os.path.join(dirpath, name)).st_size
    return total


def _cgroup_free() -> int | None:
    """What the pod's cgroup (v2) memory limit leaves (the memory emptyDir counts against it),
    None without a limit."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        return None


def _mem_available() -> int | None:
    with contextlib.suppress(OSError), open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def state_bytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, dict):
        return sum(state_bytes(v) for v in tensors.values())
    if isinstance(tensors, (list, tuple)):
        return sum(state_bytes(v) for v in tensors)
    return 0


@dataclass
class Restored:
    state: dict | None  # {"model": ..., "optim": ...}, None: read the store
    source: str  # this rank's: memory, peer or store
    gang_source: str  # the slowest rank's (store > peer > memory)


class MemoryTier:
    """One rank's memory tier. ``group``: a gloo group for the tier's collectives (the
    checkpoint writers'); every rank makes the same calls in the same order, and no local
    failure (a full /dev/shm, an unreadable copy) skips one: it only makes that rank read the
    store."""

    def __init__(self, mode: str, uri: str, ps: ParallelState, group=None, root: Path | None = None,
                 env: PodEnv | None = None):
        env = env or PodEnv.from_environ()
        mode = MEMORY_ALIASES.of(mode)  # Auto, Peers or Disabled, however the caller spelled it
        base = root if root is not None else root_dir(env)
        self.ps, self.group = ps, group
        self.on = mode != "Disabled" and bool(uri) and base is not None
        self.base = base / run_key(uri, env) if self.on else None
        self.fits: bool | None = None  # the last save's decision (logged when it changes)
        # every rank makes the tier's calls, or none does
        agreed = all_agree(self.on, group, getattr(ps, "is_distributed", False))
        if self.on and not agreed:
            log.warning("checkpoint memory tier off: another rank has no memory directory (%s or a pod's "
                        "TRAINING_RUN)", DIR_ENV)
        self.on = agreed
        if not self.on:
            self.base = None
            return
        self.local_world = env.local_world_size if env.local_world_size is not None else ps.world_size
        self.nnodes = max(1, ps.world_size // self.local_world)
        self.node = ps.rank // self.local_world
        local = ps.rank % self.local_world
        # the ring: this rank's copy goes to the same local rank of the next node, and it keeps
        # the previous node's
        self.next_rank = ((self.node + 1) % self.nnodes) * self.local_world + local
        self.prev_rank = ((self.node - 1) % self.nnodes) * self.local_world + local
        self.peers = mode == "Peers" and self.nnodes > 1

    def own_dir(self) -> Path:
        return self.base / "own" / f"rank_{self.ps.rank}"

    def peer_dir(self) -> Path:
        return self.base / "peer" / f"rank_{self.prev_rank}"

    def coordinates(self, rank: int | None = None) -> dict:
        """What a copy of ``rank`` (default this one) holds: its place in this layout."""
        ps = self.ps
        rank = ps.rank if rank is None else rank
        pp, dp, tp = RankGrid(ps.pp, ps.dp, ps.tp).coords(rank)
        return {"rank": rank, "tp": tp, "pp": pp, "dp": dp, "layout": [ps.tp, ps.pp, ps.dp], "world": ps.world_size}

    def _keeps(self, rank_dp: int, zero1: bool) -> bool:
        """Whether a rank's own state is what the store holds for it: the store has data rank 0's
        model and optimizer for every data rank unless ZeRO-1 shards the optimizer (another data
        rank's stochastic-rounding generator differs), so those ranks read the store."""
        return zero1 or rank_dp == 0

    # -- save (the writer thread) -------------------------------------------------------------

    def _free(self) -> int:
        """Bytes free on this node for the tier: the least of the memory volume's free space,
        the node's MemAvailable and what the pod's cgroup memory limit leaves. The node's, not
        this rank's: its other ranks share it."""
        self.base.mkdir(parents=True, exist_ok=True)  # a new node's memory has none yet
        st = os.statvfs(self.base)
        room = st.f_bavail * st.f_frsize
        for free in (_mem_available(), _cgroup_free()):
            if free is not None:
                room = min(room, free)
        return room

    def _receive_limit(self) -> int:
        """What one rank may accept from a peer: its share of the node's free memory."""
        try:
            return self._free() // self.local_world
        except OSError:
            return 0

    def _fit(self, snapshot: dict) -> bool:
        # every rank of the node: its copy, and with peers the one it holds for its peer and the
        # buffer that receives it; the run's copies on the node now are replaced, so count as free
        need = state_bytes(snapshot) * (3 if self.peers else 1) * self.local_world
        try:
            room = self._free() + _held_bytes(self.base)
        except OSError as exc:
            log.warning("checkpoint memory tier: %s is not usable (%s)", self.base, exc)
            return False
        ok = need <= FIT_FRACTION * room
        if not ok and self.fits is not False:
            log.warning("checkpoint memory tier off for this save: this node's copies need %.2f GB, more than "
                        "%.0f%% of the %.2f GB free for them (restores read the store)", need / 1e9,
                        100 * FIT_FRACTION, room / 1e9)
        return ok

    def keep(self, tag: str, step: int, save_id: str, snapshot: dict) -> None:
        """Keep this complete save in memory (and, with peers, the previous node's beside it).
        Collective: every rank's writer calls it after every complete save. Never raises: the
        tier is a cache of the store."""
        if not self.on:
            return
        t0 = time.perf_counter()
        fits = all_agree(self._fit(snapshot), self.group, self.ps.is_distributed)
        if fits != self.fits and fits:
            log.info("checkpoint memory tier on: each save is kept in %s%s", self.base,
                     " and on the next node" if self.peers else "")
        self.fits = fits
        own = self.own_dir()
        _remove(own)  # first, and whatever follows: no older save's copy outlives this one
        if self.peers:
            _remove(self.peer_dir())
        manifest = None
        if fits and self._keeps(self.ps.dp_rank, bool(snapshot["optim"].get("zero1"))):
            try:
                own.mkdir(parents=True, exist_ok=True)
                with _no_zip_crc32():
                    torch.save(snapshot, own / STATE)
                manifest = {"tag": tag, "step": step, "saveId": save_id, "coordinates": self.coordinates(),
                            "size": (own / STATE).stat().st_size, "xxh3": digest_of(own / STATE)}
                (own / (MANIFEST + ".tmp")).write_text(json.dumps(manifest))
                os.replace(own / (MANIFEST + ".tmp"), own / MANIFEST)
            except Exception as exc:  # noqa: BLE001 - a full tmpfs, a removed volume: the store still has it
                log.warning("checkpoint memory tier: could not keep %s (%s)", tag, exc)
                _remove(own)
                manifest = None
        if self.peers and fits:
            self._send_to_peer(manifest)
        if manifest is not None and self.ps.rank == 0:
            log.info("checkpoint %s kept in memory in %.2f s", tag, time.perf_counter() - t0)

    def _send_to_peer(self, manifest: dict | None) -> None:
        """Give this rank's copy to the next node's, take the previous node's (one exchange)."""
        peer = self.peer_dir()
        limit = self._receive_limit()
        got = _exchange(json.dumps(manifest).encode() if manifest is not None else b"",
                        self.own_dir() / STATE if manifest is not None else None, self.next_rank, self.prev_rank,
                        self.group, peer / STATE, limit)
        try:
            if got is not None:
                (peer / (MANIFEST + ".tmp")).write_text(got.decode())
                os.replace(peer / (MANIFEST + ".tmp"), peer / MANIFEST)
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("checkpoint memory tier: peer copy not kept (%s)", exc)
            _remove(peer)

    # -- restore (collective) -----------------------------------------------------------------

    def _valid(self, folder: Path, tag: str, step: int, save_id: str, coordinates: dict,
               check_digest: bool = True) -> dict | None:
        """The manifest of a copy in ``folder`` that is this save's, for these coordinates, and
        (``check_digest``) intact: its size and digest as when it was written."""
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
            if (manifest.get("tag"), manifest.get("step"), manifest.get("saveId"), manifest.get("coordinates")) != \
                    (tag, step, save_id, coordinates):
                return None
            if (folder / STATE).stat().st_size != manifest.get("size") or (
                    check_digest and digest_of(folder / STATE) != manifest.get("xxh3")):
                log.warning("checkpoint memory tier: the copy in %s is not as written (size or digest): not loaded",
                            folder)
                return None
            return manifest
        except (OSError, ValueError, AttributeError):
            return None

    def restore(self, tag: str, step: int, save_id: str | None, zero1: bool) -> Restored:
        """This rank's state for the store's complete ``tag``, from memory or its peer, or
        Restored(None, ...) to read the store. Collective."""
        if not self.on:
            return Restored(None, STORE, STORE)
        mine = self.coordinates()
        own = self._valid(self.own_dir(), tag, step, save_id, mine) \
            if save_id and self._keeps(self.ps.dp_rank, zero1) else None
        # the copy held for the previous node: its digest is checked only if it is asked for
        held = self._valid(self.peer_dir(), tag, step, save_id, self.coordinates(self.prev_rank),
                           check_digest=False) if (save_id and self.peers) else None
        # who has what: [own ok, holds a copy of the previous node's]
        flags = torch.tensor([[int(own is not None), int(held is not None)]])
        if self.ps.is_distributed:
            everyone = [torch.zeros_like(flags) for _ in range(self.ps.world_size)]
            dist.all_gather(everyone, flags, group=self.group)
            table = torch.cat(everyone).tolist()
        else:
            table = flags.tolist()
        source, state = STORE, None
        if own is not None:
            source, state = MEMORY, _load_or_none(self.own_dir() / STATE)
            if state is None:
                source = STORE
        # the exchanges: a rank without its copy whose next node holds one asks for it (every
        # rank computes the same pairs from the same table)
        need = self.peers and not table[self.ps.rank][0] and bool(table[self.next_rank][1])
        give = self.peers and not table[self.prev_rank][0] and bool(table[self.ps.rank][1])
        if give and self._valid(self.peer_dir(), tag, step, save_id, self.coordinates(self.prev_rank)) is None:
            held = None  # not as written: the previous node's rank is told there is nothing (it reads the store)
        if need or give:
            dest = self.own_dir()
            if need:
                _remove(dest)
            limit = self._receive_limit() if need else 0
            got = _exchange(json.dumps(held).encode() if give and held is not None else b"",
                            self.peer_dir() / STATE if give and held is not None else None,
                            self.prev_rank if give else None, self.next_rank if need else None,
                            self.group, dest / STATE if need else None, limit)
            if need:
                try:
                    manifest = json.loads(got.decode()) if got else None
                    if manifest is not None:
                        (dest / MANIFEST).write_text(json.dumps(manifest))  # this node's own copy again ...
                    if manifest is not None and self._valid(dest, tag, step, save_id, mine):  # ... if it is
                        source, state = PEER, _load_or_none(dest / STATE)
                except (OSError, ValueError, UnicodeDecodeError):
                    state = None
                if state is None:
                    log.warning("checkpoint memory tier: the next node had no good copy of this rank's save, "
                                "or it arrived torn: reading the store")
                    _remove(dest)
                    source = STORE
        gang = self._gang_source(source)
        return Restored(state, source, gang)

    def _gang_source(self, source: str) -> str:
        if not self.ps.is_distributed:
            return source
        worst = torch.tensor([RESTORE_SOURCES.index(source)])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.group)
        return RESTORE_SOURCES[int(worst.item())]


@contextlib.contextmanager
def _no_zip_crc32():
    """torch.save computes a crc32 of every record (miniz, about 0.5 GB/s here), most of a write
    to memory. A memory copy has our own digest (xxh3, 28 GB/s here) and is read only by this
    trainer, so it goes without; the store's shards keep theirs (torch before 2.6 cannot read
    a file without them). torch's setting is process-wide: only the checkpoint writer thread
    saves, one save at a time. torch before 2.6 has no such setting and computes it."""
    try:
        from torch.utils.serialization import config
        patch = config.patch
    except (ImportError, AttributeError):
        yield
        return
    with patch({"save.compute_crc32": False}):
        yield


def _load_or_none(path: Path) -> dict | None:
    """Mapped, not read: the tensors are views of the memory file's pages until load_state_dict
    copies them (one copy, as from the store's page cache). Tensors and plain data only
    (weights_only): the file is in a directory anything in the pod can write. None when it
    cannot be loaded (that rank reads the store)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - whatever is wrong with the copy, the store has it
        log.warning("checkpoint memory tier: cannot load %s (%s): reading the store", path, exc)
        return None


MAX_HEADER = 1 << 20  # a manifest is a few hundred bytes


def _exchange(header: bytes, payload: Path | None, to: int | None, frm: int | None, group,
              into: Path | None, limit: int) -> bytes | None:
    """Send (header, payload file) to rank ``to`` and receive the same from rank ``frm`` (either
    may be None), at once: sizes first, then the receiver's answer (it takes sizes it can hold:
    ``limit`` bytes), then the bytes, so that neither side waits for what the other will not
    send. The received file is written to ``into``. Returns the received header, or None when
    nothing came (the sender had nothing, or it did not fit, or it could not be written)."""
    data = None
    if to is not None and header and payload is not None:
        try:  # mapped by the tensor itself: the pages live as long as anything (gloo) uses them
            size = payload.stat().st_size
            if size:
                data = torch.from_file(str(payload), shared=False, size=size, dtype=torch.uint8)
        except (OSError, RuntimeError) as exc:
            log.warning("checkpoint memory tier: cannot send %s (%s)", payload, exc)
    if data is None:
        header = b""
    sizes_out = torch.tensor([len(header), data.numel() if data is not None else 0], dtype=torch.int64)
    sizes_in = torch.zeros(2, dtype=torch.int64)
    _run([(dist.isend, sizes_out, to)] if to is not None else [],
         [(dist.irecv, sizes_in, frm)] if frm is not None else [], group)
    n_header, n_payload = (int(x) for x in sizes_in.tolist())
    recv_header = recv_payload = None
    if frm is not None and 0 < n_header <= MAX_HEADER and 0 < n_payload <= limit:
        try:
            recv_header = torch.empty(n_header, dtype=torch.uint8)
            recv_payload = torch.empty(n_payload, dtype=torch.uint8)
        except (MemoryError, RuntimeError):
            recv_header = recv_payload = None
    accept_out = torch.tensor([int(recv_header is not None)])
    accept_in = torch.zeros(1, dtype=torch.int64)
    _run([(dist.isend, accept_out, frm)] if frm is not None else [],
         [(dist.irecv, accept_in, to)] if to is not None else [], group)
    sends = [(dist.isend, torch.frombuffer(bytearray(header), dtype=torch.uint8), to), (dist.isend, data, to)] \
        if to is not None and data is not None and accept_in.item() else []
    recvs = [(dist.irecv, recv_header, frm), (dist.irecv, recv_payload, frm)] if recv_header is not None else []
    _run(sends, recvs, group)
    if recv_header is None:
        return None
    try:
        into.parent.mkdir(parents=True, exist_ok=True)
        with open(into, "wb") as out:
            out.write(memoryview(recv_payload.numpy()))
    except OSError as exc:
        log.warning("checkpoint memory tier: cannot write %s (%s)", into, exc)
        return None
    return bytes(recv_header.numpy())


def _run(sends: list, recvs: list, group) -> None:
    ops = [dist.P2POp(op, tensor, peer, group) for op, tensor, peer in sends + recvs]
    for req in dist.batch_isend_irecv(ops) if ops else []:
        req.wait()
