"""Checkpoint store contract (docs/architecture.md 3.3): listing, selection and retention. No torch.

    <root>/<tag>/checkpoint        begin marker, written first
    <root>/<tag>/model/...pt       shards (dp_rank_00_tp_rank_TT_pp_rank_PP.pt)
    <root>/<tag>/optim/...pt       optimizer shards (one per DP rank with ZeRO-1)
    <root>/<tag>/scheduler.pt, user_content.pt
    <root>/<tag>/meta.json         step, tokens, data position, config digest, file list
    <root>/<tag>/done              completion marker, written last

A tag counts only with ``done``. The newest complete tag is the one with the highest step;
NxD orders by the ``done`` marker's modification time, and :func:`newest_complete` checks that
both agree. The operator imports this module to read ``lastCheckpoint``; it works on local
paths and any fsspec URL (s3:// through s3fs).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field

import fsspec

from trainium_api.spec import LAYOUTS

log = logging.getLogger(__name__)

BEGIN, DONE, META = "checkpoint", "done", "meta.json"
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


def shard_name(dp: int, tp: int, pp: int = 0) -> str:
    return f"dp_rank_{dp:02d}_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"


@dataclass
class TagInfo:
    tag: str
    uri: str
    step: int | None
    complete: bool
    done_mtime: float | None = None
    meta: dict = field(default_factory=dict)


def _fs(root: str):
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
    fs, base = _fs(root)
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
    best = complete[-1]
    by_marker = max(complete, key=lambda t: t.done_mtime or 0.0)
    if by_marker.tag != best.tag:
        log.warning("newest complete checkpoint by step is %s but by done-marker time is %s "
                    "(NxD would pick the latter); using %s", best.tag, by_marker.tag, best.tag)
    return best


def retention_victims(tags: list[TagInfo], keep: int) -> list[TagInfo]:
    """Complete tags to delete so that ``keep`` remain; never the newest complete one.

    Incomplete tags older than the newest complete one are victims too (a crashed save);
    an incomplete tag newer than it may still be in flight and is left alone.
    """
    complete = [t for t in tags if t.complete and t.step is not None]
    if not complete:
        return []
    newest = complete[-1]
    keep = max(keep, 1) if keep else len(complete)
    victims = complete[:-keep] if len(complete) > keep else []
    victims += [t for t in tags if not t.complete and t.step is not None and t.step < newest.step]
    return [t for t in victims if t.tag != newest.tag]


def delete_tag(root: str, tag: str) -> None:
    """Remove a tag safely: ``done`` first (it stops counting at once), then everything else."""
    fs, base = _fs(root)
    path = f"{base}/{tag}"
    if fs.exists(f"{path}/{DONE}"):
        fs.rm_file(f"{path}/{DONE}")
    if fs.exists(path):
        fs.rm(path, recursive=True)


def apply_retention(root: str, keep: int) -> list[str]:
    """Delete old tags; returns the tags deleted. Errors are logged, never raised."""
    deleted = []
    try:
        for victim in retention_victims(list_tags(root, read_meta=False), keep):
            delete_tag(root, victim.tag)
            deleted.append(victim.tag)
    except Exception as exc:  # a failed purge must not kill the run
        log.warning("checkpoint retention in %s failed: %s", root, exc)
    return deleted
