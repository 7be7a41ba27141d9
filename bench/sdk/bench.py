"""bench/sdk: what tine's Python SDK costs over raw HTTP, and SDK against
CLI for the same work. Medians; the last line is `name=value` pairs.

  overhead   one GET /v1/vms/NAME: SDK (`vm.info()`, parsed to a model),
             sync and asyncio, vs httpx on the same socket vs a raw
             HTTP/1.1 request on a kept-alive Unix socket; interleaved
             A B C D A B C D; `sdk_overhead_ms` and `sdk_async_overhead_ms`
             are the SDK's p50 minus raw's (the target: ≤ 0.2 ms)
  fork       fork into K children (micro guest: until they run; --linux:
             until each child's first command answered), then rm, via
             the SDK and via `tine fork`, interleaved; --linux adds the
             unmodified e2b SDK (`sbx.fork(count=K)`, then
             `commands.run` in each child) against the same tined
  tti        --linux: run → first command's result, SDK vs CLI vs e2b
             (`Sandbox.create()` then `commands.run`)

--linux uses the debian image for all three (E2B's commands need bash),
512 MiB, tined's TCP listener with an API key for e2b.
"""

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

import tine

ROOT = Path(__file__).resolve().parents[2]
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release"


def ms(f):
    t0 = time.perf_counter()
    f()
    return (time.perf_counter() - t0) * 1000


async def ams(f):
    """`ms` of an async call, timed inside the event loop."""
    t0 = time.perf_counter()
    await f()
    return (time.perf_counter() - t0) * 1000


def med(xs):
    return statistics.median(xs)


class RawHttp:
    """One kept-alive HTTP/1.1 connection, requests written by hand: the floor."""

    def __init__(self, path):
        self.s = socket.socket(socket.AF_UNIX)
        self.s.connect(path)
        self.f = self.s.makefile("rb")

    def get(self, path):
        self.s.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
        n = 0
        while True:
            line = self.f.readline()
            if line in (b"\r\n", b""):
                break
            if line.lower().startswith(b"content-length:"):
                n = int(line.split(b":")[1])
        return self.f.read(n)


