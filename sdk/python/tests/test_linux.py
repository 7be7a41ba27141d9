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


async def test_async_exec_and_files(daemon):
    async with tine.AsyncTine(socket=daemon.socket) as t:
        async with await t.run(image="minimal", mem="256M") as v:
            await v.files.write("/tmp/x", b"async")
            assert await v.files.read("/tmp/x") == b"async"
            r = await v.exec(["cat", "/tmp/x"])
            assert r.stdout == "async"
            lines = [l async for l in v.lines("echo a; echo b")]
            assert lines == [("stdout", "a"), ("stdout", "b"), ("exit", 0)]
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
