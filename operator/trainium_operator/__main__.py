"""python -m trainium_operator [--namespace NS ...] [--metrics-port 8080] [--log-level INFO]

Runs the operator against the cluster of $KUBECONFIG (or in-cluster credentials), cluster-wide
or in the given namespaces. /metrics on --metrics-port; liveness on --liveness-port /healthz.
Several replicas may run: one leads (a Lease, leader.py), the others stand by and take over.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import http.server
import socket
import sys
import threading
import logging
import os
import warnings

import kopf


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainium_operator", description="The Trainium Operator")
    ap.add_argument("--namespace", action="append", default=[], help="watch only these (repeatable)")
    ap.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", "8080")))
    ap.add_argument("--liveness-port", type=int, default=int(os.environ.get("LIVENESS_PORT", "8081")))
    ap.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))
    ap.add_argument("--leader-election", choices=("on", "off"), default=os.environ.get("LEADER_ELECTION", "on"),
                    help="on: only the holder of the Lease acts; off: this process acts alone (one replica only)")
    ap.add_argument("--leader-election-namespace", default=os.environ.get("POD_NAMESPACE", "default"),
                    help="namespace of the Lease (default: this pod's, else default)")
    ap.add_argument("--leader-election-identity", default=os.environ.get("POD_NAME") or socket.gethostname(),
                    help="this candidate's name (default: the pod name; a restarted container leads again at once)")
    from . import ratelimit
    ap.add_argument("--api-qps", type=float, default=os.environ.get("API_QPS", ratelimit.DEFAULT_QPS),
                    help="requests a second the operator's API client sends at most, watches aside (0: no limit; "
                         f"default {ratelimit.DEFAULT_QPS:g}: ratelimit.py says how it is sized)")
    ap.add_argument("--api-burst", type=int, default=os.environ.get("API_BURST", ratelimit.DEFAULT_BURST),
                    help=f"requests it may send at once above that pace (default {ratelimit.DEFAULT_BURST})")
    from trainium_api.fields import field_docs

    from .disruption_guard import DisruptionGuard
    docs = field_docs(DisruptionGuard)
    for f in dataclasses.fields(DisruptionGuard):  # --disruption-threshold, --disruption-min-nodes, ...
        if isinstance(f.default, bool):  # a switch: --trust-pod-fault-reports / --no-trust-pod-fault-reports
            ap.add_argument(GUARD_SWITCHES[f.name], dest=f"disruption_{f.name}", action=argparse.BooleanOptionalAction,
                            default=f.default, help=docs.get(f.name, ""))
            continue
        ap.add_argument("--disruption-" + f.name.replace("_", "-"), dest=f"disruption_{f.name}", type=type(f.default),
                        default=f.default, help=f"{docs.get(f.name, '')} (default {f.default})")
    from . import hostaccess
    hostaccess.add_flags(ap)
    args = ap.parse_args(argv)
    host = hostaccess.from_flags(args)
    try:
        host.validate()
    except ValueError as exc:
        ap.error(str(exc))
    try:
        bucket = ratelimit.TokenBucket(args.api_qps, args.api_burst)
    except ValueError as exc:
        ap.error(str(exc))
    guard = DisruptionGuard(**{f.name: getattr(args, f"disruption_{f.name}") for f in dataclasses.fields(DisruptionGuard)})
    try:
        guard.validate()
    except ValueError as exc:
        ap.error(str(exc))
    level = getattr(logging, args.log_level.upper(), None)
    if not isinstance(level, int):
        ap.error(f"--log-level must be DEBUG, INFO, WARNING or ERROR, got {args.log_level!r}")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not host.checkpoint_prefixes:
        logging.getLogger("trainium_operator").warning(
            "no --checkpoint-prefix: runs may name any s3:// bucket or absolute path as checkpoint.uri, and "
            "their pods read and write it with their own identity; on a cluster shared by teams, allow each "
            "namespace its own stores (e.g. --checkpoint-prefix 's3://BUCKET/{namespace}')")
    if level > logging.DEBUG:  # kopf logs every successful handler call at INFO: every pod change
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message="Unverified HTTPS request")
    from kubernetes import client, config

    from .handlers import build_registry
    from .kube import WRITE_TIMEOUT_SECONDS, Kube
    from .metrics import Metrics
    from .watcher import Options

    metrics = Metrics()  # served while standing by too

    def kube_factory() -> Kube:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
        else:
            config.load_kube_config()
        from .applier import fence
        return Kube(ratelimit.paced(client.ApiClient(), bucket, metrics.api_paced.inc, lambda: fence(may_write)))

    elector = None  # with leader election: passes write only while its lease is current

    def may_write() -> bool:  # a write started now ends (or gives up) before the lease could pass on
        return elector is None or elector.holds(margin=WRITE_TIMEOUT_SECONDS)

    registry = build_registry(Options(kube_factory, guard, may_write, host, metrics))

    @kopf.on.login(registry=registry)
    def login(**kwargs):
        return kopf.login_via_client(**kwargs)

    if args.metrics_port:
        metrics.serve(args.metrics_port)
    if args.liveness_port:
        serve_liveness(args.liveness_port)
    # the operator's memory (the Watcher its start-up puts here) lasts the process: a replica that
    # leads again keeps its API outages, device shortfalls and child checks
    memo = kopf.Memo()

    def operate(stop_flag: asyncio.Event | None = None):
        return kopf.operator(registry=registry, clusterwide=not args.namespace, namespaces=args.namespace,
                             standalone=True, stop_flag=stop_flag, memo=memo)

    if args.leader_election == "off":
        asyncio.run(operate())
        return exit_now(0)
    from .leader import Elector, LeaderConfig
    kube_factory()  # loads the credentials the elector's client uses
    elector = Elector(client.CoordinationV1Api(), LeaderConfig(namespace=args.leader_election_namespace,
                                                               identity=args.leader_election_identity))
    log = logging.getLogger("trainium_operator")
    while elector.wait_until_leader():
        stepped_down, done = threading.Event(), threading.Event()

        async def lead() -> None:
            # kopf stops on SIGTERM/SIGINT by itself, or when we lose the lease (this flag);
            # an asyncio flag, so that a signal leaves no thread blocked waiting on it
            flag, loop = asyncio.Event(), asyncio.get_running_loop()

            def renew() -> None:
                elector.keep_leading(stopping=done.is_set)
                if not done.is_set():
                    stepped_down.set()
                    loop.call_soon_threadsafe(flag.set)
            threading.Thread(target=renew, name="lease", daemon=True).start()
            log.info("leading (lease %s/%s as %s)", args.leader_election_namespace, elector.cfg.name,
                     elector.cfg.identity)
            try:
                await operate(flag)
            finally:
                done.set()

        asyncio.run(lead())
        if not stepped_down.is_set():  # stopped by SIGTERM/SIGINT: shut down and let a standby lead
            elector.release()
            return exit_now(0)
        log.warning("stepped down; standing by again")
    return 0


GUARD_SWITCHES = {"trust_pod_reports": "--trust-pod-fault-reports"}
"""The DisruptionGuard switches' flags (the numbers are --disruption-<name>)."""


def exit_now(code: int) -> int:
    """Leave without the interpreter's teardown: the lease is given up and the status is the only
    memory, so nothing is left to finish, while daemon threads (the lease renewer, the API probe,
    the child re-checks, the metrics and liveness servers) may sit in a socket call that the
    teardown can abort in: an HA test saw a replica stopped by SIGTERM exit -6 after it had
    released the lease."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
    return code  # not reached


def serve_liveness(port: int) -> None:
    """/healthz: 200 while this process runs, leading or standing by (a standby is healthy)."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            ok = self.path.split("?")[0] == "/healthz"
            self.send_response(200 if ok else 404)
            self.end_headers()
            self.wfile.write(b"ok\n" if ok else b"")

        def log_message(self, *_):
            """Probes come every few seconds: not worth a log line."""
    server = http.server.ThreadingHTTPServer(("0.0.0.0", port), Handler)
    threading.Thread(target=server.serve_forever, name="liveness", daemon=True).start()


if __name__ == "__main__":
    raise SystemExit(main())
