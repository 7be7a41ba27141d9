"""A real tined per test session, in a temporary TINE_HOME whose images
link to the built image cache (scripts/test builds them)."""

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import tine

ROOT = Path(__file__).resolve().parents[3]


def _binary(name: str) -> Path:
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    p = target / "debug" / name
    if not p.exists():
        pytest.exit(f"{p} is missing: run `cargo build --workspace` first", returncode=2)
    return p


def _image_cache() -> Path:
    home = os.environ.get("TINE_HOME") or os.path.expanduser("~/.cache/tine")
    return Path(home) / "images"


class Daemon:
    """tined in its own home; `client()` connects to it."""

    def __init__(self) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="tine-sdk-"))
        (self.home / "images").symlink_to(_image_cache())
        self.log = open(self.home / "tined.test.log", "wb")
        # A TCP listener too, for the e2b SDK (E2B_API_URL, E2B_SANDBOX_URL).
        self.token = secrets.token_hex(16)
        (self.home / "token").write_text(self.token)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [str(_binary("tined")), "--home", str(self.home), "--idle-exit", "0",
             "--tcp", f"127.0.0.1:{self.port}", "--token-file", str(self.home / "token")],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.socket = str(self.home / "tined.sock")
        deadline = time.monotonic() + 30
        while True:
            try:
                tine.Tine(socket=self.socket).health()
                break
            except tine.Unavailable:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"tined did not start: {self.tail()}")
                time.sleep(0.05)

    def tail(self) -> str:
        self.log.flush()
        return (self.home / "tined.test.log").read_text(errors="replace")[-3000:]

    def client(self) -> tine.Tine:
        return tine.Tine(socket=self.socket)

    def stop(self) -> None:
        # Every vm left is removed, so no VMM outlives the tests.
        t = self.client()
        try:
            for v in t.vms():
                t.vm(v.name).rm()
            for b in t.branches():
                try:
                    t.branch(b["name"]).rm()
                except tine.TineError:
                    pass
        except tine.TineError:
            pass
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.home, ignore_errors=True)


@pytest.fixture(scope="session")
def daemon():
    d = Daemon()
    yield d
    d.stop()


@pytest.fixture(scope="session")
def api_key(daemon) -> str:
    """An API key tined issued (POST /v1/keys over its Unix socket, as
    `tine keys create` does): what an E2B user puts in E2B_API_KEY."""
    import httpx

    with httpx.Client(transport=httpx.HTTPTransport(uds=daemon.socket), base_url="http://tined") as c:
        r = c.post("/v1/keys", json={"name": "e2b-tests"})
        r.raise_for_status()
        return r.json()["key"]


@pytest.fixture
def e2b_env(daemon, api_key, monkeypatch):
    """The e2b SDK pointed at tined through its documented environment
    (nothing else: HTTP/1.1 or 2 is its own default)."""
    monkeypatch.setenv("E2B_API_URL", daemon.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", daemon.url)
    monkeypatch.setenv("E2B_API_KEY", api_key)
    monkeypatch.delenv("E2B_DOMAIN", raising=False)
    monkeypatch.delenv("E2B_HTTP_VERSION", raising=False)
    monkeypatch.delenv("E2B_DEBUG", raising=False)


@pytest.fixture
def t(daemon):
    with daemon.client() as c:
        yield c


@pytest.fixture
async def at(daemon):
    async with tine.AsyncTine(socket=daemon.socket) as c:
        yield c


def kvm_ok() -> bool:
    return os.access("/dev/kvm", os.R_OK | os.W_OK)


def linux_guests() -> bool:
    """Linux guests boot here: hardware KVM (as inside the nested test host),
    not kvm_pvm (ENVIRONMENT.md)."""
    hw = Path("/sys/module/kvm_amd").exists() or Path("/sys/module/kvm_intel").exists()
    return kvm_ok() and hw and not Path("/sys/module/kvm_pvm").exists()
