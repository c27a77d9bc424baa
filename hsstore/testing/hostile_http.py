"""A hostile HTTP server on loopback, for tests and the fuzzer (stdlib only): it serves a folder as a static file
server does (``Range`` honoured, HTML index pages of folders), except the paths a ``faults`` rule picks, which get
one misbehaviour each:

  ignore_range  ``200`` and the file, then bytes forever: a server that ignores ``Range`` and never ends
  huge_length   a ``Content-Length`` of 10^12, then the file and the connection closed
  overrun       ``206`` without a length: the range, then bytes forever (a body past what was asked)
  gzip          ``Content-Encoding: gzip``: a gzip bomb (a few MiB that expand to gigabytes)
  endless_index a folder's index page that never ends (links, forever)
  trickle       the headers, then the body one byte a second
  trickle_head  the status line and headers one byte a second
  redirect      ``302`` to the same path on ``redirect_to`` (another server: another host's store)
  slow          the headers, then the body at ``rate`` bytes a second (just above a client's minimum rate: a
                large object takes minutes yet is never cut off by a rate)
  stall         ``206`` (or ``200``) without a length: the bytes asked for, then nothing, the connection held open
  truncate      the answer's headers (its whole ``Content-Length``), half its body, then the connection closed
  no_length     a ``HEAD`` answered without a ``Content-Length`` (a server that declares no length); GETs as usual

A ``POST`` (an engine's ``/v1/chat/completions``) is answered as a ``GET`` of the same path is: the file there (a
canned answer), with the same misbehaviours.

``faults``: list of (kind, predicate of the request path). ``sent`` counts response bytes by path, ``paths`` every
path asked for (what a client read, outside the store's prefix too), ``heads`` the ``HEAD`` requests by path. Threads end when the client goes.
"""

from __future__ import annotations

import collections
import html
import os
import posixpath
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

KINDS = ("ignore_range", "huge_length", "overrun", "gzip", "endless_index", "trickle", "trickle_head", "redirect",
         "slow", "stall", "truncate", "no_length")
FOREVER_S = 120  # how long "forever" lasts (a client that was not cut off by then has failed anyway)
_BOMB: bytes | None = None


