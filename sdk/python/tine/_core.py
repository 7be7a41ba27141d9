"""What the sync and asyncio clients share: where tined is, how a request
is made and how an answer becomes a model or an exception. The two
clients differ only in how they wait."""

from __future__ import annotations

import base64
import json
import os
import secrets
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union
from urllib.parse import quote

from . import errors, models

#: Answers of long operations (sleep, wake, snapshot) are awaited this long.
OPERATION_TIMEOUT = 600.0


def default_socket() -> str:
    """tined's socket: `$TINE_HOME/tined.sock` (default ~/.cache/tine)."""
    home = os.environ.get("TINE_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "tine")
    return os.path.join(home, "tined.sock")


@dataclass
class Endpoint:
    """Where tined answers: its Unix socket (default), or `url` with a token."""

    base_url: str
    uds: Optional[str]
    headers: Dict[str, str] = field(default_factory=dict)

    @staticmethod
    def resolve(url: Optional[str], token: Optional[str], socket: Optional[str]) -> "Endpoint":
        url = url or os.environ.get("TINE_URL")
        token = token or os.environ.get("TINE_TOKEN")
        headers = {"User-Agent": "tine-python/0.1"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if url:
            return Endpoint(url.rstrip("/"), None, headers)
        return Endpoint("http://tined", socket or default_socket(), headers)


def mib(size: Union[int, str, None]) -> Optional[int]:
    """`"256M"`, `"1G"`, `"512MiB"` or MiB as a number → MiB."""
    if size is None or isinstance(size, int):
        return size
    s = size.strip().upper().removesuffix("IB").removesuffix("B")
    units = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
    try:
        if s and s[-1] in units:
            value = float(s[:-1]) * units[s[-1]]
        else:
            value = float(s)
    except ValueError:
        raise errors.InvalidInput(f"size {size!r} is not a size like 256M or 2G", code="invalid_input") from None
    if value <= 0 or value != int(value):
        raise errors.InvalidInput(f"size {size!r} is not a whole number of MiB", code="invalid_input")
    return int(value)


def new_name(prefix: str = "py") -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


def seg(name: str) -> str:
    """A name as one path segment (tined validates it; never a `/`)."""
    return quote(name, safe="")


@dataclass
class Call:
    """One request: method, path, body, and what to parse the answer as."""

    method: str
    path: str
    json: Any = None
    params: Optional[Dict[str, Any]] = None
    content: Optional[bytes] = None
    headers: Optional[Dict[str, str]] = None
    model: Optional[type] = None
    many: bool = False
    raw: bool = False


def answer(call: Call, res: Any) -> Any:
    """The parsed answer of `call` (`res`: an `_http.Response` or an
    `httpx.Response`), or its typed exception."""
    if res.status_code >= 400:
        try:
            body = res.json()
        except ValueError:
            body = None
        raise errors.from_answer(
            res.status_code, body, f"{call.method} {call.path}: HTTP {res.status_code}: {res.text[:200]}"
        )
    if call.raw:
        return res
    if res.status_code == 204 or not res.content:
        return None
    data = res.json()
    if call.model is None:
        return data
    if call.many:
        return [models.parse(call.model, d) for d in data]
    return models.parse(call.model, data)


def unreachable(ep: Endpoint, e: Exception) -> errors.Unavailable:
    where = ep.uds or ep.base_url
    hint = " (start it with `tine daemon start`)" if ep.uds else ""
    return errors.Unavailable(f"cannot reach tined at {where}: {e}{hint}", code="unavailable")


def operation_result(op: models.Operation) -> Dict[str, Any]:
    """The result of a finished operation, or its error raised."""
    if op.state == "succeeded":
        return op.result or {}
    err = op.error or {}
    raise errors.from_answer(op.status or 500, err, f"operation {op.id} ({op.kind}) failed")


def run_call(
    name: Optional[str],
    image: str,
    mem: Union[int, str, None],
    vcpus: Optional[int],
    net: bool,
    disks: Sequence[str],
    contract: Optional[str],
    from_dir: Optional[str],
    agent: Optional[bool],
    timeout: Optional[int],
) -> Call:
    body: Dict[str, Any] = {"name": name or new_name(), "image": image, "net": net}
    if mem is not None:
        body["mem_mib"] = mib(mem)
    if vcpus is not None:
        body["vcpus"] = vcpus
    if disks:
        body["disks"] = [os.path.abspath(d) for d in disks]
    if contract is not None:
        body["contract"] = contract
    if from_dir is not None:
        body["from"] = os.path.abspath(from_dir)
    if agent is None:
        agent = not image.startswith("micro-")
    body["no_agent"] = not agent
    if timeout is not None:
        body["timeout_s"] = timeout
    return Call("POST", "/v1/vms", json=body, model=models.RunReport)


def exec_body(
    argv: Union[str, Sequence[str]],
    env: Optional[Mapping[str, str]],
    cwd: Optional[str],
    timeout: Optional[float],
    stdin: Union[bytes, str, bool, None],
    user: Optional[str] = None,
) -> Dict[str, Any]:
    """An ExecSpec. `stdin`: the whole input (bytes or text), or True to
    keep it open for later input (a kept command's `write`)."""
    if isinstance(argv, str):
        argv = ["sh", "-c", argv]
    body: Dict[str, Any] = {"argv": list(argv)}
    if env:
        body["env"] = dict(env)
    if cwd:
        body["cwd"] = cwd
    if timeout is not None:
        body["timeout_s"] = timeout
    if user is not None:
        body["user"] = user
    if stdin is True:
        body["open_stdin"] = True
    elif stdin is not None and stdin is not False:
        if isinstance(stdin, str):
            stdin = stdin.encode()
        body["stdin_b64"] = base64.b64encode(stdin).decode()
    return body


def spawn_body(
    argv: Union[str, Sequence[str]],
    env: Optional[Mapping[str, str]],
    cwd: Optional[str],
    timeout: Optional[float],
    stdin: Union[bytes, str, bool, None],
    user: Optional[str],
    tag: Optional[str],
) -> Dict[str, Any]:
    """The ExecSpec of a kept command (the agent's: it outlives the
    request, a sleep and a fork)."""
    body = exec_body(argv, env, cwd, timeout, stdin, user)
    body["keep"] = True
    if tag is not None:
        body["tag"] = tag
    return body


#: Asks for the streamed form of an exec (NDJSON, one ExecEvent a line).
NDJSON = {"Accept": "application/x-ndjson"}


def pid_of(pid: Any) -> int:
    """A guest pid from a pid or a `ProcessInfo`."""
    pid = getattr(pid, "pid", pid)
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise errors.InvalidInput(f"{pid!r} is not a guest pid (a positive number)", code="invalid_input")
    return pid


def signal_value(sig: Any) -> Union[int, str]:
    """A signal as tined takes it: a number (`signal.SIGTERM`, 15) or a
    name (`"TERM"`, `"SIGKILL"`)."""
    if isinstance(sig, str):
        return sig.upper()
    if isinstance(sig, int) and not isinstance(sig, bool):
        return int(sig)
    raise errors.InvalidInput(f"{sig!r} is not a signal (a number, or a name like TERM)", code="invalid_input")


def fork_body(n: Optional[int], names: Optional[Sequence[str]], contract: Optional[str]) -> Dict[str, Any]:
    body: Dict[str, Any] = {}
    if names:
        body["names"] = list(names)
    else:
        body["count"] = 1 if n is None else n
    if contract is not None:
        body["contract"] = contract
    return body


@dataclass
class ExecEvent:
    """One event of a streamed exec: `stdout`/`stderr` with `data`, or
    `exit`; a kept command's stream starts with `started` (its `pid`)."""

    type: str
    data: bytes = b""
    exit_code: Optional[int] = None
    signal: Optional[int] = None
    timed_out: bool = False
    pid: Optional[int] = None

    @property
    def text(self) -> str:
        return self.data.decode(errors="replace")


def exec_event(line: str) -> ExecEvent:
    ev = json.loads(line)
    kind = ev.get("type")
    if kind in ("stdout", "stderr"):
        return ExecEvent(kind, base64.b64decode(ev.get("data_b64", "")))
    if kind == "exit":
        return ExecEvent("exit", exit_code=ev.get("exit_code"), signal=ev.get("signal"), timed_out=bool(ev.get("timed_out")))
    if kind == "started":
        return ExecEvent("started", pid=ev.get("pid"))
    err = ev.get("error") or {}
    raise errors.from_answer(500, err, f"exec failed: {line[:200]}")


class Lines:
    """Splits a stream's chunks into lines, per stream (stdout, stderr)."""

    def __init__(self) -> None:
        self.partial: Dict[str, bytes] = {"stdout": b"", "stderr": b""}

    def feed(self, ev: ExecEvent) -> List[tuple]:
        buf = self.partial[ev.type] + ev.data
        *whole, rest = buf.split(b"\n")
        self.partial[ev.type] = rest
        return [(ev.type, w.decode(errors="replace")) for w in whole]

    def rest(self) -> List[tuple]:
        out = [(k, v.decode(errors="replace")) for k, v in self.partial.items() if v]
        self.partial = {"stdout": b"", "stderr": b""}
        return out


class Followed:
    """A kept command as one handle follows it (what `Process` and
    `AsyncProcess` share, without the waiting): its events parsed, its
    output kept for `wait()`, its lines split, its end."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.out = bytearray()
        self.err = bytearray()
        self.split = Lines()
        self.end: Optional[ExecEvent] = None

    def started(self, line: str) -> int:
        """The pid of a stream's first line (`started`), or the stream's error raised."""
        ev = exec_event(line)
        if ev.type != "started" or ev.pid is None:
            raise errors.Failed(f"the command's stream did not start with its pid: {line[:200]}", code="failed")
        return ev.pid

    def event(self, line: str) -> Optional[ExecEvent]:
        """The event of a stream's line (None for `started` and blank
        lines), its output kept; an `error` event raised."""
        if not line.strip():
            return None
        ev = exec_event(line)
        if ev.type == "stdout":
            self.out += ev.data
        elif ev.type == "stderr":
            self.err += ev.data
        elif ev.type == "exit":
            self.end = ev
        else:
            return None
        return ev

    def lines(self, ev: ExecEvent) -> List[tuple]:
        """`ev` as whole lines: `("stdout", text)`, `("stderr", text)`, and
        last `("exit", exit_code)`."""
        if ev.type == "exit":
            return self.split.rest() + [("exit", ev.exit_code)]
        return self.split.feed(ev)

    def result(self) -> models.ExecResult:
        assert self.end is not None
        out, err = bytes(self.out), bytes(self.err)
        return models.ExecResult(
            exit_code=self.end.exit_code if self.end.exit_code is not None else -1,
            timed_out=self.end.timed_out,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            stdout_b64=base64.b64encode(out).decode(),
            stderr_b64=base64.b64encode(err).decode(),
            signal=self.end.signal,
        )


def not_followed(pid: int) -> errors.Failed:
    return errors.Failed(
        f"the stream of pid {pid} ended before its exit (the vm slept, stopped or was removed?); "
        "follow it again with vm.process(pid)",
        code="failed",
    )


@dataclass
class Child:
    """One child of a fork: `vm` when it runs, `error` when it failed."""

    name: str
    ok: bool
    error: Optional[str]
    vm: Any = None

    def __repr__(self) -> str:
        return f"Child({self.name!r}, ok)" if self.ok else f"Child({self.name!r}, error={self.error!r})"


def sse_done(lines) -> Optional[models.Operation]:
    """The `done` event's operation in an SSE stream of lines."""
    event = None
    for line in lines:
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:") and event == "done":
            return models.parse(models.Operation, json.loads(line[5:].strip()))
    return None
