"""bench/fleet: three tineds (release build) on one PostgreSQL and one
Garage bucket, both started by scripts/servers and removed at the end;
micro guests (micro-memtouch) on this host's /dev/kvm.

What it measures (medians; a ratio is within one run):
- cross_host_cold_vs_warm: a branch that slept on h1 wakes, time to
  useful work (wake request -> the guest's answer to `sum 64` on its
  console): on h1, whose chunk cache the sleep filled (warm), against on
  h2 with its cache emptied first (cold: chunks and the working-set pack
  come from Garage). The same branch both times (slept again between, a
  few pages apart).
- placement_ms_p50_3 / _100: GET /v1/branches/NAME/placement's
  decision_ms (read every host row, check the snapshot's compatibility
  manifest against each offer, score): 3 real hosts, then 97 more
  simulated rows (copies of h1's, inserted with psql).
- move_pause_ms: `tine move` h1 -> h2 of a vm with 64 MiB written: from
  the start of its sleep until it runs on h2, after a pre-copy round (its
  memory stored while it ran, fetched by h2; the sleep then stores only
  what it wrote since). move_pause_stop_ms: the same without the round
  (sleep, then wake), interleaved with it.
- pg_vs_sqlite_sleep / _wake: the same sleep and warm wake on a tined
  whose metadata is its own SQLite file (same Garage, another prefix)
  against h1 on PostgreSQL.
"""

import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.path.join(ROOT, "target", "release")
QUICK = "--quick" in sys.argv
N = 5 if QUICK else 11
MIB = 64