class E2b:
    """The unmodified e2b SDK against this tined's TCP listener, with an
    API key the bench makes over the Unix socket (as `tine keys create`)."""

    def __init__(self, sock, port):
        with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://t") as c:
            key = c.post("/v1/keys", json={"name": "bench"}).json()["key"]
        url = f"http://127.0.0.1:{port}"
        os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=key)
        from e2b import Sandbox

        self.Sandbox = Sandbox
        self.parent = Sandbox.create(timeout=86400)

    def fork(self, k):
        """Fork → the first command's result in every child; then kill them."""
        kids = []

        def f():
            nonlocal kids
            kids = self.parent.fork(count=k, timeout=3600)
            assert all(isinstance(x, self.Sandbox) for x in kids), kids
            for x in kids:
                x.commands.run("hostname")

        took = ms(f)
        for x in kids:
            x.kill()
        return took

    def tti(self):
        """Create → the first command's result; then kill."""
        sbx = None

        def f():
            nonlocal sbx
            sbx = self.Sandbox.create(timeout=3600)
            sbx.commands.run("hostname")

        took = ms(f)
        sbx.kill()
        return took

    def close(self):
        self.parent.kill()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--forks", type=int, default=10)
    ap.add_argument("--linux", action="store_true", help="Linux guests (exec): tti and fork to first answer")
    a = ap.parse_args()

    home = Path(tempfile.mkdtemp(prefix="tine-bench-sdk-"))
    cache = Path(os.environ.get("TINE_HOME") or os.path.expanduser("~/.cache/tine"))
    (home / "images").symlink_to(cache / "images")
    env = dict(os.environ, TINE_HOME=str(home), TINE_MACHINE="never")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tcp = ["--tcp", f"127.0.0.1:{port}"] if a.linux else []
    tined = subprocess.Popen([str(TARGET / "tined"), "--home", str(home), "--idle-exit", "0", *tcp],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    sock = str(home / "tined.sock")
    out = {}
    try:
        for _ in range(300):
            try:
                tine.Tine(socket=sock).health()
                break
            except tine.Unavailable:
                time.sleep(0.05)
        t = tine.Tine(socket=sock)
        cli = str(TARGET / "tine")

        def tine_cli(*args):
            subprocess.run([cli, *args], env=env, check=True, stdout=subprocess.DEVNULL)

        image = "debian" if a.linux else "micro-counter"
        mem = "512M" if a.linux else "256M"
        parent = t.run(image=image, mem=mem, name="p")
        e2b = E2b(sock, port) if a.linux else None

        if not a.linux:
            raw = RawHttp(sock)
            hx = httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://t")
            loop = asyncio.new_event_loop()
            at = tine.AsyncTine(socket=sock)
            aparent = at.vm("p")
            sdk, asdk, rx, rr = [], [], [], []
            for _ in range(a.calls):
                sdk.append(ms(parent.info))
                asdk.append(loop.run_until_complete(ams(aparent.info)))
                rx.append(ms(lambda: hx.get("/v1/vms/p")))
                rr.append(ms(lambda: raw.get("/v1/vms/p")))
            loop.run_until_complete(at.close())
            loop.close()
            out.update(sdk_call_ms=med(sdk), sdk_async_call_ms=med(asdk), httpx_call_ms=med(rx),
                       raw_call_ms=med(rr), sdk_overhead_ms=med(sdk) - med(rr),
                       sdk_async_overhead_ms=med(asdk) - med(rr), sdk_over_httpx_ms=med(sdk) - med(rx))
            print(f"overhead: {a.calls} GETs each: SDK {med(sdk):.3f} ms, SDK asyncio {med(asdk):.3f} ms, "
                  f"httpx {med(rx):.3f} ms, raw {med(rr):.3f} ms (p50)")
            print(f"SDK over raw HTTP, p50: sync {med(sdk) - med(rr):.3f} ms, asyncio {med(asdk) - med(rr):.3f} ms "
                  f"(target ≤ 0.2 ms)")

        # The same first command for all three: E2B's commands.run runs
        # its command under `/bin/bash -l -c`.
        first = ["bash", "-l", "-c", "hostname"] if a.linux else ["hostname"]

        def sdk_fork(k):
            kids = parent.fork(k)
            assert all(c.ok for c in kids), kids
            if a.linux:
                for c in kids:
                    c.vm.exec(first)
            return kids

        def cli_fork(k):
            names = ",".join(f"c{i}" for i in range(k))
            tine_cli("fork", "p", "-n", str(k), "--names", names)
            if a.linux:
                for i in range(k):
                    tine_cli("exec", f"c{i}", "--", *first)
            return names

        for k in (1, 10):
            s, c, e = [], [], []
            for _ in range(a.forks if k == 1 else max(3, a.forks // 3)):
                if e2b:
                    e.append(e2b.fork(k))
                kids = None

                def f():
                    nonlocal kids
                    kids = sdk_fork(k)

                s.append(ms(f))
                for v in kids.vms:
                    v.rm()
                names = None

                def g():
                    nonlocal names
                    names = cli_fork(k)

                c.append(ms(g))
                for n in names.split(","):
                    tine_cli("rm", "--force", n)
            out[f"fork{k}_sdk_ms"], out[f"fork{k}_cli_ms"] = med(s), med(c)
            out[f"fork{k}_cli_over_sdk"] = med(c) / med(s)
            what = "first answer in every child" if a.linux else "children running"
            also = ""
            if e:
                out[f"fork{k}_e2b_ms"] = med(e)
                out[f"fork{k}_e2b_over_cli"] = med(e) / med(c)
                also = f", e2b SDK {med(e):.1f} ms"
            print(f"fork K={k} → {what}: SDK {med(s):.1f} ms, CLI {med(c):.1f} ms{also} (p50 of {len(s)})")

        if a.linux:
            s, c, e = [], [], []
            for i in range(3):
                def f():
                    with t.run(image=image, mem=mem, name=f"s{i}") as v:
                        v.exec(first)
                s.append(ms(f))

                def g():
                    tine_cli("run", "--name", f"r{i}", "--image", image, "--mem", mem)
                    tine_cli("exec", f"r{i}", "--", *first)
                c.append(ms(g))
                tine_cli("rm", "--force", f"r{i}")
                e.append(e2b.tti())
            out.update(tti_sdk_ms=med(s), tti_cli_ms=med(c), tti_e2b_ms=med(e),
                       tti_cli_over_sdk=med(c) / med(s), tti_e2b_over_cli=med(e) / med(c))
            print(f"time to interactive (run → first result): SDK {med(s):.0f} ms, CLI {med(c):.0f} ms, "
                  f"e2b SDK {med(e):.0f} ms (p50 of 3)")
            e2b.close()
        parent.rm()
    finally:
        tined.terminate()
        tined.wait(30)
        shutil.rmtree(home, ignore_errors=True)
    print(" ".join(f"{k}={v:.3f}" for k, v in out.items()))


if __name__ == "__main__":
    main()
