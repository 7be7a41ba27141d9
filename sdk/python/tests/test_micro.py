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
