"""Receiving a remote store's bytes, bounded by what hsstore expects whatever a server declares (docs/RELIABILITY.md,
"Boundaries").

fsspec's HTTP filesystem reads a body whole as it comes (a server that ignores ``Range`` streams the object, or
forever), lets aiohttp decode ``Content-Encoding: gzip`` (4 MiB became 4 GiB), follows a redirect to any host and
reads an index page whole; botocore's read timeout is an idle timeout (a byte a second never trips it). So every
GET of a remote store's object, every listing page and every S3 request comes through here:

- at most the bytes asked for: a declared ``Content-Length`` beyond them is refused before a byte is read, a body
  past them is cut and refused, and an answer that ignored ``Range`` is read only up to the range's end;
- no transparent decoding: ``identity`` is asked for, and any other ``Content-Encoding`` refused unread;
- a deadline per request, total time: its first byte within ``request_s()``, and after that its bytes at no less
  than ``min_rate()`` on average (``request_s() + n / min_rate()`` for ``n`` bytes): a peer sending a byte a second
  is cut off after ``request_s()``, whatever its idle gaps; a deadline is never retried. (S3: the status and
  headers within ``head_s()``, the body's clock started when they arrive);
- no redirect followed (HTTP); on S3 an answer that came through a redirect to another origin is refused;
- listings: each page at most ``PAGE_CAP`` (HTML: ``HTML_PAGE_CAP``) bytes, at most ``LIST_PAGES`` pages.

A refusal is ``AnswerRefused`` (a ``CorruptionError``) and a deadline ``DeadlineError`` (an ``OSError``, never retried
by s3fs or botocore), each one line naming the URL and the bound. Only ``door`` and the storage modules under it
(``transfer``, ``listing``) and the storage backends (``backends``) call this.
"""

from __future__ import annotations

import asyncio
import html.parser
from typing import Any, Callable
from urllib.parse import unquote, urljoin, urlsplit

from .. import env
from ..errors import CorruptionError

PAGE_CAP = 16 << 20  # one S3 answer that is not an object's body (a listing page of 1,000 keys is ~300 KB)
HTML_PAGE_CAP = 64 << 20  # one HTML index page (~100 bytes a link: ~600K records)
LIST_PAGES = 10_000  # pages of one S3 listing (1e7 keys; each page's keys must follow the last page's)
PIECE = 1 << 20  # bytes asked of a body at a time
# once every byte asked for has arrived, how long an answer without a length is watched for more (bytes past the
# asked end are refused when they are already there; they are never waited for)
PAST_END_S = 0.5
UNDECLARED_CAP = 64 << 20  # an HTTP object whose size neither a listing nor its server says: read at most this


class AnswerRefused(CorruptionError):
    """An answer hsstore will not take: more bytes than asked for (declared or sent), an encoded body, a
    redirect, a listing past its bounds. ``what`` (the URL) and ``why`` are kept apart, for ``door``."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: refused ({why})")
        self.what, self.why = what, why


class DeadlineError(OSError):
    """A request past its deadline (``deadline``): cut off, not retried."""


def min_rate() -> float:
    """The slowest average rate (bytes/s) an answer's bytes may arrive at (``env.MIN_RATE``)."""
    return env.MIN_RATE.get()


def request_s() -> float:
    """Seconds a request may wait for its answer's first byte (``env.REQUEST_S``)."""
    return env.REQUEST_S.get()


def head_s() -> float:
    """Seconds an S3 request may wait for its status and headers (``env.HEAD_S``): its wait for one of the
    client's pooled connections and an endpoint's queue included; its body's bytes then count from the
    headers."""
    return env.HEAD_S.get()


def deadline(nbytes: int) -> float:
    """Seconds a request of ``nbytes`` may take in all (``request_s()`` + its bytes at ``min_rate()``)."""
    return request_s() + max(0, int(nbytes)) / min_rate()


class Clock:
    """One request's deadline: ``check(got)`` raises once the request has run longer than its first byte's
    ``request_s()`` plus ``got`` bytes at ``min_rate()`` (a trickle is cut off; a stall by the caller's ``wait_for``)."""

    def __init__(self, what: str) -> None:
        self.what, self.t0, self.rate, self.first = what, asyncio.get_running_loop().time(), min_rate(), request_s()

    def restart(self) -> None:
        """Count from now (an S3 answer's headers arrived: its body's bytes are timed from here)."""
        self.t0 = asyncio.get_running_loop().time()

    def left(self, got: int) -> float:
        return self.first + got / self.rate - (asyncio.get_running_loop().time() - self.t0)

    def check(self, got: int) -> None:
        if self.left(got) <= 0:
            raise self.expired(got)

    def expired(self, got: int) -> DeadlineError:
        return DeadlineError(f"{self.what}: cut off after {asyncio.get_running_loop().time() - self.t0:.1f} s with "
                             f"{got:,} bytes (a request's deadline: its first byte within {self.first:g} s, then "
                             f"{self.rate / 1024:,.0f} KiB/s on average; {env.MIN_RATE.name} sets the rate)")


