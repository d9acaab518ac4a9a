"""What a run's pods may take from the node they run on: the operator's configuration (flags
--host-*, chart values ``hostAccess``), never the run's.

A hostPath volume is the node's file system, and the Neuron training image runs as root: a run
that may name any host path owns the node. So the run names only where its container sees the
compile cache (``compileCache.path``); where that cache lives on the node is this module's
(under ``compile_cache_root``, one directory per namespace by default, so one tenant cannot
plant compiled graphs that another loads), and ``spec.volumes`` may use a hostPath only under a
prefix the operator allows (none by default), mounted read-only.

The operator never reads a checkpoint store (the pods list it with their own mounts and identity
and report what they see: store.py). ``checkpoint_prefixes`` says which stores a run may name,
per namespace, so that a run's pods (which may share a node role or a volume with another
team's) write and read only their namespace's bucket or path.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from typing import Literal, get_args

from trainium_api.fields import ConfigError

CacheScope = Literal["namespace", "run", "shared"]


@dataclass(frozen=True)
class HostAccess:
    compile_cache_root: str = "/var/tmp/trainium-compile-cache"
    """Node directory under which the Neuron compile caches live ("" keeps each pod's cache in an
    emptyDir, lost with the pod: no hostPath at all, so a namespace of Pod Security level
    baseline can run it). Not the old shared /var/tmp/neuron-compile-cache, which every tenant
    could write to (and plant a symlink in)."""
    compile_cache_scope: str = "namespace"
    """Who shares one compile cache: namespace (ROOT/NAMESPACE: the runs of one tenant), run
    (ROOT/NAMESPACE/RUN) or shared (ROOT: every run on the node, only where all runs trust each
    other: one run can plant graphs another loads)."""
    volume_prefixes: tuple[str, ...] = ()
    """Node path prefixes under which spec.volumes may mount a hostPath, read-only (none by
    default). Allow only directories no tenant can write to: the kubelet follows symlinks."""
    checkpoint_prefixes: tuple[str, ...] = ()
    """Checkpoint stores a run may name as checkpoint.uri: s3://BUCKET[/PATH] or /PATH prefixes,
    {namespace} standing for the run's namespace (e.g. s3://ckpt/{namespace}); the run's pods read
    and write them (the operator never does). Empty: any s3:// bucket or absolute path (one
    team's cluster)."""

    trainer_account_annotations: tuple[tuple[str, str], ...] = ()
    """Annotations of every run's own trainer ServiceAccount (KEY=VALUE, {namespace} standing for
    the run's namespace in VALUE), e.g. eks.amazonaws.com/role-arn=arn:aws:iam::ACCOUNT:role/
    trainer-{namespace} so that the pods reach the namespace's checkpoint store with IRSA. Set
    when the account is made (a change reaches runs created after it)."""

    def validate(self) -> None:
        if self.compile_cache_scope not in get_args(CacheScope):
            raise ValueError(f"--host-compile-cache-scope must be one of {', '.join(get_args(CacheScope))}, "
                             f"got {self.compile_cache_scope!r}")
        if self.compile_cache_root and normalised(self.compile_cache_root) in (None, "/"):
            raise ValueError(f"--host-compile-cache-root must be an absolute path below /, without '..', got "
                             f"{self.compile_cache_root!r}")
        root = normalised(self.compile_cache_root) if self.compile_cache_root else None
        for prefix in self.volume_prefixes:
            norm = normalised(prefix)
            if norm in (None, "/"):
                raise ValueError(f"--host-volume-prefix must be an absolute path below /, without '..', got {prefix!r}")
            if root and (_under(root, norm) or _under(norm, root)):
                raise ValueError(f"--host-volume-prefix {prefix} overlaps --host-compile-cache-root {root}: runs write "
                                 "there, and a symlink one plants would be followed by another's mount")

        for prefix in self.checkpoint_prefixes:
            if _store_path(prefix.replace("{namespace}", "ns")) is None:
                raise ValueError(f"--checkpoint-prefix must be s3://BUCKET[/PATH] or an absolute path below /, without "
                                 f"'..', {{namespace}} for the run's namespace; got {prefix!r}")

    def trainer_account_metadata(self, namespace: str) -> dict[str, str]:
        return {key: value.replace("{namespace}", namespace) for key, value in self.trainer_account_annotations}

    def check_checkpoint_store(self, uri: str, namespace: str) -> None:
        """Refuse a checkpoint.uri outside the stores allowed for ``namespace``, naming the field."""
        if not self.checkpoint_prefixes:
            return
        allowed = [p.replace("{namespace}", namespace) for p in self.checkpoint_prefixes]
        path = _resolved(_store_path(uri))
        if path is None or not any(_under(path, _resolved(_store_path(p))) for p in allowed):
            raise ConfigError("spec.checkpoint.uri", f"{uri} is not under a checkpoint store the operator allows "
                                                     f"in namespace {namespace} ({', '.join(allowed)})")

    def compile_cache_volume(self, namespace: str, run: str) -> dict:
        """The pod's compile-cache volume source: a directory of the node, or an emptyDir."""
        if not self.compile_cache_root:
            return {"emptyDir": {}}
        root = normalised(self.compile_cache_root)
        path = {"namespace": f"{root}/{namespace}", "run": f"{root}/{namespace}/{run}", "shared": root}[
            self.compile_cache_scope]
        return {"hostPath": {"path": path, "type": "DirectoryOrCreate"}}

    def check_volumes(self, volumes: list[dict], mounts: list[dict], init_containers: list[dict] = ()) -> None:
        """Refuse a hostPath in spec.volumes outside the allowed prefixes, naming the field; a
        hostPath that is allowed must be mounted read-only, by the trainer and by every init
        container of spec.podTemplate."""
        for i, vol in enumerate(volumes):
            kind = next((k for k in vol if k != "name"), "")
            if kind not in VOLUME_SOURCES and kind != "hostPath":
                raise ConfigError(f"spec.volumes[{i}].{kind}" if kind else f"spec.volumes[{i}]",
                                  f"volume source {kind or '(none)'} is not allowed (it reaches storage or the node "
                                  f"outside what the namespace owns); allowed: {', '.join(VOLUME_SOURCES)}, and "
                                  "hostPath under the operator's prefixes")
            if kind != "hostPath":
                continue
            where = f"spec.volumes[{i}].hostPath.path"
            source = vol["hostPath"]
            path = source.get("path") if isinstance(source, dict) else None
            norm = normalised(path) if isinstance(path, str) else None
            if norm is None:
                raise ConfigError(where, f"must be an absolute path without '..', got {path!r}")
            if not self.volume_prefixes:
                raise ConfigError(where, "hostPath volumes are not allowed by the operator's configuration "
                                         "(hostAccess.volumePrefixes is empty): a host path is the node's file system")
            if not any(_under(norm, p) for p in map(normalised, self.volume_prefixes)):
                raise ConfigError(where, f"{norm} is not under a host path the operator allows "
                                         f"({', '.join(self.volume_prefixes)})")
            if isinstance(source, dict) and source.get("type") in ("Socket", "CharDevice", "BlockDevice"):
                raise ConfigError(f"spec.volumes[{i}].hostPath.type", f"{source['type']} is not allowed: a read-only "
                                  "mount does not stop connecting to a socket or writing to a device")
        self.check_read_only(volumes, mounts, init_containers)

    @staticmethod
    def check_read_only(volumes: list[dict], mounts: list[dict], init_containers: list[dict] = ()) -> None:
        """Every mount of a hostPath volume is read-only, the trainer's and the init containers'."""
        host = {vol["name"] for vol in volumes if "hostPath" in vol}
        every = [(f"spec.volumeMounts[{i}]", m) for i, m in enumerate(mounts)]
        every += [(f"spec.podTemplate.spec.initContainers[{i}].volumeMounts[{j}]", m)
                  for i, c in enumerate(init_containers) for j, m in enumerate(c.get("volumeMounts") or [])]
        for where, mount in every:
            if mount.get("name") in host and not mount.get("readOnly"):
                raise ConfigError(f"{where}.readOnly",
                                  "must be true: a hostPath volume is mounted read-only (a tenant writing there "
                                  "could plant a symlink another run's mount follows)")


