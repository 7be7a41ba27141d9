"""The unmodified e2b SDK against tined's E2B control API, on micro guests
(they run on this host's /dev/kvm): sandboxes, their lifetime, forks,
snapshots, keys, and the answers to what tine does not support. Only the
e2b package in the test bodies; the `e2b_env` fixture points it at tined.
Commands and files need a Linux guest: test_e2b.py."""

import time

import pytest

from conftest import kvm_ok

pytestmark = [
    pytest.mark.skipif(not kvm_ok(), reason="needs /dev/kvm"),
    pytest.mark.usefixtures("e2b_env"),
]

MICRO = "micro-counter"


def ids(paginator):
    out = []
    while True:
        out += [s.sandbox_id for s in paginator.next_items()]
        if not paginator.has_next:
            return out


def test_create_list_info_kill():
    from e2b import Sandbox, SandboxQuery, SandboxState

    a = Sandbox.create(template=MICRO, metadata={"team": "a"}, timeout=120)
    b = Sandbox.create(template=MICRO, metadata={"team": "b"}, timeout=120)
    try:
        info = a.get_info()
        assert info.sandbox_id == a.sandbox_id and info.template_id == MICRO
        assert info.metadata == {"team": "a"} and info.state == SandboxState.RUNNING
        assert 110 <= (info.end_at - info.started_at).total_seconds() <= 130
        assert info.cpu_count >= 1 and info.memory_mb > 0
        assert {a.sandbox_id, b.sandbox_id} <= set(ids(Sandbox.list()))
        assert ids(Sandbox.list(query=SandboxQuery(metadata={"team": "b"}))) == [b.sandbox_id]
        assert ids(Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED]))) == []
        # Pages of one: every sandbox once, in order.
        assert ids(Sandbox.list(limit=1)) == ids(Sandbox.list())
        assert Sandbox.kill(b.sandbox_id) is True
        assert Sandbox.kill(b.sandbox_id) is False
        assert b.sandbox_id not in ids(Sandbox.list())
        assert not b.is_running()  # envd of a sandbox that is gone: 502, not 401
    finally:
        a.kill()
        b.kill()


def test_pause_connect_resume():
    from e2b import Sandbox, SandboxQuery, SandboxState

    sbx = Sandbox.create(template=MICRO, timeout=120)
    try:
        assert sbx.pause() is True
        assert Sandbox.pause(sbx.sandbox_id) is False  # already paused
        assert sbx.get_info().state == SandboxState.PAUSED
        assert sbx.sandbox_id in ids(Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])))
        assert not sbx.is_running()
        again = Sandbox.connect(sbx.sandbox_id, timeout=90)
        assert again.sandbox_id == sbx.sandbox_id
        assert again.get_info().state == SandboxState.RUNNING
        assert again.is_running()
        # Connecting to a running one is a no-op that keeps it running.
        Sandbox.connect(sbx.sandbox_id)
        assert sbx.get_info().state == SandboxState.RUNNING
    finally:
        sbx.kill()


def test_fork_per_child_results():
    from e2b import Sandbox, SandboxState
    from e2b.exceptions import InvalidArgumentException, SandboxException

    sbx = Sandbox.create(template=MICRO, metadata={"who": "parent"}, timeout=120)
    try:
        kids = sbx.fork(count=3, timeout=60)
        assert len(kids) == 3 and all(isinstance(k, Sandbox) for k in kids)
        assert len({k.sandbox_id for k in kids} | {sbx.sandbox_id}) == 4
        for k in kids:
            info = k.get_info()
            assert info.state == SandboxState.RUNNING and info.metadata == {"who": "parent"}
            assert 50 <= (info.end_at - info.started_at).total_seconds() <= 70
        assert sbx.get_info().state == SandboxState.RUNNING  # the parent goes on
        # A paused sandbox forks too: its children wake from its snapshot.
        sbx.pause()
        (kid,) = Sandbox.fork(sbx.sandbox_id, count=1, timeout=60)
        assert kid.get_info().state == SandboxState.RUNNING
        kids.append(kid)
        with pytest.raises((InvalidArgumentException, SandboxException)):
            sbx.fork(count=21)
        for k in kids:
            k.kill()
    finally:
        sbx.kill()


