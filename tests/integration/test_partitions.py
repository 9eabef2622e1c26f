"""Network partitions by packet loss (the design report's fault plan), not by SIGSTOP: a
stopped peer's kernel still answers, a dropped packet is silence until timeouts fire.

Runs in a network namespace of its own (tests/integration/in_netns.sh: `unshare -n`, loopback
up), where nftables rules drop the packets of one TCP port:

- `daemon_partitioned_from_control_plane`: mepd A reaches the server through a port that is
  blackholed; A's lease goes degraded, then lost on A's local deadline, its `mep run` child
  is killed before the server-side expiry (and before B's grant is even asked for), daemon
  B takes over after it, and when the partition heals A's late renewal and sync are refused.
- `server_partitioned_from_postgresql`: the server's database port blackholed (17 s, past a
  lease operation's 15 s bound), then 30 % of its packets dropped at random: every request
  ends within its bound with a definite answer or 503 with Retry-After, no acknowledged
  grant is lost, the server recovers.
- `replies_dropped_requests_delivered`: only the server's outgoing segments are dropped;
  a claim retried with the same Idempotency-Key is granted exactly once.
"""
import json
import os
import signal
import subprocess
import threading
import time
import unittest
import urllib.parse
import uuid

import pgfixture
from daemonfixture import DaemonClient, EventStream, Mepd, MepServer, RecordingProxy, clean_env, mepd_bin
from history import History
from mephelpers import mep_bin
from serverfixture import ApiClient, new_key

TTL = 6


