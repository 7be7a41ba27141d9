"""The asyncio client: `AsyncTine`, `AsyncVm`, `AsyncCheckpoint`,
`AsyncBranch`, `AsyncProcess`, the same methods as `tine.client`, awaited. Every method is one request (sleep, wake and
snapshot wait for their operation); errors raise `tine.errors.TineError`
subclasses carrying tined's code and message."""

from __future__ import annotations

import os
from typing import Any, AsyncIterator, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from . import _core, _http, errors, models
from ._core import Call, Child, ExecEvent, seg


class AsyncTine:
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
            # The Unix socket: tine's own HTTP/1.1 (_http.py); httpx cost ~0.6 ms a call there.
            self._http = _http.AsyncClient(self._ep.uds, self._ep.headers, timeout)
            self._errors: Tuple[type, ...] = (_http.TransportError,)
        else:
            import httpx

            self._http = httpx.AsyncClient(base_url=self._ep.base_url, headers=self._ep.headers, timeout=timeout)
            self._errors = (httpx.TransportError,)

    # -- plumbing --------------------------------------------------------

    async def _do(self, call: Call, timeout: Optional[float] = None) -> Any:
        kw: Dict[str, Any] = {}
        if timeout is not None:
            kw["timeout"] = timeout
        try:
            res = await self._http.request(
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

    async def _operation(self, call: Call) -> Dict[str, Any]:
        """Starts an operation and waits for its end (its SSE stream)."""
        op = models.parse(models.Operation, await self._do(call))
        if op.state == "running":
            path = f"/v1/operations/{seg(op.id)}/events"
            try:
                async with self._http.stream("GET", path, timeout=_core.OPERATION_TIMEOUT) as res:
                    if res.status_code >= 400:
                        await res.aread()
                        _core.answer(Call("GET", path), res)
                    done = _core.sse_done([line async for line in res.aiter_lines()])
            except self._errors as e:
                raise _core.unreachable(self._ep, e) from e
            if done is None:
                done = await self._do(Call("GET", f"/v1/operations/{seg(op.id)}", model=models.Operation))
            op = done
        return _core.operation_result(op)

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncTine":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- the host --------------------------------------------------------

    async def health(self) -> models.Health:
        return await self._do(Call("GET", "/v1/health", model=models.Health))

    async def run(
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
    ) -> "AsyncVm":
        """Boots a vm (or restores `from_dir`, a snapshot directory) and
        returns once it runs (its agent answers, for images with one).
        `mem`: `"256M"`, `"1G"` or MiB; micro guests (`micro-*`) have no agent."""
        call = _core.run_call(name, image, mem, vcpus, net, disks, contract, from_dir, agent, timeout)
        report = await self._do(call)
        return AsyncVm(self, report.name, report=report, owned=True)

    def vm(self, name: str) -> "AsyncVm":
        """A handle on an existing vm (no request made)."""
        return AsyncVm(self, name)

    async def vms(self) -> List[models.VmInfo]:
        return await self._do(Call("GET", "/v1/vms", model=models.VmInfo, many=True))

    async def branches(self) -> List[Dict[str, Any]]:
        return await self._do(Call("GET", "/v1/branches"))

    def branch(self, name: str) -> "AsyncBranch":
        return AsyncBranch(self, name)

    async def wake(
        self,
        branch: Union["AsyncBranch", str],
        *,
        name: Optional[str] = None,
        lazy: bool = False,
        net: bool = False,
        contract: Optional[str] = None,
    ) -> "AsyncVm":
        """Wakes a sleeping branch (as itself, or as a new branch `name`)."""
        b = branch.name if isinstance(branch, AsyncBranch) else branch
        body = {"name": name, "lazy": lazy, "net": net, "contract": contract}
        result = await self._operation(Call("POST", f"/v1/branches/{seg(b)}/wake", json=body))
        report = models.parse(models.RunReport, result)
        return AsyncVm(self, report.name, report=report, owned=True)

    async def tree(self) -> models.Lineage:
        return await self._do(Call("GET", "/v1/tree", model=models.Lineage))

    async def gc(self) -> Dict[str, Any]:
        return await self._operation(Call("POST", "/v1/gc"))

    # -- API keys (the host's owner only) ----------------------------------

    async def keys(self) -> List[models.KeyInfo]:
        """The API keys tined issued (for its TCP listener)."""
        return await self._do(Call("GET", "/v1/keys", model=models.KeyInfo, many=True))

    async def create_key(self, name: str) -> models.NewKey:
        """A new API key; its `.key` is shown this once."""
        return await self._do(Call("POST", "/v1/keys", json={"name": name}, model=models.NewKey))

    async def delete_key(self, key: Union[str, models.KeyInfo]) -> None:
        """Revokes a key (its id or name, or a `KeyInfo`): refused at once."""
        await self._do(Call("DELETE", f"/v1/keys/{seg(getattr(key, 'id', key))}"))


class AsyncVm:
    """A vm. As a context manager, a vm this client made (run, wake, fork)
    is removed on exit, with its checkpoints."""

    def __init__(self, t: AsyncTine, name: str, *, report: Any = None, owned: bool = False):
        self._t = t
        self.name = name
        self.report = report
        self._owned = owned
        self.files = AsyncFiles(self)

    def __repr__(self) -> str:
        return f"Vm({self.name!r})"

    async def __aenter__(self) -> "AsyncVm":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._owned:
            try:
                await self.rm()
            except errors.NotFound:
                pass

    @property
    def _p(self) -> str:
        return f"/v1/vms/{seg(self.name)}"

    async def info(self) -> models.VmInfo:
        return await self._t._do(Call("GET", self._p, model=models.VmInfo))

    # -- work inside -----------------------------------------------------

    async def exec(
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
        return await self._t._do(Call("POST", f"{self._p}/exec", json=body, model=models.ExecResult), wait)

    async def stream(
        self,
        argv: Union[str, Sequence[str]],
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout: Optional[float] = None,
        stdin: Union[bytes, str, None] = None,
        user: Optional[str] = None,
    ) -> AsyncIterator[ExecEvent]:
        """Runs a command and yields its output as it comes (`ExecEvent`s:
        stdout, stderr, then one `exit`). The command ends with the stream;
        for input as it goes, or one that outlives the stream, `spawn`."""
        body = _core.exec_body(argv, env, cwd, timeout, stdin, user)
        path = f"{self._p}/exec"
        try:
            async with self._t._http.stream("POST", path, json=body, headers=_core.NDJSON, timeout=None) as res:
                if res.status_code >= 400:
                    await res.aread()
                    _core.answer(Call("POST", path), res)
                async for line in res.aiter_lines():
                    if line.strip():
                        yield _core.exec_event(line)
        except self._t._errors as e:
            raise _core.unreachable(self._t._ep, e) from e

    async def lines(self, argv: Union[str, Sequence[str]], **kw: Any) -> AsyncIterator[Tuple[str, Any]]:
        """Like `stream`, by whole lines: `("stdout", text)`, `("stderr",
        text)`, and last `("exit", exit_code)`."""
        split = _core.Lines()
        async for ev in self.stream(argv, **kw):
            if ev.type == "exit":
                for line in split.rest():
                    yield line
                yield ("exit", ev.exit_code)
            else:
                for line in split.feed(ev):
                    yield line

    async def spawn(
        self,
        argv: Union[str, Sequence[str]],
        *,
        stdin: Union[bool, bytes, str, None] = None,
        tag: Optional[str] = None,
        user: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> "AsyncProcess":
        """Starts a command in the background and returns its `AsyncProcess`
        once it runs. The guest's agent keeps it: it runs on when this
        client leaves, through a sleep and a wake, and in every child of a
        fork. `stdin=True` keeps its stdin open for `write`; `tag` names
        it among the vm's commands; `timeout` kills it after so many
        seconds. Its output is followed from the start."""
        body = _core.spawn_body(argv, env, cwd, timeout, stdin, user, tag)
        p = AsyncProcess(self, 0, owned=True)
        await p._open("POST", f"{self._p}/exec", body)
        return p

    def process(self, pid: Union[int, models.ProcessInfo]) -> "AsyncProcess":
        """A handle on a running command (a pid, or one of `processes()`),
        e.g. in a fork's child or after a wake. No request made: reading
        follows its output from then on."""
        return AsyncProcess(self, _core.pid_of(pid))

    async def processes(self) -> List[models.ProcessInfo]:
        """The commands the guest's agent runs."""
        return await self._t._do(Call("GET", f"{self._p}/processes", model=models.ProcessInfo, many=True))

    async def console(self) -> str:
        return (await self._t._do(Call("GET", f"{self._p}/console", raw=True))).text

    async def console_send(self, line: str) -> None:
        await self._t._do(Call("POST", f"{self._p}/console", json={"line": line}))

    # -- moments ---------------------------------------------------------

    async def fork(
        self,
        n: Optional[int] = None,
        *,
        names: Optional[Sequence[str]] = None,
        contract: Optional[str] = None,
        idempotency_key: Optional[str] = None,
    ) -> "AsyncChildren":
        """`n` children (or one per name) continue from this moment; one
        `Child` per child, each with its `vm` or its `error`."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        call = Call("POST", f"{self._p}/fork", json=_core.fork_body(n, names, contract), headers=headers, model=models.ForkReport)
        report: models.ForkReport = await self._t._do(call)
        kids = AsyncChildren(
            Child(r.name, r.ok, r.error, AsyncVm(self._t, r.name, owned=True) if r.ok else None) for r in report.results
        )
        kids.report = report
        return kids

    async def checkpoint(self, tag: Optional[str] = None) -> "AsyncCheckpoint":
        report = await self._t._do(Call("POST", f"{self._p}/checkpoints", json={"tag": tag}, model=models.MomentReport))
        return AsyncCheckpoint(self, report.tag or "", report)

    async def checkpoints(self) -> List[models.CheckpointRecord]:
        return await self._t._do(Call("GET", f"{self._p}/checkpoints", model=models.CheckpointRecord, many=True))

    async def rollback(self, checkpoint: Union["AsyncCheckpoint", str]) -> models.MomentReport:
        tag = checkpoint.tag if isinstance(checkpoint, AsyncCheckpoint) else checkpoint
        return await self._t._do(Call("POST", f"{self._p}/rollback", json={"tag": tag}, model=models.MomentReport))

    async def snapshot(self, to: str) -> Dict[str, Any]:
        return await self._t._operation(Call("POST", f"{self._p}/snapshot", json={"dir": os.path.abspath(to)}))

    async def sleep(self) -> "AsyncBranch":
        """The vm's moment goes into the store; the vm ends, its branch sleeps."""
        result = await self._t._operation(Call("POST", f"{self._p}/sleep"))
        return AsyncBranch(self._t, result.get("branch", self.name), result, owned=self._owned)

    # -- lifecycle -------------------------------------------------------

    async def stop(self, timeout: Optional[float] = None) -> models.StopReport:
        body = {} if timeout is None else {"timeout_s": timeout}
        return await self._t._do(Call("POST", f"{self._p}/stop", json=body, model=models.StopReport))

    async def kill(self) -> models.StopReport:
        return await self._t._do(Call("POST", f"{self._p}/kill", model=models.StopReport))

    async def rm(self, *, force: bool = True) -> models.Removed:
        """Removes the vm and its checkpoints (a running one is killed first,
        unless `force=False`)."""
        params = {"force": "true"} if force else None
        return await self._t._do(Call("DELETE", self._p, params=params, model=models.Removed))

    # -- contract, secrets, effects --------------------------------------

    async def contract(self) -> str:
        return (await self._t._do(Call("GET", f"{self._p}/contract")))["toml"]

    async def set_contract(self, toml: str) -> str:
        return (await self._t._do(Call("PUT", f"{self._p}/contract", json={"toml": toml})))["toml"]

    async def effects(self) -> models.LineageEffects:
        return await self._t._do(Call("GET", f"{self._p}/effects", model=models.LineageEffects))


class AsyncProcess:
    """A command the guest's agent keeps (`vm.spawn`, `vm.process`):
    `async for ev in p` gives its `ExecEvent`s as they come (stdout,
    stderr, then `exit`); `lines()` the same by whole lines; `await
    wait()` its end as an `ExecResult` (with the output this handle saw).
    The handle follows the command on a stream of its own, from `spawn`
    (or the first read) until the exit or `detach()`; a command nobody
    follows runs on and its output is dropped. As an async context
    manager, a command this handle spawned is killed on exit if it still
    runs."""

    def __init__(self, vm: AsyncVm, pid: int, *, owned: bool = False):
        self.vm = vm
        self.pid = pid
        self._owned = owned
        self._f = _core.Followed(pid)
        self._res: Any = None
        self._lines: Optional[AsyncIterator[str]] = None

    def __repr__(self) -> str:
        return f"Process({self.vm.name}:{self.pid})"

    @property
    def _p(self) -> str:
        return f"{self.vm._p}/processes/{self.pid}"

    async def _next_line(self) -> Optional[str]:
        assert self._lines is not None
        try:
            return await self._lines.__anext__()
        except StopAsyncIteration:
            return None

    async def _open(self, method: str, path: str, body: Any = None) -> None:
        """Opens the stream of the command's events; its first is `started`."""
        t = self.vm._t
        try:
            # Entered by hand: the stream outlives this call.
            cm = t._http.stream(method, path, json=body, headers=_core.NDJSON, timeout=None)
            res = await cm.__aenter__()
            self._res = cm
            if res.status_code >= 400:
                await res.aread()
                _core.answer(Call(method, path), res)
            self._lines = res.aiter_lines()
            first: Optional[str] = ""
            while first is not None and not first.strip():
                first = await self._next_line()
            if first is None:
                raise _core.not_followed(self.pid)
            self.pid = self._f.pid = self._f.started(first)
        except BaseException as e:
            await self.detach()
            if isinstance(e, t._errors):
                raise _core.unreachable(t._ep, e) from e
            raise

    async def __aiter__(self) -> AsyncIterator[ExecEvent]:
        t = self.vm._t
        while self._f.end is None:
            if self._lines is None:
                await self._open("GET", f"{self._p}/output")
            try:
                line = await self._next_line()
                if line is None:
                    raise _core.not_followed(self.pid)
                ev = self._f.event(line)
            except BaseException as e:
                await self.detach()
                if isinstance(e, t._errors):
                    raise _core.unreachable(t._ep, e) from e
                raise
            if ev is not None:
                if ev.type == "exit":
                    await self._drain()
                yield ev

    async def lines(self) -> AsyncIterator[Tuple[str, Any]]:
        """Its output by whole lines as it comes: `("stdout", text)`,
        `("stderr", text)`, and last `("exit", exit_code)`."""
        async for ev in self:
            for line in self._f.lines(ev):
                yield line

    async def wait(self) -> models.ExecResult:
        """Waits for its end: its exit code and the output this handle saw."""
        async for _ in self:
            pass
        return self._f.result()

    async def write(self, data: Union[bytes, str]) -> None:
        """Writes to its stdin (it was spawned with `stdin=True`)."""
        if isinstance(data, str):
            data = data.encode()
        call = Call("POST", f"{self._p}/stdin", content=data, headers={"Content-Type": "application/octet-stream"})
        await self.vm._t._do(call)

    async def close_stdin(self) -> None:
        """Closes its stdin: it reads EOF."""
        call = Call("POST", f"{self._p}/stdin", params={"close": True}, content=b"",
                    headers={"Content-Type": "application/octet-stream"})
        await self.vm._t._do(call)

    async def signal(self, sig: Union[int, str]) -> bool:
        """Sends a signal (`signal.SIGTERM`, 15 or `"TERM"`) to its process
        group; False when it had just ended."""
        call = Call("POST", f"{self._p}/signal", json={"signal": _core.signal_value(sig)}, model=models.Signalled)
        return (await self.vm._t._do(call)).delivered

    async def kill(self) -> bool:
        """SIGKILL to its process group; False when it had just ended."""
        return await self.signal("KILL")

    async def detach(self) -> None:
        """Stops following it; the command runs on."""
        res, self._res, self._lines = self._res, None, None
        if res is not None:
            await res.__aexit__(None, None, None)

    async def _drain(self) -> None:
        """After the exit: the stream's end (so its connection is kept)."""
        try:
            while self._lines is not None and await self._next_line() is not None:
                pass
        except self.vm._t._errors:
            pass
        await self.detach()

    async def __aenter__(self) -> "AsyncProcess":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            if self._owned and self._f.end is None:
                try:
                    await self.kill()
                except errors.NotFound:
                    pass
        finally:
            await self.detach()


class AsyncChildren(list):
    """A fork's children (`Child` each). As a context manager, the children
    that run are removed on exit."""

    report: Optional[models.ForkReport] = None

    @property
    def vms(self) -> List[AsyncVm]:
        return [c.vm for c in self if c.ok]

    @property
    def failed(self) -> List[Child]:
        return [c for c in self if not c.ok]

    async def __aenter__(self) -> "AsyncChildren":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for vm in self.vms:
            await vm.__aexit__(None, None, None)


class AsyncFiles:
    """A vm's files, through its agent."""

    def __init__(self, vm: AsyncVm):
        self._vm = vm

    def _p(self, what: str = "") -> str:
        return f"{self._vm._p}/files{what}"

    async def read(self, path: str) -> bytes:
        return (await self._vm._t._do(Call("GET", self._p(), params={"path": path}, raw=True))).content

    async def read_text(self, path: str) -> str:
        return (await self.read(path)).decode()

    async def write(self, path: str, data: Union[bytes, str], *, mode: int = 0o644) -> None:
        if isinstance(data, str):
            data = data.encode()
        params = {"path": path, "mode": f"{mode:o}"}
        call = Call("PUT", self._p(), params=params, content=data, headers={"Content-Type": "application/octet-stream"})
        await self._vm._t._do(call)

    async def list(self, path: str, *, depth: int = 1) -> List[models.Entry]:
        call = Call("GET", self._p("/list"), params={"path": path, "depth": depth}, model=models.Entry, many=True)
        return await self._vm._t._do(call)

    async def stat(self, path: str) -> models.Entry:
        return await self._vm._t._do(Call("GET", self._p("/stat"), params={"path": path}, model=models.Entry))

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
            return True
        except errors.NotFound:
            return False

    async def remove(self, path: str) -> bool:
        return (await self._vm._t._do(Call("DELETE", self._p(), params={"path": path})))["changed"]

    async def make_dir(self, path: str) -> bool:
        return (await self._vm._t._do(Call("POST", self._p("/dir"), params={"path": path})))["changed"]

    async def move(self, src: str, dst: str) -> models.Entry:
        """Renames `src` to `dst` (its missing parents are made); the moved entry."""
        call = Call("POST", self._p("/move"), json={"from": src, "to": dst}, model=models.Entry)
        return await self._vm._t._do(call)


class AsyncCheckpoint:
    """A kept moment of a vm. As a context manager, deleted on exit."""

    def __init__(self, vm: AsyncVm, tag: str, report: Optional[models.MomentReport] = None):
        self.vm = vm
        self.tag = tag
        self.report = report

    def __repr__(self) -> str:
        return f"Checkpoint({self.vm.name}@{self.tag})"

    async def rollback(self) -> models.MomentReport:
        return await self.vm.rollback(self)

    async def delete(self) -> models.Removed:
        return await self.vm._t._do(Call("DELETE", f"{self.vm._p}/checkpoints/{seg(self.tag)}", model=models.Removed))

    async def __aenter__(self) -> "AsyncCheckpoint":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.delete()
        except errors.NotFound:
            pass


class AsyncBranch:
    """A sleeping branch in the store. As a context manager, a branch this
    client put to sleep is removed on exit."""

    def __init__(self, t: AsyncTine, name: str, report: Optional[Dict[str, Any]] = None, *, owned: bool = False):
        self._t = t
        self.name = name
        self.report = report or {}
        self._owned = owned

    def __repr__(self) -> str:
        return f"Branch({self.name!r})"

    async def wake(self, *, name: Optional[str] = None, lazy: bool = False, net: bool = False) -> AsyncVm:
        return await self._t.wake(self, name=name, lazy=lazy, net=net)

    async def fork(self, n: int = 1, *, names: Optional[Sequence[str]] = None) -> AsyncChildren:
        """`n` new branches wake from this branch's snapshot."""
        return await AsyncVm(self._t, self.name).fork(n, names=names)

    async def rm(self) -> models.Removed:
        return await self._t._do(Call("DELETE", f"/v1/branches/{seg(self.name)}", model=models.Removed))

    async def __aenter__(self) -> "AsyncBranch":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._owned:
            try:
                await self.rm()
            except (errors.NotFound, errors.Conflict):
                pass
