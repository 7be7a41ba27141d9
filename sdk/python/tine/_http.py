"""HTTP/1.1 on tined's Unix socket, small and quick: what the clients use
instead of httpx there (httpx stays for `url=`, TCP). httpx costs about
0.25 ms of Python per request; this costs a few hundredths of that.

- Kept-alive connections in a pool: one per request in flight (so one per
  thread, for the sync client), reused LIFO, at most `MAX_IDLE` kept idle.
  The asyncio client holds at most `MAX_OPEN` at once.
- Answers framed by Content-Length, chunked, or the connection's end;
  `stream()` hands out the body as it comes (the NDJSON of a streamed
  exec, the SSE of an operation).
- A kept-alive connection the server closed while idle (tined restarted)
  is replaced: a request that could not be sent on it is sent again on a
  new one (none of it arrived), and one that got no byte of answer is
  sent again only when its method is idempotent (it may have been done).
- `timeout` is per operation like httpx's (connecting, sending, waiting
  for the next bytes of the answer), except for the asyncio client's
  `request`, where it bounds the whole request; None waits forever.
- Every failure of the connection or the protocol is `TransportError`.
- A forked child does not use its parent's connections; it opens its own.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
import os
import socket
import sys
import time
import weakref
from typing import Any, AsyncIterator, Dict, Iterator, List, Mapping, Optional, Tuple
from urllib.parse import quote, urlencode

from . import errors

MAX_IDLE = 20
MAX_OPEN = 100
MAX_LINE = 65536
#: A body bigger is sent apart from the head, not copied into it.
BIG = 65536
#: Requests sent again when a reused connection ends before any answer.
IDEMPOTENT = frozenset(("GET", "HEAD", "PUT", "DELETE", "OPTIONS"))
CHUNKED, UNTIL_CLOSE = -1, -2
#: `timeout=DEFAULT`: the client's timeout.
DEFAULT: Any = object()


class TransportError(Exception):
    """tined could not be reached, or the connection to it broke."""


class _NoAnswer(TransportError):
    """The connection ended before any byte of the answer."""


class Response:
    """An answer: `status_code`, `headers` (lower-case names), `content`."""

    __slots__ = ("status_code", "headers", "content")

    def __init__(self, status_code: int, headers: Dict[str, str], content: bytes = b""):
        self.status_code = status_code
        self.headers = headers
        self.content = content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return jsonlib.loads(self.content)

    def __repr__(self) -> str:
        return f"<Response [{self.status_code}]>"


# -- what both clients share: the request's bytes, the answer's head ------


class _Base:
    def __init__(self, path: str, headers: Mapping[str, str], timeout: Optional[float]):
        self.path = path
        self.timeout = timeout
        self._idle: List[Any] = []
        self._closed = False
        _CLIENTS.add(self)
        fixed = {"host": ("Host", "tined"), "accept": ("Accept", "*/*")}
        fixed.update((k.lower(), (k, v)) for k, v in headers.items())
        self._fixed = fixed
        self._fixed_head = _header_lines(fixed)

    def _encode(
        self,
        method: str,
        path: str,
        json: Any,
        params: Optional[Mapping[str, Any]],
        content: Optional[bytes],
        headers: Optional[Mapping[str, str]],
    ) -> Tuple[bytes, Optional[bytes]]:
        """The request's bytes: its head with a small body, and a big body
        apart (sent after, not copied)."""
        if params:
            path = f"{path}?{urlencode({k: _param(v) for k, v in params.items()}, quote_via=quote)}"
        extra = ""
        if json is not None:
            content = jsonlib.dumps(json, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
            if not (headers and any(k.lower() == "content-type" for k in headers)):
                extra = "Content-Type: application/json\r\n"
        if content is not None:
            extra += f"Content-Length: {len(content)}\r\n"
        elif method in ("POST", "PUT", "PATCH"):
            extra = "Content-Length: 0\r\n"
        if headers:
            merged = dict(self._fixed)
            merged.update((k.lower(), (k, v)) for k, v in headers.items())
            lines = _header_lines(merged)
        else:
            lines = self._fixed_head
        if any(c in path for c in " \r\n"):
            raise errors.InvalidInput(f"a request path with a space or a line break: {path!r}", code="invalid_input")
        head = f"{method} {path} HTTP/1.1\r\n{lines}{extra}\r\n".encode()
        if not content:
            return head, None
        if len(content) <= BIG:
            return head + content, None
        return head, content

    def _pooled(self, conn: Any, keep: bool) -> None:
        """`conn` goes back to the pool when it may carry another request."""
        if keep and not self._closed and len(self._idle) < MAX_IDLE:
            self._idle.append(conn)
        else:
            conn.close()


_CLIENTS: "weakref.WeakSet[_Base]" = weakref.WeakSet()


def _forget_connections() -> None:
    """In a forked child: the parent's connections are not the child's to
    use (their answers would go to either); it opens its own."""
    for c in list(_CLIENTS):
        c._idle = []


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_connections)


def _param(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return "" if v is None else str(v)


def _header_lines(headers: Mapping[str, Tuple[str, str]]) -> str:
    out = []
    for name, value in headers.values():
        value = str(value)
        if any(c in name + value for c in "\r\n\0") or not name or ":" in name:
            raise errors.InvalidInput(f"header {name!r} has a line break or is malformed", code="invalid_input")
        out.append(f"{name}: {value}\r\n")
    return "".join(out)


def _parse_head(lines: List[bytes]) -> Tuple[int, Dict[str, str], bool]:
    """Status, headers and whether HTTP/1.1 keep-alive holds, from the
    head's lines (the status line first, without the blank line)."""
    parts = lines[0].split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise TransportError(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
    headers: Dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise TransportError(f"a malformed header line: {line[:80]!r}")
        k = name.strip().lower().decode("latin-1")
        v = value.strip().decode("latin-1")
        headers[k] = f"{headers[k]}, {v}" if k in headers else v
    keep = parts[0] == b"HTTP/1.1" and "close" not in headers.get("connection", "").lower()
    return int(parts[1]), headers, keep


def _framing(method: str, status: int, headers: Dict[str, str], keep: bool) -> Tuple[int, bool]:
    """The body's length (or CHUNKED, UNTIL_CLOSE) and whether the
    connection stays usable after it (RFC 9112 §6.3)."""
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return 0, keep
    te = headers.get("transfer-encoding")
    if te is not None:
        if te.lower().rsplit(",", 1)[-1].strip() == "chunked":
            return CHUNKED, keep
        return UNTIL_CLOSE, False
    cl = headers.get("content-length")
    if cl is not None:
        values = {v.strip() for v in cl.split(",")}
        if len(values) != 1 or not next(iter(values)).isdigit():
            raise TransportError(f"a bad Content-Length: {cl!r}")
        return int(values.pop()), keep
    return UNTIL_CLOSE, False


def _chunk_size(line: bytes) -> int:
    size = line.split(b";", 1)[0].strip()
    if not line.endswith(b"\n") or not size or any(c not in b"0123456789abcdefABCDEF" for c in size):
        raise TransportError(f"a bad chunk size line: {line[:80]!r}")
    return int(size, 16)


def _trailer(line: bytes) -> bool:
    """Whether `line` is a trailer (after the last chunk), not the end."""
    if not line.endswith(b"\n"):
        raise TransportError("the connection closed in the trailers of a chunked answer")
    return line not in (b"\r\n", b"\n")


def _backlog_pauses(timeout: Optional[float]) -> Iterator[float]:
    """Pauses between connects while the listener's backlog is full (a
    Unix socket's connect then fails with EAGAIN, it never waits)."""
    pause, waited = 0.001, 0.0
    while timeout is None or waited < timeout:
        yield pause
        waited += pause
        pause = min(pause * 2, 0.05)


def _connected(sock: socket.socket, path: str) -> bool:
    try:
        sock.connect(path)
        return True
    except BlockingIOError:
        return False


def _next_pause(pauses: Iterator[float]) -> float:
    pause = next(pauses, None)
    if pause is None:
        raise TimeoutError("timed out: tined accepts no connection (its listen backlog stays full)")
    return pause


def _lines(chunks: Iterator[bytes]) -> Iterator[str]:
    buf = b""
    for chunk in chunks:
        buf += chunk
        if b"\n" in chunk:
            *whole, buf = buf.split(b"\n")
            for line in whole:
                yield line.rstrip(b"\r").decode("utf-8", errors="replace")
    if buf:
        yield buf.rstrip(b"\r").decode("utf-8", errors="replace")


# -- the sync client -------------------------------------------------------


class _Conn:
    __slots__ = ("sock", "rfile", "timeout")

    def __init__(self, path: str, timeout: Optional[float]):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            pauses = _backlog_pauses(timeout)
            while not _connected(sock, path):
                time.sleep(_next_pause(pauses))
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.rfile = sock.makefile("rb")
        self.timeout = timeout

    def close(self) -> None:
        self.rfile.close()
        self.sock.close()

    def head(self) -> Tuple[int, Dict[str, str], bool]:
        rfile = self.rfile
        while True:
            try:
                line = rfile.readline(MAX_LINE)
            except ConnectionResetError as e:
                raise _NoAnswer(str(e)) from e
            if not line:
                raise _NoAnswer("the connection closed before an answer")
            lines = []
            while line not in (b"\r\n", b"\n"):
                if not line.endswith(b"\n"):
                    raise TransportError("the answer's head ended early, or has a line too long")
                lines.append(line)
                line = rfile.readline(MAX_LINE)
            status, headers, keep = _parse_head(lines)
            if not 100 <= status < 200 or status == 101:
                return status, headers, keep

    def chunks(self, length: int) -> Iterator[bytes]:
        """The body, as it comes."""
        rfile = self.rfile
        if length == CHUNKED:
            while True:
                size = _chunk_size(rfile.readline(MAX_LINE))
                if size == 0:
                    while _trailer(rfile.readline(MAX_LINE)):
                        pass
                    return
                data = rfile.read(size)
                if len(data) < size or rfile.readline(MAX_LINE) not in (b"\r\n", b"\n"):
                    raise TransportError("the connection closed in the middle of a chunk")
                yield data
        while length:
            data = rfile.read1(65536 if length < 0 else min(length, 65536))
            if not data:
                if length < 0:
                    return
                raise TransportError("the connection closed in the middle of the answer")
            if length > 0:
                length -= len(data)
            yield data


class Client(_Base):
    """A client of an HTTP server on a Unix socket (the same calls as
    `httpx.Client`'s that the SDK makes: `request`, `stream`, `close`)."""

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Optional[Mapping[str, Any]] = None,
        content: Optional[bytes] = None,
        headers: Optional[Mapping[str, str]] = None,
        timeout: Any = DEFAULT,
    ) -> Response:
        data = self._encode(method, path, json, params, content, headers)
        conn, status, hdrs, length, keep = self._start(method, *data, self.timeout if timeout is DEFAULT else timeout)
        try:
            if length >= 0:
                body = conn.rfile.read(length)
                if len(body) < length:
                    raise TransportError("the connection closed in the middle of the answer")
            else:
                body = b"".join(conn.chunks(length))
        except BaseException as e:
            conn.close()
            if isinstance(e, (OSError, ValueError)):
                raise TransportError(str(e) or type(e).__name__) from e
            raise
        self._pooled(conn, keep)
        return Response(status, hdrs, body)

    def stream(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Optional[Mapping[str, Any]] = None,
        content: Optional[bytes] = None,
        headers: Optional[Mapping[str, str]] = None,
        timeout: Any = DEFAULT,
    ) -> "StreamResponse":
        """The answer once its head is in, its body to read as it comes:
        `with client.stream(...) as res: for line in res.iter_lines(): ...`"""
        data = self._encode(method, path, json, params, content, headers)
        return StreamResponse(self, *self._start(method, *data, self.timeout if timeout is DEFAULT else timeout))

    def _start(
        self, method: str, data: bytes, big: Optional[bytes], timeout: Optional[float]
    ) -> Tuple[_Conn, int, Dict[str, str], int, bool]:
        """Sends the request and reads the answer's head."""
        while True:
            try:
                conn, reused = self._idle.pop(), True
            except IndexError:
                try:
                    conn, reused = _Conn(self.path, timeout), False
                except OSError as e:
                    raise TransportError(str(e)) from e
            try:
                if conn.timeout != timeout:
                    conn.sock.settimeout(timeout)
                    conn.timeout = timeout
                try:
                    conn.sock.sendall(data)
                    if big is not None:
                        conn.sock.sendall(big)
                except (BrokenPipeError, ConnectionResetError):
                    if reused:  # closed by the server while idle: nothing of it arrived
                        conn.close()
                        continue
                    raise
                try:
                    status, headers, keep = conn.head()
                except _NoAnswer:
                    if reused and method in IDEMPOTENT:
                        conn.close()
                        continue
                    raise
                length, keep = _framing(method, status, headers, keep)
                return conn, status, headers, length, keep
            except BaseException as e:
                conn.close()
                if isinstance(e, (OSError, ValueError)):
                    raise TransportError(str(e) or type(e).__name__) from e
                raise

    def close(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class StreamResponse(Response):
    """An answer whose body is read as it comes; its connection goes back
    to the pool when the body was read to its end, else it is closed."""

    __slots__ = ("_client", "_conn", "_length", "_keep", "_done")

    def __init__(self, client: Client, conn: _Conn, status: int, headers: Dict[str, str], length: int, keep: bool):
        super().__init__(status, headers)
        self._client, self._conn, self._length, self._keep, self._done = client, conn, length, keep, False

    def iter_bytes(self) -> Iterator[bytes]:
        if self._conn is None:
            raise TransportError("the answer was closed")
        try:
            yield from self._conn.chunks(self._length)
        except (OSError, ValueError) as e:
            self.close()
            raise TransportError(str(e) or type(e).__name__) from e
        self._done = True

    def iter_lines(self) -> Iterator[str]:
        """The body's lines as they come, decoded, without line ends."""
        return _lines(self.iter_bytes())

    def read(self) -> bytes:
        self.content = b"".join(self.iter_bytes())
        return self.content

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            if self._done:
                self._client._pooled(conn, self._keep)
            else:
                conn.close()

    def __enter__(self) -> "StreamResponse":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- the asyncio client ----------------------------------------------------

if sys.version_info >= (3, 11):

    async def _within(aw: Any, timeout: Optional[float]) -> Any:
        if timeout is None:
            return await aw
        async with asyncio.timeout(timeout):
            return await aw

else:

    async def _within(aw: Any, timeout: Optional[float]) -> Any:
        return await asyncio.wait_for(aw, timeout)


_ASYNC_ERRORS = (OSError, ValueError, EOFError, asyncio.TimeoutError, asyncio.LimitOverrunError)


def _transport_error(e: BaseException) -> TransportError:
    if isinstance(e, asyncio.IncompleteReadError):
        return TransportError("the connection closed in the middle of the answer")
    if isinstance(e, asyncio.TimeoutError):
        return TransportError("timed out")
    return TransportError(str(e) or type(e).__name__)


async def _aconnect(path: str, timeout: Optional[float]) -> Tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    # Not open_unix_connection(path): its connect takes a Unix socket's
    # EAGAIN (a full backlog) for "in progress", then sends on a socket
    # that is not connected.
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        pauses = _backlog_pauses(timeout)
        while not _connected(sock, path):
            await asyncio.sleep(_next_pause(pauses))
        return await asyncio.open_unix_connection(sock=sock, limit=MAX_LINE)
    except BaseException:
        sock.close()
        raise


class _AConn:
    __slots__ = ("reader", "writer", "loop")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, loop: Any):
        self.reader, self.writer, self.loop = reader, writer, loop

    def close(self) -> None:
        try:
            self.writer.close()
        except RuntimeError:  # its event loop is closed: the socket closes when collected
            pass

    async def head(self, timeout: Optional[float]) -> Tuple[int, Dict[str, str], bool]:
        while True:
            try:
                block = await _within(self.reader.readuntil(b"\r\n\r\n"), timeout)
            except asyncio.IncompleteReadError as e:
                if e.partial:
                    raise
                raise _NoAnswer("the connection closed before an answer") from e
            except ConnectionResetError as e:
                raise _NoAnswer(str(e)) from e
            status, headers, keep = _parse_head(block.split(b"\r\n")[:-2])
            if not 100 <= status < 200 or status == 101:
                return status, headers, keep

    async def chunks(self, length: int, timeout: Optional[float]) -> AsyncIterator[bytes]:
        """The body, as it comes."""
        reader = self.reader
        if length == CHUNKED:
            while True:
                size = _chunk_size(await _within(reader.readline(), timeout))
                if size == 0:
                    while _trailer(await _within(reader.readline(), timeout)):
                        pass
                    return
                data = await _within(reader.readexactly(size + 2), timeout)
                if data[-2:] != b"\r\n":
                    raise TransportError("a chunk without its line end")
                yield data[:-2]
        while length:
            data = await _within(reader.read(65536 if length < 0 else min(length, 65536)), timeout)
            if not data:
                if length < 0:
                    return
                raise TransportError("the connection closed in the middle of the answer")
            if length > 0:
                length -= len(data)
            yield data


