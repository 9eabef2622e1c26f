#!/usr/bin/env python3
"""A bounded soak of the whole system (issue 21): 200 simulated agents, in agent processes,
attach and detach memories through 2 daemons against 2 `mep server` processes sharing one
PostgreSQL database, and write each grant's bytes to `mep store` with its fencing token —
while the soak SIGKILLs agent processes, a daemon and a server (each started again), restarts
the database, and (in a network namespace of its own) drops packets to the database for a
window. Names are shared by every agent of both daemons; each daemon's memories are shared
by its own agents.

At the end it checks:
- the history of grants, releases and writes (history.py): tokens grow in real time per
  memory (S3), no name or memory granted to two holders at once (S1/S2), no write with a
  stale token accepted and the store's final bytes those of the highest accepted token
  (D1–D3);
- every process the soak did not kill is still running;
- sampled RSS and open file descriptors of the servers, daemons and store do not grow
  without bound (last sample against the first after warm-up);
- that the faults happened and work was done through them (grants before and after).

    python3 tests/integration/soak.py [--seconds 600] [--agents 200]

It prints a table of what it did and what it checked; exit status 0 when every check
passed. MEP_BIN and MEPD_BIN name the binaries (scripts/soak.sh and ctest set them); the
packet-loss window needs a network namespace (run it under in_netns.sh; without one the
window is skipped and the table says so). Every process it starts is stopped by PID.
"""
import argparse
import http.client
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pgfixture  # noqa: E402
from daemonfixture import Proc, UnixHTTPConnection, clean_env, mepd_bin  # noqa: E402
from history import History  # noqa: E402
from mephelpers import free_port, mep_bin  # noqa: E402
from storefixture import MepStore, StoreClient, new_store_token  # noqa: E402

TTL_S = 5
NAMES = 24             # shared by both daemons
MEMORIES = 12          # per daemon, shared by its agents
THREADS_PER_AGENT = 25


# ---- one agent process: THREADS_PER_AGENT simulated agents ------------------------------------

def agent_main(socket_path, store_port, store_token, files, names, out_path, stop_path, seed):
    rng0 = random.Random(seed)
    out = open(out_path, "a", buffering=1)
    lock = threading.Lock()
    me = os.getpid()

    def record(op):
        with lock:
            out.write(json.dumps(op) + "\n")

    def worker(i):
        rng = random.Random(rng0.random())
        owner = "agent-%d-%d" % (me, i)
        store = StoreClient(store_port, store_token, timeout=10)
        seq = 0
        while not os.path.exists(stop_path):
            k = rng.randrange(len(files))
            name, path = names[rng.randrange(len(names))], files[k]
            start = time.monotonic()
            status, body = call(socket_path, "/v1/attach", {"name": name, "path": path, "ttl_seconds": TTL_S,
                                                            "bind": "pid"})
            if status in (200, 201) and body:
                # The daemon's answer has no server time: the grant's is its expiry less its TTL.
                body["server_time_ms"] = ms(body["expires_at"]) - body["ttl_seconds"] * 1000
            record({"kind": "claim", "start": start, "end": time.monotonic(), "status": 201 if status in (200, 201)
                    else status, "name": name, "memory": None, "owner": owner, "token": None, "body": body})
            if status not in (200, 201):
                time.sleep(rng.uniform(0.02, 0.2))
                continue
            token, memory, lease_id = body["fencing_token"], body["memory_instance_id"], body["lease_id"]
            seq += 1
            data = ("%s %d token %d" % (owner, seq, token)).encode()
            start = time.monotonic()
            try:
                r = store.put(memory, data, token)
                wstatus, wbody = r.status, (r.json() if r.body else None)
            except (OSError, http.client.HTTPException, ValueError):
                store.close()
                wstatus, wbody = None, None
            record({"kind": "write", "start": start, "end": time.monotonic(), "status": wstatus, "name": name,
                    "memory": memory, "owner": owner, "token": token, "body": wbody, "data": data.hex()})
            time.sleep(rng.uniform(0, 0.2))
            start = time.monotonic()
            # By lease id, as a client must: a name alone may name a lease another agent of
            # this daemon was granted after ours ended.
            status, body = call(socket_path, "/v1/detach", {"name": name, "lease_id": lease_id})
            record({"kind": "release", "start": start, "end": time.monotonic(),
                    "status": 204 if status in (200, 204) else status, "name": name, "memory": memory,
                    "owner": owner, "token": token, "body": body})

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(THREADS_PER_AGENT)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def call(socket_path, path, body):
    """One request to mepd: (status, parsed body), or (None, None) with no answer."""
    conn = UnixHTTPConnection(socket_path, timeout=15)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read()
        try:
            return r.status, json.loads(raw) if raw else None
        except ValueError:
            return r.status, None
    except (OSError, http.client.HTTPException):
        return None, None
    finally:
        conn.close()


