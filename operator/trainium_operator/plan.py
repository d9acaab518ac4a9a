"""Desired children of a TrainingRun: headless Service, ConfigMap, one Pod per node. Pure.

The pod contract (docs/architecture.md 3.2): pod i of attempt a is ``<run>-a<a>-<i>``, reachable as
``<run>-<i>.<run>`` through the headless Service; it runs ``python -m trainer.launch`` (torchrun
with the exit-code contract) with ``processesPerNode`` ranks; the rendered trainer config is
mounted from the ConfigMap; restarts are the operator's job (restartPolicy Never).

A command trainer (spec.trainer.kind command) gets the same contract with the user's script in
place of ``-m trainer``, under ``python -m trainer.watch``, which reads progress from its log;
no ConfigMap. The watch lists the run's checkpoint store from the pod (the operator cannot see it)
and tells an NxDT command which checkpoint to resume from (trainer.pod.store_watch), so every
attempt's pods have the same spec.
"""

from __future__ import annotations

import hashlib
from datetime import datetime

import yaml

from trainium_api import keys
from trainium_api import API_GROUP, API_VERSION, KIND
from trainium_api import gangorder, launch, podenv as E
from trainium_api.launch import AGENT_FLAG, LAUNCH_MODULE, PRECOMPILE_FLAG, PREFLIGHT_FLAG, WATCH_MODULE
from trainium_api.runtimefaults import TERMINATION_MESSAGE_PATH
from trainium_api.load import to_dict
from trainium_api.spec import (CONTRACT_MOUNTS, EFA_DEVICE_CLASS, INSTANCE_TYPES, NEURON_DEVICE_CLASS, TrainingRunSpec,
                               trainer_identity)

from . import pod_template, workload
from .containers import locked_down
from .hostaccess import HostAccess

MASTER_PORT = 29500
CONFIG_MOUNT = CONTRACT_MOUNTS[0]
METRICS_PORT = 9400

NEURON_ENV = {  # docs/neuron.md, "Running on EKS"
    "FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1",
    "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS": "3", "NEURON_FUSE_SOFTMAX": "1", "MALLOC_ARENA_MAX": "64",
    "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1",
}


