"""The SDK's mechanics against a real tined, with micro guests on this
host's KVM (fast): run, fork, checkpoint/rollback, sleep/wake, tree,
typed errors, context managers, and the same through asyncio."""

import asyncio
import re
import subprocess
import time

import pytest

import tine
from conftest import kvm_ok

pytestmark = pytest.mark.skipif(not kvm_ok(), reason="no /dev/kvm")


def count(vm, after: float = 0.0) -> int:
    """The micro-counter's last printed count (it prints a rising number)."""
    deadline = time.monotonic() + 10
    while True:
        nums = [int(n) for n in re.findall(r"^CNT (\d+)", vm.console(), re.M)]
        if nums and time.monotonic() >= after:
            return nums[-1]
        assert time.monotonic() < deadline, f"{vm.name} printed no count: {vm.console()[-300:]!r}"
        time.sleep(0.05)


def test_run_fork_children_continue_and_are_removed(t):
    with t.run(image="micro-counter", mem="64M") as vm:
        assert vm.info().state == "running"
        before = count(vm)
        with vm.fork(3) as kids:
            assert [k.ok for k in kids] == [True, True, True], kids
            assert kids.report.pause_ms is not None
            names = [k.name for k in kids]
            assert len(set(names)) == 3
            for k in kids:
                info = k.vm.info()
                assert info.state == "running" and info.parent == vm.name
                # a child continues from the moment: its count starts at or above the parent's
                assert count(k.vm, time.monotonic() + 0.2) >= before
        left = {v.name for v in t.vms()}
        assert not left & set(names), "the context manager removes the children it made"
    assert vm.name not in {v.name for v in t.vms()}


def test_fork_names_and_per_child_errors(t):
    with t.run(image="micro-counter", mem="64M") as vm:
        with vm.fork(names=["x-a", "x-b"]) as kids:
            assert [k.name for k in kids] == ["x-a", "x-b"]
        with pytest.raises(tine.InvalidInput) as e:
            vm.fork(names=["bad/name"])
        assert e.value.status == 400 and "bad/name" in e.value.message


def test_fork_idempotency_key_makes_one_fork(t):
    with t.run(image="micro-counter", mem="64M") as vm:
        a = vm.fork(2, idempotency_key="k-123")
        b = vm.fork(2, idempotency_key="k-123")
        with a:
            assert [k.name for k in a] == [k.name for k in b]
            assert len([v for v in t.vms() if v.parent == vm.name]) == 2


def test_checkpoint_rollback_delete(t):
    with t.run(image="micro-counter", mem="64M") as vm:
        with vm.checkpoint("t1") as cp:
            assert [c.tag for c in vm.checkpoints()] == ["t1"]
            at = count(vm)
            time.sleep(0.3)
            assert count(vm) > at
            report = cp.rollback()
            assert report.total_ms > 0
            assert vm.info().state == "running"
        assert vm.checkpoints() == []
        with pytest.raises(tine.NotFound):
            vm.rollback("t1")


def test_sleep_wake_tree(t):
    vm = t.run(image="micro-counter", mem="64M")
    with vm.sleep() as branch:
        assert branch.name == vm.name and branch.report["snapshot"] > 0
        assert vm.name not in {v.name for v in t.vms()}
        assert vm.name in {b["name"] for b in t.branches()}
        with t.wake(branch, name=vm.name + "-w") as woken:
            assert woken.info().state == "running"
            kinds = {(n.name, n.kind) for n in t.tree().nodes}
            assert any(name == woken.name for name, _ in kinds), kinds
        with pytest.raises(tine.NotFound):
            t.wake("no-such-branch")


def test_errors_are_typed_with_the_servers_message(t):
    with pytest.raises(tine.NotFound) as e:
        t.vm("nope").info()
    assert e.value.code == "not_found" and "nope" in e.value.message
    with t.run(image="micro-counter", mem="64M") as vm:
        with pytest.raises(tine.Conflict):
            t.run(image="micro-counter", mem="64M", name=vm.name)
    with pytest.raises(tine.InvalidInput):
        t.run(image="micro-counter", mem="lots")
    with pytest.raises(tine.TineError) as e:
        t.run(image="no-such-image")
    assert "no-such-image" in e.value.message
    with pytest.raises(tine.Unavailable):
        tine.Tine(socket="/nonexistent/tined.sock").health()


def test_exec_in_a_vm_without_agent_is_a_clear_error(t):
    with t.run(image="micro-counter", mem="64M") as vm:
        with pytest.raises(tine.TineError) as e:
            vm.exec(["true"])
        assert e.value.status in (400, 409) and "agent" in e.value.message


async def test_async_client(at):
    async with await at.run(image="micro-counter", mem="64M") as vm:
        assert (await vm.info()).state == "running"
        async with await vm.fork(2) as kids:
            assert all(k.ok for k in kids)
            for k in kids:
                assert (await k.vm.info()).parent == vm.name
        async with await vm.checkpoint() as cp:
            await cp.rollback()
        branch = await vm.sleep()
        async with branch:
            async with await at.wake(branch, name=vm.name + "-aw") as w:
                assert (await w.info()).state == "running"
        with pytest.raises(tine.NotFound):
            await at.vm("nope").info()


def test_tcp_listener_with_token(daemon):
    with tine.Tine(url=daemon.url, token=daemon.token) as t:
        assert t.health().ok and isinstance(t.vms(), list)
    with pytest.raises(tine.Unauthorized):
        tine.Tine(url=daemon.url, token="wrong").health()
    with pytest.raises(tine.Unavailable):
        tine.Tine(url="http://127.0.0.1:1").health()