def test_snapshots():
    from e2b import Sandbox, SandboxState

    sbx = Sandbox.create(template=MICRO, timeout=120)
    made = []
    try:
        snap = sbx.create_snapshot(name="e2b-test-snap")
        assert snap.snapshot_id == "e2b-test-snap" and snap.names == ["e2b-test-snap"]
        assert sbx.get_info().state == SandboxState.RUNNING  # the source goes on
        listed = []
        pages = Sandbox.list_snapshots()
        while True:
            listed += [s.snapshot_id for s in pages.next_items()]
            if not pages.has_next:
                break
        assert "e2b-test-snap" in listed
        mine = sbx.list_snapshots().next_items()
        assert [s.snapshot_id for s in mine] == ["e2b-test-snap"]
        # The same name again is refused (delete it first).
        with pytest.raises(Exception) as e:
            sbx.create_snapshot(name="e2b-test-snap")
        assert "taken" in str(e.value)
        for _ in range(2):
            s = Sandbox.create(template=snap.snapshot_id, timeout=60)
            made.append(s)
            info = s.get_info()
            assert info.template_id == "e2b-test-snap" and info.state == SandboxState.RUNNING
        assert made[0].sandbox_id != made[1].sandbox_id
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
        # The sandboxes made from it live on.
        assert all(m.get_info().state == SandboxState.RUNNING for m in made)
    finally:
        for m in made:
            m.kill()
        sbx.kill()


def wait_for(cond, secs=20.0):
    deadline = time.monotonic() + secs
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_timeouts_kill_or_pause():
    from e2b import Sandbox, SandboxState
    from e2b.exceptions import SandboxNotFoundException

    killed = Sandbox.create(template=MICRO, timeout=120)
    paused = Sandbox.create(template=MICRO, timeout=120, lifecycle={"on_timeout": "pause"})
    try:
        assert paused.get_info().lifecycle["on_timeout"] == "pause"
        killed.set_timeout(1)
        paused.set_timeout(1)

        def gone():
            try:
                killed.get_info()
                return False
            except SandboxNotFoundException:
                return True

        wait_for(gone)
        wait_for(lambda: paused.get_info().state == SandboxState.PAUSED)
        # Connect gives it time again.
        Sandbox.connect(paused.sandbox_id, timeout=120)
        assert paused.get_info().state == SandboxState.RUNNING
    finally:
        killed.kill()
        paused.kill()


def test_what_is_not_supported_says_so():
    from e2b import Sandbox
    from e2b.exceptions import NotFoundException, SandboxException, SandboxNotFoundException

    sbx = Sandbox.create(template=MICRO, timeout=60)
    try:
        with pytest.raises(SandboxException) as e:
            sbx.get_metrics()
        assert "501" in str(e.value) and "metrics" in str(e.value)
        with pytest.raises(SandboxException) as e:
            sbx.pause(mode="filesystem")
        assert "filesystem-only" in str(e.value)
        with pytest.raises(SandboxException) as e:
            Sandbox.create(template=MICRO, allow_internet_access=False)
        assert "allowInternetAccess" in str(e.value)
    finally:
        sbx.kill()
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info("sbx-nosuchthing")
    with pytest.raises((NotFoundException, SandboxException)) as e:
        Sandbox.create(template="no-such-template")
    assert "no-such-template" in str(e.value)
    # Nothing is left of the refused creates.
    assert [s for s in Sandbox.list().next_items()] == []


def test_envd_answers_fast_where_it_cannot_serve():
    """PTYs and directory watches are not supported; a micro guest has no
    agent, so its commands and files fail at once, saying why."""
    from e2b import PtySize, Sandbox
    from e2b.exceptions import SandboxException

    sbx = Sandbox.create(template=MICRO, timeout=60)
    try:
        t0 = time.monotonic()
        with pytest.raises(SandboxException) as e:
            sbx.pty.create(PtySize(rows=24, cols=80))
        assert "PTY" in str(e.value)
        with pytest.raises(SandboxException) as e:
            sbx.files.watch_dir("/tmp")
        assert "watching directories" in str(e.value)
        with pytest.raises(SandboxException) as e:
            sbx.commands.run("true")
        assert "agent" in str(e.value)
        with pytest.raises(SandboxException) as e:
            sbx.files.read("/etc/hostname")
        assert "agent" in str(e.value)
        assert time.monotonic() - t0 < 10
    finally:
        sbx.kill()


def test_keys_are_checked(monkeypatch):
    from e2b import Sandbox
    from e2b.exceptions import AuthenticationException

    monkeypatch.setenv("E2B_API_KEY", "tine_not-a-key-tined-issued")
    with pytest.raises(AuthenticationException):
        Sandbox.create(template=MICRO)
    with pytest.raises(AuthenticationException):
        Sandbox.list().next_items()