VOLUME_SOURCES = ("configMap", "secret", "persistentVolumeClaim", "emptyDir", "downwardAPI", "projected", "ephemeral")
"""Volume sources spec.volumes may use: the namespace's own objects and claims, and scratch
space. Not nfs, csi, awsElasticBlockStore, iscsi, rbd, flexVolume or gitRepo: they reach storage
no claim of the namespace grants, or run code on the node."""


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")


def _store_path(uri: str) -> str | None:
    """A checkpoint URI as one path to compare prefixes on (s3://b/k -> s3:/b/k), or None when
    it is neither s3://BUCKET[/KEY] nor absolute, or climbs ('..')."""
    if uri.startswith("s3://"):
        bucket, _, key = uri[len("s3://"):].partition("/")
        parts = key.rstrip("/").split("/") if key.rstrip("/") else []
        if not bucket or any(p in ("", ".", "..") for p in parts):
            return None  # S3 keys are literal: 'a//b' or 'a/./b' is refused, not normalised
        return "s3:/" + "/".join([bucket, *parts])
    return normalised(uri)


def _resolved(path: str | None) -> str | None:
    """A file-system store as the operator would reach it (a tenant's symlink followed); S3
    keys as they are."""
    if path is None or path.startswith("s3:"):
        return path
    return normalised(os.path.realpath(path))


