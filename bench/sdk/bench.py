"""bench/sdk: what tine's Python SDK costs over raw HTTP, and SDK against
CLI for the same work. Medians; the last line is `name=value` pairs.

  overhead   one GET /v1/vms/NAME: SDK (`vm.info()`, parsed to a model),
             sync and asyncio, vs httpx on the same socket vs a raw
             HTTP/1.1 request on a kept-alive Unix socket; interleaved
             A B C D A B C D; `sdk_overhead_ms` and `sdk_async_overhead_ms`
             are the SDK's p50 minus raw's (the target: ≤ 0.2 ms)
  fork       fork into K children (micro guest: until they run; --linux:
             until each child's first command answered), then rm, via
             the SDK and via `tine fork`, interleaved
  tti        --linux: run → first command's result, SDK vs CLI
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
    tined = subprocess.Popen([str(TARGET / "tined"), "--home", str(home), "--idle-exit", "0"],
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

        image = "minimal" if a.linux else "micro-counter"
        parent = t.run(image=image, mem="256M", name="p")

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

        first = "hostname"

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
                    tine_cli("exec", f"c{i}", "--", first)
            return names

        for k in (1, 10):
            s, c = [], []
            for _ in range(a.forks if k == 1 else max(3, a.forks // 3)):
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
            print(f"fork K={k} → {what}: SDK {med(s):.1f} ms, CLI {med(c):.1f} ms (p50 of {len(s)})")

        if a.linux:
            s, c = [], []
            for i in range(3):
                def f():
                    with t.run(image="minimal", mem="256M", name=f"s{i}") as v:
                        v.exec(first)
                s.append(ms(f))

                def g():
                    tine_cli("run", "--name", f"r{i}")
                    tine_cli("exec", f"r{i}", "--", first)
                c.append(ms(g))
                tine_cli("rm", "--force", f"r{i}")
            out.update(tti_sdk_ms=med(s), tti_cli_ms=med(c), tti_cli_over_sdk=med(c) / med(s))
            print(f"time to interactive (run → first result): SDK {med(s):.0f} ms, CLI {med(c):.0f} ms (p50 of 3)")
        parent.rm()
    finally:
        tined.terminate()
        tined.wait(30)
        shutil.rmtree(home, ignore_errors=True)
    print(" ".join(f"{k}={v:.3f}" for k, v in out.items()))


if __name__ == "__main__":
    main()