def owner_reference(run: dict) -> dict:
    return {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND, "name": run["metadata"]["name"],
            "uid": run["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


def _created(run: dict) -> int:
    """The run's creation time, epoch seconds (0 when unknown): with ATTEMPT it orders the gangs
    of one checkpoint store, a run created again under the same name and store included."""
    stamp = run["metadata"].get("creationTimestamp")
    try:
        return int(datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()) if stamp else 0
    except ValueError:
        return 0


def pod_name(run_name: str, attempt: int, index: int) -> str:
    return gangorder.pod_name(run_name, attempt, index)  # (the agents read gang orders by it)


def spare_name(run_name: str, serial: int) -> str:
    return f"{run_name}-spare-{serial}"


def is_spare_name(run_name: str, name: str) -> bool:
    return name.startswith(f"{run_name}-spare-") and name.rsplit("-", 1)[-1].isdigit()


def spare_hostname(run_name: str, pod: str) -> str:
    """A spare's hostname, ``<run>-s<n>``: within a DNS label's 63 characters for every run
    name (at most RUN_NAME_MAX) and up to 99,999 spares."""
    return f"{run_name}-s{pod.rsplit('-', 1)[-1]}"


def master_address(run: dict, index0_pod: str) -> str:
    """The rendezvous address: the DNS name of the pod that runs index 0 (its hostname under the
    run's headless Service: ``<run>-0``, or a spare's own once it took index 0)."""
    name, ns = run["metadata"]["name"], run["metadata"]["namespace"]
    host = spare_hostname(name, index0_pod) if is_spare_name(name, index0_pod) else f"{name}-0"
    return f"{host}.{name}.{ns}.svc"


_RENDERED: dict[int, tuple[TrainingRunSpec, str]] = {}  # id(spec) -> (spec, its YAML)
_RENDERED_KEPT = 256


def rendered_config(spec: TrainingRunSpec) -> str:
    """The trainer's run.yaml. Rendered once per parsed spec (observer.spec_in_force hands every
    pass of an unchanged spec the same object): the YAML dump took 2.5 ms and its cache key
    0.5 ms, the largest parts of a pass, and every pass of a live run ensures the ConfigMap.
    The entry keeps its spec, so the id is not reused while it is cached."""
    hit = _RENDERED.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    cfg = to_dict(spec.run, older_words=True)  # a trainer image older than the CamelCase words reads them
    cfg["checkpoint"]["resume"] = "auto"  # first start and every restart run the same pod spec
    cfg["logging"]["metricsPort"] = cfg["logging"]["metricsPort"] or METRICS_PORT
    text = yaml.safe_dump(cfg, sort_keys=False)
    if len(_RENDERED) >= _RENDERED_KEPT:
        _RENDERED.clear()
    _RENDERED[id(spec)] = (spec, text)
    return text


def service(run: dict) -> dict:
    name = run["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "labels": {keys.RUN: name, **keys.MANAGED_BY},
                         "ownerReferences": [owner_reference(run)]},
            "spec": {"clusterIP": "None", "selector": {keys.RUN: name}, "publishNotReadyAddresses": True,
                     "ports": [{"name": "rendezvous", "port": MASTER_PORT},
                               {"name": "metrics", "port": METRICS_PORT}]}}


def disruption_budget(run: dict, spec: TrainingRunSpec) -> dict:
    """A PodDisruptionBudget that lets no eviction take a pod of the gang (faultTolerance.doNotDisrupt):
    a drain cordons the node and waits; the operator sees the cordon and moves the gang off it
    at a save (judge: drain), and the drain goes on. Spares are not covered (a drain takes them
    at once), nor pods that are not Ready (AlwaysAllow: a broken pod never blocks a drain).
    minAvailable, the whole gang, as an integer: the one form the disruption controller takes
    for pods of a controller without a scale subresource (a TrainingRun)."""
    name = run["metadata"]["name"]
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": name, "labels": {keys.RUN: name, **keys.MANAGED_BY},
                         "ownerReferences": [owner_reference(run)]},
            "spec": {"minAvailable": spec.nodes, "unhealthyPodEvictionPolicy": "AlwaysAllow",
                     "selector": {"matchLabels": {keys.RUN: name},
                                  "matchExpressions": [{"key": keys.SPARE, "operator": "NotIn", "values": ["true"]}]}}}


def trainer_identity_objects(run: dict, spec: TrainingRunSpec, annotations: dict[str, str] | None = None) -> list[dict]:
    """The trainer's identity for the run's life: its own ServiceAccount (unless the spec names
    one), with ``annotations`` (the operator's, e.g. an IAM role), and the RoleBinding of the
    run's trainer Role (trainer_role) to whichever it is. Owned by the run: the garbage
    collector deletes them with it."""
    name = run["metadata"]["name"]
    meta = {"name": trainer_identity(name), "labels": {keys.RUN: name, **keys.MANAGED_BY},
            "ownerReferences": [owner_reference(run)]}
    account = spec.trainer_service_account(name)
    objs = [{"apiVersion": "v1", "kind": "ServiceAccount",
             "metadata": {**meta, **({"annotations": dict(annotations)} if annotations else {})}}] \
        if spec.own_trainer_identity else []
    return objs + [{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": dict(meta),
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": trainer_identity(name)},
                    "subjects": [{"kind": "ServiceAccount", "name": account,
                                  "namespace": run["metadata"]["namespace"]}]}]


def gang_pod_names(run_name: str, nodes: int, gang_attempt: int, pod_names: list[str] = ()) -> list[str]:
    """The names of the gang's pods, by index: gang_attempt's, or the pod that replaced that
    index (status.current.podNames)."""
    return [pod_names[i] if i < len(pod_names) else pod_name(run_name, gang_attempt, i) for i in range(nodes)]


