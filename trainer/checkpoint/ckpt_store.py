"""The trainer's side of the checkpoint store: shard file names and retention. No torch.

The store's contract (tag names, the ``checkpoint``/``done`` markers, ``meta.json``, layouts,
listing and selection of the newest complete tag) is trainium_api.checkpoints, which the
operator reads too; this module adds what only the trainer writes and deletes.
"""

from __future__ import annotations

import logging

import dataclasses

from trainium_api.checkpoints import DONE, TagInfo, completed_after_fence, fences, list_tags, store_fs

log = logging.getLogger(__name__)


def shard_name(dp: int, tp: int, pp: int = 0) -> str:
    return f"dp_rank_{dp:02d}_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"


MIN_KEEP = 2
"""Complete tags retention always leaves, whatever ``checkpoint.keep`` says: a restore that finds
the newest damaged (a shard cut short, expired or deleted) falls back to the one before it
(trainer.checkpoint.checkpointer), so a run must never be left with a single complete tag."""


def retention_victims(tags: list[TagInfo], keep: int) -> list[TagInfo]:
    """Complete tags to delete so that ``keep`` (at least MIN_KEEP; 0: all) remain; never the
    newest complete one.

    Incomplete tags older than the newest complete one are victims too (a crashed save);
    an incomplete tag newer than it may still be in flight and is left alone, and so is a tag
    marked damaged (it counts as incomplete, so it is not one of the tags kept either).
    """
    complete = [t for t in tags if t.complete and t.step is not None]
    if not complete:
        return []
    newest = complete[-1]
    keep = max(keep, MIN_KEEP) if keep else len(complete)
    victims = complete[:-keep] if len(complete) > keep else []
    victims += [t for t in tags if not t.complete and t.step is not None and t.step < newest.step]
    # a tag a restore marked damaged is left for a person to look at (checkpoints.DAMAGED)
    return [t for t in victims if t.tag != newest.tag and not t.damaged]


def delete_tag(root: str, tag: str) -> None:
    """Remove a tag safely: ``done`` first (it stops counting at once), then everything else."""
    fs, base = store_fs(root)
    path = f"{base}/{tag}"
    if fs.exists(f"{path}/{DONE}"):
        fs.rm_file(f"{path}/{DONE}")
    if fs.exists(path):
        fs.rm(path, recursive=True)


def apply_retention(root: str, keep: int) -> list[str]:
    """Delete old tags; returns the tags deleted. Errors are logged, never raised. A tag a
    fenced attempt completed after the fence counts as incomplete (it is never resumed from)."""
    deleted = []
    try:
        epochs = fences(root)
        tags = [dataclasses.replace(t, complete=False) if completed_after_fence(root, t, epochs) else t
                for t in list_tags(root)]
        for victim in retention_victims(tags, keep):
            delete_tag(root, victim.tag)
            deleted.append(victim.tag)
    except Exception as exc:  # a failed purge must not kill the run
        log.warning("checkpoint retention in %s failed: %s", root, exc)
    return deleted
