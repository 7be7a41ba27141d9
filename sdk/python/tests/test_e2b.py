"""The unmodified e2b SDK (PyPI, pinned in requirements-test.txt) against
tined with Linux guests: only `from e2b import ...` in the test bodies;
the `e2b_env` fixture points the SDK at tined through its documented
environment (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY: a key tined
issued). The same scenario twice: Sandbox, then AsyncSandbox."""

import re

import pytest

from conftest import linux_guests

pytestmark = [
    pytest.mark.linux,
    pytest.mark.skipif(not linux_guests(), reason="Linux guests need hardware KVM (scripts/test runs this in the nested host)"),
    pytest.mark.usefixtures("e2b_env"),
]

# A counter that runs until it is killed: it must survive a pause.
COUNTER = "i=0; while true; do echo $i > /tmp/counter; i=$((i+1)); sleep 0.2; done"
# Who a copy is, and 16 fresh random bytes.
IDENTITY = "echo $(hostname) $(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n')"


def test_sandbox():
    import time

    from e2b import CommandExitException, Sandbox, SandboxState

    sbx = Sandbox.create(timeout=600)
    kids = []
    try:
        # Commands: output, exit code, stderr, streaming, background, stdin.
        r = sbx.commands.run("echo hello; echo oops >&2")
        assert (r.stdout, r.stderr, r.exit_code) == ("hello\n", "oops\n", 0)
        with pytest.raises(CommandExitException) as e:
            sbx.commands.run("echo bad >&2; exit 3")
        assert e.value.exit_code == 3 and e.value.stderr == "bad\n"
        out, err = [], []
        sbx.commands.run("for i in 1 2 3; do echo $i; echo e$i >&2; done", on_stdout=out.append, on_stderr=err.append)
        assert "".join(out) == "1\n2\n3\n" and "".join(err) == "e1\ne2\ne3\n"
        r = sbx.commands.run("pwd; echo $GREETING", envs={"GREETING": "hi"}, cwd="/tmp")
        assert r.stdout == "/tmp\nhi\n"
        bg = sbx.commands.run("sleep 0.5; echo bg", background=True)
        assert bg.pid > 0 and bg.wait().stdout == "bg\n"
        reader = sbx.commands.run("read line; echo got:$line", background=True, stdin=True)
        sbx.commands.send_stdin(reader.pid, "typed\n")
        assert reader.wait().stdout == "got:typed\n"

        # Files.
        sbx.files.write("/tmp/e2b/a.txt", "content")
        assert sbx.files.read("/tmp/e2b/a.txt") == "content"
        assert {e.name for e in sbx.files.list("/tmp/e2b")} == {"a.txt"}
        assert sbx.files.exists("/tmp/e2b/a.txt")
        sbx.files.rename("/tmp/e2b/a.txt", "/tmp/e2b/b.txt")
        assert sbx.files.read("/tmp/e2b/b.txt") == "content"
        sbx.files.remove("/tmp/e2b/b.txt")
        assert not sbx.files.exists("/tmp/e2b/b.txt")
        sbx.files.write("note.txt", "before the pause")  # relative: the user's home

        # Pause, then connect: the files and a running process survive.
        counter = sbx.commands.run(COUNTER, background=True, timeout=0)
        time.sleep(1)
        assert sbx.pause() is True
        assert sbx.get_info().state == SandboxState.PAUSED
        assert not sbx.is_running()
        sbx = Sandbox.connect(sbx.sandbox_id, timeout=600)
        assert sbx.is_running()
        assert sbx.files.read("note.txt") == "before the pause"
        assert counter.pid in [p.pid for p in sbx.commands.list()]
        first = int(sbx.files.read("/tmp/counter"))
        time.sleep(1)
        assert int(sbx.files.read("/tmp/counter")) > first
        # Followed again, then killed.
        again = sbx.commands.connect(counter.pid)
        assert sbx.commands.kill(counter.pid) is True
        with pytest.raises(CommandExitException):
            again.wait()
        assert counter.pid not in [p.pid for p in sbx.commands.list()]
        assert sbx.commands.kill(counter.pid) is False

        # Fork into 3: each child runs a command, each is someone else.
        kids = sbx.fork(count=3, timeout=300)
        assert all(isinstance(k, Sandbox) for k in kids), kids
        who = [k.commands.run(IDENTITY).stdout.split() for k in kids]
        who.append(sbx.commands.run(IDENTITY).stdout.split())
        hostnames, randomness = {w[0] for w in who}, {w[1] for w in who}
        assert len(hostnames) == 4 and len(randomness) == 4, who
        assert all(re.fullmatch("[0-9a-f]{32}", r) for r in randomness), who
        # What the parent wrote before the fork, each child has.
        assert all(k.files.read("note.txt") == "before the pause" for k in kids)
    finally:
        for k in kids:
            k.kill()
        sbx.kill()
    assert not sbx.is_running()


async def test_async_sandbox():
    import asyncio

    from e2b import AsyncSandbox, CommandExitException, SandboxState

    sbx = await AsyncSandbox.create(timeout=600)
    kids = []
    try:
        r = await sbx.commands.run("echo hello; echo oops >&2")
        assert (r.stdout, r.stderr, r.exit_code) == ("hello\n", "oops\n", 0)
        with pytest.raises(CommandExitException) as e:
            await sbx.commands.run("exit 4")
        assert e.value.exit_code == 4
        out = []
        await sbx.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=out.append)
        assert "".join(out) == "1\n2\n3\n"
        bg = await sbx.commands.run("sleep 0.5; echo bg", background=True)
        assert (await bg.wait()).stdout == "bg\n"

        await sbx.files.write("/tmp/e2b/a.txt", "content")
        assert await sbx.files.read("/tmp/e2b/a.txt") == "content"
        assert {e.name for e in await sbx.files.list("/tmp/e2b")} == {"a.txt"}
        assert await sbx.files.exists("/tmp/e2b/a.txt")
        await sbx.files.remove("/tmp/e2b/a.txt")
        assert not await sbx.files.exists("/tmp/e2b/a.txt")
        await sbx.files.write("/root/note.txt", "before the pause")

        counter = await sbx.commands.run(COUNTER, background=True, timeout=0)
        await asyncio.sleep(1)
        assert await sbx.pause() is True
        assert (await sbx.get_info()).state == SandboxState.PAUSED
        sbx = await AsyncSandbox.connect(sbx.sandbox_id, timeout=600)
        assert await sbx.files.read("/root/note.txt") == "before the pause"
        assert counter.pid in [p.pid for p in await sbx.commands.list()]
        first = int(await sbx.files.read("/tmp/counter"))
        await asyncio.sleep(1)
        assert int(await sbx.files.read("/tmp/counter")) > first
        assert await sbx.commands.kill(counter.pid) is True

        kids = await sbx.fork(count=3, timeout=300)
        assert all(isinstance(k, AsyncSandbox) for k in kids), kids
        who = [(await k.commands.run(IDENTITY)).stdout.split() for k in kids]
        who.append((await sbx.commands.run(IDENTITY)).stdout.split())
        assert len({w[0] for w in who}) == 4 and len({w[1] for w in who}) == 4, who
    finally:
        for k in kids:
            await k.kill()
        await sbx.kill()
    assert not await sbx.is_running()