def trainer_role(run: dict, spec: TrainingRunSpec, attempt: int, gang_attempt: int | None = None,
                 pod_names: list[str] = (), also: list[str] = ()) -> dict:
    """The only permission a trainer needs: get and patch of its pod (the progress annotation,
    the agent's report), reading the run's gang order, and list and watch of its pod by name
    (orders written on the pod for an older agent: the API server
    authorizes a watch with fieldSelector metadata.name against resourceNames), narrowed by
    resourceNames to the pods of the run's current attempt (``gang_attempt``: the attempt
    whose pods an in-place restart kept, ``pod_names`` the pods of replaced indexes, ``also``
    a replacement waiting at the barrier and the spares; rewritten when an attempt starts), so a trainer
    token reaches no other run's pods and no pod of an older gang, with or without the
    admission policy. Before the first attempt: no rule at all (a rule with no resourceNames
    would allow every pod)."""
    name = run["metadata"]["name"]
    names = gang_pod_names(name, spec.nodes, gang_attempt or attempt, pod_names)
    names += [n for n in also if n not in names]
    rules = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "patch", "watch"],
              "resourceNames": names},
             # the gang order (trainium_api.gangorder): read by every agent, written by the operator only
             {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"],
              "resourceNames": [gangorder.object_name(name)]}] if attempt else []
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            # the attempt it names: an ensure never moves the Role back to an older one (Kube.ensure)
            "metadata": {"name": trainer_identity(name), "labels": {keys.RUN: name, keys.ATTEMPT: str(attempt),
                                                                     **keys.MANAGED_BY},
                         "ownerReferences": [owner_reference(run)]},
            "rules": rules}


def gang_order_map(run: dict, gang: "gangorder.GangOrder") -> dict:
    """The run's gang order object (trainium_api.gangorder), owned by the run."""
    name = run["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": gangorder.object_name(name), "namespace": run["metadata"]["namespace"],
                         "labels": {keys.RUN: name, keys.GANG_ORDER: "true", **keys.MANAGED_BY},
                         "ownerReferences": [owner_reference(run)]},
            "data": {gangorder.DATA_KEY: gangorder.payload(gang)}}


def config_map(run: dict, spec: TrainingRunSpec) -> dict:
    name = run["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"{name}-config", "labels": {keys.RUN: name, **keys.MANAGED_BY},
                         "ownerReferences": [owner_reference(run)]},
            "data": {"run.yaml": rendered_config(spec)}}


def pods(run: dict, spec: TrainingRunSpec, attempt: int, excluded_nodes: list[str],
         host: HostAccess = HostAccess(), preflight_trusted: list[str] = ()) -> list[dict]:
    """``host``: where the compile cache lives on the node (the operator's configuration)."""
    return [pod(run, spec, attempt, i, excluded_nodes, host, preflight_trusted) for i in range(spec.nodes)]


def spare_pod(run: dict, spec: TrainingRunSpec, attempt: int, serial: int, excluded_nodes: list[str],
              host: HostAccess = HostAccess()) -> dict:
    """A standby pod (faultTolerance.spares): a gang pod of no index yet (hostname
    ``<run>-s<n>``: spare_hostname), its agent told to wait (it says ready and starts workers only when an order gives
    it an index, a node rank and the rendezvous address: trainium_api.agent.Order). The run's
    anti-affinity keeps it off the gang's nodes and the other spares'."""
    obj = pod(run, spec, attempt, 0, excluded_nodes, host, (), await_start=True)
    name = spare_name(run["metadata"]["name"], serial)
    labels = {k: v for k, v in obj["metadata"]["labels"].items() if k not in (keys.ATTEMPT, keys.INDEX)}
    obj["metadata"] = {**obj["metadata"], "name": name, "labels": {**labels, keys.SPARE: "true"}}
    obj["spec"]["hostname"] = spare_hostname(run["metadata"]["name"], name)
    return obj