async def bounded(coro, clock: Clock, nbytes: int, head: float = 0.0):
    """``coro`` under the whole request's deadline (``head`` + ``deadline(nbytes)``): a stalled peer is cut off
    too."""
    try:
        return await asyncio.wait_for(coro, head + deadline(nbytes))
    except asyncio.TimeoutError:
        raise clock.expired(nbytes) from None


async def read_body(read: Callable[[int], Any], limit: int, clock: Clock, exact: bool = False) -> bytes:
    """Up to ``limit + 1`` bytes of a body (``read(n)``: an aiohttp ``StreamReader.read``), the clock checked as
    each piece arrives: a caller that wanted ``limit`` sees more as ``len > limit``. ``exact``: ``limit`` bytes are
    all the answer should hold (a range's, a record's): once they are in, a byte past them is looked for only
    ``PAST_END_S``, never waited for until the deadline."""
    buf = bytearray()
    while len(buf) <= limit:
        done = exact and len(buf) == limit
        try:  # a peer that stops sending is cut off when its time is up, not when the whole page's would be
            piece = await asyncio.wait_for(read(min(limit + 1 - len(buf), PIECE)),
                                           PAST_END_S if done else max(0.001, clock.left(len(buf))))
        except asyncio.TimeoutError:
            if done:
                break
            raise clock.expired(len(buf)) from None
        if not piece:
            break
        buf += piece
        clock.check(len(buf))
    return bytes(buf) if len(buf) <= limit else buf  # past the limit the caller sees only its length: no copy


def _encoding_refused(what: str, headers) -> AnswerRefused | None:
    enc = (headers.get("Content-Encoding") or "identity").strip().lower()
    if enc in ("", "identity"):
        return None
    return AnswerRefused(what, f"Content-Encoding {enc!r}: a store's objects are read as stored, never decoded on the way")


def _origin(url: str) -> tuple[str, str | None, int | None]:
    u = urlsplit(str(url))
    return u.scheme.lower(), (u.hostname or "").lower(), u.port


# -- HTTP (fsspec's HTTPFileSystem: its session and options, hsstore's requests) ----------------------------------
def _http_kwargs(fs, headers: dict[str, str], total: float) -> dict[str, Any]:
    import aiohttp

    kw = {k: v for k, v in fs.kwargs.items() if k not in ("headers", "allow_redirects", "timeout")}
    return {**kw, "headers": {**(fs.kwargs.get("headers") or {}), **headers}, "allow_redirects": False,
            "timeout": aiohttp.ClientTimeout(total=total, sock_connect=request_s())}


def _http_status(r, url: str) -> None:
    if r.status == 404:
        raise FileNotFoundError(url)
    if 300 <= r.status < 400:
        raise AnswerRefused(url, f"{r.status} redirects to {r.headers.get('Location')!r}; a store is read from its own URL, "
                           "redirects are not followed")
    r.raise_for_status()


async def _answer(session, url: str, kwargs: dict[str, Any], clock: Clock):
    """The answer to a GET, its status line and headers within ``request_s()`` (a peer sending its headers a byte a
    second is cut off then, whatever the body's deadline would allow)."""
    task = asyncio.ensure_future(session.get(url, **kwargs))
    try:
        done, _ = await asyncio.wait({task}, timeout=request_s())
    except BaseException:  # the whole request cancelled meanwhile
        await _dropped(task)
        raise
    if not done:
        await _dropped(task)
        raise clock.expired(0)
    return task.result()


async def _dropped(task: "asyncio.Future") -> None:
    """``task`` cancelled and its end retrieved (a task whose exception nobody retrieves is logged at exit,
    traceback and all: lines a user must not see under a refusal's one line)."""
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass


