"""The synchronous client: `Tine` (a connection to tined), `Vm`,
`Checkpoint`, `Branch`, `Process`. Every method is one request (sleep, wake and
snapshot wait for their operation); errors raise `tine.errors.TineError`
subclasses carrying tined's code and message."""

from __future__ import annotations

import os
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from . import _core, _http, errors, models
from ._core import Call, Child, ExecEvent, seg


class Tine:
    """A client of tined. `Tine()` uses `$TINE_HOME/tined.sock`;
    `Tine(url="http://host:7300", token=...)` a TCP listener
    (`TINE_URL`/`TINE_TOKEN` work too)."""

    def __init__(
        self,
        url: Optional[str] = None,
        *,
        token: Optional[str] = None,
        socket: Optional[str] = None,
        timeout: float = 300.0,
    ):
        self._ep = _core.Endpoint.resolve(url, token, socket)
        self._http: Any
        if self._ep.uds:
            # The Unix socket: tine's own HTTP/1.1 (_http.py); httpx cost ~0.3 ms a call there.
            self._http = _http.Client(self._ep.uds, self._ep.headers, timeout)
            self._errors: Tuple[type, ...] = (_http.TransportError,)
        else:
            import httpx

            self._http = httpx.Client(base_url=self._ep.base_url, headers=self._ep.headers, timeout=timeout)
            self._errors = (httpx.TransportError,)

    # -- plumbing --------------------------------------------------------

    def _do(self, call: Call, timeout: Optional[float] = None) -> Any:
        kw: Dict[str, Any] = {}
        if timeout is not None:
            kw["timeout"] = timeout
        try:
            res = self._http.request(
                call.method,
                call.path,
                json=call.json,
                params=call.params,
                content=call.content,
                headers=call.headers,
                **kw,
            )
        except self._errors as e:
            raise _core.unreachable(self._ep, e) from e
        return _core.answer(call, res)

    def _operation(self, call: Call) -> Dict[str, Any]:
        """Starts an operation and waits for its end (its SSE stream)."""
        op = models.parse(models.Operation, self._do(call))
        if op.state == "running":
            path = f"/v1/operations/{seg(op.id)}/events"
            try:
                with self._http.stream("GET", path, timeout=_core.OPERATION_TIMEOUT) as res:
                    if res.status_code >= 400:
                        res.read()
                        _core.answer(Call("GET", path), res)
                    done = _core.sse_done(res.iter_lines())
            except self._errors as e:
                raise _core.unreachable(self._ep, e) from e
            if done is None:
                done = self._do(Call("GET", f"/v1/operations/{seg(op.id)}", model=models.Operation))
            op = done
        return _core.operation_result(op)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Tine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the host --------------------------------------------------------

    def health(self) -> models.Health:
        return self._do(Call("GET", "/v1/health", model=models.Health))

    def run(
        self,
        image: str = "minimal",
        *,
        name: Optional[str] = None,
        mem: Union[int, str, None] = None,
        vcpus: Optional[int] = None,
        net: bool = False,
        disks: Sequence[str] = (),
        contract: Optional[str] = None,
        from_dir: Optional[str] = None,
        agent: Optional[bool] = None,
        timeout: Optional[int] = None,
    ) -> "Vm":
        """Boots a vm (or restores `from_dir`, a snapshot directory) and
        returns once it runs (its agent answers, for images with one).
        `mem`: `"256M"`, `"1G"` or MiB; micro guests (`micro-*`) have no agent."""
        call = _core.run_call(name, image, mem, vcpus, net, disks, contract, from_dir, agent, timeout)
        report = self._do(call)
        return Vm(self, report.name, report=report, owned=True)

    def vm(self, name: str) -> "Vm":
        """A handle on an existing vm (no request made)."""
        return Vm(self, name)

    def vms(self) -> List[models.VmInfo]:
        return self._do(Call("GET", "/v1/vms", model=models.VmInfo, many=True))

    def branches(self) -> List[Dict[str, Any]]:
        return self._do(Call("GET", "/v1/branches"))

    def branch(self, name: str) -> "Branch":
        return Branch(self, name)

    def wake(
        self,
        branch: Union["Branch", str],
        *,
        name: Optional[str] = None,
        lazy: bool = False,
        net: bool = False,
        contract: Optional[str] = None,
    ) -> "Vm":
        """Wakes a sleeping branch (as itself, or as a new branch `name`)."""
        b = branch.name if isinstance(branch, Branch) else branch
        body = {"name": name, "lazy": lazy, "net": net, "contract": contract}
        result = self._operation(Call("POST", f"/v1/branches/{seg(b)}/wake", json=body))
        report = models.parse(models.RunReport, result)
        return Vm(self, report.name, report=report, owned=True)

    def tree(self) -> models.Lineage:
        return self._do(Call("GET", "/v1/tree", model=models.Lineage))

    def gc(self) -> Dict[str, Any]:
        return self._operation(Call("POST", "/v1/gc"))

    # -- API keys (the host's owner only) ----------------------------------

    def keys(self) -> List[models.KeyInfo]:
        """The API keys tined issued (for its TCP listener)."""
        return self._do(Call("GET", "/v1/keys", model=models.KeyInfo, many=True))

    def create_key(self, name: str) -> models.NewKey:
        """A new API key; its `.key` is shown this once."""
        return self._do(Call("POST", "/v1/keys", json={"name": name}, model=models.NewKey))

    def delete_key(self, key: Union[str, models.KeyInfo]) -> None:
        """Revokes a key (its id or name, or a `KeyInfo`): refused at once."""
        self._do(Call("DELETE", f"/v1/keys/{seg(getattr(key, 'id', key))}"))


