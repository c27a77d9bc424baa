"""A fault-injecting HTTP reverse proxy on loopback, for tests (stdlib only).

Put it between s3fs/botocore (``endpoint_url`` = ``proxy.url``) and a real S3 endpoint (moto's server):
every request is forwarded unchanged, except those the schedule picks, which get one fault:

  reset      the connection is closed (RST) before any response
  reset_after  forwarded (the upstream acts on it: a PUT is stored), then an RST instead of the response
  reset_mid  the upstream answers; the client gets the headers and half the body, then an RST
  500        ``500 InternalError`` with an S3 XML error body (nothing forwarded)
  503        ``503 SlowDown`` with an S3 XML error body (nothing forwarded)
  truncate   the upstream answers; the full Content-Length is sent, the body is cut, the socket closed
  short      the upstream answers; a cut body is sent *with a matching Content-Length* (what no HTTP
             layer can notice: only the chunk's CRC32C can)
  latency    forwarded after ``delay`` seconds
  403        ``403 AccessDenied`` with an S3 XML error body (nothing forwarded; not in ``ALL_FAULTS``: no retry
             can cure it, it is for the tests of what a user is told)

A hostile endpoint, for the tests of what hsstore takes (``HOSTILE``; not in ``ALL_FAULTS``, no retry cures them):

  trickle      the upstream's answer, its body one byte a second
  overrun      the upstream's answer without a length, then bytes forever (a body past what was asked)
  huge_length  the upstream's answer declaring a ``Content-Length`` of 10^12, the connection then closed
  endless_list a listing (``list-type=2``) answered as truncated, with a continuation token, for ever (each
               request's token dropped before it is forwarded: the same first page again)
  redirect     ``307`` to the same path and query on ``redirect_to`` (another endpoint), nothing forwarded

Bounded schedule: request ``i`` (of those matching ``match``) gets a fault when ``i % every == every - 1``,
kinds strictly in turn from ``faults`` (seeded order; a kind that needs a body or a chunk waits for the next
request that has one), until ``limit`` faults are injected: ``limit / len(faults)`` of each kind. Persistent
mode (``persistent=True``): every matching request gets a fault. ``injected`` counts faults by kind, so
a test can assert that faults really happened. ``replay=True`` (benchmarks) answers a GET/HEAD it has seen
before from memory, so a second run of the same reads costs the upstream nothing.

An object store's shape, for benchmarks: ``latency`` delays every request (before its answer, as a round
trip does) and ``bandwidth`` caps each connection's response rate in bytes/s (the body is paced in 64 KiB
pieces), so throughput depends on how many requests a client keeps in flight. ``sent`` counts response
body bytes by request path: what a client fetched remotely. ``range_checksums=False`` drops the object's
``x-amz-checksum-*`` headers from answers to a ``Range`` request, as AWS S3 does for any range (MinIO does the
same): moto returns them for a range that covers the whole object, which is how hsstore reads a chunk, so
without this botocore checks a CRC32 of every chunk in an emulation and never on AWS.
"""

from __future__ import annotations

import collections
import http.client
import random
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import urlsplit

BODY_FAULTS = ("reset_mid", "truncate", "short")  # need a response body to cut
ALL_FAULTS = ("reset", "reset_after", "reset_mid", "500", "503", "truncate", "short", "latency")
HOSTILE = ("trickle", "overrun", "huge_length", "endless_list", "redirect")
FOREVER_S = 120  # how long "forever" lasts (a client not cut off by then has failed anyway)

_XML = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{msg}</Message>'
        '<RequestId>faultproxy</RequestId></Error>')