async def http_size(fs, url: str) -> int | None:
    """The length a HEAD of ``url`` declares (None: it declares none), asked under the request's deadline, no
    redirect followed, no encoding taken: what an object of unlisted size (an HTTP listing gives none) is read as."""
    clock = Clock(url)

    async def go() -> int | None:
        session = await fs.set_session()
        kwargs = _http_kwargs(fs, {"Accept-Encoding": "identity"}, request_s())
        task = asyncio.ensure_future(session.head(fs.encode_url(url), **kwargs))
        try:
            done, _ = await asyncio.wait({task}, timeout=request_s())
        except BaseException:
            await _dropped(task)
            raise
        if not done:
            await _dropped(task)
            raise clock.expired(0)
        async with task.result() as r:
            _http_status(r, url)
            refused = _encoding_refused(url, r.headers)
            if refused:
                raise refused
            return r.content_length

    return await bounded(go(), clock, 0)


def object_size(fs, path: str) -> int | None:
    """``http_size`` from synchronous code."""
    from fsspec.asyn import sync

    return sync(fs.loop, http_size, fs, path)


async def http_get(fs, url: str, start: int, end: int, size: int | None = None) -> bytes:
    """Bytes ``start:end`` of the object at ``url`` (``size``: the object's size, when a record lists it). An
    answer that ignores ``Range`` is read up to ``end`` only (and refused when it declares another ``size``)."""
    clock = Clock(url)
    n = end - start

    async def go() -> bytes:
        session = await fs.set_session()
        headers = {"Accept-Encoding": "identity"}
        if n:
            headers["Range"] = f"bytes={start}-{end - 1}"
        async with await _answer(session, fs.encode_url(url), _http_kwargs(fs, headers, deadline(n)), clock) as r:
            if r.status == 416 and start == 0:  # an empty object has no byte 0
                return b""
            _http_status(r, url)
            refused = _encoding_refused(url, r.headers)
            if refused:
                raise refused
            declared = r.content_length
            if r.status == 206 or (start == 0 and size is None):
                if declared is not None and declared > n:
                    raise AnswerRefused(url, f"the answer declares {declared:,} bytes, {n:,} were asked for")
                data = await read_body(r.content.read, n, clock, exact=r.status == 206)
                if len(data) > n and r.status == 206:
                    raise AnswerRefused(url, f"the answer holds more than the {n:,} bytes asked for; cut")
                return data[:n + 1]  # (an unsized read sees the object exceed its bound: the caller refuses it)
            if size is not None and declared is not None and declared != size:  # Range ignored: the whole object
                raise AnswerRefused(url, f"the object is {declared:,} bytes, its record lists {size:,}")
            data = await read_body(r.content.read, end, clock, exact=True)  # up to the range's end, never past it
            return data[start:end]

    return await bounded(go(), clock, n)


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        if tag.lower() == "a":
            self.links += [v for k, v in attrs if k.lower() == "href" and v]


async def http_list(fs, url: str) -> list[str]:
    """The base names of the objects an HTML index page at ``url`` links to directly under it (what fsspec's
    ``ls`` finds), the page bounded (``HTML_PAGE_CAP``), under its deadline, no redirect followed."""
    clock = Clock(url)
    page = url.rstrip("/") + "/"

    async def go() -> bytes:
        session = await fs.set_session()
        kwargs = _http_kwargs(fs, {"Accept-Encoding": "identity"}, deadline(HTML_PAGE_CAP))
        async with await _answer(session, fs.encode_url(page), kwargs, clock) as r:
            _http_status(r, page)
            refused = _encoding_refused(page, r.headers)
            if refused:
                raise refused
            if r.content_length is not None and r.content_length > HTML_PAGE_CAP:
                raise AnswerRefused(page, f"an index page that declares {r.content_length:,} bytes, more than the "
                                    f"{HTML_PAGE_CAP:,} a listing may take")
            data = await read_body(r.content.read, HTML_PAGE_CAP, clock)
            if len(data) > HTML_PAGE_CAP:
                raise AnswerRefused(page, f"an index page of more than the {HTML_PAGE_CAP:,} bytes a listing may take; cut")
            return data

    data = await bounded(go(), clock, HTML_PAGE_CAP)
    parser = _Links()
    parser.feed(data.decode("utf-8", errors="replace"))
    base, out = urlsplit(page), []
    for link in parser.links:
        full = urlsplit(urljoin(page, link))
        if (full.scheme, full.netloc) != (base.scheme, base.netloc) or full.query or not full.path.startswith(
                base.path):
            continue
        rest = unquote(full.path[len(base.path):])
        name = rest.rstrip("/")  # a folder's link ends in one slash; a name is what it names once decoded
        if name and "/" not in name and name not in (".", ".."):
            out.append(rest)
    return sorted(set(out))


