"""Kept commands through the SDK (`vm.spawn`, `vm.process`, `Process`),
against a scripted tined on a Unix socket: what is sent (keep, stdin,
tag, user; input, close, signals), the `started` pid, lines split across
events, output while input goes in, `wait()`'s result, following again,
and the typed errors of a stream that fails. No tined or guest needed
(tests/test_linux.py runs the same against real guests)."""

import asyncio
import base64
import json
import queue
import signal
from urllib.parse import parse_qs, urlsplit

import pytest

import tine
from test_transport import answer, json_answer, serve  # noqa: F401 (serve: a fixture)

EXIT = object()


def event(obj):
    line = json.dumps(obj).encode() + b"\n"
    return f"{len(line):x}\r\n".encode() + line + b"\r\n"


def out(data, kind="stdout"):
    return event({"type": kind, "data_b64": base64.b64encode(data).decode()})


class FakeGuest:
    """One kept command, pid 42: its stream sends `started`, then what the
    test (or its input) puts in `feed`; its input is echoed back upper-cased."""

    def __init__(self, serve, transport):
        self.feed = queue.Queue()
        self.specs = []
        self.inputs = []
        self.signals = []
        self.srv = serve(self.handle)
        self.transport = transport
        self.t = self.client(tine.Tine)
        self.vm = self.t.vm("v")

    def client(self, cls):
        """A client of this fake: on tine's own HTTP (the Unix socket's), or
        on httpx (what `url=`, TCP, uses), over the same socket."""
        c = cls(socket=self.srv.path)
        if self.transport == "httpx":
            import httpx

            if cls is tine.Tine:
                c._http = httpx.Client(transport=httpx.HTTPTransport(uds=self.srv.path), base_url="http://tined")
            else:
                c._http = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=self.srv.path), base_url="http://tined")
            c._errors = (httpx.TransportError,)
        return c

    def stream(self, s):
        s.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n")
        s.sendall(event({"type": "started", "pid": 42}))
        while True:
            item = self.feed.get(timeout=10)
            if item is EXIT:
                s.sendall(event({"type": "exit", "exit_code": 0, "signal": None, "timed_out": False}) + b"0\r\n\r\n")
                return "keep"
            if isinstance(item, dict):  # an exit or an error event, then the end
                s.sendall(event(item) + b"0\r\n\r\n")
                return "keep"
            if item is None:  # the stream ends without an exit
                s.sendall(b"0\r\n\r\n")
                return "keep"
            s.sendall(item)

    def handle(self, req, s):
        n, method, target, headers, body = req
        url = urlsplit(target)
        q = parse_qs(url.query)
        if method == "POST" and url.path == "/v1/vms/v/exec":
            assert headers["accept"] == "application/x-ndjson"
            self.specs.append(json.loads(body))
            return self.stream(s)
        if method == "GET" and url.path == "/v1/vms/v/processes/42/output":
            return self.stream(s)
        if method == "GET" and url.path.startswith("/v1/vms/v/processes/"):
            s.sendall(json_answer({"code": "not_found", "message": "no running command has pid 7"}, 404))
            return "keep"
        if method == "POST" and url.path == "/v1/vms/v/processes/42/stdin":
            self.inputs.append((body, q.get("close")))
            if body:
                self.feed.put(out(body.upper()))
            if q.get("close") == ["true"]:
                self.feed.put(EXIT)
            s.sendall(answer(204))
            return "keep"
        if method == "POST" and url.path == "/v1/vms/v/processes/42/signal":
            sig = json.loads(body)["signal"]
            self.signals.append(sig)
            self.feed.put({"type": "exit", "exit_code": 137, "signal": 9, "timed_out": False})
            s.sendall(json_answer({"delivered": True}))
            return "keep"
        if method == "GET" and url.path == "/v1/vms/v/processes":
            info = {"pid": 42, "argv": ["cat"], "keep": True, "stdin": True, "tag": "c", "env": [["K", "v"]],
                    "cwd": "/root", "user": None}
            s.sendall(json_answer([info]))
            return "keep"
        s.sendall(json_answer({"code": "invalid_input", "message": f"unexpected {method} {target}"}, 400))
        return "keep"


@pytest.fixture(params=["own", "httpx"])
def guest(serve, request):
    g = FakeGuest(serve, request.param)
    yield g
    g.t.close()


