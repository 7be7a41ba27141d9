"""tine's HTTP/1.1 on a Unix socket (`tine._http`), against a scripted
server: framing (Content-Length, chunked, until close), keep-alive and
the pool, a server that closed an idle connection, what is sent again
and what is not, timeouts, streams that yield as bytes come, and the
typed exceptions the clients make of it all. No tined needed."""

import asyncio
import json
import os
import socket
import tempfile
import threading
import time

import pytest

import tine
from tine import _http


class Server:
    """A Unix-socket HTTP server in a thread. `handler(req, sock)` answers
    each request: it writes to `sock` and returns "keep" (the connection
    serves the next request), "close" or "drop" (closed, answer or not)."""

    def __init__(self, handler):
        self.dir = tempfile.mkdtemp(prefix="tine-http-")
        self.path = os.path.join(self.dir, "s.sock")
        self.handler = handler
        self.requests = []  # (connection number, method, target, headers, body)
        self.accepted = 0
        self.lsock = socket.socket(socket.AF_UNIX)
        self.lsock.bind(self.path)
        self.lsock.listen(16)
        self.threads = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                s, _ = self.lsock.accept()
            except OSError:
                return
            self.accepted += 1
            t = threading.Thread(target=self._serve, args=(s, self.accepted), daemon=True)
            self.threads.append(t)
            t.start()

    def _serve(self, s, n):
        buf = b""
        with s:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = s.recv(65536)
                    if not data:
                        return
                    buf += data
                head, buf = buf.split(b"\r\n\r\n", 1)
                lines = head.decode().split("\r\n")
                method, target, _ = lines[0].split(" ")
                headers = {}
                for line in lines[1:]:
                    k, v = line.split(":", 1)
                    headers[k.strip().lower()] = v.strip()
                length = int(headers.get("content-length", 0))
                while len(buf) < length:
                    buf += s.recv(65536)
                body, buf = buf[:length], buf[length:]
                req = (n, method, target, headers, body)
                self.requests.append(req)
                try:
                    if self.handler(req, s) != "keep":
                        return
                except BrokenPipeError:  # the client left early
                    return

    def close(self):
        self.lsock.close()


@pytest.fixture
def serve():
    servers = []

    def make(handler):
        s = Server(handler)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


def answer(status=200, body=b"", headers=()):
    head = f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n" + "".join(f"{h}\r\n" for h in headers)
    return head.encode() + b"\r\n" + body


def chunked(*parts, status=200):
    out = f"HTTP/1.1 {status} OK\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    for p in parts:
        out += f"{len(p):x}\r\n".encode() + p + b"\r\n"
    return out + b"0\r\n\r\n"


def json_answer(obj, status=200):
    return answer(status, json.dumps(obj).encode(), ["Content-Type: application/json"])


def echo(req, s):
    """Answers the request it got, as JSON."""
    n, method, target, headers, body = req
    s.sendall(json_answer({"conn": n, "method": method, "target": target, "headers": headers, "body": body.decode()}))
    return "keep"


def client(srv, timeout=5.0):
    return _http.Client(srv.path, {"User-Agent": "t"}, timeout)


def aclient(srv, timeout=5.0):
    return _http.AsyncClient(srv.path, {"User-Agent": "t"}, timeout)


# -- framing and keep-alive ------------------------------------------------