class AsyncClient(_Base):
    """The asyncio twin of `Client`: `await request(...)`,
    `async with stream(...) as res`, `await aclose()`."""

    def __init__(self, path: str, headers: Mapping[str, str], timeout: Optional[float]):
        super().__init__(path, headers, timeout)
        self._slots: Optional[asyncio.Semaphore] = None
        self._slots_loop: Any = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Optional[Mapping[str, Any]] = None,
        content: Optional[bytes] = None,
        headers: Optional[Mapping[str, str]] = None,
        timeout: Any = DEFAULT,
    ) -> Response:
        data, big = self._encode(method, path, json, params, content, headers)
        timeout = self.timeout if timeout is DEFAULT else timeout
        try:
            # One deadline for all of it (a timer per read costs ~20 µs a request).
            return await _within(self._request(method, data, big), timeout)
        except asyncio.TimeoutError as e:
            raise _transport_error(e) from e

    async def _request(self, method: str, data: bytes, big: Optional[bytes]) -> Response:
        conn, status, hdrs, length, keep = await self._start(method, data, big, None)
        try:
            if length >= 0:
                body = await conn.reader.readexactly(length) if length else b""
            else:
                body = b"".join([c async for c in conn.chunks(length, None)])
        except BaseException as e:
            self._done(conn, False)
            if isinstance(e, _ASYNC_ERRORS):
                raise _transport_error(e) from e
            raise
        self._done(conn, keep)
        return Response(status, hdrs, body)

    def stream(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Optional[Mapping[str, Any]] = None,
        content: Optional[bytes] = None,
        headers: Optional[Mapping[str, str]] = None,
        timeout: Any = DEFAULT,
    ) -> "AsyncStreamResponse":
        """`async with client.stream(...) as res: async for line in res.aiter_lines(): ...`"""
        data = self._encode(method, path, json, params, content, headers)
        return AsyncStreamResponse(self, method, *data, self.timeout if timeout is DEFAULT else timeout)

    async def _start(
        self, method: str, data: bytes, big: Optional[bytes], timeout: Optional[float]
    ) -> Tuple[_AConn, int, Dict[str, str], int, bool]:
        """Takes a connection (and one of `MAX_OPEN` slots), sends the
        request and reads the answer's head."""
        loop = asyncio.get_running_loop()
        if self._slots_loop is not loop:
            self._slots, self._slots_loop = asyncio.Semaphore(MAX_OPEN), loop
            while self._idle:  # of another event loop
                self._idle.pop().close()
        slots = self._slots
        assert slots is not None
        await slots.acquire()
        while True:
            try:
                conn, reused = self._idle.pop(), True
                if conn.reader.at_eof():  # closed by the server while idle
                    conn.close()
                    continue
            except IndexError:
                try:
                    r, w = await _aconnect(self.path, timeout)
                except BaseException as e:
                    slots.release()
                    if isinstance(e, _ASYNC_ERRORS):
                        raise _transport_error(e) from e
                    raise
                conn, reused = _AConn(r, w, loop), False
            try:
                conn.writer.write(data)
                if big is not None:
                    conn.writer.write(big)
                if conn.writer.transport.is_closing():
                    if reused:  # closed by the server while idle: nothing of it arrived
                        conn.close()
                        continue
                    raise TransportError("the connection closed before the request was sent")
                if conn.writer.transport.get_write_buffer_size():
                    await _within(conn.writer.drain(), timeout)
                try:
                    status, headers, keep = await conn.head(timeout)
                except _NoAnswer:
                    if reused and method in IDEMPOTENT:
                        conn.close()
                        continue
                    raise
                length, keep = _framing(method, status, headers, keep)
                return conn, status, headers, length, keep
            except BaseException as e:
                self._done(conn, False)
                if isinstance(e, _ASYNC_ERRORS):
                    raise _transport_error(e) from e
                raise

    def _done(self, conn: _AConn, keep: bool) -> None:
        """`conn` is pooled or closed, and its slot freed."""
        self._pooled(conn, keep)
        if self._slots is not None and conn.loop is self._slots_loop:
            self._slots.release()

    async def aclose(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


class AsyncStreamResponse(Response):
    """`async with`: the answer once its head is in, its body read as it
    comes; its connection goes back to the pool when the body was read to
    its end, else it is closed."""

    __slots__ = ("_client", "_method", "_data", "_big", "_timeout", "_conn", "_length", "_keep", "_done")

    def __init__(self, client: AsyncClient, method: str, data: bytes, big: Optional[bytes], timeout: Optional[float]):
        super().__init__(0, {})
        self._client, self._method, self._data, self._big, self._timeout = client, method, data, big, timeout
        self._conn: Optional[_AConn] = None
        self._length, self._keep, self._done = 0, False, False

    async def __aenter__(self) -> "AsyncStreamResponse":
        self._conn, self.status_code, self.headers, self._length, self._keep = await self._client._start(
            self._method, self._data, self._big, self._timeout
        )
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        if self._conn is None:
            raise TransportError("the answer was closed")
        try:
            async for data in self._conn.chunks(self._length, self._timeout):
                yield data
        except _ASYNC_ERRORS as e:
            await self.aclose()
            raise _transport_error(e) from e
        self._done = True

    async def aiter_lines(self) -> AsyncIterator[str]:
        """The body's lines as they come, decoded, without line ends."""
        buf = b""
        async for chunk in self.aiter_bytes():
            buf += chunk
            if b"\n" in chunk:
                *whole, buf = buf.split(b"\n")
                for line in whole:
                    yield line.rstrip(b"\r").decode("utf-8", errors="replace")
        if buf:
            yield buf.rstrip(b"\r").decode("utf-8", errors="replace")

    async def aread(self) -> bytes:
        self.content = b"".join([c async for c in self.aiter_bytes()])
        return self.content

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._client._done(conn, self._done and self._keep)