class Vm:
    """A vm. As a context manager, a vm this client made (run, wake, fork)
    is removed on exit, with its checkpoints."""

    def __init__(self, t: Tine, name: str, *, report: Any = None, owned: bool = False):
        self._t = t
        self.name = name
        self.report = report
        self._owned = owned
        self.files = Files(self)

    def __repr__(self) -> str:
        return f"Vm({self.name!r})"

    def __enter__(self) -> "Vm":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._owned:
            try:
                self.rm()
            except errors.NotFound:
                pass

    @property
    def _p(self) -> str:
        return f"/v1/vms/{seg(self.name)}"

    def info(self) -> models.VmInfo:
        return self._t._do(Call("GET", self._p, model=models.VmInfo))

    # -- work inside -----------------------------------------------------

    def exec(
        self,
        argv: Union[str, Sequence[str]],
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout: Optional[float] = None,
        stdin: Union[bytes, str, None] = None,
        user: Optional[str] = None,
    ) -> models.ExecResult:
        """Runs a command (a list, or a string for `sh -c`) to its end
        (as `user`, default root)."""
        body = _core.exec_body(argv, env, cwd, timeout, stdin, user)
        wait = None if timeout is None else timeout + 30
        return self._t._do(Call("POST", f"{self._p}/exec", json=body, model=models.ExecResult), wait)

    def stream(
        self,
        argv: Union[str, Sequence[str]],
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout: Optional[float] = None,
        stdin: Union[bytes, str, None] = None,
        user: Optional[str] = None,
    ) -> Iterator[ExecEvent]:
        """Runs a command and yields its output as it comes (`ExecEvent`s:
        stdout, stderr, then one `exit`). The command ends with the stream;
        for input as it goes, or one that outlives the stream, `spawn`."""
        body = _core.exec_body(argv, env, cwd, timeout, stdin, user)
        path = f"{self._p}/exec"
        try:
            with self._t._http.stream("POST", path, json=body, headers=_core.NDJSON, timeout=None) as res:
                if res.status_code >= 400:
                    res.read()
                    _core.answer(Call("POST", path), res)
                for line in res.iter_lines():
                    if line.strip():
                        yield _core.exec_event(line)
        except self._t._errors as e:
            raise _core.unreachable(self._t._ep, e) from e

    def lines(self, argv: Union[str, Sequence[str]], **kw: Any) -> Iterator[Tuple[str, Any]]:
        """Like `stream`, by whole lines: `("stdout", text)`, `("stderr",
        text)`, and last `("exit", exit_code)`."""
        split = _core.Lines()
        for ev in self.stream(argv, **kw):
            if ev.type == "exit":
                yield from split.rest()
                yield ("exit", ev.exit_code)
            else:
                yield from split.feed(ev)

    def spawn(
        self,
        argv: Union[str, Sequence[str]],
        *,
        stdin: Union[bool, bytes, str, None] = None,
        tag: Optional[str] = None,
        user: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> "Process":
        """Starts a command in the background and returns its `Process`
        once it runs. The guest's agent keeps it: it runs on when this
        client leaves, through a sleep and a wake, and in every child of a
        fork. `stdin=True` keeps its stdin open for `write`; `tag` names
        it among the vm's commands; `timeout` kills it after so many
        seconds. Its output is followed from the start."""
        body = _core.spawn_body(argv, env, cwd, timeout, stdin, user, tag)
        p = Process(self, 0, owned=True)
        p._open("POST", f"{self._p}/exec", body)
        return p

    def process(self, pid: Union[int, models.ProcessInfo]) -> "Process":
        """A handle on a running command (a pid, or one of `processes()`),
        e.g. in a fork's child or after a wake. No request made: reading
        follows its output from then on."""
        return Process(self, _core.pid_of(pid))

    def processes(self) -> List[models.ProcessInfo]:
        """The commands the guest's agent runs."""
        return self._t._do(Call("GET", f"{self._p}/processes", model=models.ProcessInfo, many=True))

    def console(self) -> str:
        return self._t._do(Call("GET", f"{self._p}/console", raw=True)).text

    def console_send(self, line: str) -> None:
        self._t._do(Call("POST", f"{self._p}/console", json={"line": line}))

    # -- moments ---------------------------------------------------------

    def fork(
        self,
        n: Optional[int] = None,
        *,
        names: Optional[Sequence[str]] = None,
        contract: Optional[str] = None,
        idempotency_key: Optional[str] = None,
    ) -> "Children":
        """`n` children (or one per name) continue from this moment; one
        `Child` per child, each with its `vm` or its `error`."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        call = Call("POST", f"{self._p}/fork", json=_core.fork_body(n, names, contract), headers=headers, model=models.ForkReport)
        report: models.ForkReport = self._t._do(call)
        kids = Children(
            Child(r.name, r.ok, r.error, Vm(self._t, r.name, owned=True) if r.ok else None) for r in report.results
        )
        kids.report = report
        return kids

    def checkpoint(self, tag: Optional[str] = None) -> "Checkpoint":
        report = self._t._do(Call("POST", f"{self._p}/checkpoints", json={"tag": tag}, model=models.MomentReport))
        return Checkpoint(self, report.tag or "", report)

    def checkpoints(self) -> List[models.CheckpointRecord]:
        return self._t._do(Call("GET", f"{self._p}/checkpoints", model=models.CheckpointRecord, many=True))

    def rollback(self, checkpoint: Union["Checkpoint", str]) -> models.MomentReport:
        tag = checkpoint.tag if isinstance(checkpoint, Checkpoint) else checkpoint
        return self._t._do(Call("POST", f"{self._p}/rollback", json={"tag": tag}, model=models.MomentReport))

    def snapshot(self, to: str) -> Dict[str, Any]:
        return self._t._operation(Call("POST", f"{self._p}/snapshot", json={"dir": os.path.abspath(to)}))

    def sleep(self) -> "Branch":
        """The vm's moment goes into the store; the vm ends, its branch sleeps."""
        result = self._t._operation(Call("POST", f"{self._p}/sleep"))
        return Branch(self._t, result.get("branch", self.name), result, owned=self._owned)

    # -- lifecycle -------------------------------------------------------

    def stop(self, timeout: Optional[float] = None) -> models.StopReport:
        body = {} if timeout is None else {"timeout_s": timeout}
        return self._t._do(Call("POST", f"{self._p}/stop", json=body, model=models.StopReport))

    def kill(self) -> models.StopReport:
        return self._t._do(Call("POST", f"{self._p}/kill", model=models.StopReport))

    def rm(self, *, force: bool = True) -> models.Removed:
        """Removes the vm and its checkpoints (a running one is killed first,
        unless `force=False`)."""
        params = {"force": "true"} if force else None
        return self._t._do(Call("DELETE", self._p, params=params, model=models.Removed))

    # -- contract, secrets, effects --------------------------------------

    def contract(self) -> str:
        return self._t._do(Call("GET", f"{self._p}/contract"))["toml"]

    def set_contract(self, toml: str) -> str:
        return self._t._do(Call("PUT", f"{self._p}/contract", json={"toml": toml}))["toml"]

    def effects(self) -> models.LineageEffects:
        return self._t._do(Call("GET", f"{self._p}/effects", model=models.LineageEffects))


class Process:
    """A command the guest's agent keeps (`vm.spawn`, `vm.process`).
    Iterating gives its `ExecEvent`s as they come (stdout, stderr, then
    `exit`); `lines()` the same by whole lines; `wait()` its end as an
    `ExecResult` (with the output this handle saw). The handle follows
    the command on a stream of its own, from `spawn` (or the first read)
    until the exit or `detach()`; a command nobody follows runs on and
    its output is dropped. As a context manager, a command this handle
    spawned is killed on exit if it still runs."""

    def __init__(self, vm: Vm, pid: int, *, owned: bool = False):
        self.vm = vm
        self.pid = pid
        self._owned = owned
        self._f = _core.Followed(pid)
        self._res: Any = None
        self._lines: Optional[Iterator[str]] = None

    def __repr__(self) -> str:
        return f"Process({self.vm.name}:{self.pid})"

    @property
    def _p(self) -> str:
        return f"{self.vm._p}/processes/{self.pid}"

    def _open(self, method: str, path: str, body: Any = None) -> None:
        """Opens the stream of the command's events; its first is `started`."""
        t = self.vm._t
        try:
            # Entered by hand: the stream outlives this call (httpx's is a context manager).
            cm = t._http.stream(method, path, json=body, headers=_core.NDJSON, timeout=None)
            res = cm.__enter__()
            self._res = cm
            if res.status_code >= 400:
                res.read()
                _core.answer(Call(method, path), res)
            self._lines = res.iter_lines()
            first = ""
            while not first.strip():
                first = next(self._lines, None)
                if first is None:
                    raise _core.not_followed(self.pid)
            self.pid = self._f.pid = self._f.started(first)
        except BaseException as e:
            self.detach()
            if isinstance(e, t._errors):
                raise _core.unreachable(t._ep, e) from e
            raise

    def __iter__(self) -> Iterator[ExecEvent]:
        t = self.vm._t
        while self._f.end is None:
            if self._lines is None:
                self._open("GET", f"{self._p}/output")
            assert self._lines is not None
            try:
                line = next(self._lines, None)
                if line is None:
                    raise _core.not_followed(self.pid)
                ev = self._f.event(line)
            except BaseException as e:
                self.detach()
                if isinstance(e, t._errors):
                    raise _core.unreachable(t._ep, e) from e
                raise
            if ev is not None:
                if ev.type == "exit":
                    self._drain()
                yield ev

    def lines(self) -> Iterator[Tuple[str, Any]]:
        """Its output by whole lines as it comes: `("stdout", text)`,
        `("stderr", text)`, and last `("exit", exit_code)`."""
        for ev in self:
            yield from self._f.lines(ev)

    def wait(self) -> models.ExecResult:
        """Waits for its end: its exit code and the output this handle saw."""
        for _ in self:
            pass
        return self._f.result()

    def write(self, data: Union[bytes, str]) -> None:
        """Writes to its stdin (it was spawned with `stdin=True`)."""
        if isinstance(data, str):
            data = data.encode()
        call = Call("POST", f"{self._p}/stdin", content=data, headers={"Content-Type": "application/octet-stream"})
        self.vm._t._do(call)

    def close_stdin(self) -> None:
        """Closes its stdin: it reads EOF."""
        call = Call("POST", f"{self._p}/stdin", params={"close": True}, content=b"",
                    headers={"Content-Type": "application/octet-stream"})
        self.vm._t._do(call)

    def signal(self, sig: Union[int, str]) -> bool:
        """Sends a signal (`signal.SIGTERM`, 15 or `"TERM"`) to its process
        group; False when it had just ended."""
        call = Call("POST", f"{self._p}/signal", json={"signal": _core.signal_value(sig)}, model=models.Signalled)
        return self.vm._t._do(call).delivered

    def kill(self) -> bool:
        """SIGKILL to its process group; False when it had just ended."""
        return self.signal("KILL")

    def detach(self) -> None:
        """Stops following it; the command runs on."""
        res, self._res, self._lines = self._res, None, None
        if res is not None:
            res.__exit__(None, None, None)

    def _drain(self) -> None:
        """After the exit: the stream's end (so its connection is kept)."""
        try:
            for _ in self._lines or ():
                pass
        except self.vm._t._errors:
            pass
        self.detach()

    def __enter__(self) -> "Process":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._owned and self._f.end is None:
                try:
                    self.kill()
                except errors.NotFound:
                    pass
        finally:
            self.detach()


class Children(list):
    """A fork's children (`Child` each). As a context manager, the children
    that run are removed on exit."""

    report: Optional[models.ForkReport] = None

    @property
    def vms(self) -> List[Vm]:
        return [c.vm for c in self if c.ok]

    @property
    def failed(self) -> List[Child]:
        return [c for c in self if not c.ok]

    def __enter__(self) -> "Children":
        return self

    def __exit__(self, *exc: Any) -> None:
        for vm in self.vms:
            vm.__exit__(None, None, None)


class Files:
    """A vm's files, through its agent."""

    def __init__(self, vm: Vm):
        self._vm = vm

    def _p(self, what: str = "") -> str:
        return f"{self._vm._p}/files{what}"

    def read(self, path: str) -> bytes:
        return self._vm._t._do(Call("GET", self._p(), params={"path": path}, raw=True)).content

    def read_text(self, path: str) -> str:
        return self.read(path).decode()

    def write(self, path: str, data: Union[bytes, str], *, mode: int = 0o644) -> None:
        if isinstance(data, str):
            data = data.encode()
        params = {"path": path, "mode": f"{mode:o}"}
        call = Call("PUT", self._p(), params=params, content=data, headers={"Content-Type": "application/octet-stream"})
        self._vm._t._do(call)

    def list(self, path: str, *, depth: int = 1) -> List[models.Entry]:
        call = Call("GET", self._p("/list"), params={"path": path, "depth": depth}, model=models.Entry, many=True)
        return self._vm._t._do(call)

    def stat(self, path: str) -> models.Entry:
        return self._vm._t._do(Call("GET", self._p("/stat"), params={"path": path}, model=models.Entry))

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
            return True
        except errors.NotFound:
            return False

    def remove(self, path: str) -> bool:
        return self._vm._t._do(Call("DELETE", self._p(), params={"path": path}))["changed"]

    def make_dir(self, path: str) -> bool:
        return self._vm._t._do(Call("POST", self._p("/dir"), params={"path": path}))["changed"]

    def move(self, src: str, dst: str) -> models.Entry:
        """Renames `src` to `dst` (its missing parents are made); the moved entry."""
        call = Call("POST", self._p("/move"), json={"from": src, "to": dst}, model=models.Entry)
        return self._vm._t._do(call)


class Checkpoint:
    """A kept moment of a vm. As a context manager, deleted on exit."""

    def __init__(self, vm: Vm, tag: str, report: Optional[models.MomentReport] = None):
        self.vm = vm
        self.tag = tag
        self.report = report

    def __repr__(self) -> str:
        return f"Checkpoint({self.vm.name}@{self.tag})"

    def rollback(self) -> models.MomentReport:
        return self.vm.rollback(self)

    def delete(self) -> models.Removed:
        return self.vm._t._do(Call("DELETE", f"{self.vm._p}/checkpoints/{seg(self.tag)}", model=models.Removed))

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.delete()
        except errors.NotFound:
            pass


class Branch:
    """A sleeping branch in the store. As a context manager, a branch this
    client put to sleep is removed on exit."""

    def __init__(self, t: Tine, name: str, report: Optional[Dict[str, Any]] = None, *, owned: bool = False):
        self._t = t
        self.name = name
        self.report = report or {}
        self._owned = owned

    def __repr__(self) -> str:
        return f"Branch({self.name!r})"

    def wake(self, *, name: Optional[str] = None, lazy: bool = False, net: bool = False) -> Vm:
        return self._t.wake(self, name=name, lazy=lazy, net=net)

    def fork(self, n: int = 1, *, names: Optional[Sequence[str]] = None) -> Children:
        """`n` new branches wake from this branch's snapshot."""
        return Vm(self._t, self.name).fork(n, names=names)

    def rm(self) -> models.Removed:
        return self._t._do(Call("DELETE", f"/v1/branches/{seg(self.name)}", model=models.Removed))

    def __enter__(self) -> "Branch":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._owned:
            try:
                self.rm()
            except (errors.NotFound, errors.Conflict):
                pass