def normalised(path: str) -> str | None:
    """``path`` without '.', '//' or a trailing '/', or None when it is not absolute or climbs
    ('..' anywhere: refused rather than resolved, so a prefix check sees what the kubelet sees)."""
    if not path.startswith("/") or ".." in path.split("/"):
        return None
    return posixpath.normpath(path).replace("//", "/")


def from_flags(args) -> HostAccess:
    return HostAccess(compile_cache_root=args.host_compile_cache_root,
                      compile_cache_scope=args.host_compile_cache_scope,
                      volume_prefixes=tuple(args.host_volume_prefix or ()),
                      checkpoint_prefixes=tuple(args.checkpoint_prefix or ()),
                      trainer_account_annotations=tuple(_key_value(a) for a in args.trainer_account_annotation or ()))


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"--trainer-account-annotation must be KEY=VALUE, got {text!r}")
    return key, value


def add_flags(ap) -> None:
    """--host-compile-cache-root, --host-compile-cache-scope, --host-volume-prefix (repeatable),
    documented from HostAccess's fields."""
    from trainium_api.fields import field_docs
    docs, default = field_docs(HostAccess), HostAccess()
    ap.add_argument("--host-compile-cache-root", default=default.compile_cache_root,
                    help=f"{docs['compile_cache_root']} (default {default.compile_cache_root})")
    ap.add_argument("--host-compile-cache-scope", default=default.compile_cache_scope, choices=get_args(CacheScope),
                    help=f"{docs['compile_cache_scope']} (default {default.compile_cache_scope})")
    ap.add_argument("--host-volume-prefix", action="append", default=[],
                    help=docs["volume_prefixes"] + " (repeatable)")
    ap.add_argument("--checkpoint-prefix", action="append", default=[],
                    help=docs["checkpoint_prefixes"] + " (repeatable)")
    ap.add_argument("--trainer-account-annotation", action="append", default=[], metavar="KEY=VALUE",
                    help=docs["trainer_account_annotations"] + " (repeatable)")
