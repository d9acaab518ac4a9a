"""python -m trainium_operator [--namespace NS ...] [--metrics-port 8080] [--log-level INFO]

Runs the operator against the cluster of $KUBECONFIG (or in-cluster credentials), cluster-wide
or in the given namespaces. /metrics on --metrics-port; liveness on --liveness-port /healthz.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
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
    from .crd import field_docs
    from .policy import DisruptionGuard
    docs = field_docs(DisruptionGuard)
    for f in dataclasses.fields(DisruptionGuard):  # --disruption-threshold, --disruption-min-nodes, ...
        ap.add_argument("--disruption-" + f.name.replace("_", "-"), dest=f"disruption_{f.name}", type=type(f.default),
                        default=f.default, help=f"{docs.get(f.name, '')} (default {f.default})")
    args = ap.parse_args(argv)
    guard = DisruptionGuard(**{f.name: getattr(args, f"disruption_{f.name}") for f in dataclasses.fields(DisruptionGuard)})
    try:
        guard.validate()
    except ValueError as exc:
        ap.error(str(exc))
    level = getattr(logging, args.log_level.upper(), None)
    if not isinstance(level, int):
        ap.error(f"--log-level must be DEBUG, INFO, WARNING or ERROR, got {args.log_level!r}")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level > logging.DEBUG:  # kopf logs every successful timer tick and event handler at INFO: once a second per run
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message="Unverified HTTPS request")
    from kubernetes import client, config

    from . import metrics
    from .handlers import build_registry
    from .kube import Kube

    def kube_factory() -> Kube:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
        else:
            config.load_kube_config()
        return Kube(client.ApiClient())

    registry = build_registry(kube_factory, guard)

    @kopf.on.login(registry=registry)
    def login(**kwargs):
        return kopf.login_via_client(**kwargs)

    if args.metrics_port:
        metrics.serve(args.metrics_port)
    asyncio.run(kopf.operator(registry=registry, clusterwide=not args.namespace, namespaces=args.namespace,
                              liveness_endpoint=f"http://0.0.0.0:{args.liveness_port}/healthz",
                              standalone=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
