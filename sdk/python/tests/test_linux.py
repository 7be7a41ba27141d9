"""exec, files and the wake-up contract through the SDK, in Linux guests
(on this machine: inside the nested test host; scripts/test runs this
file there through testhost/run)."""

import asyncio

import pytest

import tine
from conftest import linux_guests

pytestmark = [pytest.mark.linux, pytest.mark.skipif(not linux_guests(), reason="Linux guests need hardware KVM (scripts/test runs this in the nested host)")]


@pytest.fixture(scope="module")
def vm(daemon):
    t = daemon.client()
    v = t.run(image="minimal", mem="256M")
    yield v
    v.rm()


def test_exec_result_stderr_exit_env_cwd_stdin(vm):
    r = vm.exec(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (r.stdout, r.stderr, r.exit_code, r.ok) == ("out\n", "err\n", 3, False)
    r = vm.exec("echo $K $(pwd)", env={"K": "v"}, cwd="/tmp")
    assert r.stdout == "v /tmp\n" and r.ok
    assert vm.exec(["cat"], stdin=b"abc").stdout == "abc"
    r = vm.exec(["sleep", "10"], timeout=0.5)
    assert r.timed_out


def test_exec_streams_lines_as_they_come(vm):
    got = list(vm.lines("for i in 1 2 3; do echo line$i; sleep 0.2; done; echo e >&2; exit 4"))
    assert ("stdout", "line1") in got and ("stderr", "e") in got
    assert got[-1] == ("exit", 4)
    outs = [line for kind, line in got if kind == "stdout"]
    assert outs == ["line1", "line2", "line3"]
    events = list(vm.stream(["cat"], stdin="in"))
    assert b"".join(e.data for e in events if e.type == "stdout") == b"in"


def test_files_write_read_list_stat_remove(vm):
    assert vm.files.make_dir("/tmp/sdk") is True
    vm.files.write("/tmp/sdk/a.txt", b"hello")
    assert vm.files.read("/tmp/sdk/a.txt") == b"hello"
    vm.files.write("/tmp/sdk/run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    assert vm.exec(["/tmp/sdk/run.sh"]).stdout == "ran\n"
    vm.files.make_dir("/tmp/sdk/d/e")
    entries = {e.name: e for e in vm.files.list("/tmp/sdk")}
    assert set(entries) == {"a.txt", "run.sh", "d"}
    assert entries["a.txt"].size == 5 and entries["run.sh"].mode == 0o755 and entries["d"].is_dir
    assert {e.path for e in vm.files.list("/tmp/sdk", depth=2)} >= {"/tmp/sdk/d/e"}
    assert vm.files.exists("/tmp/sdk/a.txt") and not vm.files.exists("/tmp/sdk/none")
    assert vm.files.remove("/tmp/sdk") is True
    assert not vm.files.exists("/tmp/sdk")
    with pytest.raises(tine.NotFound):
        vm.files.read("/tmp/sdk/a.txt")
    with pytest.raises(tine.InvalidInput):
        vm.files.read("relative/path")


def test_fork_children_are_new_computers(vm):
    vm.files.write("/tmp/before", b"parent wrote this")
    with vm.fork(3) as kids:
        assert all(k.ok for k in kids), kids
        seen = set()
        for k in kids:
            r = k.vm.exec("hostname; head -c 16 /dev/urandom | od -An -tx1; cat /tmp/before")
            host, rand, before = r.stdout.split("\n", 2)
            assert before.strip() == "parent wrote this"
            seen.add((host, rand))
        assert len({h for h, _ in seen}) == 3 and len({r for _, r in seen}) == 3
        assert isinstance(kids[0].vm.effects(), tine.models.LineageEffects)


def test_spawn_with_stdin_lines_as_they_come(vm):
    sh = 'while read l; do echo "got $l"; done; echo bye >&2'
    with vm.spawn(sh, stdin=True, tag="echo") as p:
        assert p.pid > 1
        info = {i.pid: i for i in vm.processes()}[p.pid]
        assert (info.tag, info.keep, info.stdin, info.argv) == ("echo", True, True, ["sh", "-c", sh])
        lines = p.lines()
        p.write("a\n")
        assert next(lines) == ("stdout", "got a")   # before stdin ends: as it comes
        p.write(b"b\n")
        assert next(lines) == ("stdout", "got b")
        p.close_stdin()
        assert sorted(lines) == [("exit", 0), ("stderr", "bye")]
        r = p.wait()
        assert (r.ok, r.stdout, r.stderr) == (True, "got a\ngot b\n", "bye\n")
    assert p.pid not in {i.pid for i in vm.processes()}
    # Input given whole, a timeout, and a user the guest lacks.
    assert vm.spawn(["cat"], stdin="whole").wait().stdout == "whole"
    assert vm.spawn(["sleep", "10"], timeout=0.5).wait().timed_out
    # (The minimal image has no /etc/passwd: the agent's message is about that file.)
    with pytest.raises(tine.Failed) as e:
        vm.spawn(["true"], user="nobody-here")
    assert "cannot run" in e.value.message


def test_signal_and_files_move(vm):
    sh = 'trap "echo term; exit 3" TERM; echo ready; while :; do sleep 0.1; done'
    p = vm.spawn(sh)
    assert next(p.lines()) == ("stdout", "ready")
    assert p.signal("TERM") is True
    r = p.wait()
    assert (r.exit_code, r.stdout) == (3, "ready\nterm\n")
    with pytest.raises(tine.NotFound):
        p.signal(15)
    with pytest.raises(tine.NotFound):
        vm.process(p.pid).wait()
    vm.files.write("/tmp/mv-a", b"moved")
    e = vm.files.move("/tmp/mv-a", "/tmp/mv/sub/b")
    assert (e.path, e.name, e.size, e.kind) == ("/tmp/mv/sub/b", "b", 5, "file")
    assert vm.files.read("/tmp/mv/sub/b") == b"moved" and not vm.files.exists("/tmp/mv-a")
    with pytest.raises(tine.NotFound):
        vm.files.move("/tmp/mv-a", "/tmp/mv-c")


def count_from(p, n=3):
    """The next `n` numbers a counter prints, read as they come."""
    got = []
    for kind, line in p.lines():
        assert kind == "stdout", (kind, line)
        got.append(int(line))
        if len(got) == n:
            return got
    raise AssertionError(f"the counter ended: {got}")


def test_kept_counter_survives_sleep_wake_and_fork(daemon, vm):
    t = daemon.client()
    counter = "i=0; while :; do i=$((i+1)); echo $i; sleep 0.1; done"
    p = vm.spawn(counter, tag="counter")
    before = count_from(p)
    assert before == sorted(before)
    follower = vm.process(p.pid)
    assert count_from(follower, 1)[0] > before[-1]   # a second follower, from now on
    p.detach()
    branch = vm.sleep()
    with pytest.raises(tine.Failed):                    # its stream ended with the vm
        follower.wait()
    woken = t.wake(branch)                              # as itself: `vm` names it again
    assert woken.name == vm.name
    info = {i.tag: i for i in vm.processes()}["counter"]
    assert info.pid == p.pid and info.keep
    again = vm.process(info)
    after = count_from(again)
    assert after[0] > before[-1] and after == sorted(after)
    again.detach()
    with vm.fork(2) as kids:
        assert all(k.ok for k in kids), kids
        for k in kids:
            assert p.pid in {i.pid for i in k.vm.processes()}
            c = k.vm.process(p.pid)
            assert count_from(c, 1)[0] > after[-1]        # the child's copy counts on
            assert c.kill() is True
            r = c.wait()
            assert (r.signal, r.exit_code) == (9, 137)
            assert p.pid not in {i.pid for i in k.vm.processes()}
        assert p.pid in {i.pid for i in vm.processes()}   # the parent's is its own
    assert vm.process(p.pid).kill() is True


async def test_async_exec_and_files(daemon):
    async with tine.AsyncTine(socket=daemon.socket) as t:
        async with await t.run(image="minimal", mem="256M") as v:
            await v.files.write("/tmp/x", b"async")
            assert await v.files.read("/tmp/x") == b"async"
            r = await v.exec(["cat", "/tmp/x"])
            assert r.stdout == "async"
            lines = [l async for l in v.lines("echo a; echo b")]
            assert lines == [("stdout", "a"), ("stdout", "b"), ("exit", 0)]
            async with await v.spawn('while read l; do echo "got $l"; done', stdin=True, tag="a") as p:
                out = p.lines()
                await p.write("x\n")
                assert await out.__anext__() == ("stdout", "got x")
                assert "a" in {i.tag for i in await v.processes()}
                await p.close_stdin()
                assert [l async for l in out] == [("exit", 0)]
                assert (await p.wait()).stdout == "got x\n"
            await v.files.move("/tmp/x", "/tmp/y")
            assert await v.files.read("/tmp/y") == b"async"
            p = await v.spawn("while :; do echo tick; sleep 0.1; done")
            await p.detach()
            again = v.process(p.pid)
            assert await again.lines().__anext__() == ("stdout", "tick")
            assert await again.kill() is True
            assert (await again.wait()).signal == 9
            kids = await v.fork(2)
            async with kids:
                outs = await asyncio.gather(*(k.vm.exec("hostname") for k in kids))
                assert len({o.stdout for o in outs}) == 2


def test_readme_example_runs(daemon, capsys):
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert len(code.strip().splitlines()) <= 16
    code = code.replace("tine.Tine()", f"tine.Tine(socket={daemon.socket!r})")
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3, out
    counts = [int(re.search(r"counted to (\d+)", line).group(1)) for line in out]
    assert min(counts) >= 5, out   # the counter ran a second before the fork, and the children kept it