class FaultProxy:
    def __init__(self, upstream: str, faults=ALL_FAULTS, every: int = 3, limit: int = 10, seed: int = 0,
                 persistent: bool = False, match: Callable[[str, str], bool] | None = None,
                 delay: float = 0.05, short_on: Callable[[str], bool] | None = None, replay: bool = False,
                 latency: float = 0.0, bandwidth: float | None = None, range_checksums: bool = True,
                 redirect_to: str | None = None) -> None:
        u = urlsplit(upstream)
        self.upstream = (u.hostname, u.port)
        self.faults = list(faults)
        random.Random(seed).shuffle(self.faults)
        self.every, self.limit, self.persistent, self.delay = max(1, every), limit, persistent, delay
        self.match = match or (lambda method, path: True)
        self.short_on = short_on or (lambda path: True)  # where a silently short body may be served
        # replay: GET/HEAD answers (200/206) are kept by method, path+query and Range, and served again from memory
        # for the same request (faults still applied): the upstream's CPU leaves the measurement (benchmarks)
        self.replay, self.replayed = replay, 0
        self.latency, self.bandwidth = float(latency), bandwidth  # every request; bytes/s per connection
        self.range_checksums = range_checksums  # False: a Range request's answer carries no object checksum (AWS)
        self.redirect_to = redirect_to  # the endpoint a "redirect" fault sends the client to
        self.sent: collections.Counter = collections.Counter()  # path -> response body bytes sent
        self._answers: dict[tuple[str, str, str], tuple[int, str, list, bytes]] = {}
        self.injected: collections.Counter = collections.Counter()
        self.events: list[tuple[str, str, str]] = []  # (method, path, fault)
        self.requests = 0
        self.log: list[tuple[str, str]] = []  # (method, path) of every request, in arrival order
        self.in_flight = 0
        self.max_in_flight = 0  # most requests the proxy held at once (how concurrent a client was)
        self._seen = 0
        self._next = 0  # index of the next fault kind: kinds are injected strictly in turn
        self._pending = False
        self._lock = threading.Lock()
        server_class = type("Server", (ThreadingHTTPServer,), {"request_queue_size": 256})  # many clients at once
        self._server = server_class(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._server.handle_error = lambda request, address: None  # a client gone mid-fault is expected
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def reset_counts(self) -> None:
        """Forget the requests seen so far (``log``, ``requests``, ``max_in_flight``): count a phase alone."""
        with self._lock:
            self.log, self.requests, self.max_in_flight = [], 0, self.in_flight
            self.sent = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.injected.values())

    def __enter__(self) -> "FaultProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _pick(self, method: str, path: str, has_body: bool) -> str | None:
        """The fault for this request, or None (forward unchanged)."""
        with self._lock:
            self.requests += 1
            self.log.append((method, path))
            if not self.match(method, path):
                return None
            i = self._seen
            self._seen += 1
            due = self._pending or i % self.every == self.every - 1
            if not self.persistent and (self.total >= self.limit or not due):
                return None
            kind = self.faults[self._next % len(self.faults)]
            if (kind in BODY_FAULTS and not has_body) or (kind == "short" and not self.short_on(path)):
                self._pending = True  # this request cannot take it: the next one that can does
                return None
            self._pending = False
            self._next += 1
            self.injected[kind] += 1
            self.events.append((method, path, kind))
            return kind

    def _handler(self) -> type:
        return type("Handler", (_Handler,), {"proxy": self})