def nft(*args):
    subprocess.run(["nft", *args], check=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


class Drop:
    """Drops packets with nftables while it is in effect: `rules` are nft rule bodies for
    the input hook (every packet on loopback passes it)."""

    def __init__(self, *rules):
        self.rules = rules

    def __enter__(self):
        nft("add", "table", "inet", "mep_partition")
        nft("add", "chain", "inet", "mep_partition", "input", "{ type filter hook input priority 0; }")
        for r in self.rules:
            nft("add", "rule", "inet", "mep_partition", "input", *r.split())
        return self

    def __exit__(self, *exc):
        nft("delete", "table", "inet", "mep_partition")


def in_own_netns():
    try:
        with open("/proc/self/ns/net") as f:
            pass
        return os.environ.get("MEP_IN_NETNS") == "1"
    except OSError:
        return False


class PartitionCase(unittest.TestCase):
    def setUp(self):
        if not in_own_netns():
            self.skipTest("run through tests/integration/in_netns.sh (a network namespace of its own)")
        import tempfile
        self.tmp = tempfile.mkdtemp(prefix="mep-part-")
        self.env = clean_env(self.tmp)
        self.data = os.path.join(self.tmp, "data")
        os.makedirs(self.data)
        self.procs = []

    def tearDown(self):
        for p in reversed(self.procs):
            p.stop()
        import shutil
        shutil.rmtree(self.tmp, ignore_errors=True)

    def started(self, p):
        self.procs.append(p)
        return p.start()


class DaemonPartition(PartitionCase):
    def test_daemon_partitioned_from_control_plane(self):
        server = self.started(MepServer(self.tmp, self.env))
        token = server.token("tenant-a")
        proxy = RecordingProxy("127.0.0.1", server.port)
        self.addCleanup(proxy.stop)
        a = self.started(Mepd(self.tmp, self.env, control_plane=proxy.url, token=token, tag="host-a"))
        b = self.started(Mepd(self.tmp, self.env, control_plane=server.url, token=token, tag="host-b"))
        path = os.path.join(self.data, "shared.uai")
        subprocess.run([mep_bin(), "--socket", a.socket_path, "init", path], check=True, env=self.env,
                       stdout=subprocess.PIPE)
        envfile = os.path.join(self.tmp, "child.env")
        pidfile = os.path.join(self.tmp, "child.pid")
        events = EventStream(a.socket_path)
        self.addCleanup(events.close)
        run = subprocess.Popen([mep_bin(), "--socket", a.socket_path, "run", "--ttl", str(TTL), "--grace", "1",
                                "part-agent", path, "--", "sh", "-c", 'env > "$1"; echo $$ > "$2"; exec sleep 120',
                                "sh", envfile, pidfile], env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.addCleanup(lambda: run.poll() is None and run.kill())
        deadline = time.monotonic() + 20
        while not (os.path.exists(pidfile) and os.path.getsize(pidfile)):
            self.assertLess(time.monotonic(), deadline, "the child never started")
            time.sleep(0.05)
        child = int(open(pidfile).read())
        child_env = dict(l.split("=", 1) for l in open(envfile).read().splitlines() if "=" in l)
        token_a = int(child_env["MEP_FENCING_TOKEN"])
        memory = child_env["MEP_MEMORY_INSTANCE_ID"]
        # A second lease on A, held by the daemon alone (no mep run deciding before it).
        watched = os.path.join(self.data, "watched.uai")
        subprocess.run([mep_bin(), "--socket", a.socket_path, "init", watched], check=True, env=self.env,
                       stdout=subprocess.PIPE)
        r = DaemonClient(a.socket_path).attach("watch-agent", watched, ttl_seconds=TTL, bind="none")
        self.assertEqual(r.status, 201, r)
        time.sleep(2.5)  # a renewal or two go through first

        with Drop("tcp dport %d drop" % proxy.port, "tcp sport %d drop" % proxy.port):
            # Taken once the rules are in: a renewal can still go through while nft installs
            # them (four processes, slow on a loaded machine).
            cut = time.monotonic()
            # The daemon's lease: degraded first, then lost on A's own clock.
            self.assertTrue(events.wait_for(lambda e: e["event"] == "degraded" and e["canonical_name"] == "watch-agent",
                                            TTL), "no degraded event")
            self.assertTrue(events.wait_for(lambda e: e["event"] == "lost" and e["canonical_name"] == "watch-agent",
                                            TTL + 2), "no lost event: %r\n%s" % ([e[2] for e in events.events],
                                                                                   a.log_text()))
            self.assertLess(time.monotonic(), cut + TTL)
            while True:
                try:
                    os.kill(child, 0)
                except ProcessLookupError:
                    break
                self.assertLess(time.monotonic(), cut + TTL, "the child outlived the server-side expiry")
                time.sleep(0.02)
            killed_at = time.monotonic()
            self.assertLess(killed_at, cut + TTL)  # the last renewal was at or before `cut`
            self.assertEqual(run.wait(10), 4)
            # Host B takes the name and memory over once the server's lease has expired.
            # Never two live holders: A's command was dead before B's grant was sent.
            cb = b.client()
            while True:
                asked = time.monotonic()
                r = cb.attach("part-agent", path, ttl_seconds=TTL)
                if r.status == 201:
                    break
                self.assertEqual(r.status, 423, r)
                self.assertLess(time.monotonic(), cut + 3 * TTL, "B never got the lease")
                time.sleep(0.2)
            self.assertLess(killed_at, asked)
            self.assertGreater(r.json["fencing_token"], token_a)
        # The partition heals: A's late renewal (its old token, sent by hand as A would) and
        # a sync through A's daemon are refused.
        late = server.request("POST", "/v1/leases/renew", token, {
            "canonical_name": "part-agent", "memory_instance_id": memory, "fencing_token": token_a,
            "owner_client_id": child_env.get("MEP_LEASE_ID", "x")})
        self.assertIn(late.status, (404, 409, 410), late)
        r = DaemonClient(a.socket_path).request("POST", "/v1/sync", {"name": "part-agent"})
        self.assertIn(r.status, (404, 410), r)


class DatabasePartition(PartitionCase):
    def test_server_partitioned_from_postgresql(self):
        try:
            cluster = pgfixture.PgCluster().start()
        except unittest.SkipTest:
            raise
        self.addCleanup(cluster.destroy)
        db = pgfixture.PgDb(admin_url=cluster.url)
        env = dict(self.env)
        server = MepServer(self.tmp, env)
        server.pgdb = db
        server.db = db.url
        self.started(server)
        token = server.token("tenant-a")
        clients = [ApiClient(server.port, token, timeout=30) for _ in range(6)]
        memories = [clients[0].new_memory() for _ in range(3)]
        history = History()
        stop = threading.Event()
        outcomes = []
        lock = threading.Lock()

        def worker(i):
            c = clients[i]
            n = 0
            while not stop.is_set():
                n += 1
                name = "pg-%d-%d" % (i % 3, n % 2)
                memory = memories[i % 3]
                start = history.begin()
                try:
                    r = c.claim(name, memory, "owner-%d" % i, ttl=5, key=new_key())
                except OSError as e:
                    with lock:
                        outcomes.append(("error", time.monotonic() - start, str(e)))
                    continue
                took = time.monotonic() - start
                history.record("claim", start, r.status, owner="owner-%d" % i, name=name, memory=memory,
                               body=r.json if r.status == 201 else None)
                with lock:
                    outcomes.append((r.status, took, r.header("Retry-After")))
                if r.status == 201:
                    start = history.begin()
                    rel = c.release(r.json["canonical_name"], memory, r.json["fencing_token"], "owner-%d" % i)
                    history.record("release", start, rel.status, owner="owner-%d" % i, name=r.json["canonical_name"],
                                   memory=memory, token=r.json["fencing_token"])
                time.sleep(0.02)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(clients))]
        for t in threads:
            t.start()
        time.sleep(2)
        # Longer than a lease operation's 15 s bound: tokens are verified from the server's
        # cache (no round trip), so only an operation that outlives its bound can show the
        # partition; a shorter one is ridden out, late but granted.
        with Drop("tcp dport %d drop" % cluster.port, "tcp sport %d drop" % cluster.port):
            time.sleep(17)
        with Drop("tcp dport %d numgen random mod 100 < 30 drop" % cluster.port,
                  "tcp sport %d numgen random mod 100 < 30 drop" % cluster.port):
            time.sleep(6)
        healed = time.monotonic()
        # On until a claim sent after the heal (2 s on) was granted: the server recovers by
        # itself, sooner or later on a loaded machine (60 s at most; asserted below).
        time.sleep(3)
        while (time.monotonic() < healed + 60 and not any(
                o["kind"] == "claim" and o["status"] == 201 and o["start"] > healed + 2 for o in list(history.ops))):
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(60)
        for c in clients:
            c.close()
        # Every request ended within its bound with a definite answer, or 503 + Retry-After.
        for status, took, extra in outcomes:
            self.assertNotEqual(status, "error", (took, extra))
            self.assertLess(took, 20, (status, took))
            self.assertIn(status, (201, 423, 503), (status, extra))
            if status == 503:
                self.assertIsNotNone(extra, "a 503 without Retry-After")
        self.assertTrue(any(s == 503 for s, _, _ in outcomes), "the partition was never noticed")
        # The server recovered by itself: grants after the heal.
        after = [o for o in history.ops if o["kind"] == "claim" and o["status"] == 201 and o["start"] > healed + 2]
        self.assertTrue(after, "no grant after the partition healed")
        # No acknowledged grant lost: each memory's counter is at least its highest granted token.
        rows = db.query("SELECT memory_id::text, fence_counter FROM memories")
        counters = {r[0]: r[1] for r in rows}
        for o in history.ops:
            if o["kind"] == "claim" and o["status"] == 201:
                self.assertGreaterEqual(counters[o["body"]["memory_instance_id"]], o["body"]["fencing_token"])
        self.assertEqual(history.check(), [])