def _command(spec: TrainingRunSpec, index: int, master: str) -> list[str]:
    precompile = ([PRECOMPILE_FLAG, str(spec.compile_cache.precompile_steps)]
                  if spec.compile_cache.precompile_steps else [])
    ft = spec.fault_tolerance
    check = ([PREFLIGHT_FLAG, f"{ft.preflight_slow_factor:g},{ft.preflight_timeout_seconds:g},{spec.backend or 'auto'}"]
             if spec.preflight_on() else [])
    agent = [AGENT_FLAG] if spec.in_place_on() else []  # first: the agent runs the rest as its child
    launch = ["python", "-m", LAUNCH_MODULE, *agent, *precompile, *check, "--nnodes", str(spec.nodes), "--node_rank", str(index),
              "--nproc_per_node", str(spec.processes_per_node), "--master_addr", master,
              "--master_port", str(MASTER_PORT)]
    if not spec.trainer.is_command:
        return [*launch, "-m", "trainer", "--config", f"{CONFIG_MOUNT}/run.yaml"]
    t = spec.trainer
    watch = ["python", "-m", WATCH_MODULE, "--format", t.progress_format,
             "--interval", str(spec.run.logging.progress_interval_seconds)]
    if t.progress_regex:
        watch += ["--regex", t.progress_regex]
    if t.tokens_per_sample:
        watch += ["--tokens-per-sample", str(t.tokens_per_sample)]
    # the watch lists $CHECKPOINT_URI from the pod: where an NxDT script resumes, the start step
    watch += ["--checkpoint-layout", t.layout]
    return [*watch, "--", *launch, *t.command]


NETWORK_WEIGHTS = {3: 100, 2: 50, 1: 25}
"""Preferred pod affinity weights per network layer: the nearest layer that holds the gang wins."""


PREFLIGHT_LIST_MAX = 512 * 1024
"""The most the list of passed nodes may take (a ConfigMap holds 1 MiB): about 40,000 nodes. A
longer list is left out, and the check runs (trusting too little costs only its time)."""


def preflight_list(nodes, room: int = PREFLIGHT_LIST_MAX) -> str:
    """The nodes that passed the run's pre-flight check recently, as the pods read them
    (launch.PREFLIGHT_PASSED_FILE_ENV): one token a line, sorted ("" for none, or too many:
    more than ``room`` bytes)."""
    listed = "".join(t + "\n" for t in sorted({launch.node_token(n) for n in nodes}))
    return listed if len(listed) <= room else ""


def preflight_map(run: dict, spec: TrainingRunSpec, preflight_trusted) -> dict | None:
    """The ConfigMap the pods given ``preflight_trusted`` read the list from (None when they get
    none). One object per distinct list, named by its content (a list is never changed under
    a pod that mounts it), owned by the run, and shared by every pod given that list: the list
    is stored once, not on each pod (4,096 pods each carrying 4,096 nodes' tokens were 218 MB
    in etcd)."""
    listed = preflight_list(preflight_trusted) if spec.preflight_on() and not _preflight_file_taken(spec) else ""
    if not listed:
        return None
    name = run["metadata"]["name"]
    digest = hashlib.sha256(listed.encode()).hexdigest()[:PREFLIGHT_MAP_DIGEST]
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"{name}-preflight-{digest}",
                         "labels": {keys.RUN: name, keys.PREFLIGHT_LIST: "true", **keys.MANAGED_BY},
                         "ownerReferences": [owner_reference(run)]},
            "data": {launch.PREFLIGHT_PASSED_FILE.rsplit("/", 1)[1]: listed}}


PREFLIGHT_MAP_DIGEST = 10


def with_list(run: dict, spec: TrainingRunSpec, preflight_trusted) -> list[dict]:
    """What pods given ``preflight_trusted`` need made with them: the list's ConfigMap, if any
    (the applier makes a pod's children first; a pod without it would wait to start)."""
    made = preflight_map(run, spec, preflight_trusted)
    return [made] if made else []