def ms(rfc3339):
    from serverfixture import parse_rfc3339_ms
    return parse_rfc3339_ms(rfc3339)


# ---- the soak ----------------------------------------------------------------------------------

def sample(pid):
    """(RSS KiB, open fds) of a live process, or None."""
    try:
        with open("/proc/%d/status" % pid) as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return rss, len(os.listdir("/proc/%d/fd" % pid))
    except (OSError, StopIteration):
        return None


class Soak:
    def __init__(self, seconds, agents, workdir):
        self.seconds = seconds
        self.agent_procs = max(1, agents // THREADS_PER_AGENT)
        self.dir = workdir
        self.env = clean_env(os.path.join(workdir, "home"))
        self.stop_path = os.path.join(workdir, "stop")
        self.did = []       # (time, what)
        self.skipped = []   # what could not run here, and why
        self.killed = set()  # PIDs the soak killed itself
        self.samples = {}   # label -> [(t, rss, fds)] of the current process under that label
        self.cleanup = []

    # -- processes
    def start_server(self, i):
        argv = [mep_bin(), "server", "--db", self.db.url, "--listen", "127.0.0.1:%d" % self.server_ports[i],
                "--rate-limit", "0", "--log-level", os.environ.get("MEP_SOAK_LOG_LEVEL", "info")]
        p = Proc("server%d" % i, argv, self.env, os.path.join(self.dir, "server%d.log" % i), cwd=self.dir)
        p.wait_for_log(r"mep server listening on")
        self.servers[i] = p
        self.samples["server%d" % i] = []

    def start_daemon(self, i):
        tag = "mepd%d" % i
        argv = [mepd_bin(), "--socket", self.sockets[i], "--state-dir", os.path.join(self.dir, tag + "-state"),
                "--control-plane", "http://127.0.0.1:%d" % self.server_ports[i], "--token-file", self.token_file,
                "--store", self.store.url, "--store-token-file", self.store_token_file,
                "--log-level", os.environ.get("MEP_SOAK_LOG_LEVEL", "info")]
        p = Proc(tag, argv, self.env, os.path.join(self.dir, tag + ".log"), cwd=self.dir)
        p.wait_for_log(r"mepd: info: listening on")
        self.daemons[i] = p
        self.samples[tag] = []

    def start_agent(self, j):
        d = j % 2
        out = os.path.join(self.dir, "agent-%d-%d.jsonl" % (j, len(self.agent_outputs)))
        self.agent_outputs.append(out)
        argv = [sys.executable, os.path.abspath(__file__), "--agent", self.sockets[d], str(self.store.port),
                self.store_token, json.dumps(self.files[d]), json.dumps(self.names), out, self.stop_path,
                str(random.random())]
        env = dict(os.environ)
        p = Proc("agent%d" % j, argv, env, os.path.join(self.dir, "agent%d.log" % j), cwd=self.dir)
        self.agents[j] = (p, out)

    def setup(self):
        os.chmod(self.dir, 0o755)
        self.cluster = pgfixture.PgCluster().start()
        self.cleanup.append(self.cluster.destroy)
        self.db = pgfixture.PgDb(self.cluster.url)
        rc = subprocess.run([mep_bin(), "token", "create", "--db", self.db.url, "--tenant", "soak"],
                            capture_output=True, env=self.env, timeout=60)
        assert rc.returncode == 0, rc.stderr
        self.token_file = os.path.join(self.dir, "mepd.token")
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(rc.stdout.decode().strip() + "\n")
        self.store_token, hashes = new_store_token(self.dir)
        self.store_token_file = os.path.join(self.dir, "store.token")
        self.store = MepStore(self.dir, os.path.join(self.dir, "store"), ["--token-file", hashes]).start()
        self.cleanup.append(self.store.stop)
        self.samples["store"] = []
        self.server_ports = [free_port(), free_port()]
        self.servers, self.daemons, self.agents, self.agent_outputs = [None, None], [None, None], {}, []
        self.sockets = [os.path.join(self.dir, "mepd%d-run" % i, "mepd.sock") for i in range(2)]
        for i in range(2):
            self.start_server(i)
            self.start_daemon(i)
        self.names = ["soak-%02d" % n for n in range(NAMES)]
        self.files = []
        for d in range(2):
            fs = []
            for m in range(MEMORIES):
                p = os.path.join(self.dir, "memories%d" % d, "m%02d.uai" % m)
                os.makedirs(os.path.dirname(p), exist_ok=True)
                with open(p, "wb") as f:
                    f.write(b"memory %d of daemon %d\n" % (m, d))
                fs.append(p)
            self.files.append(fs)
        for j in range(self.agent_procs):
            self.start_agent(j)

    def procs(self):
        out = {"store": self.store.proc.pid}
        for i in range(2):
            out["server%d" % i] = self.servers[i].pid
            out["mepd%d" % i] = self.daemons[i].pid
        return out

    def take_samples(self, t):
        for label, pid in self.procs().items():
            s = sample(pid)
            if s:
                self.samples[label].append((t, pid) + s)

    # -- faults
    def fault_agent(self):
        j = random.randrange(self.agent_procs)
        p, out = self.agents[j]
        killed_at = time.monotonic()
        self.killed.add(p.pid)
        p.kill9()
        self.kills.append((out, killed_at))
        self.start_agent(j)
        return "SIGKILL agent process %d (%d simulated agents), started again" % (j, THREADS_PER_AGENT)

    def fault_daemon(self):
        i = random.randrange(2)
        self.killed.add(self.daemons[i].pid)
        self.daemons[i].kill9()
        time.sleep(0.5)
        self.start_daemon(i)
        return "SIGKILL mepd%d, started again 0.5 s later (it re-adopts what it held)" % i

    def fault_server(self):
        i = random.randrange(2)
        self.killed.add(self.servers[i].pid)
        self.servers[i].kill9()
        time.sleep(0.5)
        self.start_server(i)
        return "SIGKILL server%d, started again 0.5 s later on the same port" % i

    def fault_database(self):
        self.cluster.stop()
        time.sleep(1)
        self.cluster.start()
        return "PostgreSQL stopped (fast) and started again after 1 s"

    def fault_packets(self):
        if not os.environ.get("MEP_IN_NETNS"):
            self.skipped.append("packet-loss window: not in a network namespace of our own (run under in_netns.sh)")
            return None
        port = self.cluster.port

        def nft(*args):
            subprocess.run(["nft", *args], check=True, capture_output=True, timeout=10)
        nft("add", "table", "inet", "mep_soak")
        nft("add", "chain", "inet", "mep_soak", "input", "{ type filter hook input priority 0; }")
        nft("add", "rule", "inet", "mep_soak", "input", "tcp", "dport", str(port), "numgen", "random", "mod", "100",
            "<", "40", "drop")
        try:
            time.sleep(4)
        finally:
            nft("delete", "table", "inet", "mep_soak")
        return "40 %% of packets to PostgreSQL (port %d) dropped for 4 s" % port

    # -- the run
    def run(self):
        self.kills = []
        self.exits = []
        faults = [self.fault_agent, self.fault_daemon, self.fault_agent, self.fault_server, self.fault_database,
                  self.fault_agent, self.fault_packets]
        t0 = time.monotonic()
        warmup = min(5.0, self.seconds / 10)
        end = t0 + self.seconds
        # The faults spread over the run, after the warm-up, and none in its last tenth.
        gap = (self.seconds * 0.9 - warmup) / (len(faults) + 1)
        plan = [t0 + warmup + gap * (k + 1) for k in range(len(faults))]
        next_sample = t0 + warmup
        while time.monotonic() < end:
            now = time.monotonic()
            if plan and now >= plan[0]:
                plan.pop(0)
                what = faults.pop(0)()
                if what:
                    self.did.append((time.monotonic() - t0, what))
            if now >= next_sample:
                self.take_samples(now - t0)
                next_sample = now + max(1.0, self.seconds / 40)
            exits = list(self.unexpected_exits())
            if exits:
                for label, p in exits:
                    log = p.log_text() if hasattr(p, "log_text") else p.stderr_text()
                    self.exits.append("%s exited on its own; its log ends: %s" % (label, log[-300:]))
                break
            time.sleep(0.05)
        self.take_samples(time.monotonic() - t0)
        with open(self.stop_path, "w"):
            pass
        for p, _ in self.agents.values():
            try:
                p.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill9()
        self.elapsed = time.monotonic() - t0

    def unexpected_exits(self):
        for i in range(2):
            for label, p in (("server%d" % i, self.servers[i]), ("mepd%d" % i, self.daemons[i])):
                if not p.alive() and p.pid not in self.killed:
                    yield label, p
        if self.store.proc.poll() is not None:
            yield "store", self.store

    # -- the checks
    def history(self):
        h = History()
        for out in self.agent_outputs:
            try:
                with open(out) as f:
                    lines = f.read().splitlines()
            except OSError:
                continue
            ops = []
            for line in lines:
                try:
                    ops.append(json.loads(line))
                except ValueError:
                    pass  # the last line of a killed process
            killed_at = next((k for o, k in self.kills if o == out), None)
            held = {}
            for o in ops:
                if o.get("data"):
                    o["data"] = bytes.fromhex(o["data"])
                if o["kind"] == "claim" and o["status"] == 201:
                    o["body"]["server_time"] = o["body"].pop("server_time_ms")
                    held[(o["owner"], o["name"])] = o
                elif o["kind"] == "release":
                    held.pop((o["owner"], o["name"]), None)
                h.ops.append(o)
            # A killed process's leases are released by its daemon (outcome unknown here).
            if killed_at is not None:
                for g in held.values():
                    h.ops.append({"kind": "release", "start": killed_at, "end": killed_at, "status": None,
                                  "name": g["name"], "memory": g["body"]["memory_instance_id"], "owner": g["owner"],
                                  "token": g["body"]["fencing_token"], "body": {}, "data": None})
        return h

    def final_objects(self, memories):
        c = StoreClient(self.store.port, self.store_token)
        final = {}
        for m in memories:
            g = c.get(m)
            if g.status == 200:
                final[m] = (int(g.header("Fencing-Token")), g.body)
        c.close()
        return final

    def check(self):
        results = []
        h = self.history()
        bad = h.check()
        memories = {o["memory"] for o in h.ops if o["kind"] == "write"}
        bad += h.check_data(self.final_objects(memories))
        results.append(("history S1–S4 (grants, releases)", not any(b.startswith("S") for b in bad),
                        "; ".join(b for b in bad if b.startswith("S"))[:400] or "no violation"))
        results.append(("history D1–D3 (writes, final bytes)", not any(b.startswith("D") for b in bad),
                        "; ".join(b for b in bad if b.startswith("D"))[:400] or "no violation"))
        claims = [o for o in h.ops if o["kind"] == "claim"]
        grants = [o for o in claims if o["status"] == 201]
        writes = [o for o in h.ops if o["kind"] == "write"]
        self.counts = {
            "attaches": len(claims), "granted": len(grants),
            "refused (423/409)": sum(1 for o in claims if o["status"] in (409, 423)),
            "failed (5xx, no answer)": sum(1 for o in claims if o["status"] is None or o["status"] >= 500),
            "writes accepted": sum(1 for o in writes if o["status"] == 200),
            "writes refused stale (409)": sum(1 for o in writes if o["status"] == 409),
            "writes failed (no answer, 5xx)": sum(1 for o in writes if o["status"] is None or o["status"] >= 500),
            "releases": sum(1 for o in h.ops if o["kind"] == "release"),
        }
        last_fault = max((t for t, _ in self.did), default=0)
        late = [g for g in grants if g["start"] - self.t0 > last_fault]
        results.append(("work through the faults", len(grants) > 0 and len(late) > 0,
                        "%d grants, %d after the last fault" % (len(grants), len(late))))
        results.append(("no process exited on its own", not self.exits,
                        "; ".join(self.exits)[:600] or "servers, daemons and store ran to the end"))
        for label, rows in sorted(self.samples.items()):
            # The samples of the process under this label now (a restart begins a new series).
            if not rows:
                continue
            pid = rows[-1][1]
            rows = [r for r in rows if r[1] == pid]
            if len(rows) < 6:
                results.append(("%s: RSS and fds bounded" % label, None,
                                "not judged: %d samples since it was started again" % len(rows)))
                continue
            # The last sample against the most of the first half (warm-up and connections
            # opening are growth to a bound; what goes on growing after it is not).
            half = rows[:len(rows) // 2]
            rss0, fd0 = max(r[2] for r in half), max(r[3] for r in half)
            rss1, fd1 = rows[-1][2], rows[-1][3]
            ok = rss1 <= 1.5 * rss0 + 32 * 1024 and fd1 <= fd0 + 64
            results.append(("%s: RSS and fds bounded" % label, ok,
                            "RSS %.1f → %.1f MiB, fds %d → %d (most of the first half → last; %d samples)"
                            % (rss0 / 1024, rss1 / 1024, fd0, fd1, len(rows))))
        return results

    def stop(self):
        for p, _ in getattr(self, "agents", {}).values():
            p.kill9() if p.alive() else None
        for p in getattr(self, "daemons", []) + getattr(self, "servers", []):
            if p:
                p.stop()
        for fn in reversed(self.cleanup):
            try:
                fn()
            except Exception as e:  # keep stopping the rest
                print("soak: cleanup: %s" % e, file=sys.stderr)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--agent":
        a = sys.argv[2:]
        agent_main(a[0], int(a[1]), a[2], json.loads(a[3]), json.loads(a[4]), a[5], a[6], float(a[7]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=600, help="how long the load runs (default 600)")
    ap.add_argument("--agents", type=int, default=200, help="simulated agents (default 200)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, histories)")
    args = ap.parse_args()
    mep_bin(), mepd_bin()  # skip early (exit 77 below) when they are not named
    workdir = tempfile.mkdtemp(prefix="mep-soak-")
    soak = Soak(args.seconds, args.agents, workdir)
    try:
        soak.setup()
        soak.t0 = time.monotonic()
        soak.run()
        results = soak.check()
    finally:
        soak.stop()
    print("\nmep soak: %.0f s, %d simulated agents in %d processes, 2 daemons, 2 servers, PostgreSQL, mep store"
          % (soak.elapsed, soak.agent_procs * THREADS_PER_AGENT, soak.agent_procs))
    print("\n| at (s) | fault |\n|---:|---|")
    for t, what in soak.did:
        print("| %.1f | %s |" % (t, what))
    for what in soak.skipped:
        print("| — | skipped: %s |" % what)
    print("\n| work | count |\n|---|---:|")
    for k, v in soak.counts.items():
        print("| %s | %d |" % (k, v))
    print("\n| check | result | detail |\n|---|---|---|")
    for what, ok, detail in results:
        print("| %s | %s | %s |" % (what, "—" if ok is None else "pass" if ok else "FAIL", detail))
    failed = [r for r in results if r[1] is False]
    if args.keep or failed:
        print("\nwork directory kept: %s" % workdir)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - the one-line reason, then the status
        import unittest
        if isinstance(e, unittest.SkipTest):
            print("SKIP: %s" % e)
            sys.exit(77)
        raise
