"""What the Neuron runtime said when a rank died: the signatures, and the termination message
that carries the finding from the pod to the operator (docs/neuron.md, "Failures the runtime
names").

A rank that dies of an uncorrectable memory error or a DMA abort exits non-zero like any
crash. The runtime names these faults: its status codes are in ``nrt_status.h``
(aws-neuron/aws-neuron-sdk, ``src/libnrt/include/nrt/nrt_status.h``; the list is rendered in
``neuron-runtime/api/nrt_status.rst``) and the lines it prints for each are in the runtime's
troubleshooting guide (``neuron-runtime/nrt-troubleshoot.rst``, "Hardware errors"). The pod's
wrapper around torchrun (trainer.pod.launch) scans its ranks' output for them when a worker fails,
and writes the finding into the container's termination message; the operator parses it back
(trainium_operator.observe) and judges: ``device`` -> cause neuron-device, the node is
quarantined; ``restart`` -> the runtime asks only for a new process, the node is kept;
``peer`` -> this rank lost a peer (a collective that never completed, a closed connection):
the culprit is elsewhere, and this pod is never blamed while another pod's finding names it.

The termination message is written by code the run's author controls: the operator parses it
strictly (a known kind, a known status, a bounded evidence line) and ignores anything else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Literal

FaultKind = Literal["device", "network", "repairable", "restart", "peer"]
KINDS: tuple[FaultKind, ...] = ("device", "network", "repairable", "restart", "peer")
"""In order of precedence: a rank whose output shows a device fault is the culprit, even if it
also printed that its peers went away. ``device``: the node's Neuron hardware is faulty (left
out); ``network``: the node's network path to its peers failed (left out, as a node fault);
``repairable``: an error the runtime says a driver reload or a reboot repairs (the node is kept
once, then left out: failure_policy); ``restart``: the runtime asks only for a new process;
``peer``: this rank lost a peer."""
NODE_KINDS: tuple[FaultKind, ...] = ("device", "network", "repairable")
"""Findings that name their pod's node as the fault (the culprit, over pods that lost a peer)."""

# Where the kubelet reads a container's termination message (the default terminationMessagePath;
# the operator writes it into the pod spec too, so both ends name one path). At most 4096 bytes
# are kept by the kubelet.
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
TERMINATION_MESSAGE_LIMIT = 4096
EVIDENCE_LIMIT = 400

MESSAGE_PREFIX = "neuron-runtime-fault:"


@dataclass(frozen=True)
class Signature:
    status: str
    """The NRT_STATUS name the runtime uses for this fault (nrt_status.h)."""
    kind: FaultKind
    pattern: re.Pattern[str]
    what: str


def _sig(status: str, kind: FaultKind, pattern: str, what: str) -> Signature:
    return Signature(status, kind, re.compile(pattern), what)