def _preflight_file_taken(spec: TrainingRunSpec) -> bool:
    """A run an earlier release accepted may use the list's volume, path or variable itself
    (spec.CONTRACT_ADDED_LATER): its pods go without the list."""
    return (any(v["name"] == launch.PREFLIGHT_PASSED_VOLUME for v in spec.volumes)
            or any(m["mountPath"].rstrip("/") == launch.PREFLIGHT_PASSED_DIR for m in spec.volume_mounts)
            or any(e["name"] == E.PREFLIGHT_PASSED_FILE_ENV for e in spec.env))


def gang_affinity(spec: TrainingRunSpec, name: str) -> dict:
    """Keeps a Trainium gang close on the network ({} for other runs, and for a run whose pod
    template asks Kueue for a topology: Kueue's topology-aware scheduling places it). Preferred:
    each pod drawn to the network nodes of the gang's pods placed already, the nearest layer
    weighing most, so the gang fills the smallest network domain that fits. Required, for a
    trn2u gang of at most one UltraServer (4 nodes, its spares counted): all of it inside one
    UltraServer (the NeuronLink domain; the scheduler places a first pod anywhere and the rest
    with it). A pod replaced later must find a free node of that UltraServer; when none is left,
    the gang is placed again whole (the scheduling rule's capacity wait)."""
    if not INSTANCE_TYPES[spec.instance_type]["neuron"] or workload.topology_request(spec):
        return {}
    gang = {"labelSelector": {"matchLabels": {keys.RUN: name}}}
    out: dict = {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": NETWORK_WEIGHTS[layer], "podAffinityTerm": {**gang, "topologyKey": f"{keys.NETWORK_LAYER}{layer}"}}
        for layer in keys.NETWORK_LAYERS]}
    if spec.instance_type.startswith("trn2u.") and spec.nodes + spec.fault_tolerance.spares <= keys.ULTRASERVER_NODES:
        out["requiredDuringSchedulingIgnoredDuringExecution"] = [{**gang, "topologyKey": keys.ULTRASERVER}]
    return out


DEVICE_CLAIM = "devices"
"""The pod's ResourceClaim (resources DRA), made from the run's template by the resource claim controller."""


def claim_template_name(run_name: str, efa: bool = False) -> str:
    """One name per request shape: a template's spec cannot change, so the EFA DRA class coming
    or going gives the run's later pods a new template (the old one goes with the run)."""
    return f"{run_name}-devices" + ("-efa" if efa else "")


def claim_template(run: dict, spec: TrainingRunSpec) -> dict:
    """The run's ResourceClaimTemplate (resources DRA): every Neuron device of the node a pod
    lands on (allocationMode All over the node's pool), of the run's instance type (a Trn3
    instance: any whose instanceType attribute starts trn3), as the Neuron DRA driver publishes
    them (attributes instanceType and resourceType, aws-neuron-sdk deploy/eks/dra.rst); and the
    node's EFA interfaces where the EFA DRA driver's class exists (dra_efa). One claim a pod: the
    resource claim controller makes it from this template and deletes it with the pod."""
    attrs = f"device.attributes['{NEURON_DEVICE_CLASS}']"
    kind = (f"{attrs}.instanceType.startsWith('{spec.instance_type}')" if INSTANCE_TYPES[spec.instance_type].get(
        "dra_only") else f"{attrs}.instanceType == '{spec.instance_type}'")
    requests = [{"name": "neuron", "exactly": {
        "deviceClassName": NEURON_DEVICE_CLASS, "allocationMode": "All",
        "selectors": [{"cel": {"expression": f"{kind} && {attrs}.resourceType == 'neuron_device'"}}]}}]
    if spec.dra_efa:
        requests.append({"name": "efa", "exactly": {"deviceClassName": EFA_DEVICE_CLASS, "allocationMode": "All"}})
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": claim_template_name(run["metadata"]["name"], spec.dra_efa),
                         "namespace": run["metadata"]["namespace"],
                         "labels": {keys.RUN: run["metadata"]["name"], **keys.MANAGED_BY},
                         "ownerReferences": [owner_reference(run)]},
            "spec": {"spec": {"devices": {"requests": requests}}}}