def test_content_length_keep_alive_and_what_is_sent(serve):
    srv = serve(echo)
    with client(srv) as c:
        r = c.request("GET", "/a", params={"path": "/x y/ü", "force": True, "depth": 2})
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        got = r.json()
        assert got["target"] == "/a?path=%2Fx%20y%2F%C3%BC&force=true&depth=2"
        assert got["headers"]["host"] == "tined" and got["headers"]["user-agent"] == "t"
        assert "content-length" not in got["headers"]
        r = c.request("POST", "/b", json={"k": "v"}, headers={"Accept": "application/x-ndjson"})
        got = r.json()
        assert got["body"] == '{"k":"v"}' and got["headers"]["content-type"] == "application/json"
        assert got["headers"]["accept"] == "application/x-ndjson", "a call's header replaces the default"
        got = c.request("POST", "/c").json()
        assert got["headers"]["content-length"] == "0" and got["body"] == ""
        got = c.request("PUT", "/d", content=b"\x00bin", headers={"Content-Type": "application/octet-stream"}).json()
        assert got["headers"]["content-type"] == "application/octet-stream"
        assert got["headers"]["content-length"] == "4"
        assert {g[0] for g in srv.requests} == {1}, "one kept-alive connection"
        with pytest.raises(tine.InvalidInput):
            c.request("GET", "/e", headers={"X": "a\r\nInjected: 1"})
        big = b"0123456789abcdef" * (_http.BIG // 8) + b"end"  # sent apart from its head
        got = c.request("PUT", "/f", content=big).json()
        assert got["body"].encode() == big and got["headers"]["content-length"] == str(len(big))


def test_threads_each_take_a_connection_and_share_the_pool(serve):
    srv = serve(echo)
    got = []
    with client(srv) as c:
        go = threading.Barrier(30)

        def work(i):
            go.wait()
            got.append(c.request("GET", f"/{i}").json()["target"])

        threads = [threading.Thread(target=work, args=(i,)) for i in range(30)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert sorted(got) == sorted(f"/{i}" for i in range(30))
        opened = srv.accepted
        assert 1 < opened <= 30 and len(c._idle) <= _http.MAX_IDLE
        for i in range(5):
            c.request("GET", "/again")
        assert srv.accepted == opened, "later requests reuse pooled connections"


def test_a_forked_child_opens_its_own_connection(serve):
    srv = serve(echo)
    with client(srv) as c:
        assert c.request("GET", "/parent").json()["conn"] == 1
        pid = os.fork()
        if pid == 0:
            ok = False
            try:
                ok = c.request("GET", "/child").json()["conn"] == 2
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert c.request("GET", "/parent").json()["conn"] == 1


def test_chunked_bodies_with_extensions_and_trailers(serve):
    def handler(req, s):
        s.sendall(chunked(b"hello ", b"world") if req[2] == "/plain" else
                  b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                  b"3;ext=1\r\nabc\r\n10\r\n" + b"x" * 16 + b"\r\n0\r\nTrailer: t\r\n\r\n")
        return "keep"

    srv = serve(handler)
    with client(srv) as c:
        assert c.request("GET", "/plain").content == b"hello world"
        assert c.request("GET", "/ext").content == b"abc" + b"x" * 16
        assert c.request("GET", "/plain").text == "hello world"
    assert srv.accepted == 1


def test_answer_until_close_and_connection_close(serve):
    def handler(req, s):
        if req[2] == "/eof":
            s.sendall(b"HTTP/1.1 200 OK\r\n\r\nall of it")
        else:
            s.sendall(answer(200, b"bye", ["Connection: close"]))
        return "close"

    srv = serve(handler)
    with client(srv) as c:
        assert c.request("GET", "/eof").content == b"all of it"
        assert c.request("GET", "/close").content == b"bye"
        assert c.request("GET", "/eof").content == b"all of it"
    assert srv.accepted == 3


def test_interim_and_bodyless_answers(serve):
    def handler(req, s):
        if req[1] == "HEAD":
            s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n")
        else:
            s.sendall(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n")
        return "keep"

    srv = serve(handler)
    with client(srv) as c:
        r = c.request("DELETE", "/x")
        assert r.status_code == 204 and r.content == b""
        assert c.request("HEAD", "/x").content == b""
        assert c.request("DELETE", "/x").status_code == 204
    assert srv.accepted == 1


# -- a connection the server closed, what is sent again ------------------


def test_a_server_that_closed_an_idle_connection(serve):
    srv = serve(lambda req, s: (s.sendall(json_answer({"n": req[0]})), "close")[1])
    with client(srv) as c:
        # The answer says nothing of the close: the connection is pooled,
        # found closed at the next request, which goes on a new one.
        assert c.request("GET", "/").json() == {"n": 1}
        time.sleep(0.05)
        assert c.request("POST", "/", json={}).json() == {"n": 2}
        time.sleep(0.05)
        assert c.request("GET", "/").json() == {"n": 3}
    assert [r[1] for r in srv.requests] == ["GET", "POST", "GET"], "each request arrived once"


def test_no_answer_on_a_reused_connection_retries_only_idempotent_requests(serve):
    # The first request of each connection is answered, the second is
    # read and dropped without an answer (it may have been done).
    def handler(req, s):
        if sum(1 for r in srv.requests if r[0] == req[0]) == 1:
            s.sendall(json_answer({"ok": True}))
            return "keep"
        return "drop"

    srv = serve(handler)
    with client(srv) as c:
        c.request("GET", "/")
        assert c.request("GET", "/again").json() == {"ok": True}, "a GET is sent again, on a new connection"
        assert [r[2] for r in srv.requests] == ["/", "/again", "/again"]
        with pytest.raises(_http.TransportError, match="closed before an answer"):
            c.request("POST", "/once")
        assert [r[2] for r in srv.requests].count("/once") == 1, "a POST is not sent twice"


def test_no_answer_on_a_new_connection_is_an_error(serve):
    srv = serve(lambda req, s: "drop")
    with client(srv) as c:
        with pytest.raises(_http.TransportError):
            c.request("GET", "/")
    assert len(srv.requests) == 1


def test_server_not_there_and_timeouts(serve):
    missing = os.path.join(tempfile.mkdtemp(), "none.sock")
    with pytest.raises(_http.TransportError, match="No such file"):
        _http.Client(missing, {}, 1.0).request("GET", "/")
    with pytest.raises(tine.Unavailable) as e:
        tine.Tine(socket=missing).health()
    assert missing in e.value.message and e.value.code == "unavailable"

    srv = serve(lambda req, s: (time.sleep(1), "close")[1])
    t0 = time.monotonic()
    with pytest.raises(_http.TransportError, match="timed out"):
        client(srv, timeout=0.2).request("GET", "/")
    assert time.monotonic() - t0 < 0.9
    with pytest.raises(tine.Unavailable):
        tine.Tine(socket=srv.path, timeout=0.2).health()


def test_malformed_answers_are_transport_errors(serve):
    srv = serve(lambda req, s: (s.sendall(b"SSH-2.0-nope\r\n\r\n"), "close")[1])
    with pytest.raises(_http.TransportError, match="not an HTTP"):
        client(srv).request("GET", "/")
    srv = serve(lambda req, s: (s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"), "close")[1])
    with pytest.raises(_http.TransportError, match="middle"):
        client(srv).request("GET", "/")
    srv = serve(lambda req, s: (s.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"), "close")[1])
    with pytest.raises(_http.TransportError, match="chunk"):
        client(srv).request("GET", "/")
    srv = serve(lambda req, s: (s.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n0\r\nT: 1"), "close")[1])
    with pytest.raises(_http.TransportError, match="trailers"):
        client(srv).request("GET", "/")


async def test_async_malformed_answers_are_transport_errors(serve):
    for answer_bytes, what in [
        (b"SSH-2.0-nope\r\n\r\n", "not an HTTP"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "middle"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n0\r\nT: 1", "trailers"),
        (b"HTTP/1.1 200 OK\r\nContent-Le", "middle"),
    ]:
        srv = serve(lambda req, s: (s.sendall(answer_bytes), "close")[1])
        with pytest.raises(_http.TransportError, match=what):
            await aclient(srv).request("GET", "/")


# -- streams ---------------------------------------------------------------


def stepped(seen, late):
    """A chunked NDJSON answer (a line split across chunks) whose second
    line waits until the client saw the first (`late` says if it had to
    give up waiting)."""

    def handler(req, s):
        s.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(b'{"a":') + chunk(b"1}\n"))
        late.append(not seen.wait(5))
        s.sendall(chunk(b'{"b":2}\n') + b"0\r\n\r\n")
        return "keep"

    return handler


def chunk(p):
    return f"{len(p):x}\r\n".encode() + p + b"\r\n"


def test_stream_yields_lines_as_they_come_then_pools_the_connection(serve):
    seen, late = threading.Event(), []
    srv = serve(lambda req, s: stepped(seen, late)(req, s) if req[2] == "/s" else echo(req, s))
    with client(srv) as c:
        with c.stream("POST", "/s", json={}, timeout=None) as res:
            assert res.status_code == 200
            lines = []
            for line in res.iter_lines():
                lines.append(json.loads(line))
                seen.set()
        assert lines == [{"a": 1}, {"b": 2}] and late == [False]
        assert c.request("GET", "/").json()["conn"] == 1, "a stream read to its end leaves its connection pooled"
        # A stream left early closes its connection; the next request opens one.
        seen.clear()
        seen.set()
        with c.stream("POST", "/s") as res:
            next(iter(res.iter_lines()))
        assert c.request("GET", "/").json()["conn"] == 2


def test_stream_error_answer_is_read_whole(serve):
    srv = serve(lambda req, s: (s.sendall(json_answer({"code": "not_found", "message": "no vm x"}, 404)), "keep")[1])
    with client(srv) as c:
        with c.stream("GET", "/") as res:
            assert res.status_code == 404
            assert res.read() and res.json()["message"] == "no vm x"


# -- asyncio ---------------------------------------------------------------


async def test_async_framing_keep_alive_and_streams(serve):
    seen, late = threading.Event(), []

    def handler(req, s):
        if req[2] == "/chunked":
            s.sendall(chunked(b"hello ", b"world"))
            return "keep"
        if req[2] == "/s":
            return stepped(seen, late)(req, s)
        return echo(req, s)

    srv = serve(handler)
    async with aclient(srv) as c:
        got = (await c.request("PUT", "/a", params={"p": "a b"}, json=[1])).json()
        assert got["target"] == "/a?p=a%20b" and got["body"] == "[1]"
        big = b"0123456789abcdef" * (_http.BIG // 8) + b"end"
        assert (await c.request("PUT", "/f", content=big)).json()["body"].encode() == big
        assert (await c.request("GET", "/chunked")).content == b"hello world"
        async with c.stream("GET", "/s", timeout=None) as res:
            lines = []
            async for line in res.aiter_lines():
                lines.append(json.loads(line))
                seen.set()
        assert lines == [{"a": 1}, {"b": 2}] and late == [False]
        # More at once than the listener's backlog (16): a connect that
        # finds it full waits instead of failing.
        many = await asyncio.gather(*(c.request("GET", f"/{i}") for i in range(30)))
        assert [r.json()["target"] for r in many] == [f"/{i}" for i in range(30)]
    assert srv.requests[0][0] == 1 and srv.requests[2][0] == 1, "one connection while requests are one at a time"


async def test_async_server_closed_idle_retries_and_errors(serve):
    srv = serve(lambda req, s: (s.sendall(json_answer({"n": req[0]})), "close")[1])
    async with aclient(srv) as c:
        assert (await c.request("GET", "/")).json() == {"n": 1}
        await asyncio.sleep(0.05)
        assert (await c.request("POST", "/", json={})).json() == {"n": 2}
        # At once: the close is seen before sending, or as no answer; a GET is sent again either way.
        assert (await c.request("GET", "/")).json() == {"n": 3}
    assert len(srv.requests) == 3

    def once(req, s):
        if sum(1 for r in srv2.requests if r[0] == req[0]) == 1:
            s.sendall(json_answer({"ok": True}))
            return "keep"
        return "drop"

    srv2 = serve(once)
    async with aclient(srv2) as c:
        await c.request("GET", "/")
        assert (await c.request("DELETE", "/again")).json() == {"ok": True}
        with pytest.raises(_http.TransportError):
            await c.request("POST", "/once")
        assert [r[2] for r in srv2.requests].count("/once") == 1

    slow = serve(lambda req, s: (time.sleep(1), "close")[1])
    with pytest.raises(_http.TransportError, match="timed out"):
        await aclient(slow, timeout=0.2).request("GET", "/")
    missing = os.path.join(tempfile.mkdtemp(), "none.sock")
    with pytest.raises(tine.Unavailable):
        await tine.AsyncTine(socket=missing).health()


# -- the clients on top: typed errors, streamed exec -----------------------


def test_clients_make_typed_errors_and_stream_exec(serve):
    def handler(req, s):
        if req[2].endswith("/exec"):
            lines = [{"type": "stdout", "data_b64": "aGkK"}, {"type": "exit", "exit_code": 0}]
            s.sendall(chunked(*(json.dumps(x).encode() + b"\n" for x in lines)))
        else:
            s.sendall(json_answer({"code": "busy", "message": "vm v is busy: fork"}, 409))
        return "keep"

    srv = serve(handler)
    with tine.Tine(socket=srv.path) as t:
        with pytest.raises(tine.Busy) as e:
            t.vm("v").info()
        assert e.value.message == "vm v is busy: fork" and e.value.status == 409
        assert list(t.vm("v").lines(["true"])) == [("stdout", "hi"), ("exit", 0)]
    assert srv.accepted == 1
    assert srv.requests[1][3]["accept"] == "application/x-ndjson"

    async def go():
        async with tine.AsyncTine(socket=srv.path) as at:
            with pytest.raises(tine.Busy):
                await at.vm("v").info()
            return [x async for x in at.vm("v").lines(["true"])]

    assert asyncio.run(go()) == [("stdout", "hi"), ("exit", 0)]