# Order matters only within a kind: the first signature that matches a line names its status.
SIGNATURES: tuple[Signature, ...] = (
    # -- the runtime's printed lines (nrt-troubleshoot.rst, "Hardware errors") ------------------
    _sig("NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE", "repairable",
         r"Uncorrectable HBM memory error is detected.*reload the neuron driver or reboot",
         "repairable uncorrectable HBM error (1205): a driver reload or a reboot repairs it"),
    _sig("NRT_EXEC_HW_ERR_HBM_UE", "device", r"Uncorrectable HBM memory error is detected",
         "uncorrectable HBM error: the instance is to be replaced"),
    _sig("NRT_EXEC_HW_ERR_NC_UE", "device", r"\[NC \d+\] Uncorrectable memory error is detected",
         "uncorrectable NeuronCore SRAM error: the instance is to be replaced"),
    _sig("NRT_EXEC_HW_ERR_DMA_ABORT", "device", r"DMA (?:TX|RX) engine \d+ is in an abort state",
         "a DMA engine aborted: the instance is to be replaced"),
    _sig("NRT_TIMEOUT", "device",
         r"\(FATAL-RT-UNDEFINED-STATE\) execution timeout \(\d+ ms\) on Neuron Device \d+ NC \d+",
         "a NeuronCore never completed its execution (hang on compute): the instance is to be replaced"),
    _sig("NRT_HW_ERROR", "device", r"NEURON_HW_ERR=[A-Z_]+", "the driver reported a hardware error"),
    # -- the status names, as frameworks print them when a runtime call fails ------------------
    *(_sig(status, kind, rf"\b{status}\b", what) for status, kind, what in (
        ("NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE", "repairable", "repairable uncorrectable HBM error (1205)"),
        # nrt_status.h 1201: "an unrepairable uncorrectable error"
        ("NRT_EXEC_HW_ERR_HBM_UE", "device", "unrepairable uncorrectable HBM error (1201)"),
        # nrt_status.h 1206: "EFA network proxy operation failed" (the node's path to its peers)
        ("NRT_NETWORK_PROXY_FAILURE", "network", "the EFA network proxy failed (1206)"),
        ("NRT_EXEC_HW_ERR_NC_UE", "device", "uncorrectable NeuronCore error"),
        ("NRT_EXEC_HW_ERR_DMA_ABORT", "device", "a DMA engine aborted"),
        ("NRT_EXEC_UNIT_UNRECOVERABLE", "device", "an execution unit is unrecoverable"),
        # the runtime asks for a new process, not a new node
        ("NRT_EXEC_COMPLETED_WITH_NUM_ERR", "restart", "execution completed with numerical errors (NaN)"),
        ("NRT_EXEC_SW_NQ_OVERFLOW", "restart", "the runtime's notification queue overflowed"),
        # this rank lost a peer: the culprit is another rank
        ("NRT_EXEC_HW_ERR_COLLECTIVES", "peer", "a collective never completed: a hardware error on this or another worker"),
    )),
    # -- this rank lost a peer: the runtime's and gloo's words -----------------------------------
    _sig("NRT_EXEC_HW_ERR_COLLECTIVES", "peer", r"suspected hang in collectives operation",
         "a collective never completed: a hardware error on this or another worker"),
    _sig("PEER_CLOSED", "peer", r"(?i:connection closed by (?:remote )?peer|connection reset by peer)",
         "a peer closed its connection"),
)
STATUSES = frozenset(s.status for s in SIGNATURES)
REPAIRABLE_STATUSES = frozenset(s.status for s in SIGNATURES if s.kind == "repairable")
_ANY = re.compile("|".join(f"(?:{s.pattern.pattern})" for s in SIGNATURES))
"""One pass over a line that matches none (nearly every line) instead of one per signature."""


@dataclass(frozen=True)
class Finding:
    kind: FaultKind
    status: str
    local_rank: int | None
    evidence: str
    """The line the runtime printed, verbatim but for control characters, at most EVIDENCE_LIMIT."""

    def describe(self) -> str:
        where = f"local rank {self.local_rank}" if self.local_rank is not None else "a rank"
        return f"{where}: Neuron runtime {self.status}: {self.evidence}"


def _clean(line: str) -> str:
    return "".join(c if c.isprintable() else " " for c in line).strip()[:EVIDENCE_LIMIT]


def scan(lines: Iterable[str], local_rank: int | None = None) -> Finding | None:
    """The most serious finding in one rank's output (KINDS order), the first line of it."""
    best: Finding | None = None
    for line in lines:
        if not _ANY.search(line):
            continue
        for sig in SIGNATURES:
            if (best is None or KINDS.index(sig.kind) < KINDS.index(best.kind)) and sig.pattern.search(line):
                best = Finding(sig.kind, sig.status, local_rank, _clean(line))
                break
        if best is not None and best.kind == KINDS[0]:
            break
    return best


def worst(findings: Iterable[Finding | None]) -> Finding | None:
    """The finding that names the culprit among several ranks' (KINDS order, then the first)."""
    found = [f for f in findings if f is not None]
    return min(found, key=lambda f: KINDS.index(f.kind), default=None)


def format_message(finding: Finding) -> str:
    rank = "-" if finding.local_rank is None else str(finding.local_rank)
    text = f"{MESSAGE_PREFIX} {finding.kind} {finding.status} local-rank {rank}\n{_clean(finding.evidence)}\n"
    return text.encode()[:TERMINATION_MESSAGE_LIMIT].decode(errors="ignore")


_HEADER = re.compile(r"^" + re.escape(MESSAGE_PREFIX) + r" ([a-z]+) ([A-Z_]+) local-rank (-|\d{1,5})$")


def parse_message(text: str | None) -> Finding | None:
    """The finding in a termination message, or None when it carries none (or a malformed one:
    the message is the tenant's to write, so an unknown kind or status means nothing)."""
    if not text or not isinstance(text, str):
        return None
    lines = text[:TERMINATION_MESSAGE_LIMIT].splitlines()
    match = _HEADER.match(lines[0]) if lines else None
    if not match or match.group(1) not in KINDS or match.group(2) not in STATUSES:
        return None
    rank = None if match.group(3) == "-" else int(match.group(3))
    return Finding(match.group(1), match.group(2), rank, _clean(lines[1]) if len(lines) > 1 else "")  # type: ignore[arg-type]