def gzip_bomb(expanded: int = 1 << 30) -> bytes:
    """gzip of ``expanded`` zero bytes (~1000x smaller), made in pieces."""
    import zlib

    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    piece = bytes(64 << 20)
    parts = [z.compress(piece) for _ in range(expanded // len(piece))]
    return b"".join(parts) + z.flush()


class HostileHTTPServer:
    def __init__(self, directory: str, faults: list[tuple[str, Callable[[str], bool]]] | None = None,
                 redirect_to: str | None = None, rate: float = 320 << 10) -> None:
        self.directory = os.path.abspath(directory)
        self.rate = float(rate)  # the "slow" fault's bytes a second
        self.faults = list(faults or [])
        for kind, _ in self.faults:
            if kind not in KINDS:
                raise ValueError(f"unknown fault {kind!r}")
        self.redirect_to = redirect_to
        self.sent: collections.Counter = collections.Counter()
        self.paths: list[str] = []
        self.heads: collections.Counter = collections.Counter()
        self.injected: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        server_class = type("Server", (ThreadingHTTPServer,), {"request_queue_size": 128, "daemon_threads": True})
        self._server = server_class(("127.0.0.1", 0), type("Handler", (_Handler,), {"server_of": self}))
        self._server.handle_error = lambda request, address: None  # a client cut off mid-answer is expected
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def fault_for(self, path: str) -> str | None:
        for kind, pick in self.faults:
            if pick(path):
                with self._lock:
                    self.injected[kind] += 1
                return kind
        return None

    def bomb(self) -> bytes:
        global _BOMB
        if _BOMB is None:  # made once a process (seconds of compression)
            _BOMB = gzip_bomb()
        return _BOMB

    def __enter__(self) -> "HostileHTTPServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    server_of: HostileHTTPServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *a) -> None:
        pass

    def _local(self, path: str) -> str | None:
        """The file or folder a URL path names under the served folder (as a static server maps it: decoded,
        dot segments resolved, never above the served folder)."""
        p = posixpath.normpath(urllib.parse.unquote(path.split("?", 1)[0]))
        parts = [x for x in p.split("/") if x and x not in (".", "..")]
        return os.path.join(self.server_of.directory, *parts)

    def _write(self, data: bytes) -> None:
        self.wfile.write(data)
        with self.server_of._lock:
            self.server_of.sent[self.path.split("?")[0]] += len(data)

    def _forever(self, piece: bytes = b"\0" * 65536, pause: float = 0.0) -> None:
        end = time.monotonic() + FOREVER_S
        while time.monotonic() < end and not self.server_of._stop.is_set():
            self._write(piece)
            if pause:
                time.sleep(pause)

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve(head=False)

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)  # the request (a prompt): read and dropped
        self._serve(head=False)

    def _serve(self, head: bool) -> None:
        srv = self.server_of
        with srv._lock:
            srv.paths.append(urllib.parse.unquote(self.path))
            if head:
                srv.heads[urllib.parse.unquote(self.path)] += 1
        kind = srv.fault_for(self.path)
        local = self._local(self.path)
        self.close_connection = True
        try:
            if kind == "redirect":
                self.send_response(302)
                self.send_header("Location", srv.redirect_to.rstrip("/") + self.path)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if kind == "trickle_head":
                for b in b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n":
                    self._write(bytes([b]))
                    time.sleep(1)
                return
            if os.path.isdir(local):
                return self._index(local, head, kind == "endless_index")
            if not os.path.isfile(local):
                self.send_error(404)
                return
            data = open(local, "rb").read()
            if kind == "gzip":
                bomb = srv.bomb()
                self.send_response(200)
                self.send_header("Content-Encoding", "gzip")
                self.send_header("Content-Length", str(len(bomb)))
                self.end_headers()
                if not head:
                    self._write(bomb)
                return
            if kind == "huge_length":
                self.send_response(200)
                self.send_header("Content-Length", str(10 ** 12))
                self.end_headers()
                if not head:
                    self._write(data)
                return
            if kind == "ignore_range":
                self.send_response(200)
                self.end_headers()  # no length: the body ends when the connection does (never)
                if not head:
                    self._write(data)
                    self._forever()
                return
            rng = self.headers.get("Range")
            start, end = 0, len(data)
            if rng and rng.startswith("bytes="):
                a, _, b = rng[6:].partition("-")
                start, end = int(a or 0), min(len(data), int(b) + 1 if b else len(data))
                if start >= len(data) and len(data) == 0:
                    self.send_response(416)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
            body = data[start:end]
            self.send_response(206 if rng else 200)
            if (kind != "no_length") if head else kind not in ("overrun", "stall"):
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self._body(body, kind)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _body(self, body: bytes, kind: str | None) -> None:
        """A file's body as the fault ``kind`` sends it (None: as it is)."""
        if kind == "slow":
            piece = max(1, int(self.server_of.rate / 20))
            for i in range(0, len(body), piece):  # 20 pieces a second, at ``rate`` on average
                self._write(body[i:i + piece])
                time.sleep(piece / self.server_of.rate)
            return
        if kind == "stall":
            self._write(body)
            self.server_of._stop.wait(FOREVER_S)  # nothing more, the connection held
            return
        if kind == "truncate":
            self._write(body[:len(body) // 2])
            return
        if kind == "trickle":
            for i in range(len(body)):
                self._write(body[i:i + 1])
                time.sleep(1)
            return
        self._write(body)
        if kind == "overrun":
            self._forever()

    def _index(self, folder: str, head: bool, endless: bool) -> None:
        names = sorted(os.listdir(folder))
        links = "".join(f'<a href="{html.escape(urllib.parse.quote(n))}{"/" if os.path.isdir(os.path.join(folder, n)) else ""}">'
                        f"{html.escape(n)}</a>\n" for n in names)
        page = f"<html><body>\n{links}".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        if not endless:
            page += b"</body></html>\n"
            self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        if head:
            return
        self._write(page)
        if endless:
            self._forever(b"".join(b'<a href="x%08d.json">x</a>\n' % i for i in range(2000)))

