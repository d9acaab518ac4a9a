"""A pod spec -> what a kubelet would give its container: environment, files, mounts, command.

Pure but for the ``Sources`` it is handed (ConfigMaps, Secrets and service-account tokens read
through the API by the runner), so the rules are unit-tested without a cluster.

- Environment as the kubelet resolves it: the service variables (``KUBERNETES_SERVICE_HOST``/
  ``_PORT`` pointing at the real API server), ``envFrom`` (ConfigMap/Secret, with prefix), then
  ``env`` in order: ``value`` with ``$(VAR)`` expansion (``$$(`` escapes), ``fieldRef``
  (metadata.name/namespace/uid, labels['k'], annotations['k'], spec.nodeName,
  spec.serviceAccountName, status.podIP, status.hostIP), ``configMapKeyRef``, ``secretKeyRef``
  (``optional`` honoured), ``resourceFieldRef`` (limits/requests of cpu and memory).
- Volumes materialised as files in the pod's directory: ``configMap``, ``secret`` (``items``,
  ``optional``, ``defaultMode``), ``emptyDir`` (a directory; ``medium: Memory`` a tmpfs),
  ``hostPath`` (the host path itself; ``DirectoryOrCreate``/``FileOrCreate`` create it),
  ``projected`` (serviceAccountToken, configMap, secret, downwardAPI) and ``downwardAPI`` - so the
  service-account token the API server injects reaches its usual path.
- ``start_script``: a shell script run inside new mount, UTS and PID namespaces; it sets the
  pod's hostname, bind-mounts each volume (and the pod's hosts file over /etc/hosts) at the
  path the pod spec names, then execs the container's command as PID 1. The paths the process
  sees are the ones in the spec; nothing is rewritten. Mount points that do not exist on the
  host are created there (empty directories or files), since the file system is shared.
"""

from __future__ import annotations

import base64
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class PodSpecError(ValueError):
    """The pod cannot start as specified (a missing ConfigMap key, an unsupported volume...):
    reported like the kubelet's CreateContainerConfigError (or ``reason``), and retried."""

    def __init__(self, message: str, reason: str = "CreateContainerConfigError") -> None:
        super().__init__(message)
        self.reason = reason


class Sources(Protocol):
    def config_map(self, namespace: str, name: str) -> dict[str, str] | None: ...
    def secret(self, namespace: str, name: str) -> dict[str, str] | None: ...  # decoded values
    def token(self, namespace: str, service_account: str, audience: str | None, seconds: int,
              pod_name: str, pod_uid: str) -> str: ...
    def claim_path(self, namespace: str, claim: str) -> str | None: ...  # its bound volume's directory


TERMINATION_MESSAGE_FILE = "termination-log"
TERMINATION_MESSAGE_LIMIT = 4096  # bytes the kubelet keeps of it


@dataclass
class Mount:
    source: str
    target: str
    read_only: bool = False
    tmpfs_size: str | None = None  # a tmpfs instead of a bind mount
    is_file: bool = False


@dataclass
class Prepared:
    env: dict[str, str]
    argv: list[str]
    workdir: str
    mounts: list[Mount] = field(default_factory=list)


# -- environment -------------------------------------------------------------------------------

_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined variables are replaced, unknown references kept
    as written, and $$ is a literal $."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _REF.sub(sub, text)


def field_value(pod: dict, path: str) -> str:
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    simple = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
              "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
              "spec.serviceAccountName": spec.get("serviceAccountName"),
              "status.podIP": status.get("podIP"), "status.hostIP": status.get("hostIP")}
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1]) or {}
        return "".join(f'{k}="{v}"\n' for k, v in sorted(items.items()))
    if path not in simple:
        raise PodSpecError(f"fieldRef {path!r} is not supported")
    return simple[path] or ""


def _resource_value(container: dict, ref: dict) -> str:
    res = ref.get("resource", "")
    kind, _, what = res.partition(".")
    value = ((container.get("resources") or {}).get(kind) or {}).get(what)
    if value is None:
        raise PodSpecError(f"resourceFieldRef {res!r}: the container sets no such value")
    return str(value)


def _keyed(sources: Sources, ns: str, ref: dict, secret: bool) -> str | None:
    kind = "secret" if secret else "configMap"
    data = (sources.secret if secret else sources.config_map)(ns, ref.get("name", ""))
    if data is None or ref.get("key") not in data:
        if ref.get("optional"):
            return None
        missing = f"{kind} {ref.get('name')!r}" if data is None else f"key {ref.get('key')!r} in {kind} {ref.get('name')!r}"
        raise PodSpecError(f"{missing} not found")
    return data[ref["key"]]