class DroppedReplies(PartitionCase):
    def test_replies_dropped_requests_delivered(self):
        server = self.started(MepServer(self.tmp, self.env))
        token = server.token("tenant-a")
        c = ApiClient(server.port, token)
        memory = c.new_memory()
        c.close()
        key = new_key()
        body = {"display_name": "once-agent", "memory_instance_id": memory, "owner_client_id": "o1"}
        with Drop("tcp sport %d drop" % server.port):
            lost = ApiClient(server.port, token, timeout=2)
            with self.assertRaises(OSError):
                lost.post("/v1/leases", body, idem=key)  # delivered, its answer dropped
            lost.close()
        grants = []
        for _ in range(3):
            with ApiClient(server.port, token) as again:
                r = again.post("/v1/leases", body, idem=key)
            self.assertIn(r.status, (200, 201), r)
            grants.append(r.json["fencing_token"])
        self.assertEqual(grants, [1, 1, 1])  # granted once; the retries replay it
        with ApiClient(server.port, token) as check:
            m = check.get("/v1/memories/" + memory)
            self.assertEqual(m.json["fencing_token_high_water"], 1)


if __name__ == "__main__":
    unittest.main()


class NonLoopbackMetrics(PartitionCase):
    """Beyond loopback /metrics is for admins (SPEC §6). `mep store --strict` has no token
    file to check against, so it asks the control plane whether the token has the admin
    scope; and it exports its own families only (no mep_db_ready 0 beside the server's)."""

    ADDR = "10.77.0.1"  # on a veth pair of this namespace: a peer that is not loopback

    def test_store_strict_metrics_need_an_admin_token(self):
        import http.client
        import re
        for argv in (["ip", "link", "add", "mep0", "type", "veth", "peer", "name", "mep1"],
                     ["ip", "addr", "add", self.ADDR + "/24", "dev", "mep0"], ["ip", "link", "set", "mep0", "up"],
                     ["ip", "link", "set", "mep1", "up"]):
            subprocess.run(argv, check=True, timeout=30)
        server = self.started(MepServer(self.tmp, self.env))
        lease, admin = server.token("t"), server.token("t", admin=True)
        log = os.path.join(self.tmp, "store.log")
        with open(log, "wb") as err:
            store = subprocess.Popen([mep_bin(), "store", "--listen", self.ADDR + ":0", "--insecure-plaintext",
                                      "--dir", self.data, "--strict", "--control-plane", server.url],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                     start_new_session=True)

        def stop_store():
            store.kill()
            store.wait(timeout=30)
        self.addCleanup(stop_store)
        port = None
        deadline = time.monotonic() + 30
        while port is None and time.monotonic() < deadline:
            with open(log, "rb") as f:
                m = re.search(rb"listening on http://10\.77\.0\.1:(\d+)", f.read())
            if m:
                port = int(m.group(1))
            elif store.poll() is not None:
                self.fail("mep store exited: %s" % open(log).read())
            else:
                time.sleep(0.05)
        self.assertIsNotNone(port, "mep store never listened")

        def get(token):
            conn = http.client.HTTPConnection(self.ADDR, port, timeout=10)
            try:
                conn.request("GET", "/metrics", headers={"Authorization": "Bearer " + token} if token else {})
                r = conn.getresponse()
                return r.status, r.read().decode()
            finally:
                conn.close()
        self.assertEqual(get(None)[0], 401)
        self.assertEqual(get(lease)[0], 403)
        status, text = get(admin)
        self.assertEqual(status, 200, text)
        self.assertIn("mep_store_bytes_written_total", text)
        self.assertIn("mep_fencing_rejections_total", text)
        for family in ("mep_db_ready", "mep_leases_active", "mep_claims_total"):
            self.assertNotIn("\n" + family + " ", "\n" + text)