class _Handler(BaseHTTPRequestHandler):
    """One request to a ``FaultProxy`` (``proxy``, set on the subclass each proxy makes): forwarded, or faulted."""

    proxy: "FaultProxy"
    protocol_version = "HTTP/1.1"

    def log_message(self, *a) -> None:  # quiet
        pass

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline().strip():
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _rst(self) -> None:
        """Close with a TCP reset (SO_LINGER 0), as a dropped connection looks to a client."""
        try:
            self.wfile.flush()
        except OSError:
            pass
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    def _forward(self, body: bytes, path: str | None = None):
        conn = http.client.HTTPConnection(*self.proxy.upstream, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        conn.request(self.command, path or self.path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        return resp.status, resp.reason, resp.getheaders(), data

    def _send(self, status, reason, headers, data: bytes, length: int | None = None) -> None:
        self.send_response_only(status, reason)
        drop = ("content-length", "transfer-encoding", "connection")
        if not self.proxy.range_checksums and self.headers.get("Range"):
            drop += ("x-amz-checksum-",)
        for k, v in headers:
            if not k.lower().startswith(drop):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data) if length is None else length))
        self.end_headers()
        if self.command == "HEAD":
            return
        with self.proxy._lock:
            self.proxy.sent[self.path.split("?")[0]] += len(data)
        if not self.proxy.bandwidth:
            self.wfile.write(data)
            return
        t0, step = time.perf_counter(), 64 << 10
        for i in range(0, len(data), step):  # paced: this connection's share of the link
            self.wfile.write(data[i:i + step])
            ahead = t0 + (i + step) / self.proxy.bandwidth - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)

    def _error(self, status: int, code: str, msg: str) -> None:
        data = _XML.format(code=code, msg=msg).encode()
        self._send(status, "Error", [("Content-Type", "application/xml")], data)

    def _serve(self) -> None:
        with self.proxy._lock:
            self.proxy.in_flight += 1
            self.proxy.max_in_flight = max(self.proxy.max_in_flight, self.proxy.in_flight)
        try:
            self._serve_one()
        finally:
            with self.proxy._lock:
                self.proxy.in_flight -= 1

    def _serve_one(self) -> None:
        body = self._body()
        has_body = self.command == "GET"
        kind = self.proxy._pick(self.command, self.path, has_body)
        if kind == "reset":
            return self._rst()
        if kind == "500":
            return self._error(500, "InternalError", "We encountered an internal error. Please try again.")
        if kind == "403":
            return self._error(403, "AccessDenied", "Access Denied")
        if kind == "503":
            return self._error(503, "SlowDown", "Please reduce your request rate.")
        if kind == "redirect":
            self.send_response_only(307, "Temporary Redirect")
            self.send_header("Location", self.proxy.redirect_to.rstrip("/") + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if kind == "latency":
            time.sleep(self.proxy.delay)
        if self.proxy.latency:
            time.sleep(self.proxy.latency)
        key = (self.command, self.path, self.headers.get("Range", ""))
        answer = self.proxy._answers.get(key) if self.proxy.replay and self.command in ("GET", "HEAD") else None
        if answer is not None:
            with self.proxy._lock:
                self.proxy.replayed += 1
            status, reason, headers, data = answer
        else:
            status, reason, headers, data = self._forward(body, _first_page(self.path) if kind == "endless_list"
                                                          else None)
            if self.proxy.replay and self.command in ("GET", "HEAD") and status in (200, 206):
                self.proxy._answers[key] = (status, reason, headers, data)
        if kind == "reset_after":
            return self._rst()
        if kind in HOSTILE:
            return self._hostile(kind, status, reason, headers, data)
        if kind in BODY_FAULTS and len(data) < 2:  # nothing to cut: drop the connection instead
            kind = "reset_mid"
            data = b""
        if kind == "reset_mid":
            self._send(status, reason, headers, data[: len(data) // 2], length=len(data))
            return self._rst()
        if kind == "truncate":
            self._send(status, reason, headers, data[: len(data) // 2], length=len(data))
            self.close_connection = True
            return
        if kind == "short":
            cut = data[: len(data) // 2]
            headers = [(k, v) for k, v in headers if not k.lower().startswith(("etag", "x-amz-checksum"))]
            return self._send(status, reason, headers, cut)
        self._send(status, reason, headers, data)

    def _hostile(self, kind: str, status, reason, headers, data: bytes) -> None:
        """One of ``HOSTILE``'s answers built on the upstream's."""
        self.close_connection = True
        if kind == "endless_list" and b"<ListBucketResult" in data:
            token = f"hostile-{time.monotonic_ns()}".encode()
            data = data.replace(b"<IsTruncated>false</IsTruncated>", b"<IsTruncated>true</IsTruncated>"
                                b"<NextContinuationToken>" + token + b"</NextContinuationToken>")
        if kind in ("endless_list",):
            return self._send(status, reason, headers, data)
        self.send_response_only(status, reason)
        for k, v in headers:
            if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                self.send_header(k, v)
        if kind == "huge_length":
            self.send_header("Content-Length", str(10 ** 12))
        elif kind == "trickle":
            self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command == "HEAD":
            return
        try:
            if kind == "trickle":
                for i in range(len(data)):
                    self.wfile.write(data[i:i + 1])
                    self.wfile.flush()
                    time.sleep(1)
                return
            self.wfile.write(data)
            if kind == "overrun":
                end, junk = time.monotonic() + FOREVER_S, b"\0" * 65536
                while time.monotonic() < end:
                    self.wfile.write(junk)
        except OSError:  # the client cut it off, as it should
            pass

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _serve


def _first_page(path: str) -> str:
    """A listing request's path without its continuation token: the first page again."""
    head, _, query = path.partition("?")
    kept = [q for q in query.split("&") if not q.startswith("continuation-token=")]
    return head + ("?" + "&".join(kept) if kept else "")