def resolve_env(pod: dict, container: dict, sources: Sources, base: dict[str, str]) -> dict[str, str]:
    ns = pod["metadata"]["namespace"]
    env = dict(base)
    for src in container.get("envFrom") or []:
        prefix = src.get("prefix", "")
        for key, secret in (("configMapRef", False), ("secretRef", True)):
            ref = src.get(key)
            if not ref:
                continue
            data = (sources.secret if secret else sources.config_map)(ns, ref.get("name", ""))
            if data is None:
                if ref.get("optional"):
                    continue
                raise PodSpecError(f"envFrom: {'secret' if secret else 'configMap'} {ref.get('name')!r} not found")
            env.update({prefix + k: v for k, v in data.items()})
    for item in container.get("env") or []:
        name = item["name"]
        if "valueFrom" not in item or item.get("valueFrom") is None:
            env[name] = expand(item.get("value") or "", env)
            continue
        vf = item["valueFrom"]
        if vf.get("fieldRef"):
            env[name] = field_value(pod, vf["fieldRef"]["fieldPath"])
        elif vf.get("configMapKeyRef"):
            value = _keyed(sources, ns, vf["configMapKeyRef"], secret=False)
            if value is not None:
                env[name] = value
        elif vf.get("secretKeyRef"):
            value = _keyed(sources, ns, vf["secretKeyRef"], secret=True)
            if value is not None:
                env[name] = value
        elif vf.get("resourceFieldRef"):
            env[name] = _resource_value(container, vf["resourceFieldRef"])
        else:
            raise PodSpecError(f"env {name}: unsupported valueFrom {sorted(vf)}")
    return env


# -- volumes -----------------------------------------------------------------------------------

def _token_owner(pod: dict) -> tuple[int | None, int | None]:
    """(user, group) the kubelet gives a projected token file: the runAsUser every container
    shares (the pod's, or each container's alike), and the pod's fsGroup."""
    spec = pod.get("spec") or {}
    pod_sc = spec.get("securityContext") or {}
    users = {(c.get("securityContext") or {}).get("runAsUser", pod_sc.get("runAsUser"))
             for c in (spec.get("initContainers") or []) + (spec.get("containers") or [])}
    user = users.pop() if len(users) == 1 else None
    return (None if user is None else int(user),
            None if pod_sc.get("fsGroup") is None else int(pod_sc["fsGroup"]))