# -- S3 (s3fs: its client and retries, hsstore's reads of bodies) ---------------------------------------------------
async def _s3_read(fs, path: str, start: int, end: int, consume) -> Any:
    """One ranged GET of S3 object ``path`` whose body ``consume(body, declared length, clock)`` reads; a body cut
    mid-way is fetched again (s3fs's retry count and backoff), all under one deadline (each try's headers within
    ``head_s()``, its body timed from them)."""
    import aiohttp
    from s3fs.core import S3_RETRYABLE_ERRORS

    clock = Clock(f"s3://{path}")
    n = end - start
    bucket, key, version = fs.split_path(path)
    extra = {"VersionId": version} if version else {}
    if n:  # an empty object takes no Range (it has no byte 0)
        extra["Range"] = f"bytes={start}-{end - 1}"
    retryable = S3_RETRYABLE_ERRORS + (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)
    tries = max(1, int(getattr(fs, "retries", 5)))

    async def go() -> Any:
        for i in range(tries):
            resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, **extra)
            body = resp["Body"]
            clock.restart()
            try:
                return await consume(body, resp.get("ContentLength"), clock)
            except retryable:
                if i + 1 >= tries:
                    raise
                await asyncio.sleep(min(1.7 ** i * 0.1, 15))
            finally:
                body.close()
        raise AssertionError("unreachable")

    return await bounded(go(), clock, n, head_s() * tries)


async def s3_get(fs, path: str, start: int, end: int) -> bytes:
    """Bytes ``start:end`` of the S3 object at ``path``: a declared length past them refused unread, a body past
    them cut and refused."""
    n = end - start

    async def consume(body, declared, clock: Clock) -> bytes:
        if declared is not None and declared > n:
            raise AnswerRefused(f"s3://{path}", f"the answer declares {declared:,} bytes, {n:,} were asked for")
        stream = getattr(getattr(body, "raw_stream", None), "content", None)
        data = await read_body(stream.read if stream is not None else body.read, n, clock, exact=True)
        if len(data) > n:
            raise AnswerRefused(f"s3://{path}", f"the answer holds more than the {n:,} bytes asked for; cut")
        return data

    return await _s3_read(fs, path, start, end, consume)


async def s3_into(fs, path: str, views: list[memoryview]) -> int:
    """The S3 object at ``path`` straight into ``views`` in turn (``transfer.cat_into``): the bytes written, or
    more than the views hold when the answer declares more (nothing of it read) or sends more (cut one piece
    past them): the caller names either."""
    want = sum(len(v) for v in views)

    async def consume(body, declared, clock: Clock) -> int:
        if declared is not None and declared > want:
            return int(declared)
        return await _copy_body(body, views, clock)

    return await _s3_read(fs, path, 0, want, consume)


def scatter(blob: bytes, views: list[memoryview]) -> int:
    """Copy ``blob`` into ``views`` in turn (as much as they hold); the blob's size."""
    done, src = 0, memoryview(blob).cast("B")
    for v in views:
        n = min(len(v), len(src) - done)
        v[:n] = src[done:done + n]
        done += n
    return len(src)


async def _copy_body(body, views: list[memoryview], clock: Clock) -> int:
    """The body's bytes into ``views`` in turn; a body longer than them is cut after one piece past them (the
    count says so). aiohttp's pieces are copied as the parser hands them over (the clock checked per piece, no
    timer of its own); another HTTP client's body is read to one byte past the views, then copied."""
    want = sum(len(v) for v in views)
    stream = getattr(getattr(body, "raw_stream", None), "content", None)
    if stream is None or not hasattr(stream, "iter_any"):
        return scatter(await body.read(want + 1), views)
    k = off = done = 0
    async for piece in stream.iter_any():
        done += len(piece)
        clock.check(done)
        piece, at = memoryview(piece), 0
        while at < len(piece) and k < len(views):
            m = min(len(views[k]) - off, len(piece) - at)
            views[k][off:off + m] = piece[at:at + m]
            at, off = at + m, off + m
            if off == len(views[k]):
                k, off = k + 1, 0
        if done >= want:
            break
    if done == want and not stream.at_eof():  # every byte asked for is in: one past them looked for, not waited for
        try:
            done += len(await asyncio.wait_for(stream.readany(), PAST_END_S))
        except asyncio.TimeoutError:
            pass
    return done