def test_spawn_sends_a_kept_command_and_reads_its_pid(guest):
    p = guest.vm.spawn(["cat"], stdin=True, tag="c", user="u", env={"K": "v"}, cwd="/w", timeout=5)
    assert p.pid == 42
    assert guest.specs[-1] == {"argv": ["cat"], "env": {"K": "v"}, "cwd": "/w", "timeout_s": 5, "user": "u",
                               "open_stdin": True, "keep": True, "tag": "c"}
    guest.feed.put(EXIT)
    assert p.wait().exit_code == 0
    guest.vm.spawn("echo", stdin=b"x").detach()
    assert guest.specs[-1] == {"argv": ["sh", "-c", "echo"], "stdin_b64": "eA==", "keep": True}


def test_lines_as_they_come_with_input_between(guest):
    with guest.vm.spawn(["cat"], stdin=True) as p:
        guest.feed.put(out(b"a\nb"))
        guest.feed.put(out(b"c\n"))
        guest.feed.put(out(b"oops\n", "stderr"))
        lines = p.lines()
        assert [next(lines), next(lines), next(lines)] == [("stdout", "a"), ("stdout", "bc"), ("stderr", "oops")]
        p.write("hi\n")           # echoed back upper-cased by the fake guest
        assert next(lines) == ("stdout", "HI")
        p.write(b"there")         # no line end yet: held until the end
        p.close_stdin()
        assert list(lines) == [("stdout", "THERE"), ("exit", 0)]
        r = p.wait()
    assert guest.inputs == [(b"hi\n", None), (b"there", None), (b"", ["true"])]
    assert (r.exit_code, r.ok, r.stdout, r.stderr) == (0, True, "a\nbc\nHI\nTHERE", "oops\n")
    assert base64.b64decode(r.stdout_b64) == b"a\nbc\nHI\nTHERE"
    assert guest.signals == [], "a process that ended is not killed on exit"


def test_signal_kill_and_the_context_manager_kills(guest):
    p = guest.vm.spawn(["sleep", "100"])
    assert p.signal(signal.SIGTERM) is True and p.signal("term") is True
    events = list(p)
    assert events[-1].type == "exit" and events[-1].signal == 9
    assert guest.signals == [15, "TERM"]
    with guest.vm.spawn(["sleep", "100"]):
        pass
    assert guest.signals[-1] == "KILL"
    with pytest.raises(tine.InvalidInput):
        p.signal(1.5)


def test_following_again_and_typed_errors(guest):
    procs = guest.vm.processes()
    assert procs[0].pid == 42 and procs[0].tag == "c" and procs[0].env == [["K", "v"]]
    p = guest.vm.process(procs[0])
    assert p.pid == 42 and guest.srv.requests[-1][2] == "/v1/vms/v/processes", "process() makes no request"
    guest.feed.put(out(b"later\n"))
    guest.feed.put(EXIT)
    assert list(p.lines()) == [("stdout", "later"), ("exit", 0)]
    assert list(p.lines()) == [], "an ended process has nothing more"
    with pytest.raises(tine.NotFound) as e:
        guest.vm.process(7).wait()
    assert "pid 7" in e.value.message
    with pytest.raises(tine.InvalidInput):
        guest.vm.process(0)
    # The stream's own failure, before the pid or after it.
    guest.feed.put({"type": "error", "error": {"code": "failed", "message": "the agent went away"}})
    with pytest.raises(tine.Failed) as e:
        guest.vm.process(42).wait()
    assert e.value.message == "the agent went away"
    guest.feed.put(None)
    with pytest.raises(tine.Failed) as e:
        guest.vm.process(42).wait()
    assert "vm.process(pid)" in e.value.message


async def test_async_process(guest):
    async with guest.client(tine.AsyncTine) as at:
        vm = at.vm("v")
        async with await vm.spawn(["cat"], stdin=True, tag="c") as p:
            assert p.pid == 42 and guest.specs[-1]["keep"] is True
            guest.feed.put(out(b"x\ny"))
            lines = p.lines()
            assert await lines.__anext__() == ("stdout", "x")
            await p.write("z\n")
            await p.close_stdin()
            assert [x async for x in lines] == [("stdout", "yZ"), ("exit", 0)]
            assert (await p.wait()).stdout == "x\nyZ\n"
        p = vm.process(42)
        assert [pi.pid for pi in await vm.processes()] == [42]
        task = asyncio.ensure_future(p.wait())
        await asyncio.sleep(0.1)
        assert await p.kill() is True
        r = await task
        assert (r.exit_code, r.signal) == (137, 9)
        with pytest.raises(tine.NotFound):
            await vm.process(7).wait()