def _write(path: Path, content: str | bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    path.chmod(mode)


def _write_keys(out: Path, data: dict[str, str], items: list | None, mode: int, what: str) -> None:
    if items:
        for it in items:
            if it["key"] not in data:
                raise PodSpecError(f"{what}: key {it['key']!r} not found")
            _write(out / it["path"], data[it["key"]], it.get("mode", mode))
    else:
        for k, v in data.items():
            _write(out / k, v, mode)


def _downward(pod: dict, out: Path, items: list, mode: int) -> None:
    for it in items or []:
        if it.get("fieldRef"):
            _write(out / it["path"], field_value(pod, it["fieldRef"]["fieldPath"]), it.get("mode", mode))
        else:
            raise PodSpecError(f"downwardAPI item {it.get('path')!r}: only fieldRef is supported")


def materialise(pod: dict, vol: dict, out: Path, sources: Sources) -> Mount | None:
    """Write one volume's files under ``out``; returns the mount source (target filled later),
    or None for a volume with nothing to mount (an optional, missing ConfigMap is empty)."""
    ns, name = pod["metadata"]["namespace"], vol["name"]
    out.mkdir(parents=True, exist_ok=True)
    if "configMap" in vol or "secret" in vol:
        secret = "secret" in vol
        ref = vol["secret" if secret else "configMap"]
        obj = ref.get("secretName" if secret else "name", "")
        data = (sources.secret if secret else sources.config_map)(ns, obj)
        if data is None:
            if not ref.get("optional"):
                raise PodSpecError(f"volume {name}: {'secret' if secret else 'configMap'} {obj!r} not found")
            data = {}
        _write_keys(out, data, ref.get("items"), ref.get("defaultMode", 0o644), f"volume {name}")
        return Mount(str(out), "", read_only=True)
    if "emptyDir" in vol:
        ed = vol["emptyDir"] or {}
        if ed.get("medium") == "Memory":
            return Mount("tmpfs", "", tmpfs_size=str(ed.get("sizeLimit") or "50%").replace("Gi", "g").replace("Mi", "m"))
        return Mount(str(out), "")
    if "hostPath" in vol:
        hp = vol["hostPath"]
        path, kind = Path(hp["path"]), hp.get("type") or ""
        if kind == "DirectoryOrCreate":
            path.mkdir(parents=True, exist_ok=True)
        elif kind == "FileOrCreate":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(exist_ok=True)
        elif kind and not path.exists():
            raise PodSpecError(f"volume {name}: hostPath {path} does not exist (type {kind})")
        return Mount(str(path), "", is_file=path.is_file())
    if "persistentVolumeClaim" in vol:
        # a claim bound to a hostPath or local PersistentVolume (the local stand-in for a shared
        # file system's, FSx for Lustre's): its directory, read-only if the volume says so
        ref = vol["persistentVolumeClaim"]
        path = sources.claim_path(ns, ref.get("claimName", ""))
        if path is None:
            raise PodSpecError(f"volume {name}: persistentVolumeClaim {ref.get('claimName')!r} is not bound to a "
                               "hostPath or local PersistentVolume")
        return Mount(path, "", read_only=bool(ref.get("readOnly")))
    if "downwardAPI" in vol:
        _downward(pod, out, vol["downwardAPI"].get("items"), vol["downwardAPI"].get("defaultMode", 0o644))
        return Mount(str(out), "", read_only=True)
    if "projected" in vol:
        proj = vol["projected"]
        mode = proj.get("defaultMode", 0o644)
        for src in proj.get("sources") or []:
            if src.get("serviceAccountToken"):
                t = src["serviceAccountToken"]
                token = sources.token(ns, pod["spec"].get("serviceAccountName") or "default", t.get("audience"),
                                      int(t.get("expirationSeconds") or 3607), pod["metadata"]["name"],
                                      pod["metadata"]["uid"])
                # as the kubelet (pkg/volume/projected): the volume's defaultMode (0644 in the
                # kube-api-access volume the API server adds), or 0600 owned by the pod's
                # runAsUser / group fsGroup when the pod names one
                # (fsGroup: the kubelet's volume ownership pass then lets the group read it)
                owner = _token_owner(pod)
                _write(out / t["path"], token, mode if owner == (None, None) else
                       0o600 | (0o040 if owner[1] is not None else 0))
                if owner != (None, None) and os.geteuid() == 0:  # (the runner is root; a unit test may not be)
                    os.chown(out / t["path"], -1 if owner[0] is None else owner[0],
                             -1 if owner[1] is None else owner[1])
            elif src.get("configMap") or src.get("secret"):
                secret = bool(src.get("secret"))
                ref = src["secret" if secret else "configMap"]
                data = (sources.secret if secret else sources.config_map)(ns, ref.get("name", ""))
                if data is None:
                    if ref.get("optional"):
                        continue
                    raise PodSpecError(f"volume {name}: {'secret' if secret else 'configMap'} {ref.get('name')!r} not found")
                _write_keys(out, data, ref.get("items"), mode, f"volume {name}")
            elif src.get("downwardAPI"):
                _downward(pod, out, src["downwardAPI"].get("items"), mode)
            else:
                raise PodSpecError(f"volume {name}: projected source {sorted(src)} is not supported")
        return Mount(str(out), "", read_only=True)
    kinds = sorted(k for k in vol if k != "name")
    raise PodSpecError(f"volume {name}: type {kinds} is not supported by the process runner")


def prepare(pod: dict, container: dict, pod_dir: Path, sources: Sources, base_env: dict[str, str],
            image: bool = False) -> Prepared:
    """Resolve everything the container needs; files go under ``pod_dir/volumes``. ``image``:
    it runs from its image (podcontainer.py), whose entrypoint stands in for a missing command
    and whose user must be able to write the emptyDirs (world-writable, as the kubelet makes them)."""
    env = resolve_env(pod, container, sources, base_env)
    command = [expand(a, env) for a in container.get("command") or []]
    args = [expand(a, env) for a in container.get("args") or []]
    argv = command + args
    if not command and not image:
        raise PodSpecError("the container has no command: there is no image here to supply an entrypoint")
    volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
    sources_by_name: dict[str, Mount | None] = {}
    mounts = []
    for vm in container.get("volumeMounts") or []:
        vname = vm["name"]
        if vname not in volumes:
            raise PodSpecError(f"volumeMount {vname!r}: no such volume")
        if vname not in sources_by_name:
            sources_by_name[vname] = materialise(pod, volumes[vname], pod_dir / "volumes" / vname, sources)
        src = sources_by_name[vname]
        if src is None:
            continue
        # an image's user writes an emptyDir (and its subPath folders) as the kubelet makes them
        writable = image and "emptyDir" in volumes[vname] and not src.tmpfs_size
        if writable:
            os.chmod(src.source, 0o777)
        mount = Mount(src.source, vm["mountPath"], read_only=src.read_only or bool(vm.get("readOnly")),
                      tmpfs_size=src.tmpfs_size, is_file=src.is_file)
        if vm.get("subPath"):
            if src.tmpfs_size:
                raise PodSpecError(f"volumeMount {vname!r}: subPath on a memory emptyDir is not supported")
            sub = Path(src.source) / vm["subPath"]
            if not sub.exists():
                sub.mkdir(parents=True)
                if writable:
                    os.chmod(sub, 0o777)
            mount.source, mount.is_file = str(sub), sub.is_file()
        mounts.append(mount)
    # the kubelet's per-container file at terminationMessagePath, read back when the container ends
    # (the runner creates it; the mount point is made once on this host's /dev, and only each
    # pod's namespace, where this file is mounted over it, writes there)
    message = pod_dir / TERMINATION_MESSAGE_FILE
    mounts.append(Mount(str(message), container.get("terminationMessagePath") or "/dev/termination-log", is_file=True))
    return Prepared(env=env, argv=argv, workdir=container.get("workingDir") or "/", mounts=mounts)


def start_script(prepared: Prepared, hostname: str, hosts_file: Path) -> str:
    """The shell script that runs inside the pod's new namespaces and execs the command."""
    q = shlex.quote
    lines = ["exec 2>&1", "set -e", f"hostname {q(hostname[:63])}", f"mount --bind {q(str(hosts_file))} /etc/hosts"]
    for m in prepared.mounts:
        t = q(m.target)
        lines.append(f"[ -e {t} ] || {{ mkdir -p \"$(dirname {t})\"; "
                     + (f"touch {t}; }}" if m.is_file else f"mkdir -p {t}; }}"))
        if m.tmpfs_size:
            lines.append(f"mount -t tmpfs -o size={q(m.tmpfs_size)} tmpfs {t}")
            continue
        lines.append(f"mount --bind {q(m.source)} {t}")
        if m.read_only:
            lines.append(f"mount -o remount,bind,ro {t}")
    lines.append(f"cd {q(prepared.workdir)}")
    lines.append('exec "$@"')
    return "\n".join(lines) + "\n"


def hosts_file(own: tuple[str, list[str]], peers: list[tuple[str, list[str]]]) -> str:
    """/etc/hosts of one pod: localhost, its own names, then every published peer name."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback", f"{own[0]}\t{' '.join(own[1])}"]
    lines += [f"{ip}\t{' '.join(names)}" for ip, names in peers if names]
    return "\n".join(lines) + "\n"


def dns_names(pod: dict, namespace_of_reader: str) -> list[str]:
    """The names a pod is published under: ``<hostname>.<subdomain>.<ns>.svc[.cluster.local]``
    (a headless Service's per-pod records), plus ``<hostname>.<subdomain>`` for readers in the
    same namespace (the resolver's search path on a real pod)."""
    spec, ns = pod.get("spec") or {}, pod["metadata"]["namespace"]
    host, sub = spec.get("hostname"), spec.get("subdomain")
    if not (host and sub):
        return []
    names = [f"{host}.{sub}.{ns}.svc.cluster.local", f"{host}.{sub}.{ns}.svc"]
    if ns == namespace_of_reader:
        names.append(f"{host}.{sub}")
    return names


def decode_secret(data: dict | None) -> dict[str, str] | None:
    if data is None:
        return None
    return {k: base64.b64decode(v).decode(errors="replace") for k, v in data.items()}


def pod_hostname(pod: dict) -> str:
    return (pod.get("spec") or {}).get("hostname") or pod["metadata"]["name"][:63]


def thread_environment(threads: int) -> dict[str, str]:
    """A thread count per process chosen once for every pod (podrunner.THREADS_PER_PROCESS):
    what every pod gets, from its image or not."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def base_environment(threads: int, python_bin: str) -> dict[str, str]:
    """What the 'image' provides a process-backed pod: the project's Python environment first on
    this machine's PATH, and the thread count (an image brings its own PATH and HOME)."""
    path = os.pathsep.join([python_bin, os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")])
    return {"PATH": path, "HOME": "/root", "LANG": "C.UTF-8", **thread_environment(threads)}
