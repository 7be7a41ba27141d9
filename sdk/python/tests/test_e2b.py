"""The unmodified e2b SDK (PyPI, pinned in requirements-test.txt) against
tined: only `from e2b import Sandbox` / `AsyncSandbox` in the test bodies;
the fixture points the SDK at tined through its documented environment."""

import pytest

from conftest import linux_guests

pytestmark = [pytest.mark.linux, pytest.mark.skipif(not linux_guests(), reason="Linux guests need hardware KVM (scripts/test runs this in the nested host)")]


@pytest.fixture(autouse=True)
def e2b_env(daemon, monkeypatch):
    monkeypatch.setenv("E2B_API_URL", daemon.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", daemon.url)
    monkeypatch.setenv("E2B_API_KEY", daemon.token)
    monkeypatch.setenv("E2B_HTTP_VERSION", "1.1")


def test_sandbox_commands_files_kill():
    from e2b import Sandbox

    sbx = Sandbox.create()
    try:
        r = sbx.commands.run("echo hello; echo oops >&2")
        assert r.stdout == "hello\n" and r.stderr == "oops\n" and r.exit_code == 0
        from e2b import CommandExitException

        with pytest.raises(CommandExitException) as e:
            sbx.commands.run("exit 3")
        assert e.value.exit_code == 3
        seen = []
        r = sbx.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=seen.append)
        assert "".join(seen) == "1\n2\n3\n"
        bg = sbx.commands.run("sleep 0.5; echo bg", background=True)
        assert bg.wait().stdout == "bg\n"
        sbx.files.write("/tmp/e2b/a.txt", "content")
        assert sbx.files.read("/tmp/e2b/a.txt") == "content"
        names = {e.name for e in sbx.files.list("/tmp/e2b")}
        assert names == {"a.txt"}
        assert sbx.files.exists("/tmp/e2b/a.txt")
        sbx.files.remove("/tmp/e2b/a.txt")
        assert not sbx.files.exists("/tmp/e2b/a.txt")
        assert sbx.is_running()
    finally:
        sbx.kill()

