"""S3 under load, in front of a real S3 API server: a loopback HTTP proxy that answers the first
N requests matching a method and path with one of S3's error responses (503 SlowDown, 500
InternalError, 503 ServiceUnavailable, 403 AccessDenied, with S3's XML error body), and forwards
every other request to the server unchanged.

It stands in for what moto's server never does and a test cannot make AWS do on demand:
throttle a prefix, fail in its front end, refuse a request once. The trainer reaches it with
s3fs (``AWS_ENDPOINT_URL``), so botocore, s3fs and the trainer's own retries all see the same
bytes they would see from S3. It also counts the requests it forwarded, per method and path,
so a test can say how many GETs of one object reached the store.
"""

from __future__ import annotations

import http.client
import re
import socket
import threading
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

MESSAGES = {  # what S3 says with each code
    "SlowDown": "Please reduce your request rate.",
    "InternalError": "We encountered an internal error. Please try again.",
    "ServiceUnavailable": "Service is unable to handle request.",
    "AccessDenied": "Access Denied",
}


@dataclass
class Fault:
    """The first ``count`` requests whose method is ``method`` ("*": any) and whose path and
    query match ``path`` (a regular expression, searched) are answered ``status`` ``code``."""

    method: str
    path: str
    count: int
    status: int
    code: str
    answered: int = 0

    def matches(self, method: str, target: str) -> bool:
        return self.answered < self.count and self.method in ("*", method) and re.search(self.path, target) is not None


def error_body(code: str, target: str) -> bytes:
    resource = urlsplit(target).path
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>{MESSAGES.get(code, code)}</Message><Resource>{resource}</Resource>"
            f"<RequestId>standin</RequestId><HostId>standin</HostId></Error>").encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3FaultProxy:
    """The proxy on ``127.0.0.1:port``, in front of the S3 API server on ``upstream_port``."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.faults: list[Fault] = []
        self.forwarded: Counter[tuple[str, str]] = Counter()  # (method, path without query) -> requests
        self.injected: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail(self, method: str, path: str, count: int, status: int = 503, code: str = "SlowDown") -> Fault:
        """Answer the next ``count`` matching requests with this error (see :class:`Fault`)."""
        fault = Fault(method, path, count, status, code)
        with self._lock:
            self.faults.append(fault)
        return fault

    def gets(self, path: str) -> int:
        """GETs of ``path`` (e.g. ``/data/tiny/tokenizer.json``) forwarded to the server."""
        with self._lock:
            return self.forwarded[("GET", path)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _fault_for(self, method: str, target: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.matches(method, target):
                    fault.answered += 1
                    self.injected[(method, urlsplit(target).path)] += 1
                    return fault
        return None

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                """Quiet: one line per S3 request would bury the test output."""

            def _answer(self, status: int, headers: list[tuple[str, str]], body: bytes, length: int | None = None):
                self.send_response(status)
                for k, v in headers:
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(body) if length is None else length))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _serve(self):
                size = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(size) if size else None
                fault = proxy._fault_for(self.command, self.path)
                if fault is not None:
                    error = b"" if self.command == "HEAD" else error_body(fault.code, self.path)
                    self._answer(fault.status, [("Content-Type", "application/xml")], error)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                    headers["Host"] = f"127.0.0.1:{proxy.upstream_port}"
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    with proxy._lock:
                        proxy.forwarded[(self.command, urlsplit(self.path).path)] += 1
                    # a HEAD's Content-Length is the object's size, and it has no body
                    length = int(resp.getheader("Content-Length", "0")) if self.command == "HEAD" else None
                    self._answer(resp.status, resp.getheaders(), data, length)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _serve

        return Handler


class LoopbackS3:
    """moto's S3 API server (the real HTTP S3 API the project tests against) on loopback, with an
    :class:`S3FaultProxy` in front: ``env`` points s3fs at the proxy, ``client`` (boto3) talks to
    the server directly, so uploads and checks never meet an injected fault."""

    def __init__(self):
        import subprocess
        import sys
        import time

        import boto3
        self.server_port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                      str(self.server_port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.server_port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.proc.kill()
                    raise
                time.sleep(0.2)
        self.proxy = S3FaultProxy(self.server_port)
        self.env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.proxy.endpoint,
                    "FSSPEC_S3_ENDPOINT_URL": self.proxy.endpoint}
        self.client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{self.server_port}",
                                   region_name="us-east-1", aws_access_key_id="testing",
                                   aws_secret_access_key="testing")

    def close(self) -> None:
        self.proxy.close()
        self.proc.terminate()
        self.proc.wait(10)
