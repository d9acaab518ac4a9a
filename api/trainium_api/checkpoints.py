"""Checkpoint store contract (docs/architecture.md 3.3): tag names, markers, layouts, listing and
selection. The trainer writes the store, the operator reads ``lastCheckpoint`` from it; both use
this module. No torch; works on local paths and any fsspec URL (s3:// through s3fs).

    <root>/<tag>/checkpoint        begin marker, written first
    <root>/<tag>/model/...pt       shards (dp_rank_00_tp_rank_TT_pp_rank_PP.pt)
    <root>/<tag>/optim/...pt       optimizer shards (one per DP rank with ZeRO-1)
    <root>/<tag>/scheduler.pt, user_content.pt
    <root>/<tag>/meta.json         step, tokens, data position, config digest, file list
    <root>/<tag>/done              completion marker, written last
    <root>/fence/attempt_<n>       raised by attempt n's gang before it picks where to resume

A tag counts only with ``done``. Fencing across attempts (our trainer's layout): the gang of
attempt n (the pod contract's ATTEMPT) raises ``fence/attempt_<n>`` first; a gang of an older
attempt that sees a newer fence never begins a save, never writes ``done`` and never deletes
(its saves check the fence before their begin marker, before ``done`` and before retention),
and a tag whose ``done`` a fenced attempt wrote at or after the fence (by the store's own
clock: both are the store's modification times) is not complete for selection. Each tag
records the attempt that wrote it (``meta.json``'s ``attempt``). The newest complete tag is the one with the highest step;
NxD orders by the ``done`` marker's modification time, and :func:`newest_complete` checks that
both agree. Shard file names and retention (what only the trainer writes and deletes) are in
trainer.ckpt_store.
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
FENCE = "fence"
_FENCE_NAME = re.compile(r"^attempt_(\d+)$")
_STEP_TAG = re.compile(r"^step_(\d+)$")
# Checkpoint layouts the operator can read (spec.trainer.checkpointLayout):
#   trainer  ours (above): step_<n> tags; newest complete = highest step
#   nxd      NxD's save_checkpoint under --checkpoint_dir: any tag with `done`; newest complete =
#            newest `done` by modification time, the tag nxd.load_checkpoint(tag=None) loads
#   nxdt     NxD Training: <name>--step=<n>-consumed_samples=<m>.ckpt tags (NxD's layout inside,
#            `done` last); newest complete = highest step (the operator pins it on resume: NxDT
#            itself would take the newest .ckpt by mtime, complete or not)
_NXDT_TAG = re.compile(r"^.+--step=(\d+)-consumed_samples=[0-9.]+(?:-v\d+)?\.ckpt$")


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

    @property
    def attempt(self) -> int | None:
        """The attempt whose gang wrote it (None: written without one, e.g. outside the operator)."""
        value = self.meta.get("attempt")
        return value if isinstance(value, int) and not isinstance(value, bool) else None


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
    try:
        entries = fs.ls(base, detail=True)
    except FileNotFoundError:
        return []
    tags: list[TagInfo] = []
    for entry in entries:
        if entry.get("type") != "directory":
            continue
        path = entry["name"].rstrip("/")
        name = path.rsplit("/", 1)[-1]
        is_tag, name_step = _tag_step(name, layout)
        if not is_tag:
            continue
        try:
            children = {c["name"].rstrip("/").rsplit("/", 1)[-1]: c for c in fs.ls(path, detail=True)}
        except FileNotFoundError:
            continue  # deleted while we listed
        if BEGIN not in children and DONE not in children:
            continue  # not a checkpoint folder
        complete = DONE in children
        meta: dict = {}
        if complete and read_meta and layout == "trainer" and META in children:
            try:
                meta = json.loads(fs.cat_file(f"{path}/{META}"))
            except (OSError, ValueError) as exc:
                log.warning("unreadable %s in %s: %s", META, path, exc)
        step = meta.get("step", name_step)
        uri = fs.unstrip_protocol(path) if "://" in root else path
        tags.append(TagInfo(name, uri, step, complete, _mtime(children[DONE]) if complete else None, meta))
    tags.sort(key=lambda t: (t.step is not None, t.step or 0))
    return tags


def raise_fence(root: str, attempt: int) -> None:
    """Attempt ``attempt``'s gang exists: every older attempt's gang is fenced from now on.
    One object per attempt, never rewritten (no read-modify-write race between two gangs)."""
    fs, base = store_fs(root)
    path = f"{base}/{FENCE}/attempt_{attempt}"
    if not fs.exists(path):
        fs.makedirs(f"{base}/{FENCE}", exist_ok=True)
        fs.pipe_file(path, json.dumps({"attempt": attempt, "time": time.time()}).encode())


def fences(root: str) -> dict[int, float | None]:
    """Attempt -> when the store wrote its fence (its modification time)."""
    fs, base = store_fs(root)
    fs.invalidate_cache()
    try:
        entries = fs.ls(f"{base}/{FENCE}", detail=True)
    except FileNotFoundError:
        return {}
    out: dict[int, float | None] = {}
    for entry in entries:
        m = _FENCE_NAME.match(entry["name"].rstrip("/").rsplit("/", 1)[-1])
        if m and entry.get("type") != "directory":
            out[int(m.group(1))] = _mtime(entry)
    return out


def newer_fence(root: str, attempt: int) -> int | None:
    """The newest attempt fenced above ``attempt`` (its gang must stop writing), or None."""
    return max((a for a in fences(root) if a > attempt), default=None)


def written_after_fence(tag: TagInfo, fence_times: dict[int, float | None]) -> bool:
    """``tag``'s ``done`` came at or after a newer attempt's fence: its writer was fenced by
    then, so what it holds may be torn or overtaken; it is not resumed from."""
    if tag.attempt is None or tag.done_mtime is None:
        return False
    return any(a > tag.attempt and at is not None and tag.done_mtime >= at for a, at in fence_times.items())


def newest_complete(root: str, layout: str = "trainer") -> TagInfo | None:
    """The complete tag the next attempt resumes from (see LAYOUTS), or None."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown checkpoint layout {layout!r} (known: {', '.join(LAYOUTS)})")
    if layout == "nxd":  # NxD's own rule; a tag whose name has no step still counts
        complete = [t for t in list_tags(root, read_meta=False, layout=layout) if t.complete]
        return max(complete, key=lambda t: (t.done_mtime or 0.0, t.step or 0), default=None)
    complete = [t for t in list_tags(root, layout=layout) if t.complete and t.step is not None]
    if not complete:
        return None
    if layout == "nxdt":
        return max(complete, key=lambda t: (t.step, t.done_mtime or 0.0))
    fence_times = fences(root)
    late = [t.tag for t in complete if written_after_fence(t, fence_times)]
    if late:
        log.warning("not resuming from %s: completed by a fenced attempt after the fence", ", ".join(late))
        complete = [t for t in complete if t.tag not in late]
        if not complete:
            return None
    best = complete[-1]
    by_marker = max(complete, key=lambda t: t.done_mtime or 0.0)
    if by_marker.tag != best.tag:
        log.warning("newest complete checkpoint by step is %s but by done-marker time is %s "
                    "(NxD would pick the latter); using %s", best.tag, by_marker.tag, best.tag)
    return best