async def test_async_tcp_listener_with_token(daemon):
    async with tine.AsyncTine(url=daemon.url, token=daemon.token) as t:
        assert (await t.health()).ok
    with pytest.raises(tine.Unauthorized):
        await tine.AsyncTine(url=daemon.url, token="wrong").health()


def test_a_restarted_tined_is_found_again(tmp_path):
    """Kept-alive connections to a tined that went away are replaced."""
    from conftest import _binary, _image_cache

    (tmp_path / "images").symlink_to(_image_cache())
    sock = str(tmp_path / "tined.sock")

    def start():
        p = subprocess.Popen([str(_binary("tined")), "--home", str(tmp_path), "--idle-exit", "0"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            try:
                tine.Tine(socket=sock).health()
                return p
            except tine.Unavailable:
                assert p.poll() is None and time.monotonic() < deadline, "tined did not start"
                time.sleep(0.05)

    p = start()
    t = tine.Tine(socket=sock)
    at = tine.AsyncTine(socket=sock)
    try:
        first = t.health().pid
        assert asyncio.run(at.health()).pid == first
        p.terminate()
        p.wait(30)
        with pytest.raises(tine.Unavailable):
            t.health()
        p = start()
        assert t.health().pid == p.pid != first
        with pytest.raises(tine.NotFound):
            t.vm("none").info()
        p.terminate()
        p.wait(30)
        p = start()
        # A POST on the connection tined closed when it stopped.
        with pytest.raises(tine.NotFound):
            t.vm("none").stop()

        async def again():
            assert (await at.health()).pid == p.pid
            with pytest.raises(tine.NotFound):
                await at.vm("none").kill()

        asyncio.run(again())
    finally:
        t.close()
        p.terminate()
        p.wait(30)


def test_api_keys(t, daemon):
    k = t.create_key("sdk-test")
    assert k.key and k.key.startswith(k.prefix) and k.name == "sdk-test"
    assert k.id in {i.id for i in t.keys()}
    assert all(not hasattr(i, "key") for i in t.keys()), "a listed key never shows its secret"
    # The key opens the TCP listener, but not key management.
    with tine.Tine(url=daemon.url, token=k.key) as kt:
        assert kt.health().ok
        with pytest.raises(tine.Forbidden) as e:
            kt.keys()
        assert e.value.status == 403
        with pytest.raises(tine.Forbidden):
            kt.create_key("more")
        t.delete_key(k)
        with pytest.raises(tine.Unauthorized):
            kt.health()
    assert k.id not in {i.id for i in t.keys()}
    with pytest.raises(tine.NotFound):
        t.delete_key(k.id)
    with pytest.raises(tine.InvalidInput):
        t.create_key("")
    # By name too.
    t.create_key("by-name")
    t.delete_key("by-name")
    assert "by-name" not in {i.name for i in t.keys()}


async def test_async_api_keys(at):
    k = await at.create_key("sdk-async")
    assert k.id in {i.id for i in await at.keys()}
    await at.delete_key(k.id)
    assert k.id not in {i.id for i in await at.keys()}


def quick(fn, within=10.0):
    """`fn()`'s exception (or None), failing if it takes longer than `within` s."""
    import threading

    got = []

    def run():
        try:
            fn()
            got.append(None)
        except Exception as e:
            got.append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(within)
    assert got, f"{fn} still waits after {within} s"
    return got[0]


def test_kept_commands_without_agent_are_clear_errors(t):
    """Micro guests have no agent: every call of kept commands (and
    files.move) answers at once, typed, saying so; none hangs."""
    with t.run(image="micro-counter", mem="64M") as vm:
        p = vm.process(5)
        calls = {
            "spawn": lambda: vm.spawn(["sleep", "9"], stdin=True, tag="x"),
            "processes": vm.processes,
            "follow": p.wait,
            "lines": lambda: next(p.lines()),
            "write": lambda: p.write(b"in"),
            "close_stdin": p.close_stdin,
            "signal": lambda: p.signal("TERM"),
            "kill": p.kill,
            "move": lambda: vm.files.move("/a", "/b"),
        }
        for name, fn in calls.items():
            e = quick(fn)
            assert isinstance(e, tine.InvalidInput), (name, e)
            assert e.status == 400 and "agent" in e.message, (name, e.message)
        # What is wrong with the request is said before the vm is asked.
        e = quick(lambda: p.signal("NOPE"))
        assert isinstance(e, tine.InvalidInput) and "signal" in e.message
        with pytest.raises(tine.InvalidInput):
            vm.process(-1)
    # A vm that is gone.
    e = quick(lambda: t.vm(vm.name).spawn("true"))
    assert isinstance(e, (tine.NotFound, tine.Conflict)), e
    e = quick(lambda: t.vm(vm.name).process(5).wait())
    assert isinstance(e, (tine.NotFound, tine.Conflict)), e


async def test_async_kept_commands_without_agent(at):
    async with await at.run(image="micro-counter", mem="64M") as vm:
        p = vm.process(5)
        for call in (vm.spawn("true"), vm.processes(), p.wait(), p.write("x"), p.kill(), vm.files.move("/a", "/b")):
            with pytest.raises(tine.InvalidInput) as e:
                await asyncio.wait_for(call, 10)
            assert "agent" in e.value.message
