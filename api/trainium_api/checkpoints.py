"""Checkpoint store contract (docs/architecture.md 3.3): tag names, markers, layouts, listing and
selection. The trainer pods write and read the store (the operator never does: it takes
``lastCheckpoint`` from what they report). No torch; works on local paths and any fsspec URL (s3:// through s3fs).

    <root>/<tag>/checkpoint        begin marker, written first
    <root>/<tag>/model/...pt       shards (dp_rank_00_tp_rank_TT_pp_rank_PP.pt)
    <root>/<tag>/optim/...pt       optimizer shards (one per DP rank with ZeRO-1)
    <root>/<tag>/scheduler.pt, user_content.pt
    <root>/<tag>/meta.json         step, tokens, data position, config digest, file list
    <root>/<tag>/done              completion marker, written last
    <root>/fence/run_<c>_attempt_<n>   raised by the gang of attempt n of the run created at c
                                       before it picks where to resume

A tag counts only with ``done``. Fencing across attempts (our trainer's layout): a gang's epoch
is (its run's creation time, its attempt), from the pod contract's TRAINING_RUN_CREATED and
ATTEMPT, so a run deleted and created again under the same store supersedes every gang of the
old one. Rank 0 of a new gang raises its fence first, recording the complete tags it sees; a
gang that finds a newer epoch's fence never begins a save, never writes ``done`` and never
deletes (its saves look before their begin marker, before ``done`` and before retention). Each
tag records its writer's epoch (``meta.json``'s ``writer``); a tag an older epoch completed
that the first newer fence does not list was completed after that fence (no clock is
compared): it is never resumed from and counts as torn for retention.

The newest complete tag is the one with the highest step; NxD orders by the ``done`` marker's
modification time, and :func:`newest_complete` checks that both agree. Shard file names and retention (what only the trainer writes and deletes) are in
trainer.checkpoint.ckpt_store.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field

import fsspec

from .spec import LAYOUTS

log = logging.getLogger(__name__)

BEGIN, DONE, META = "checkpoint", "done", "meta.json"
DAMAGED = "damaged"
"""Written in a tag by the restore that found it damaged (trainer.checkpoint.checkpointer), with the reason: the
tag is left in place, but no longer counts as complete (never resumed from again, and never one
of the tags retention keeps for a fallback); retention does not delete it either. Removed by a
save that rewrites the tag, or by hand once it is repaired."""
FENCE = "fence"
_FENCE_NAME = re.compile(r"^run_(\d+)_attempt_(\d+)$")
Epoch = tuple[int, int]
"""(the run's creation time, its attempt): a later run's gangs supersede every gang of an earlier
one of the same store, and within a run a later attempt's supersede an earlier one's."""
_STEP_TAG = re.compile(r"^step_(\d+)$")
# Checkpoint layouts the operator can read (spec.trainer.checkpointLayout):
#   trainer  ours (above): step_<n> tags; newest complete = highest step
#   nxd      NxD's save_checkpoint under --checkpoint_dir: any tag with `done`; newest complete =
#            newest `done` by modification time, the tag nxd.load_checkpoint(tag=None) loads
#   nxdt     NxD Training: <name>--step=<n>-consumed_samples=<m>.ckpt tags (NxD's layout inside,
#            `done` last); newest complete = highest step (the operator pins it on resume: NxDT
#            itself would take the newest .ckpt by mtime, complete or not)
_NXDT_TAG = re.compile(r"^.+--step=(\d+)-consumed_samples=[0-9.]+(?:-v\d+)?\.ckpt$")


# Where a restore read a rank's state from (trainer.checkpoint.memtier): its node's memory, its peer
# node's memory, the store. In this order of speed: a gang's source is its slowest rank's.
RESTORE_SOURCES = ("memory", "peer", "store")


def tag_for_step(step: int) -> str:
    return f"step_{step}"


@dataclass
class TagInfo:
    tag: str
    uri: str
    step: int | None
    complete: bool
    done_mtime: float | None = None
    meta: dict = field(default_factory=dict)
    damaged: bool = False
    """Marked damaged by a restore (DAMAGED): not complete, whatever its ``done`` says."""

    @property
    def writer(self) -> Epoch | None:
        """The epoch of the gang that wrote it (None: written without one, e.g. outside the
        operator, or by an older release)."""
        return _epoch(self.meta.get("writer"))

    @property
    def attempt(self) -> int | None:
        return self.writer[1] if self.writer else None


def _epoch(value) -> Epoch | None:
    if isinstance(value, (list, tuple)) and len(value) == 2 and \
            all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return (value[0], value[1])
    return None


def store_fs(root: str):
    """(the fsspec filesystem of ``root``, its path there without a trailing slash)."""
    fs, path = fsspec.core.url_to_fs(root)
    return fs, path.rstrip("/")


def _mtime(info: dict) -> float | None:
    for key in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(key)
        if value is None:
            continue
        return value.timestamp() if hasattr(value, "timestamp") else float(value)
    return None


def _tag_step(name: str, layout: str) -> tuple[bool, int | None]:
    """(is a tag of this layout, its step from the name)."""
    if layout == "nxdt":
        m = _NXDT_TAG.match(name)
        return bool(m), int(m.group(1)) if m else None
    m = _STEP_TAG.match(name)
    return True, int(m.group(1)) if m else None


def list_tags(root: str, read_meta: bool = True, layout: str = "trainer") -> list[TagInfo]:
    """Every tag under root, complete or not, in ascending step order (unknown steps first)."""
    fs, base = store_fs(root)
    fs.invalidate_cache()
    tags = [t for path in _tag_dirs(fs, base, layout)
            if (t := _read_tag(fs, root, path, layout, read_meta)) is not None]
    return _ordered(tags)


def _ordered(tags: list[TagInfo]) -> list[TagInfo]:
    return sorted(tags, key=lambda t: (t.step is not None, t.step or 0))


def _tag_dirs(fs, base: str, layout: str) -> list[str]:
    """The paths of the folders under ``base`` whose names are tags of ``layout`` (one listing)."""
    try:
        entries = fs.ls(base, detail=True)
    except FileNotFoundError:
        return []
    paths = [e["name"].rstrip("/") for e in entries if e.get("type") == "directory"]
    return [path for path in paths if _tag_step(name := path.rsplit("/", 1)[-1], layout)[0] and name != FENCE]


def _read_tag(fs, root: str, path: str, layout: str, read_meta: bool,
              unchanged: TagInfo | None = None) -> TagInfo | None:
    """One tag folder (a listing of it, and its meta.json when complete); None when it is not a
    checkpoint folder or went while we looked. ``unchanged``: this tag as read before, returned
    as it is when its ``done`` is the same (meta.json is written before ``done``, once)."""
    name = path.rsplit("/", 1)[-1]
    try:
        children = {c["name"].rstrip("/").rsplit("/", 1)[-1]: c for c in fs.ls(path, detail=True)}
    except FileNotFoundError:
        return None  # deleted while we listed
    except (PermissionError, NotADirectoryError) as exc:
        if "://" in root:
            raise  # an object store's refusal may be an expired token: the caller's retry decides
        # a folder of the file system we may not read (lost+found at a volume's root): not ours
        log.warning("skipping %s: %s", path, exc)
        return None
    if BEGIN not in children and DONE not in children:
        return None  # not a checkpoint folder
    damaged = DAMAGED in children
    complete = DONE in children and not damaged
    if complete and unchanged is not None and unchanged.done_mtime == _mtime(children[DONE]):
        return unchanged
    meta: dict = {}
    if complete and read_meta and layout == "trainer" and META in children:
        try:
            meta = json.loads(fs.cat_file(f"{path}/{META}"))
        except (OSError, ValueError) as exc:
            log.warning("unreadable %s in %s: %s", META, path, exc)
    step = meta.get("step", _tag_step(name, layout)[1])
    uri = fs.unstrip_protocol(path) if "://" in root else path
    return TagInfo(name, uri, step, complete, _mtime(children[DONE]) if complete else None, meta, damaged)


class StoreView:
    """A store's newest complete tag, listed as a pod does it every few seconds for as long as a
    run lasts: one listing of the root per call, and nothing read again that cannot have changed.
    A tag seen complete is remembered (its ``done`` and ``meta.json`` are written once); it is
    forgotten when its folder goes, and the newest one is looked into again each call (a save
    that rewrites a tag removes its ``done`` first, and retention deletes ``done`` first). A tag
    not complete yet is looked into again at each call until it is. Where the step is in the
    name (NxD Training's ``.ckpt``), tags are looked into from the highest step down, and only
    until the newest complete one: the first call at 10,000 tags costs the root listing and a
    tag or two, not 10,000 listings. NxD scripts' tags (newest by ``done`` time, any name) and
    ours (fencing reads each complete tag's writer) are each read once, on the first call."""

    def __init__(self, root: str, layout: str = "trainer"):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown checkpoint layout {layout!r} (known: {', '.join(LAYOUTS)})")
        self.root, self.layout = root, layout
        self.fs, self.base = store_fs(root)
        self._complete: dict[str, TagInfo] = {}  # folder path -> its complete tag
        self.requests = 0  # listings and reads made (for the benchmark)

    def newest(self) -> TagInfo | None:
        """The complete tag the next attempt resumes from (the same rule as newest_complete)."""
        self.fs.invalidate_cache(self.base)
        paths = _tag_dirs(self.fs, self.base, self.layout)
        self.requests += 1
        present = set(paths)
        self._complete = {p: t for p, t in self._complete.items() if p in present}
        while True:
            # the newest remembered one may have lost its `done` since (a rewrite, retention)
            recheck = max(self._complete, key=lambda p: recency(self.layout, self._complete[p].step,
                                                                 self._complete[p].done_mtime), default=None)
            if recheck is None or self._look(recheck):
                break
        for path in self._unknown(paths, recheck):
            self._look(path)
        return _select(list(self._complete.values()), self.layout, self.root)

    def _unknown(self, paths: list[str], newest: str | None):
        """The folders to look into: every one not known complete; for NxD Training's (step in
        the name), only those above the newest known, highest first, until the first complete
        (and its step's other versions)."""
        if self.layout != "nxdt":
            yield from (p for p in paths if p not in self._complete)
            return
        floor = self._complete[newest].step if newest is not None else -1
        found = None
        for path in sorted(paths, key=lambda p: _tag_step(p.rsplit("/", 1)[-1], "nxdt")[1], reverse=True):
            step = _tag_step(path.rsplit("/", 1)[-1], "nxdt")[1]
            if step < floor or (found is not None and step < found):
                return
            if path not in self._complete:
                yield path  # the caller looks into it before asking for the next
                if path in self._complete:
                    found = step

    def _look(self, path: str) -> bool:
        """Reads one folder; remembers it when complete. Returns whether it is."""
        self.fs.invalidate_cache(path)
        known = self._complete.get(path)
        tag = _read_tag(self.fs, self.root, path, self.layout, read_meta=self.layout == "trainer", unchanged=known)
        self.requests += 1 + (tag is not None and tag.complete and tag is not known and self.layout == "trainer")
        if tag is not None and tag.complete:
            self._complete[path] = tag
            return True
        self._complete.pop(path, None)
        return False


def raise_fence(root: str, epoch: Epoch, complete: list[TagInfo]) -> None:
    """The gang of ``epoch`` exists: every gang of an older epoch is fenced from now on.
    ``complete``: the complete tags this gang saw just before (listed first: a tag an older gang
    completes between that listing and the fence counts as late, the safe side). One object per
    epoch, never rewritten (no read-modify-write race between two gangs)."""
    fs, base = store_fs(root)
    path = f"{base}/{FENCE}/run_{epoch[0]}_attempt_{epoch[1]}"
    if not fs.exists(path):
        fs.makedirs(f"{base}/{FENCE}", exist_ok=True)
        body = {"run": epoch[0], "attempt": epoch[1], "time": time.time(),
                "complete": [[t.tag, list(t.writer) if t.writer else None] for t in complete]}
        fs.pipe_file(path, json.dumps(body).encode())


def fences(root: str) -> list[Epoch]:
    """The epochs whose fence is raised in the store."""
    fs, base = store_fs(root)
    fs.invalidate_cache()
    try:
        names = fs.ls(f"{base}/{FENCE}", detail=False)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = _FENCE_NAME.match(name.rstrip("/").rsplit("/", 1)[-1])
        if m:
            out.append((int(m.group(1)), int(m.group(2))))
    return sorted(out)


def newer_fence(root: str, epoch: Epoch) -> Epoch | None:
    """The newest epoch fenced above ``epoch`` (its gang must stop writing), or None."""
    return max((e for e in fences(root) if e > epoch), default=None)


_FENCE_LISTS: dict[tuple[str, Epoch], set | None] = {}  # fences are never rewritten: read once


def _fence_list(root: str, epoch: Epoch) -> set | None:
    """The complete tags (name, writer) the gang of ``epoch`` saw when it raised its fence;
    None when the fence cannot be read (then it decides nothing: a garbled fence must not make
    good checkpoints look late, which retention would delete)."""
    key = (root, epoch)
    if key not in _FENCE_LISTS:
        fs, base = store_fs(root)
        try:
            body = json.loads(fs.cat_file(f"{base}/{FENCE}/run_{epoch[0]}_attempt_{epoch[1]}"))
            listed = {(name, _epoch(writer)) for name, writer in body["complete"]}
        except FileNotFoundError:
            return None  # not there (yet): ask again next time
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("unreadable fence %s of %s: %s; it decides nothing", epoch, root, exc)
            listed = None
        if len(_FENCE_LISTS) > 4096:
            _FENCE_LISTS.clear()
        _FENCE_LISTS[key] = listed
    return _FENCE_LISTS[key]


def completed_after_fence(root: str, tag: TagInfo, epochs: list[Epoch]) -> bool:
    """``tag`` was completed by a gang after a newer epoch's gang had fenced it: the first fence
    above its writer does not list it. Such a tag may be torn or overtaken; it is not resumed
    from. No clock is compared (the store's modification times come from clients' clocks on
    shared file systems, and S3's have one-second resolution)."""
    writer = tag.writer
    if writer is None or not tag.complete:
        return False
    above = [e for e in epochs if e > writer]
    if not above:
        return False
    listed = _fence_list(root, min(above))
    return listed is not None and (tag.tag, writer) not in listed


def newest_complete(root: str, layout: str = "trainer") -> TagInfo | None:
    """The complete tag the next attempt resumes from (see LAYOUTS), or None."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown checkpoint layout {layout!r} (known: {', '.join(LAYOUTS)})")
    return _select([t for t in list_tags(root, read_meta=layout != "nxd", layout=layout) if t.complete],
                   layout, root)


def recency(layout: str, step: int | None, done_time: float | None) -> tuple:
    """How ``layout`` orders its complete tags, the greatest newest (see LAYOUTS): NxD scripts
    by their ``done`` marker's time (then step), the others by step (then that time). The
    operator orders what the pods report with it too (store.py)."""
    s, t = (step if step is not None else -1), (done_time or 0.0)
    return (t, s) if layout == "nxd" else (s, t)


def _select(complete: list[TagInfo], layout: str, root: str) -> TagInfo | None:
    """Of a store's complete tags, the one to resume from (see LAYOUTS)."""
    if layout == "nxd":  # NxD's own rule; a tag whose name has no step still counts
        return max(complete, key=lambda t: recency(layout, t.step, t.done_mtime), default=None)
    complete = _ordered([t for t in complete if t.step is not None])
    if not complete:
        return None
    if layout == "nxdt":
        return max(complete, key=lambda t: recency(layout, t.step, t.done_mtime))
    epochs = fences(root)
    late = [t.tag for t in complete if completed_after_fence(root, t, epochs)]
    if late:
        log.warning("not resuming from %s: completed by a fenced gang after the fence", ", ".join(late))
        complete = [t for t in complete if t.tag not in late]
        if not complete:
            return None
    best = complete[-1]
    by_marker = max(complete, key=lambda t: t.done_mtime or 0.0)
    if by_marker.tag != best.tag:
        log.warning("newest complete checkpoint by step is %s but by done-marker time is %s "
                    "(NxD would pick the latter); using %s", best.tag, by_marker.tag, best.tag)
    return best


def complete_before(root: str, step: int) -> TagInfo | None:
    """The complete tag of our layout that :func:`newest_complete` would pick if none at or above
    ``step`` existed (the same selection, fencing included): where a restore falls back to when
    the tag at ``step`` is damaged (trainer.checkpoint.checkpointer)."""
    return _select([t for t in list_tags(root) if t.complete and t.step is not None and t.step < step],
                   "trainer", root)
