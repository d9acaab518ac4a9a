"""Asynchronous checkpoints in the NxD layout (see trainium_api.checkpoints for the layout and selection).

A save is two halves:
  * in the training loop, at a step boundary: copy model and optimizer tensors to host
    memory (the only stall), then hand the copy to this rank's writer thread;
  * in the writer thread: rank 0 writes the ``checkpoint`` begin marker; all ranks meet on a
    separate gloo group (so the loop's own collectives never interleave with ours), write
    their shards, and agree by an all-reduce whether every rank succeeded; only then rank 0
    writes ``meta.json`` and ``done``, and applies retention. NxD writes ``done`` only when
    the next save begins; we write it as soon as the last rank finished.

A new save waits for the previous one to finish, so at most one copy is in flight.

Fault drills: ``TRAINER_FAULT_CKPT_WRITE_DELAY=<seconds>`` makes every rank's writer wait that
long between the begin marker and its shards, so a drill (or a test) can kill the job or break
the store while a save is reliably in flight. It is read once at start and is off by default.
If a write fails (the store is down, a request errors) the tag gets no ``done``, the failure
is logged and counted, and training goes on; the next save tries again.

Fencing (trainium_api.checkpoints): under the operator every gang knows its epoch (the pod
contract's TRAINING_RUN_CREATED and ATTEMPT). Rank 0 raises the epoch's fence, with the complete
tags it sees, before it picks where to resume; before a save's begin marker, before its ``done``
and before retention it looks for a newer fence, and a gang that finds one (it was cut off from
the control plane while a new attempt started) writes no marker and deletes nothing, and stops
(``on_fenced``). A save that rewrites a tag
removes its old ``done`` before anything else, so a rewrite never leaves a stale one.
"""

from __future__ import annotations

import io
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field

import fsspec
import torch
import torch.distributed as dist

from trainium_api import checkpoints

from . import ckpt_store, store_write
from .busy import busy
from .config import CheckpointConfig, ConfigError
from .memtier import MemoryTier
from .parallel import ParallelState, all_agree

log = logging.getLogger(__name__)


@dataclass
class SaveResult:
    tag: str
    step: int
    ok: bool
    stall_seconds: float
    write_seconds: float = 0.0  # the whole background write, retention and memory copy included
    durable_seconds: float = 0.0  # from the save call until rank 0 wrote ``done``
    error: str = ""
    started: float = field(default=0.0, repr=False)  # perf_counter() at the save call


