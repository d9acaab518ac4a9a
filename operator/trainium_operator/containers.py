"""Rules every container of a run's pods follows, the trainer's and the init containers of
spec.podTemplate: where a volume may be mounted, which environment variables may be set. Each
refusal is a ConfigError naming the field."""

from __future__ import annotations

import posixpath
import re
from typing import Mapping

from trainium_api.fields import ConfigError
from trainium_api.spec import CONTRACT_ENV, CONTRACT_MOUNTS, ENV_SOURCES, RETIRED_ENV

_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
"""A container's or a volume's name (RFC 1123 label)."""
DNS_SUBDOMAIN = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
"""A Kubernetes object name (RFC 1123 subdomain), as a ServiceAccount's or a PriorityClass's must be."""


def locked_down(*added: str) -> dict:
    """Every container's securityContext: no privilege escalation, the runtime's default seccomp
    profile, every capability dropped but ``added``."""
    return {"allowPrivilegeEscalation": False, "seccompProfile": {"type": "RuntimeDefault"},
            "capabilities": {"drop": ["ALL"], **({"add": list(added)} if added else {})}}


KERNEL_DIRS = ("/proc", "/sys", "/dev")
"""The container runtime's own mounts: a volume over them breaks the container or is refused."""


def check_mount_path(path: str, where: str, reserved: tuple[str, ...] = CONTRACT_MOUNTS,
                     taken: tuple[str, ...] = ()) -> None:
    """Raises ConfigError naming ``where`` unless ``path`` is a directory a container can mount a
    volume at: absolute, without '..', not the root (it would hide the image), not in the
    kernel's directories, neither at, inside nor above one of the operator's ``reserved`` mounts
    (one would hide the other), and not one of the ``taken`` paths (a nested mount is fine)."""
    if not path.startswith("/"):
        raise ConfigError(where, f"must be an absolute path, got {path!r}")
    if ".." in path.split("/"):
        raise ConfigError(where, f"must not contain '..', got {path!r}")
    norm = posixpath.normpath("/" + path.lstrip("/"))  # normpath keeps a leading //; the runtime does not
    if norm == "/":
        raise ConfigError(where, "must not be / (a volume there would hide the container's whole file system)")
    for d in KERNEL_DIRS:
        if norm == d or norm.startswith(d + "/"):
            raise ConfigError(where, f"{path} is in {d}, the container runtime's own; choose a directory of "
                                     f"the image's (e.g. /var/tmp/...)")
    for r in reserved:
        if norm == r or norm.startswith(r + "/") or r.startswith(norm + "/"):
            raise ConfigError(where, f"{path} " + ("is" if norm == r else "overlaps") + f" the operator's mount {r}")
    for t in taken:
        if norm == posixpath.normpath("/" + t.lstrip("/")):
            raise ConfigError(where, f"{path} is the operator's (compileCache.path)")


def check_env(raw: list[dict], at: str = "spec.env", contract: bool = True, allowed: tuple[str, ...] = ()) -> None:
    """spec.env (or an init container's ``at``): Kubernetes EnvVars with a value or a valueFrom
    (secretKeyRef, configMapKeyRef: name and key; fieldRef: fieldPath), names unique and, in
    the trainer container (``contract``), none of the contract's."""
    seen: set[str] = set()
    for i, item in enumerate(raw):
        where = f"{at}[{i}]"
        if not _ENV_NAME.fullmatch(item["name"]):
            raise ConfigError(f"{where}.name", "must be a valid environment variable name")
        name = item["name"]
        if contract and ((name in CONTRACT_ENV and name not in allowed) or name in RETIRED_ENV):
            raise ConfigError(f"{where}.name", f"{name} is set by the operator (the pod contract) and cannot be overridden")
        if name in seen:
            raise ConfigError(f"{where}.name", f"{name} is listed twice")
        seen.add(name)
        if (item.get("value") is None) == (item.get("valueFrom") is None):
            raise ConfigError(where, "needs exactly one of value or valueFrom")
        if item.get("valueFrom") is not None:
            vf = item["valueFrom"]
            kinds = sorted(vf) if isinstance(vf, Mapping) else []
            if len(kinds) != 1 or kinds[0] not in ENV_SOURCES:
                raise ConfigError(f"{where}.valueFrom", f"must have exactly one of {', '.join(ENV_SOURCES)}")
            ref = vf[kinds[0]]
            needed = ("fieldPath",) if kinds[0] == "fieldRef" else ("name", "key")
            for key in needed:
                if not isinstance(ref, Mapping) or not isinstance(ref.get(key), str) or not ref[key]:
                    raise ConfigError(f"{where}.valueFrom.{kinds[0]}.{key}", "is required")