def container_security(itype: dict, dra_efa: bool = False) -> dict:
    """The trainer container's: no privilege escalation, the runtime's default seccomp profile,
    every capability dropped but IPC_LOCK where EFA is (libfabric pins its buffers in memory),
    counted or claimed (``dra_efa``)."""
    efa = itype["resources"].get("vpc.amazonaws.com/efa") or dra_efa
    return locked_down("IPC_LOCK") if efa else locked_down()


def pod(run: dict, spec: TrainingRunSpec, attempt: int, index: int, excluded_nodes: list[str],
        host: HostAccess = HostAccess(), preflight_trusted: list[str] = (), await_start: bool = False) -> dict:
    """``preflight_trusted``: nodes that passed the run's pre-flight check recently (the
    attempt's, status.current.preflightTrusted): when every pod is on one, the check is skipped.
    ``await_start``: a pod that replaces one of a gang restarted in place: its agent says ready
    and starts its workers only on the operator's order, with the others (the barrier)."""
    name, ns = run["metadata"]["name"], run["metadata"]["namespace"]
    itype = INSTANCE_TYPES[spec.instance_type]
    master = f"{name}-0.{name}.{ns}.svc"
    env = {E.MASTER_ADDR: master, E.MASTER_PORT: str(MASTER_PORT), E.NNODES: str(spec.nodes),
           E.NODE_RANK: str(index), E.NPROC_PER_NODE: str(spec.processes_per_node), E.TRAINING_RUN: name,
           E.TRAINING_RUN_CREATED: str(_created(run)), E.ATTEMPT: str(attempt), E.CHECKPOINT_URI: spec.run.checkpoint.uri,
           E.RESUME: "auto", E.NEURON_COMPILE_CACHE_URL: spec.compile_cache.path,
           E.TERMINATION_LOG_ENV: TERMINATION_MESSAGE_PATH}  # what the runtime said goes there (trainer.pod.launch)
    if itype["neuron"]:
        env.update(NEURON_ENV)
        env[E.NEURON_RT_NUM_CORES] = str(spec.processes_per_node)  # logical cores on trn2
        # the compiler's Logical NeuronCore setting must equal the runtime's (docs/neuron.md)
        lnc = f" --logical-nc-config={itype['lnc']}" if itype["generation"] != "trn1" else ""
        extra = f" {spec.compile_cache.extra_flags.strip()}" if spec.compile_cache.extra_flags.strip() else ""
        env[E.NEURON_CC_FLAGS] = (f"--model-type transformer --distribution-strategy=llm-training{lnc} "
                                  f"--cache_dir={spec.compile_cache.path}{extra}")
        if itype["generation"] != "trn1":
            env[E.NEURON_LOGICAL_NC_CONFIG] = str(itype["lnc"])
    env_list = [{"name": k, "value": v} for k, v in env.items()]
    if itype["neuron"] and spec.preflight_on() and "aws.amazon.com/neuron" in itype["resources"]:
        # the pre-flight check counts the container's devices (a DRA-only type's count is the claim's)
        env_list.append({"name": E.PREFLIGHT_DEVICES_ENV, "value": itype["resources"]["aws.amazon.com/neuron"]})
    trusted = preflight_map(run, spec, preflight_trusted)  # (the callers ensure it with the pod)
    if trusted:
        env_list.append({"name": E.PREFLIGHT_PASSED_FILE_ENV, "value": launch.PREFLIGHT_PASSED_FILE})
    if await_start:
        env_list.append({"name": E.AWAIT_START_ENV, "value": "1"})
    env_list += [{"name": E.POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                 {"name": E.NODE_NAME, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                 {"name": E.POD_NAMESPACE, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    env_list += [dict(e) for e in spec.env]  # the user's, after the contract's (parse refuses overrides)
    command = _command(spec, index, master)
    dra = itype["neuron"] and spec.resources == "DRA"
    # with DRA the claim brings the Neuron devices, and the EFA interfaces where the EFA DRA
    # driver's class exists; else EFA stays the device plugin's extended resource
    resources = {k: v for k, v in itype["resources"].items()
                 if not dra or (k == "vpc.amazonaws.com/efa" and not spec.dra_efa)}
    affinity: dict = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {keys.RUN: name}}, "topologyKey": "kubernetes.io/hostname"}]}}
    together = gang_affinity(spec, name)
    if together:
        affinity["podAffinity"] = together
    if excluded_nodes:
        affinity["nodeAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn",
                                   "values": sorted(excluded_nodes)}]}]}}
    spec_body: dict = {
        "restartPolicy": "Never", "hostname": f"{name}-{index}", "subdomain": name,
        "serviceAccountName": spec.trainer_service_account(name),
        "terminationGracePeriodSeconds": int(spec.fault_tolerance.teardown_grace_seconds),
        "affinity": affinity,
        "containers": [{
            "name": "trainer", "image": spec.image, "command": command, "env": env_list,
            "resources": {"limits": resources, "requests": resources} if resources else {},
            "ports": [{"name": "metrics", "containerPort": METRICS_PORT}],
            "terminationMessagePath": TERMINATION_MESSAGE_PATH, "terminationMessagePolicy": "File",
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                             {"name": "compile-cache", "mountPath": spec.compile_cache.path}],
            "securityContext": container_security(itype, dra and spec.dra_efa),
        }],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}},
                    {"name": "compile-cache", **host.compile_cache_volume(ns, name)}],
    }
    if not spec.trainer.is_command:  # our trainer reads its rendered config
        spec_body["containers"][0]["volumeMounts"].insert(0, {"name": "config", "mountPath": CONFIG_MOUNT,
                                                              "readOnly": True})
        spec_body["volumes"].insert(0, {"name": "config", "configMap": {"name": f"{name}-config"}})
    spec_body["containers"][0]["volumeMounts"] += [dict(m) for m in spec.volume_mounts]
    spec_body["volumes"] += [dict(v) for v in spec.volumes]
    if trusted:  # the list, as a file (launch.PREFLIGHT_PASSED_FILE_ENV), from its ConfigMap
        spec_body["containers"][0]["volumeMounts"].append({"name": launch.PREFLIGHT_PASSED_VOLUME,
                                                           "mountPath": launch.PREFLIGHT_PASSED_DIR, "readOnly": True})
        spec_body["volumes"].append({"name": launch.PREFLIGHT_PASSED_VOLUME,
                                     "configMap": {"name": trusted["metadata"]["name"]}})
    if spec.trainer.working_dir:
        spec_body["containers"][0]["workingDir"] = spec.trainer.working_dir
    if dra:
        spec_body["resourceClaims"] = [{"name": DEVICE_CLAIM,
                                        "resourceClaimTemplateName": claim_template_name(name, spec.dra_efa)}]
        spec_body["containers"][0]["resources"]["claims"] = [{"name": DEVICE_CLAIM}]
    if itype["neuron"]:
        if "dra_only" not in itype:  # a Trn3 instance's name is not known: the claim's selector finds it
            spec_body["nodeSelector"] = {"node.kubernetes.io/instance-type": spec.instance_type}
        spec_body["tolerations"] = [{"key": "aws.amazon.com/neuron", "operator": "Exists", "effect": "NoSchedule"}]
    return workload.gate(pod_template.apply({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod_name(name, attempt, index), "namespace": ns,
                     "labels": {keys.RUN: name, keys.ATTEMPT: str(attempt), keys.INDEX: str(index), **keys.MANAGED_BY},
                     "annotations": {keys.INSTANCE_TYPE: spec.instance_type,
                                     **({keys.DO_NOT_DISRUPT: "true"} if spec.fault_tolerance.do_not_disrupt else {})},
                     "ownerReferences": [owner_reference(run)]},
        "spec": spec_body}, spec.pod_template, run["metadata"].get("labels") or {}))