def host_copy(tensors, cache: dict | None = None, key: str = ""):
    """Host copies of every tensor in a (nested) dict; the loop may then mutate the originals.

    With ``cache``, buffers of the previous save are reused (same key, shape and dtype): the
    copy is then a plain memcpy instead of fresh allocations and page faults. Safe because a
    save starts only after the previous one finished writing.
    """
    if isinstance(tensors, torch.Tensor):
        src = tensors.detach()
        if src.device.type == "xla":
            # One device-to-host transfer of the materialised tensor (the step's graph ran at
            # the step boundary); the CPU copy is ours, no buffer cache needed.
            return src.cpu()
        buf = cache.get(key) if cache is not None else None
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu",
                              pin_memory=src.device.type == "cuda")
            if cache is not None:
                cache[key] = buf
        buf.copy_(src, non_blocking=src.device.type == "cuda")
        return buf
    if isinstance(tensors, dict):
        out = {k: host_copy(v, cache, f"{key}/{k}") for k, v in tensors.items()}
    elif isinstance(tensors, (list, tuple)):
        out = type(tensors)(host_copy(v, cache, f"{key}/{i}") for i, v in enumerate(tensors))
    else:
        return tensors
    if not key and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the optimizer must not run before the copies landed
    return out


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, ps: ParallelState, async_group=None, decision_group=None,
                 epoch: tuple[int, int] | None = None, on_fenced=lambda: None):
        """``async_group``: the writer threads' gloo group. ``decision_group``: a gloo group for
        the loop's own host-side agreement (None: the default group, when that is gloo).
        ``epoch``: this gang's (run creation, attempt) (None: not fenced, e.g. outside the operator);
        ``on_fenced``: called (on rank 0, from the writer) when a newer attempt's fence is seen."""
        self.cfg, self.ps = cfg, ps
        self.decision_group = decision_group
        self.fs, self.root = fsspec.core.url_to_fs(cfg.uri) if cfg.uri else (None, "")
        self.root = self.root.rstrip("/")
        self.group = async_group
        self._thread: threading.Thread | None = None
        self._last_save_time = time.monotonic()
        self.results: list[SaveResult] = []
        self._host_cache: dict = {}
        self.fault_delay = float(os.environ.get("TRAINER_FAULT_CKPT_WRITE_DELAY", "0") or 0)
        self.epoch, self.on_fenced = epoch, on_fenced
        self.fenced_by: tuple[int, int] | None = None  # the newer epoch whose fence this gang saw
        self.memory = MemoryTier(cfg.memory, cfg.uri, ps, async_group)
        self.restore_source: str | None = None  # where the last load read from (the gang's slowest rank)

    def _fenced(self) -> bool:
        """Rank 0: has a newer gang raised its fence? (Once seen, for good.)"""
        if self.fenced_by is None and self.epoch is not None:
            self.fenced_by = checkpoints.newer_fence(self.cfg.uri, self.epoch)
            if self.fenced_by is not None:
                log.error("%s has started (its fence is in %s): this gang (%s) writes and deletes nothing "
                          "more, and stops", self.describe(self.fenced_by), self.cfg.uri, self.describe(self.epoch))
                self.on_fenced()
        return self.fenced_by is not None

    def describe(self, epoch: tuple[int, int]) -> str:
        """'attempt N', or 'attempt N of a newer run' (one created again under this store)."""
        if self.epoch is not None and epoch[0] != self.epoch[0]:
            return f"attempt {epoch[1]} of a newer run"
        return f"attempt {epoch[1]}"

    # -- when ------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether to save after ``step`` (1-based count of finished steps). All ranks agree."""
        if not self.cfg.enabled():
            return False
        by_steps = self.cfg.interval_steps > 0 and step % self.cfg.interval_steps == 0
        by_time = 0
        if self.cfg.interval_minutes > 0:
            by_time = int(time.monotonic() - self._last_save_time >= 60 * self.cfg.interval_minutes)
            if self.ps.is_distributed:  # clocks differ per rank: rank 0's view wins
                flag = torch.tensor([by_time])  # a host tensor on a gloo group: no device sync
                dist.broadcast(flag, src=0, group=self.decision_group)
                by_time = int(flag.item())
        return by_steps or bool(by_time)

    # -- save ------------------------------------------------------------------------------

    def save(self, step: int, model_state: dict, optim_state: dict, scheduler_state: dict,
             user_content: dict, meta: dict) -> SaveResult:
        """Snapshot now; write in the background (or now, when async is off)."""
        t0 = time.perf_counter()
        self.wait()  # at most one save in flight
        with busy("save"):  # (a device-to-host copy may wait on the device without host CPU)
            snapshot = host_copy({"model": model_state, "optim": optim_state}, self._host_cache)
        stall = time.perf_counter() - t0
        result = SaveResult(checkpoints.tag_for_step(step), step, False, stall, started=t0)
        job = (result, snapshot, scheduler_state, user_content, meta)
        self._last_save_time = time.monotonic()
        if self.cfg.async_save:
            self._thread = threading.Thread(target=self._write, args=job, name="ckpt-writer", daemon=True)
            self._thread.start()
        else:
            self._write(*job)
            result.stall_seconds = time.perf_counter() - t0
        return result

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def finalize(self) -> SaveResult | None:
        """Wait for the in-flight save (call on SIGTERM and at exit). Returns the last result."""
        self.wait()
        return self.results[-1] if self.results else None

    def _files(self, meta: dict) -> list[str]:
        lay = meta["layout"]
        tps, pps = range(lay["tensor"]), range(lay.get("pipeline", 1))
        files = [f"model/{ckpt_store.shard_name(0, t, p)}" for p in pps for t in tps]
        dps = range(lay["data"]) if lay["zero1"] else [0]
        files += [f"optim/{ckpt_store.shard_name(d, t, p)}" for p in pps for d in dps for t in tps]
        return files + ["scheduler.pt", "user_content.pt", checkpoints.META]

    def _save_id(self) -> str:
        """What tells this save from every other one, a save of the same step included: rank
        0's random id, the same on every rank (recorded in meta.json and beside memory copies)."""
        box = [uuid.uuid4().hex]
        if self.ps.is_distributed:
            dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _barrier_ok(self, ok: bool) -> bool:
        """Every rank learns whether every rank succeeded (on the checkpoint's own group)."""
        return all_agree(ok, self.group, self.ps.is_distributed)

    def _write(self, result: SaveResult, snapshot: dict, scheduler_state: dict, user_content: dict,
               meta: dict) -> None:
        with busy("save"):  # idle in its barriers, still saving: the agent waits (trainer.busy)
            self._write_now(result, snapshot, scheduler_state, user_content, meta)

    def _write_now(self, result: SaveResult, snapshot: dict, scheduler_state: dict, user_content: dict,
                   meta: dict) -> None:
        t0 = time.perf_counter()
        ps, tag_dir = self.ps, f"{self.root}/{result.tag}"
        ok, error = True, ""
        meta = dict(meta, saveId=self._save_id())
        try:
            if ps.rank == 0:
                if self._fenced():
                    ok, error = False, f"fenced by {self.describe(self.fenced_by)}"
                else:
                    if self.fs.exists(f"{tag_dir}/{checkpoints.DONE}"):  # a rewrite: it stops counting first
                        self.fs.rm_file(f"{tag_dir}/{checkpoints.DONE}")
                    self.fs.makedirs(f"{tag_dir}/model", exist_ok=True)
                    self.fs.makedirs(f"{tag_dir}/optim", exist_ok=True)
                    store_write.write_bytes(self.fs, f"{tag_dir}/{checkpoints.BEGIN}",
                                            json.dumps({"writer": self.epoch}).encode())
        except Exception as exc:
            ok, error = False, f"begin marker: {exc}"
        ok = self._barrier_ok(ok)  # nobody writes shards before the begin marker exists
        if ok and self.fault_delay:
            time.sleep(self.fault_delay)
        if ok:
            try:
                if ps.dp_rank == 0:
                    model_shard = ckpt_store.shard_name(0, ps.tp_rank, ps.pp_rank)
                    store_write.save_torch(self.fs, f"{tag_dir}/model/{model_shard}", snapshot["model"])
                if ps.dp_rank == 0 or snapshot["optim"].get("zero1"):
                    name = ckpt_store.shard_name(ps.dp_rank, ps.tp_rank, ps.pp_rank)
                    store_write.save_torch(self.fs, f"{tag_dir}/optim/{name}", snapshot["optim"])
                if ps.rank == 0:
                    store_write.save_torch(self.fs, f"{tag_dir}/scheduler.pt", scheduler_state)
                    store_write.save_torch(self.fs, f"{tag_dir}/user_content.pt", user_content)
            except Exception as exc:
                ok, error = False, str(exc) or type(exc).__name__
            ok = self._barrier_ok(ok)
        if ok and ps.rank == 0:
            try:
                if self._fenced():
                    ok, error = False, f"fenced by {self.describe(self.fenced_by)}"
                else:
                    meta = dict(meta, files=self._files(meta), time=time.time(), writer=self.epoch)
                    store_write.write_bytes(self.fs, f"{tag_dir}/{checkpoints.META}",
                                            json.dumps(meta, indent=1).encode())
                    store_write.write_bytes(self.fs, f"{tag_dir}/{checkpoints.DONE}", b"")
                    result.durable_seconds = time.perf_counter() - result.started
            except Exception as exc:
                ok, error = False, f"completion marker: {exc}"
        # every rank learns whether rank 0 completed the tag (the memory tier keeps only complete
        # saves, and its exchanges are collective)
        ok = self._barrier_ok(ok)
        result.ok, result.error = ok, error
        result.write_seconds = time.perf_counter() - t0
        if ok:
            log.info("checkpoint %s complete (%.2fs in background%s)", result.tag, result.write_seconds,
                     f", durable {result.durable_seconds:.2f}s after the save began" if ps.rank == 0 else "")
            if ps.rank == 0 and self.cfg.keep:
                try:
                    fenced = self._fenced()
                except Exception as exc:  # noqa: BLE001 - the save is complete; retention waits for the next
                    log.warning("cannot look for a newer fence in %s (%s): retention skipped", self.cfg.uri, exc)
                    fenced = True
                deleted = [] if fenced else ckpt_store.apply_retention(self.cfg.uri, self.cfg.keep)
                if deleted:
                    log.info("retention removed %s", ", ".join(deleted))
        else:
            log.error("checkpoint %s FAILED, not marked done: %s", result.tag, error or "another rank failed")
        if ok:  # after the store: memory never delays durability, and a failed save keeps the previous copy
            self.memory.keep(result.tag, result.step, meta["saveId"], snapshot)
        self.results.append(result)

    # -- resume ----------------------------------------------------------------------------

    def select_resume(self) -> checkpoints.TagInfo | None:
        """The tag to resume from per ``checkpoint.resume``; rank 0 decides for everyone."""
        choice = None
        if self.cfg.uri and self.ps.rank == 0 and self.epoch is not None:
            # first: from now on every older gang is fenced, and a tag it completes later (not in
            # the list recorded here) is not resumed from (a store that cannot be written fails
            # the start: retried)
            checkpoints.raise_fence(self.cfg.uri, self.epoch,
                                    [t for t in checkpoints.list_tags(self.cfg.uri) if t.complete])
        if self.cfg.uri and self.cfg.resume != "none" and self.ps.rank == 0:
            if self.cfg.resume == "auto":
                choice = checkpoints.newest_complete(self.cfg.uri)
            else:
                tags = {t.tag: t for t in checkpoints.list_tags(self.cfg.uri)}
                choice = tags.get(self.cfg.resume)
                if choice is None or not choice.complete:
                    choice = ConfigError("checkpoint.resume",
                                         f"no complete checkpoint {self.cfg.resume!r} under {self.cfg.uri}")
        if self.ps.is_distributed:
            box = [choice]
            dist.broadcast_object_list(box, src=0, group=self.decision_group)
            choice = box[0]
        if isinstance(choice, ConfigError):
            raise choice
        return choice

    @staticmethod
    def read_model_shard(tag_uri: str, model, tp: int, tp_rank: int, keys=None) -> dict:
        """Model weights of TP rank ``tp_rank`` from a complete tag (init.from another run's
        checkpoint): same tensor degree and model shape required, checked before reading.
        Any pipeline degree: the tag's stage files are read and merged, and only ``keys``
        (this stage's parameter names; None: all) are kept."""
        fs, tag_dir = fsspec.core.url_to_fs(tag_uri.rstrip("/"))
        tag_dir = tag_dir.rstrip("/")
        if not fs.exists(f"{tag_dir}/{checkpoints.DONE}"):
            raise ConfigError("init.from", f"{tag_uri} is not a complete checkpoint (no {checkpoints.DONE})")
        meta = json.loads(fs.cat_file(f"{tag_dir}/{checkpoints.META}"))
        saved = meta.get("layout", {}).get("tensor")
        if saved != tp:
            raise ConfigError("parallelism.tensor", f"init.from {tag_uri} was written with tensor={saved}, this "
                                                    f"run has {tp} (convert it: python -m trainer.convert)")
        from .config import camel, to_dict
        for key, value in (meta.get("model") or {}).items():
            if key != "preset" and to_dict(model).get(key) != value:
                raise ConfigError(f"model.{camel(key)}", f"{to_dict(model).get(key)} in this run's model config "
                                                         f"but {value} in {tag_uri}")
        shard: dict = {}
        for pp_rank in range(meta.get("layout", {}).get("pipeline", 1)):
            with fs.open(f"{tag_dir}/model/{ckpt_store.shard_name(0, tp_rank, pp_rank)}", "rb") as fh:
                part = torch.load(io.BytesIO(fh.read()), map_location="cpu", weights_only=False)
            shard.update({k: v for k, v in part.items() if keys is None or k in keys})
        return shard

    def load(self, tag: checkpoints.TagInfo, layout: dict) -> dict:
        """Read this rank's shards of ``tag``; returns model, optim, scheduler, user_content, meta."""
        ps, tag_dir = self.ps, f"{self.root}/{tag.tag}"
        meta = json.loads(self.fs.cat_file(f"{tag_dir}/{checkpoints.META}"))
        if meta.get("weightsOnly"):
            raise ConfigError("checkpoint.uri", f"{tag.uri} holds weights only (python -m trainer.convert from-hf): "
                                                "give it as init.from, not under the run's checkpoint.uri")
        saved = meta.get("layout", {})
        dims = ("tensor", "pipeline", "data")
        if any(saved.get(d, 1) != layout[d] for d in dims):
            field = next(d for d in dims if saved.get(d, 1) != layout[d])
            raise ConfigError(f"parallelism.{field}" if field != "data" else "nodes",
                              f"checkpoint {tag.tag} was written with "
                              + " ".join(f"{d}={saved.get(d, 1)}" for d in dims) + "; this run has "
                              + " ".join(f"{d}={layout[d]}" for d in dims)
                              + " (NxD checkpoints load only with the same layout)")

        local = store_write.is_local(self.fs)

        def read(path):
            if local:  # mapped, not read: load_state_dict copies each tensor once, from the page cache
                try:
                    return torch.load(f"{tag_dir}/{path}", map_location="cpu", weights_only=False, mmap=True)
                except (OSError, RuntimeError) as exc:  # a mount that refuses mmap (some FUSE file systems)
                    log.warning("restore: cannot map %s (%s); reading it instead", path, exc)
            with self.fs.open(f"{tag_dir}/{path}", "rb") as fh:  # one GET, then parsed in memory
                return torch.load(io.BytesIO(fh.read()), map_location="cpu", weights_only=False)

        # model and optimizer from this node's memory or its peer's when they hold this very
        # save (trainer.memtier), else from the store; the small files always from the store
        restored = self.memory.restore(tag.tag, meta.get("step"), meta.get("saveId"), bool(saved.get("zero1")))
        self.restore_source = restored.gang_source
        if restored.state is not None:
            state = restored.state
        else:
            optim_dp = ps.dp_rank if saved.get("zero1") else 0
            state = {"model": read(f"model/{ckpt_store.shard_name(0, ps.tp_rank, ps.pp_rank)}"),
                     "optim": read(f"optim/{ckpt_store.shard_name(optim_dp, ps.tp_rank, ps.pp_rank)}")}
        return {**state, "scheduler": read("scheduler.pt"), "user_content": read("user_content.pt"), "meta": meta}