class Unix(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("tined", timeout=600)
        self.path = path

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(600)
        s.connect(self.path)
        self.sock = s


class Host:
    def __init__(self, hid, home, env):
        self.id = hid
        self.home = home
        self.sock = os.path.join(home, "tined.sock")
        log = open(os.path.join(home, "tined.log"), "ab")
        e = dict(os.environ)
        e.update(env)
        e["TINE_HOME"] = home
        self.proc = subprocess.Popen(
            [os.path.join(BIN, "tined"), "--home", home],
            env=e, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if self.call("GET", "/v1/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise SystemExit(f"tined {hid} did not start (see {home}/tined.log)")

    def call(self, method, path, body=None, tries=3):
        try:
            return self._call(method, path, body)
        except (BrokenPipeError, ConnectionResetError) as e:
            if method != "GET" or tries <= 1:
                raise
            print(f"  ({self.id}: {method} {path}: {e}; again)", file=sys.stderr)
            time.sleep(0.05)
            return self.call(method, path, body, tries - 1)

    def _call(self, method, path, body=None):
        c = Unix(self.sock)
        data = json.dumps(body).encode() if body is not None else None
        try:
            c.request(method, path, body=data, headers={"content-type": "application/json"})
        except BrokenPipeError:
            # A route that takes no body answers without reading it and
            # closes: its answer is there to read all the same.
            pass
        r = c.getresponse()
        raw = r.read()
        c.close()
        try:
            return r.status, json.loads(raw) if raw else None
        except ValueError:
            return r.status, raw.decode(errors="replace")

    def ok(self, method, path, body=None, want=(200, 201, 204)):
        st, v = self.call(method, path, body)
        if st not in want:
            raise SystemExit(f"{self.id}: {method} {path}: {st} {v}")
        return v

    def op(self, path, body):
        v = self.ok("POST", path, body, want=(202,))
        while v["state"] == "running":
            v = self.ok("GET", f"/v1/operations/{v['id']}?wait=60")
        if v["state"] != "succeeded":
            raise SystemExit(f"{self.id}: {path}: {v}")
        return v["result"]

    def console(self, vm):
        c = Unix(self.sock)
        c.request("GET", f"/v1/vms/{vm}/console")
        t = c.getresponse().read().decode(errors="replace")
        c.close()
        return t

    def ask(self, vm, line, reply, limit=60):
        start = len(self.console(vm))
        self.ok("POST", f"/v1/vms/{vm}/console", {"line": line})
        return self.wait(vm, start, reply, limit)

    def wait(self, vm, start, reply, limit=60):
        deadline = time.time() + limit
        while time.time() < deadline:
            # Whole lines only: the last may still be being written.
            for l in self.console(vm)[start:].split("\n")[:-1]:
                if l.startswith(reply):
                    return l
            time.sleep(0.002)
        raise SystemExit(f"{self.id}: {vm} did not answer {reply}")

    def stop(self):
        try:
            for v in self.ok("GET", "/v1/vms"):
                self.call("DELETE", f"/v1/vms/{v['name']}?force=true")
        except SystemExit:
            pass
        self.proc.kill()
        self.proc.wait()


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def servers(d):
    env = {}
    for args in (["pg", d], ["garage", d, "1"]):
        out = subprocess.run([os.path.join(ROOT, "scripts", "servers")] + args,
                             check=True, capture_output=True, text=True).stdout
        for l in out.splitlines():
            k, _, v = l.partition("=")
            env[k] = v
    return env


def memtouch(h, name, seed):
    h.ok("POST", "/v1/vms", {"name": name, "image": "micro-memtouch", "mem_mib": 256, "no_agent": True})
    h.wait(name, 0, "READY")
    return h.ask(name, f"touch {MIB} {seed}", "TOUCHED").split()[-1]


def useful(h, name, body, want):
    """Wake request -> the guest's answer to `sum MIB` (ms)."""
    t0 = time.perf_counter()
    h.op(f"/v1/branches/{name}/wake", body)
    got = h.ask(name, f"sum {MIB}", "SUM").split()[-1]
    ms = (time.perf_counter() - t0) * 1000
    if got != want:
        raise SystemExit(f"{name} woke with checksum {got}, not {want}")
    return ms


def main():
    d = tempfile.mkdtemp(prefix="tine-bench-fleet-")
    hosts = []
    try:
        env = servers(d)
        base = dict(env, TINE_HEARTBEAT_MS="500")
        for i in (1, 2, 3):
            home = os.path.join(d, f"h{i}")
            os.makedirs(home)
            hosts.append(Host(f"h{i}", home, dict(base, TINE_HOST_ID=f"h{i}")))
        h1, h2, _h3 = hosts
        home4 = os.path.join(d, "sq")
        os.makedirs(home4)
        sq_env = {k: v for k, v in env.items() if k != "TINE_META"}
        sq_env["TINE_STORE"] = "s3://tine/sqlite"
        sq = Host("sqlite", home4, dict(sq_env, TINE_HOST_ID="sq"))
        hosts.append(sq)

        warm, cold, cold_lazy, sleep_pg, wake_pg = [], [], [], [], []
        for i in range(N):
            name = f"w{i}"
            want = memtouch(h1, name, 100 + i)
            sleep_pg.append(h1.op(f"/v1/vms/{name}/sleep", {})["total_ms"])
            ms = useful(h1, name, {"host": "h1"}, want)
            warm.append(ms)
            wake_pg.append(ms)
            h1.op(f"/v1/vms/{name}/sleep", {})
            subprocess.run(["rm", "-rf", os.path.join(h2.home, "store", "cache")], check=True)
            cold.append(useful(h2, name, {"host": "h2"}, want))
            h2.op(f"/v1/vms/{name}/sleep", {})
            subprocess.run(["rm", "-rf", os.path.join(h2.home, "store", "cache"),
                            os.path.join(h2.home, "store", "wake")], check=True)
            cold_lazy.append(useful(h2, name, {"host": "h2", "lazy": True}, want))
            h2.ok("DELETE", f"/v1/vms/{name}?force=true")
            print(f"  {name}: warm {warm[-1]:.1f} ms, cold on another host {cold[-1]:.1f} ms, "
                  f"lazy {cold_lazy[-1]:.1f} ms", flush=True)

        sleep_sq, wake_sq = [], []
        for i in range(N):
            name = f"s{i}"
            want = memtouch(sq, name, 100 + i)
            sleep_sq.append(sq.op(f"/v1/vms/{name}/sleep", {})["total_ms"])
            wake_sq.append(useful(sq, name, {}, want))
            sq.ok("DELETE", f"/v1/vms/{name}?force=true")

        memtouch(h1, "p0", 7)
        h1.op("/v1/vms/p0/sleep", {})

        def placement(times):
            xs = [h2.ok("GET", "/v1/branches/p0/placement")["decision_ms"] for _ in range(times)]
            return med(xs)

        p3 = placement(50)
        psql = ["/usr/lib/postgresql/15/bin/psql", env["TINE_META"], "-qAt", "-c",
                "INSERT INTO fleet_hosts SELECT 'sim-' || g, address, 'sim', offer, capacity, started_ms, "
                "heartbeat_ms, lease_ms + 3600000, NULL FROM fleet_hosts, generate_series(1, 97) g WHERE id = 'h1'"]
        subprocess.run(psql, check=True, capture_output=True)
        n = len(h2.ok("GET", "/v1/hosts")["hosts"])
        p100 = placement(50)
        subprocess.run(["/usr/lib/postgresql/15/bin/psql", env["TINE_META"], "-qAt", "-c",
                        "DELETE FROM fleet_hosts WHERE id LIKE 'sim-%'"], check=True, capture_output=True)

        moves, moves_stop, rounds = [], [], []
        for i in range(2 * N):
            name = f"m{i}"
            precopy = i % 2 == 0
            want = memtouch(h1, name, 300 + i)
            r = h1.op(f"/v1/vms/{name}/move", {"to": "h2", "precopy": precopy})
            got = h2.ask(name, f"sum {MIB}", "SUM").split()[-1]
            if got != want:
                raise SystemExit(f"{name} moved with checksum {got}, not {want}")
            if precopy:
                moves.append(r["downtime_ms"])
                rounds.append(r["precopy"]["total_ms"])
            else:
                moves_stop.append(r["downtime_ms"])
            h2.ok("DELETE", f"/v1/vms/{name}?force=true")

        ratio = med(cold) / med(warm)
        print(f"wake -> useful work, {MIB} MiB written, N={N}: warm (h1) {med(warm):.1f} ms, "
              f"cold on another host (h2, cache emptied) {med(cold):.1f} ms: {ratio:.2f}x (target <= 1.2x)")
        print(f"  the same cold, lazy (memory paged in from the store, the pack first): "
              f"{med(cold_lazy):.1f} ms: {med(cold_lazy) / med(warm):.2f}x")
        print(f"placement decision p50: {p3:.3f} ms with 3 hosts, {p100:.3f} ms with {n} hosts")
        print(f"move h1 -> h2 ({MIB} MiB written): downtime p50 {med(moves):.1f} ms after a pre-copy round "
              f"({med(rounds):.1f} ms, the vm running), {med(moves_stop):.1f} ms without one: "
              f"{med(moves_stop) / med(moves):.2f}x")
        print(f"sleep p50: PostgreSQL {med(sleep_pg):.1f} ms, SQLite {med(sleep_sq):.1f} ms; "
              f"warm wake -> useful p50: PostgreSQL {med(wake_pg):.1f} ms, SQLite {med(wake_sq):.1f} ms")
        print(f"cross_host_cold_vs_warm={ratio:.2f} placement_ms_p50_3={p3:.3f} "
              f"placement_ms_p50_100={p100:.3f} cross_host_cold_lazy_vs_warm={med(cold_lazy) / med(warm):.2f} move_pause_ms={med(moves):.1f} "
              f"move_pause_stop_ms={med(moves_stop):.1f} move_precopy_round_ms={med(rounds):.1f} "
              f"pg_vs_sqlite_sleep={med(sleep_pg) / med(sleep_sq):.2f} "
              f"pg_vs_sqlite_wake={med(wake_pg) / med(wake_sq):.2f}")
    except BaseException:
        # The homes (their tined.log) stay for a look.
        keep = d + ".failed"
        subprocess.run(["rm", "-rf", keep], check=False)
        subprocess.run(["cp", "-a", d, keep], check=False)
        print(f"bench/fleet: failed; the homes are kept in {keep}", file=sys.stderr)
        raise
    finally:
        for h in hosts:
            h.stop()
        subprocess.run([os.path.join(ROOT, "scripts", "servers"), "stop", d], check=False)
        subprocess.run(["rm", "-rf", d], check=False)


if __name__ == "__main__":
    main()