def gather(fs, fetch: Callable[..., Any], paths: list[str], starts: list, ends: list, sizes: list | None = None,
           concurrency: int = 64) -> list[Any]:
    """``fetch(fs, path, start, end, size)`` (one of this module's bounded GETs) for every range, ``concurrency`` in
    flight on the filesystem's loop: bytes, or the exception that stopped one (as fsspec's ``cat_ranges(...,
    on_error="return")`` gives). ``starts``/``ends`` None: the whole object, whose size ``sizes`` must give (a
    remote read is never unbounded)."""
    from fsspec.asyn import sync

    sizes = sizes or [None] * len(paths)

    async def run() -> list[Any]:
        gate = asyncio.Semaphore(max(1, concurrency))

        async def one(path, start, end, size):
            start = start or 0
            async with gate:
                try:
                    if end is None and size is None:
                        raise ValueError(f"{path}: a read of an unknown size (hsstore reads are bounded)")
                    return await fetch(fs, path, start, end if end is not None else size, size)
                except Exception as e:  # returned, as fsspec's on_error="return" does
                    return e

        return await asyncio.gather(*(one(*a) for a in zip(paths, starts, ends, sizes)))

    return sync(fs.loop, run)


class RangedFile:
    """A read-only binary file over a remote object of a known ``size``, read in bounded GETs of ``block`` bytes
    (``get(start, end)``): what ``door.stream`` gives for one pass over a tar or an asset, never fsspec's file
    object."""

    def __init__(self, get: Callable[[int, int], bytes], size: int, block: int = 16 << 20) -> None:
        self.get, self.size, self.block = get, int(size), block
        self._buf, self._off, self._next = b"", 0, 0  # the last block, what of it was read, where the next starts

    def read(self, n: int = -1) -> bytes:
        left = self.size - self._next + len(self._buf) - self._off
        n = left if n is None or n < 0 else min(n, left)
        out = bytearray()
        while len(out) < n:
            if self._off >= len(self._buf):
                end = min(self.size, self._next + self.block)
                self._buf, self._off = self.get(self._next, end), 0
                self._next = end
                if not self._buf:
                    break
            piece = self._buf[self._off:self._off + n - len(out)]
            out += piece
            self._off += len(piece)
        return bytes(out)

    def close(self) -> None:
        self._buf = b""

    def __enter__(self) -> "RangedFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- S3: every request botocore sends (the session class hsstore's S3 filesystems are made with) -----------------------
def session_class():
    """An aiobotocore HTTP session class whose ``send`` puts each request under a deadline (``request_s()`` to the
    first byte, its upload at ``min_rate()``), reads an answer that is not an object's body (listing pages, error
    documents) to at most ``PAGE_CAP`` bytes under the same clock, and refuses an answer that came through a
    redirect to another origin. None when aiobotocore takes no session class (older releases)."""
    global _SESSION
    if _SESSION is not None:
        return _SESSION or None
    try:
        import inspect

        from aiobotocore.config import AioConfig
        from aiobotocore.httpsession import AIOHTTPSession
    except ImportError:
        _SESSION = False
        return None
    if "http_session_cls" not in inspect.signature(AioConfig.__init__).parameters:
        _SESSION = False
        return None

    class BoundedSession(AIOHTTPSession):
        async def send(self, request):
            clock = Clock(f"{request.method} {request.url.split('?')[0]}")
            upload = int(request.headers.get("Content-Length") or 0)
            streaming = request.stream_output
            request.stream_output = True  # the body is read here, bounded, unless it is an object's
            try:
                resp = await bounded(super().send(request), clock, upload, head_s())
            finally:
                request.stream_output = streaming
            clock.restart()
            raw = resp.raw
            if getattr(raw, "history", None) and _origin(raw.url) != _origin(request.url):
                raw.close()
                raise AnswerRefused(clock.what, f"redirected to {_origin(raw.url)[1]!r}; a store is read from its own "
                                          "endpoint only")
            if not streaming:
                declared = int(resp.headers.get("content-length") or 0)
                if declared > PAGE_CAP:
                    raw.close()
                    raise AnswerRefused(clock.what, f"the answer declares {declared:,} bytes, more than the {PAGE_CAP:,} a "
                                              "listing page or a reply may take")
                try:
                    data = await bounded(read_body(raw.content.read, PAGE_CAP, clock), clock, PAGE_CAP)
                except BaseException:  # cut short, past its deadline: its connection is not handed back
                    raw.close()
                    raise
                if len(data) > PAGE_CAP:
                    raw.close()
                    raise AnswerRefused(clock.what, f"an answer of more than {PAGE_CAP:,} bytes; cut")
                resp._content = data
            return resp

    _SESSION = BoundedSession
    return BoundedSession


_SESSION: Any = None
