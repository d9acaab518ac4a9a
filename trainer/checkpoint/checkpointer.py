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

Damaged checkpoints: every file a save writes gets a record in ``meta.json`` (``digests``: its
size and xxh3-64, computed by trainer.checkpoint.store_write on the bytes as they are written; the ranks'
records reach rank 0 with the shards' agreement). A restore checks each file it reads against
its record; a file missing, cut short or changed, a meta.json or shard that cannot be read or
parsed, makes the tag damaged. The ranks agree, and all of them fall back to the previous
complete tag (trainium_api.checkpoints.complete_before, the fencing rules of newest_complete),
and so on; the damaged tag stays in the store, named in the log and in ``Checkpointer.skipped``.
A tag written before records existed is trusted as it was.
"""

from __future__ import annotations

import io
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

import fsspec
import torch
import torch.distributed as dist

from trainium_api import checkpoints, exitcodes
from trainium_api.progress import SkippedCheckpoint

from . import ckpt_store, store_write
from ..store import errors as store_errors
from ..contract.busy import busy
from ..contract.podenv import PodEnv
from ..config import CheckpointConfig, ConfigError
from . import memtier
from .memtier import MemoryTier
from ..model.parallel import ParallelState

log = logging.getLogger(__name__)


DIGESTS = "digests"  # meta.json's records: {file: {"size": bytes, "xxh3": hex}} (store_write.save_torch)


class Damaged(Exception):
    """A tag's file is not as written (missing, cut short, changed) or cannot be read or parsed."""


class NoIntactCheckpoint(SystemExit):
    """Complete checkpoints exist but none loads. The process exits RETRYABLE (a SystemExit: the
    entry point's clean-up still runs) instead of training from step 0.

    Why not start over: the store has checkpoints, so this run made progress. A fresh start would
    save new tags under the same names over the damaged ones and retention would delete the rest,
    destroying for good what may be unreadable only for now (a store outage, expired credentials
    and a mount not yet ready read as damage too). A retryable exit keeps every tag: the operator
    retries within the run's restart budget (a passing cause clears), and a person can repair or
    remove the damaged tags, or set ``checkpoint.resume: none`` to start over on purpose."""

    def __init__(self, message: str):
        super().__init__(exitcodes.RETRYABLE)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _one_line(text: str, limit: int = 240) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


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
                 epoch: tuple[int, int] | None = None, on_fenced=lambda: None, env: PodEnv | None = None):
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
        env = env or PodEnv.from_environ()
        self.fault_delay = env.fault_ckpt_write_delay
        self.epoch, self.on_fenced = epoch, on_fenced
        self.fenced_by: tuple[int, int] | None = None  # the newer epoch whose fence this gang saw
        self.memory = MemoryTier(cfg.memory, cfg.uri, ps, async_group, env=env)
        self.restore_source: str | None = None  # where the last load read from (the gang's slowest rank)
        self.skipped: SkippedCheckpoint | None = None  # the newest damaged tag the last load did not take

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
        return tag_files(meta["layout"])

    def _save_id(self) -> str:
        """What tells this save from every other one, a save of the same step included: rank
        0's random id, the same on every rank (recorded in meta.json and beside memory copies)."""
        box = [uuid.uuid4().hex]
        if self.ps.is_distributed:
            dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _agree(self, ok: bool, error: str, records: dict | None = None) -> tuple[bool, str, dict]:
        """Every rank learns whether every rank succeeded, the first rank's error that did not
        (so each pod reports what broke, not only that another rank failed) and, for the shards,
        every rank's file records for rank 0's meta.json: one all-gather on the checkpoint's own
        group, the same call on every rank."""
        records = records or {}
        if not self.ps.is_distributed:
            return ok, error, dict(records)
        everyone: list = [None] * self.ps.world_size
        dist.all_gather_object(everyone, (ok, error, records), group=self.group)
        merged = {}
        for _, _, theirs in everyone:
            merged.update(theirs)
        first = next((f"rank {r}: {why}" for r, (fine, why, _) in enumerate(everyone) if not fine and why), "")
        return all(fine for fine, _, _ in everyone), error or first, merged

    def _write_files(self, tag_dir: str, snapshot: dict, scheduler_state: dict, user_content: dict,
                     records: dict) -> None:
        """This rank's files of the tag; each one's record (size, xxh3) goes into ``records``."""
        ps = self.ps

        def save(path: str, obj) -> None:
            records[path] = store_write.save_torch(self.fs, f"{tag_dir}/{path}", obj)
        if ps.dp_rank == 0:
            save(f"model/{ckpt_store.shard_name(0, ps.tp_rank, ps.pp_rank)}", snapshot["model"])
        if ps.dp_rank == 0 or snapshot["optim"].get("zero1"):
            save(f"optim/{ckpt_store.shard_name(ps.dp_rank, ps.tp_rank, ps.pp_rank)}", snapshot["optim"])
        if ps.rank == 0:
            save("scheduler.pt", scheduler_state)
            save("user_content.pt", user_content)

    def _write(self, result: SaveResult, snapshot: dict, scheduler_state: dict, user_content: dict,
               meta: dict) -> None:
        with busy("save"):  # idle in its barriers, still saving: the agent waits (trainer.contract.busy)
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
                    if self.fs.exists(f"{tag_dir}/{checkpoints.DAMAGED}"):  # and is whole again once done
                        self.fs.rm_file(f"{tag_dir}/{checkpoints.DAMAGED}")
                    self.fs.makedirs(f"{tag_dir}/model", exist_ok=True)
                    self.fs.makedirs(f"{tag_dir}/optim", exist_ok=True)
                    store_write.write_bytes(self.fs, f"{tag_dir}/{checkpoints.BEGIN}",
                                            json.dumps({"writer": self.epoch}).encode())
        except Exception as exc:
            ok, error = False, f"begin marker: {exc}"
        ok, error, _ = self._agree(ok, error)  # nobody writes shards before the begin marker exists
        if ok and self.fault_delay:
            time.sleep(self.fault_delay)
        records: dict = {}
        if ok:
            try:
                self._write_files(tag_dir, snapshot, scheduler_state, user_content, records)
            except Exception as exc:
                ok, error = False, str(exc) or type(exc).__name__
            ok, error, records = self._agree(ok, error, records)
        if ok and ps.rank == 0:
            try:
                if self._fenced():
                    ok, error = False, f"fenced by {self.describe(self.fenced_by)}"
                else:
                    meta = dict(meta, files=self._files(meta), time=time.time(), writer=self.epoch,
                                **{DIGESTS: dict(sorted(records.items()))})
                    store_write.write_bytes(self.fs, f"{tag_dir}/{checkpoints.META}",
                                            json.dumps(meta, indent=1).encode())
                    store_write.write_bytes(self.fs, f"{tag_dir}/{checkpoints.DONE}", b"")
                    result.durable_seconds = time.perf_counter() - result.started
            except Exception as exc:
                ok, error = False, f"completion marker: {exc}"
        # every rank learns whether rank 0 completed the tag (the memory tier keeps only complete
        # saves, and its exchanges are collective)
        ok, error, _ = self._agree(ok, error)
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
            store_errors.retry(lambda: checkpoints.raise_fence(
                self.cfg.uri, self.epoch, [t for t in checkpoints.list_tags(self.cfg.uri) if t.complete]),
                f"raise this gang's fence in {self.cfg.uri}")
        if self.cfg.uri and self.cfg.resume != "none" and self.ps.rank == 0:
            if self.cfg.resume == "auto":
                choice = store_errors.retry(lambda: checkpoints.newest_complete(self.cfg.uri),
                                            f"list {self.cfg.uri}")
                if choice is None:  # none complete: but were some marked damaged by an earlier restore?
                    choice = self._all_damaged()
            else:
                tags = {t.tag: t for t in store_errors.retry(lambda: checkpoints.list_tags(self.cfg.uri),
                                                             f"list {self.cfg.uri}")}
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
        if isinstance(choice, str):  # every checkpoint of the store was marked damaged
            raise NoIntactCheckpoint(choice)
        return choice

    def _all_damaged(self) -> str | None:
        """Why not to start from step 0 when the store's only checkpoints were marked damaged
        (checkpoints.DAMAGED; see NoIntactCheckpoint), or None when it holds none."""
        damaged = [t.tag for t in store_errors.retry(lambda: checkpoints.list_tags(self.cfg.uri, read_meta=False),
                                                     f"list {self.cfg.uri}") if t.damaged]
        if not damaged:
            return None
        message = (f"every checkpoint under {self.cfg.uri} was found damaged by an earlier restore "
                   f"({', '.join(damaged)}: each has a '{checkpoints.DAMAGED}' file saying why); exiting retryable "
                   f"rather than training from step 0 over them (repair a tag and remove its marker, or set "
                   f"checkpoint.resume: none to start over)")
        log.error("%s", message)
        return message

    @staticmethod
    def read_model_shard(tag_uri: str, model, tp: int, tp_rank: int, keys=None) -> dict:
        """Model weights of TP rank ``tp_rank`` from a complete tag (init.from another run's
        checkpoint): same tensor degree and model shape required, checked before reading.
        Any pipeline degree: the tag's stage files are read and merged, and only ``keys``
        (this stage's parameter names; None: all) are kept."""
        fs, tag_dir = fsspec.core.url_to_fs(tag_uri.rstrip("/"))
        tag_dir = tag_dir.rstrip("/")
        done, meta_path = f"{tag_dir}/{checkpoints.DONE}", f"{tag_dir}/{checkpoints.META}"
        if not store_errors.retry(lambda: fs.exists(done), f"look for {done}"):
            raise ConfigError("init.from", f"{tag_uri} is not a complete checkpoint (no {checkpoints.DONE})")
        meta = json.loads(store_errors.retry(lambda: fs.cat_file(meta_path), f"read {meta_path}"))
        saved = meta.get("layout", {}).get("tensor")
        if saved != tp:
            raise ConfigError("parallelism.tensor", f"init.from {tag_uri} was written with tensor={saved}, this "
                                                    f"run has {tp} (convert it: python -m trainer.checkpoint.convert)")
        from trainium_api.fields import snake

        from ..config import camel, to_dict
        for key, value in (meta.get("model") or {}).items():
            if key != "preset" and hasattr(model, snake(key)) and not model.same_field(snake(key), value):
                raise ConfigError(f"model.{camel(key)}", f"{to_dict(model).get(key)} in this run's model config "
                                                         f"but {value} in {tag_uri}")
        shard: dict = {}
        records = meta.get(DIGESTS)
        for pp_rank in range(meta.get("layout", {}).get("pipeline", 1)):
            path = f"model/{ckpt_store.shard_name(0, tp_rank, pp_rank)}"
            data = store_errors.retry(lambda: _read_all(fs, f"{tag_dir}/{path}"), f"read {tag_dir}/{path}")
            try:  # a damaged source is refused by name: a first start has nothing older to take
                if isinstance(records, dict):
                    _check(path, _record(records, path), store_write.record_of(data))
            except Damaged as exc:
                raise ConfigError("init.from", f"{tag_uri} is damaged: {exc}") from None
            part = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
            shard.update({k: v for k, v in part.items() if keys is None or k in keys})
        return shard

    def load(self, tag: checkpoints.TagInfo, layout: dict) -> dict:
        """This rank's state of ``tag``: model, optim, scheduler, user_content, meta, and ``tag``
        (the TagInfo loaded). Collective. When any rank finds ``tag`` damaged (:class:`Damaged`),
        every rank falls back to the newest complete tag older than it (resume ``auto`` only: a
        tag named in ``checkpoint.resume`` is what was asked for), and so on; the damaged tags
        stay in the store and the newest is ``self.skipped``. Raises NoIntactCheckpoint when no
        tag is left, ConfigError when a tag's layout differs from this run's."""
        self.skipped, damaged = None, []
        while True:
            state, why = self._load_agreed(tag, layout)
            if why is None:
                return {**state, "tag": tag}
            damaged.append(f"{tag.tag} ({why})")
            self.skipped = self.skipped or SkippedCheckpoint(tag.tag, why)
            self._mark_damaged(tag, why)
            previous = self._previous(tag)
            if self.ps.rank == 0:
                log.warning("checkpoint %s is damaged, not resuming from it (it stays in %s): %s; %s", tag.tag,
                            self.cfg.uri, why, f"falling back to {previous.tag}" if previous is not None
                            else "no older complete checkpoint to fall back to")
            if previous is None:
                message = (f"no complete checkpoint under {self.cfg.uri} loads: {'; '.join(damaged)}. They are "
                           "left as they are; exiting retryable rather than training from step 0 over them "
                           "(repair or remove them, or set checkpoint.resume: none to start over)")
                if self.ps.rank == 0:
                    log.error("%s", message)
                raise NoIntactCheckpoint(message)
            tag = previous

    def _mark_damaged(self, tag: checkpoints.TagInfo, why: str) -> None:
        """Rank 0 marks ``tag`` damaged in the store (checkpoints.DAMAGED), left in place: it is
        not taken again by the next restart, nor kept by retention as a tag to fall back to. A
        gang fenced by a newer one writes nothing. Best effort: an unmarked tag is only checked
        again."""
        if self.ps.rank != 0 or self.cfg.resume != "auto" or (self.epoch is not None and self._fenced()):
            return
        path = f"{self.root}/{tag.tag}/{checkpoints.DAMAGED}"
        try:
            store_write.write_bytes(self.fs, path, json.dumps({"reason": why, "time": time.time(),
                                                               "by": self.epoch}).encode())
        except Exception as exc:  # noqa: BLE001 - the fallback goes on without the marker
            log.warning("cannot mark %s damaged (%s): %s", tag.tag, path, exc)

    def _previous(self, tag: checkpoints.TagInfo) -> checkpoints.TagInfo | None:
        """Where every rank falls back from a damaged ``tag``: rank 0 lists the store and tells
        the others (one answer for all). None when there is no such tag, the tag was named in
        ``checkpoint.resume``, or the store cannot be listed (a retry decides later)."""
        choice = None
        if self.ps.rank == 0 and self.cfg.resume == "auto" and tag.step is not None:
            try:  # (a store that stays down ends the process retryable: StoreUnavailable)
                choice = store_errors.retry(lambda: checkpoints.complete_before(self.cfg.uri, tag.step),
                                            f"list {self.cfg.uri}")
            except Exception as exc:  # noqa: BLE001 - every rank must get an answer
                log.error("cannot list %s for a checkpoint older than %s: %s", self.cfg.uri, tag.tag, exc)
        if self.ps.is_distributed:
            box = [choice]
            dist.broadcast_object_list(box, src=0, group=self.group)
            choice = box[0]
        return choice

    def _agree_damage(self, why: str | None) -> str | None:
        """Every rank learns whether any rank found the tag damaged, and the first one's reason
        (one all-gather on the checkpoint's group; every rank calls it)."""
        if not self.ps.is_distributed:
            return why
        everyone: list = [None] * self.ps.world_size
        dist.all_gather_object(everyone, why, group=self.group)
        return next((f"rank {rank}: {reason}" for rank, reason in enumerate(everyone) if reason), None)

    def _load_agreed(self, tag: checkpoints.TagInfo, layout: dict) -> tuple[dict | None, str | None]:
        """(this rank's state of ``tag``, None) when every rank loaded it whole, else (None, the
        first reason). The same collectives on every rank, whatever each finds."""
        tag_dir = f"{self.root}/{tag.tag}"
        meta, why = None, None
        try:
            meta = self._read_meta(tag_dir)
        except Damaged as exc:
            why = str(exc)
        why = self._agree_damage(why)
        if why is not None:
            return None, why
        self._check_layout(tag, meta, layout)  # the same meta on every rank: all raise, or none
        # model and optimizer from this node's memory or its peer's when they hold this very
        # save (trainer.checkpoint.memtier, which checks its own digests), else from the store; the small
        # files always from the store
        saved = meta.get("layout", {})
        if self._same_optimizer_layout(saved, layout):
            restored = self.memory.restore(tag.tag, meta.get("step"), meta.get("saveId"), bool(saved.get("zero1")))
        else:  # the memory copies are slices of the old layout: the store's files are resharded
            restored = memtier.Restored(None, memtier.STORE, memtier.STORE)
        self.restore_source = restored.gang_source
        state = None
        try:
            state = self._read_state(tag_dir, meta, restored.state, layout)
        except Damaged as exc:
            why = str(exc)
        why = self._agree_damage(why)
        return (state, None) if why is None else (None, why)

    def _read_meta(self, tag_dir: str) -> dict:
        path = f"{tag_dir}/{checkpoints.META}"
        try:  # a transient error is retried, never taken for damage (StoreUnavailable when it lasts)
            meta = json.loads(store_errors.retry(lambda: self.fs.cat_file(path), f"read {path}"))
        except FileNotFoundError as exc:
            raise Damaged(f"{checkpoints.META} is missing") from exc
        except Exception as exc:  # noqa: BLE001 - unreadable or not JSON: damaged, whatever the cause
            raise Damaged(f"{checkpoints.META}: cannot read or parse it ({_one_line(exc)})") from exc
        if not isinstance(meta, dict):
            raise Damaged(f"{checkpoints.META} is not a JSON object")
        return meta

    def _check_layout(self, tag: checkpoints.TagInfo, meta: dict, layout: dict) -> None:
        if meta.get("weightsOnly"):
            raise ConfigError("checkpoint.uri", f"{tag.uri} holds weights only (python -m trainer.checkpoint.convert from-hf): "
                                                "give it as init.from, not under the run's checkpoint.uri")
        saved = meta.get("layout", {})
        dims = ("tensor", "pipeline", "data")
        # another data-parallel degree is resharded on load (_read_state): the model files are
        # per (tensor, pipeline) rank, and the optimizer's ZeRO-1 slices are re-cut
        if any(saved.get(d, 1) != layout[d] for d in ("tensor", "pipeline")):
            field = next(d for d in ("tensor", "pipeline") if saved.get(d, 1) != layout[d])
            raise ConfigError(f"parallelism.{field}",
                              f"checkpoint {tag.tag} was written with "
                              + " ".join(f"{d}={saved.get(d, 1)}" for d in dims) + "; this run has "
                              + " ".join(f"{d}={layout[d]}" for d in dims)
                              + " (another tensor or pipeline degree: reshard it first, python -m "
                                "trainer.checkpoint.convert reshard)")

    def _overlapping_slices(self, read, saved: dict, layout: dict, model: dict) -> dict:
        """The tag's optimizer slices (this rank's tensor and pipeline coordinates) that this
        rank's new ZeRO-1 range overlaps, by index: a rank reads about one old slice, not the
        whole optimizer, whatever the degrees (model.optim.ShardedAdamW._cut takes them)."""
        from ..model.optim import shard_geometry

        ps = self.ps
        count = saved.get("data", 1) if saved.get("zero1") else 1

        def name(d: int) -> str:
            return f"optim/{ckpt_store.shard_name(d, ps.tp_rank, ps.pp_rank)}"
        first = read(name(0))
        if not isinstance(first, dict) or "param_names" not in first or "shard" not in first:
            raise Damaged(f"{name(0)} is not an optimizer state")
        try:
            numel = sum(model[n].numel() for n in first["param_names"])
        except KeyError as exc:
            raise Damaged(f"{name(0)} names a parameter the model file lacks ({exc})") from None
        new_parts = layout["data"] if layout.get("zero1") else 1
        start, length, _ = shard_geometry(numel, new_parts, ps.dp_rank if layout.get("zero1") else 0)
        old_len = first["shard"][1]
        hi = min(start + length, numel)
        wanted = range(start // old_len, -(-hi // old_len)) if hi > start and old_len else range(0)
        slices = {d: first if d == 0 else read(name(d)) for d in wanted if d < count}
        return {"slices": slices or {0: first}, "count": count}

    @staticmethod
    def _same_optimizer_layout(saved: dict, layout: dict) -> bool:
        """Whether this rank's optimizer file of the tag is its state as it is (same data-parallel
        degree and ZeRO-1 setting), or the state must be cut from the tag's slices."""
        return saved.get("data", 1) == layout["data"] and bool(saved.get("zero1")) == bool(layout.get("zero1"))

    def _read_state(self, tag_dir: str, meta: dict, from_memory: dict | None, layout: dict) -> dict:
        """This rank's files of the tag, each checked against its record (Damaged if not). At
        another data-parallel degree (or ZeRO-1 setting) "optim" is ``{"slices": {index: state},
        "count": n}``: only those of the tag's n optimizer slices for this rank's (tensor, pipeline)
        coordinates that its own range overlaps, by data-parallel index; the optimizer cuts its
        slice from them (model.optim.ShardedAdamW.load_state_dict)."""
        ps, saved = self.ps, meta.get("layout", {})
        records = meta.get(DIGESTS)
        if records is not None and not isinstance(records, dict):
            raise Damaged(f"{checkpoints.META}: its {DIGESTS!r} is not a map of files")

        def read(path: str):
            return self._read_file(tag_dir, path, None if records is None else _record(records, path))
        if from_memory is not None:
            state = from_memory
        elif not self._same_optimizer_layout(saved, layout):
            model = read(f"model/{ckpt_store.shard_name(0, ps.tp_rank, ps.pp_rank)}")
            state = {"model": model, "optim": self._overlapping_slices(read, saved, layout, model)}
            if ps.rank == 0:
                log.info("restore: checkpoint written at data=%s zero1=%s, this run data=%s zero1=%s: the "
                         "optimizer's state is resharded from %d of %d slice(s)", saved.get("data", 1),
                         bool(saved.get("zero1")), layout["data"], bool(layout.get("zero1")),
                         len(state["optim"]["slices"]), state["optim"]["count"])
        else:
            optim_dp = ps.dp_rank if saved.get("zero1") else 0
            state = {"model": read(f"model/{ckpt_store.shard_name(0, ps.tp_rank, ps.pp_rank)}"),
                     "optim": read(f"optim/{ckpt_store.shard_name(optim_dp, ps.tp_rank, ps.pp_rank)}")}
        return {**state, "scheduler": read("scheduler.pt"), "user_content": read("user_content.pt"), "meta": meta}

    def _read_file(self, tag_dir: str, path: str, record: dict | None):
        """One file of a tag, loaded after its bytes matched ``record`` (None: a tag written before
        records, trusted). Raises Damaged naming the file and what is wrong with it."""
        full = f"{tag_dir}/{path}"
        try:
            if store_write.is_local(self.fs):
                if record is not None:
                    _check(path, record, store_write.local_record(full, record["size"]))
                try:  # mapped, not read: load_state_dict copies each tensor once, from the page cache
                    return torch.load(full, map_location="cpu", weights_only=False, mmap=True)
                except FileNotFoundError:
                    raise
                except (OSError, RuntimeError) as exc:  # a mount that refuses mmap (some FUSE file systems)
                    log.warning("restore: cannot map %s (%s); reading it instead", path, exc)
            # one GET, then checked and parsed in memory; a transient error is retried, never
            # taken for damage (a store that stays down ends the process retryable)
            data = store_errors.retry(lambda: _read_all(self.fs, full), f"read {full}")
            if record is not None:
                _check(path, record, store_write.record_of(data))
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        except (Damaged, MemoryError):
            raise
        except FileNotFoundError as exc:
            raise Damaged(f"{path} is missing") from exc
        except Exception as exc:  # noqa: BLE001 - unreadable or unparsable: damaged, whatever the cause
            raise Damaged(f"{path}: cannot read or parse it ({type(exc).__name__}: {_one_line(exc)})") from exc


def tag_files(lay: dict) -> list[str]:
    """Every file of a tag written at layout ``lay`` (meta.json's ``files``)."""
    tps, pps = range(lay["tensor"]), range(lay.get("pipeline", 1))
    files = [f"model/{ckpt_store.shard_name(0, t, p)}" for p in pps for t in tps]
    dps = range(lay["data"]) if lay["zero1"] else [0]
    files += [f"optim/{ckpt_store.shard_name(d, t, p)}" for p in pps for d in dps for t in tps]
    return files + ["scheduler.pt", "user_content.pt", checkpoints.META]


def _read_all(fs, path: str) -> bytes:
    with fs.open(path, "rb") as fh:
        return fh.read()


def _record(records: dict, path: str) -> dict:
    """The record of ``path`` in meta.json's map; a tag with records has one for every file."""
    record = records.get(path)
    if not (isinstance(record, dict) and isinstance(record.get("size"), int)
            and isinstance(record.get("xxh3"), str)):
        raise Damaged(f"{checkpoints.META} has no record of {path}")
    return record


def _check(path: str, recorded: dict, actual: dict) -> None:
    why = store_write.mismatch(path, recorded, actual)
    if why is not None:
        raise Damaged(why)
