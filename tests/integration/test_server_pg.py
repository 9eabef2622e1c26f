"""mep server on PostgreSQL (SPEC §9, §11): what only a shared database can show.

- several servers starting at once on a fresh database (schema migration races);
- `two_servers_shared_db_race`: two servers on one database, 200 clients split between
  them racing on shared names and memories; the history checker finds no moment with two
  winners (S1–S4), and the database holds at most one lease per name, skeleton and memory;
- `serializable_retries_converge`: under --isolation serializable and heavy contention no
  request ends in 500: claims end 201/200/423 or 503 with Retry-After, and retries happen;
- `db_restart_under_load`: the database stops under load and starts again; requests get
  503 with Retry-After (never a hang), /readyz says not ready, and service resumes without
  restarting mep server;
- `db_frozen_requests_bounded`: every PostgreSQL process is stopped (SIGSTOP), so
  connections stay open and silent; requests still end, in 503 with Retry-After within
  seconds, and service resumes after SIGCONT.
- `sweeps_of_a_large_table_are_spaced_by_their_cost`: a sweep scans the leases table (no
  index on expires_at since v7), so with a million leases the server sweeps 50 times as
  far apart as a sweep takes, not once a second (PostgreSQL's function statistics count).
- `claims_sent_together`: claims queued together go in one transaction (schema v10); each
  is answered as if alone (tokens, a name two want, a key sent twice, a batch that fails
  and is sent one by one), and the metrics show batches of more than one claim.
- `a_second_lane_opens_for_a_full_batch_or_a_long_wait`: claims run on one lane until a
  full batch waits or a claim has waited 100 ms (a re-claim blocked on a row lock holds the
  lane; 5 claims wait for it, then take a second lane; 32 take it at once).
- `claim_paths`: since v9 a claim looks at its name's row alone first; an own lease that
  expired unswept is still taken over (a new grant, audited), not re-claimed; v8's
  signatures still answer (wrappers), and a waiting attempt keeps no refusal.
- `audit_hashes_of_ended_leases`: since schema v7 the server hashes a claim's name and
  memory and the lease row keeps the hashes; the audit rows of a takeover, an expiry found
  by a claim and a sweep carry the right tenant's HMACs, also for rows without stored hashes
  (granted before v7) and through the claim function's v6 signature (a server of an earlier
  version during a rolling upgrade).

The other control-plane suites run on PostgreSQL too (ctest's *_pg tests).
"""
import hashlib
import hmac
import json
import os
import random
import re
import signal
import socket
import subprocess
import shutil
import tempfile
import threading
import time
import unittest

import pgfixture
from history import History, explain
from mephelpers import mep_bin
from serverfixture import (HOST, ApiClient, MepServer, _split_response, create_token, db_query, new_key,
                           unique_name)

REQUEST_BOUND_S = 8  # no request may take longer, also while the database is down


def start_servers(workdir, db, n, extra=()):
    servers = [MepServer(workdir, db, ["--rate-limit", "0", *extra]) for _ in range(n)]
    errors = []

    def go(s):
        try:
            s.start()
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        for s in servers:
            s.stop()
        raise errors[0]
    return servers


def metric(port, name):
    with ApiClient(port) as c:
        r = c.get("/metrics")
    total = 0.0
    for line in r.raw.decode().splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


class PgTestCase(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="mep-pg-it-")
        self.servers = []
        self.db = None

    def tearDown(self):
        for s in self.servers:
            s.stop()
        if self.db is not None:
            self.db.drop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def storm(self, clients, names, seconds, history, statuses, token_for, memories_for, enough=lambda: True):
        """`clients` clients, client i on server i mod n with token_for(i): each claims a
        random name of `names` for a random memory of memories_for(i) with a short TTL, then
        renews and/or releases what it got; every answer is recorded. For `seconds`, then on
        until enough() (a loaded machine's storm sends less in the same time), 60 s more at most."""
        stop = threading.Event()

        def run(i):
            rnd = random.Random(i)
            port = self.servers[i % len(self.servers)].port
            owner = "owner-%d" % i
            memories = memories_for(i)
            with ApiClient(port, token_for(i), timeout=REQUEST_BOUND_S) as c:
                while not stop.is_set():
                    name, memory = rnd.choice(names), rnd.choice(memories)
                    t0 = history.begin()
                    r = c.claim(name, memory, owner, ttl=5)
                    history.record("claim", t0, r.status, name=name, memory=memory, owner=owner, body=r.json)
                    statuses.append(("claim", r.status, r.header("Retry-After")))
                    if r.status != 201:
                        time.sleep(rnd.uniform(0, 0.02))
                        continue
                    token, cname = r.json["fencing_token"], r.json["canonical_name"]
                    if rnd.random() < 0.5:
                        t0 = history.begin()
                        s = c.renew(cname, memory, token, owner, ttl=5)
                        history.record("renew", t0, s.status, name=cname, memory=memory, owner=owner, token=token,
                                       body=s.json)
                        statuses.append(("renew", s.status, s.header("Retry-After")))
                    t0 = history.begin()
                    s = c.release(cname, memory, token, owner)
                    history.record("release", t0, s.status, name=cname, memory=memory, owner=owner, token=token,
                                   body=s.json)
                    statuses.append(("release", s.status, s.header("Retry-After")))

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(clients)]
        for t in threads:
            t.start()
        time.sleep(seconds)
        deadline = time.monotonic() + 60
        while not enough() and time.monotonic() < deadline:
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(timeout=120)
            self.assertFalse(t.is_alive(), "a client hung")

    def hold_in_transaction(self, statement, like):
        """A psql session of its own runs BEGIN and `statement` and stays in the transaction,
        holding its locks, until the function returned is called (ROLLBACK). Returns once
        pg_stat_activity shows it waiting there, its query LIKE `like`."""
        session = subprocess.Popen(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", self.db.url],
                                   stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.addCleanup(lambda: (session.kill(), session.wait()))
        session.stdin.write(("BEGIN;\n%s;\n" % statement).encode())
        session.stdin.flush()
        deadline = time.monotonic() + 10
        while db_query(self.db, "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' "
                                "AND query LIKE '%s'" % like) != [(1,)]:
            self.assertLess(time.monotonic(), deadline, "the lock is not held")
            time.sleep(0.02)

        def release():
            session.stdin.write(b"ROLLBACK;\n")
            session.stdin.close()
        return release

    def server_under_a_locked_table(self, memories, extra=(), mode="ACCESS EXCLUSIVE"):
        """One server on a fresh database, 8 leases held there (owner-0 … owner-7) on the first
        of `memories` new memories, then its leases table locked by another session (in
        EXCLUSIVE mode, reads of it go on): (server, token, memories, held grants, unlock)."""
        self.db = pgfixture.PgDb()
        token = create_token(self.db, "tenant-a")
        self.servers = start_servers(self.dir, self.db, 1, extra)
        server = self.servers[0]
        with server.client(token) as c:
            mems = [c.new_memory() for _ in range(memories)]
            held = []
            for i in range(8):
                r = c.claim(unique_name(), mems[i], "owner-%d" % i)
                self.assertEqual(r.status, 201, r.json)
                held.append(r.json)
        unlock = self.hold_in_transaction("LOCK TABLE leases IN %s MODE" % mode, "LOCK TABLE%")
        return server, token, mems, held, unlock

    def private_server(self, tenant):
        """One server on a database in a cluster of this test's own, which it may stop,
        restart or freeze: (cluster, server, token)."""
        cluster = pgfixture.PgCluster().start()
        self.addCleanup(cluster.destroy)
        self.db = pgfixture.PgDb(cluster.url)
        token = create_token(self.db, tenant)
        self.servers = start_servers(self.dir, self.db, 1)
        return cluster, self.servers[0], token

    def assertConsistent(self, history):
        violations = history.check()
        if violations:
            self.fail("%s\n%s" % (violations, "\n\n".join(explain(history, v) for v in violations[:2])))

    def assertOneLeasePerResource(self):
        for col in ("canonical_name", "skeleton", "memory_id"):
            dup = db_query(self.db, "SELECT %s, count(*) FROM leases GROUP BY %s HAVING count(*) > 1" % (col, col))
            self.assertEqual(dup, [], col)


class SharedDatabase(PgTestCase):
    def test_servers_start_together_on_a_fresh_database(self):
        self.db = pgfixture.PgDb()
        self.servers = start_servers(self.dir, self.db, 3)
        version = db_query(self.db, "SELECT version FROM schema_version")
        self.assertEqual(version, [(12,)])
        indexes = {r[0] for r in db_query(self.db, "SELECT indexname FROM pg_indexes WHERE tablename = 'leases'")}
        self.assertTrue({"leases_owner_name", "leases_tenant_name"} <= indexes, indexes)
        self.assertNotIn("leases_owner", indexes)
        token = create_token(self.db, "t")
        for s in self.servers:
            with s.client(token) as c:
                self.assertEqual(c.get("/readyz").status, 200)
                c.new_memory()

    def test_two_servers_shared_db_race(self):
        self.db = pgfixture.PgDb()
        token_a = create_token(self.db, "tenant-a")
        token_b = create_token(self.db, "tenant-b")
        self.servers = start_servers(self.dir, self.db, 2)
        names = ["alpha", "bravo", "charlie", "delta", "echo"]
        with self.servers[0].client(token_a) as c:
            mem_a = [c.new_memory() for _ in range(5)]
        with self.servers[1].client(token_b) as c:
            mem_b = [c.new_memory() for _ in range(3)]
        history, statuses = History(), []
        # 200 clients, alternating between the servers: three in four of tenant A on its five
        # memories, the rest of tenant B on its three; all race for the same five names
        # (names are global across tenants).
        def is_a(i):
            return i % 4 != 0

        def grants():
            return sum(1 for k, s, _ in list(statuses) if k == "claim" and s == 201)

        self.storm(200, names, 8, history, statuses, lambda i: token_a if is_a(i) else token_b,
                   lambda i: mem_a if is_a(i) else mem_b, enough=lambda: grants() > 50)
        self.assertConsistent(history)
        codes = {s for _, s, _ in statuses}
        self.assertTrue(codes <= {201, 204, 200, 409, 410, 423}, codes)
        grants = sum(1 for k, s, _ in statuses if k == "claim" and s == 201)
        self.assertGreater(grants, 50)
        self.assertOneLeasePerResource()
        print("%d operations from 200 clients on 2 servers, %d grants" % (len(statuses), grants))


class Serializable(PgTestCase):
    def test_serializable_retries_converge(self):
        self.db = pgfixture.PgDb()
        token = create_token(self.db, "ser")
        self.servers = start_servers(self.dir, self.db, 2, ["--isolation", "serializable"])
        with self.servers[0].client(token) as c:
            memories = [c.new_memory() for _ in range(2)]
        history, statuses = History(), []
        def enough():
            grants = sum(1 for k, s, _ in list(statuses) if k == "claim" and s == 201)
            return grants > 20 and sum(metric(s.port, "mep_db_transaction_retries_total") for s in self.servers) > 0

        self.storm(48, ["alpha", "bravo"], 8, history, statuses, lambda i: token, lambda i: memories, enough=enough)
        self.assertConsistent(history)
        for kind, status, retry_after in statuses:
            if kind == "claim":
                self.assertIn(status, (201, 200, 423, 503), (kind, status))
            self.assertLess(status, 500 if status != 503 else 504, (kind, status))
            if status == 503:
                self.assertIsNotNone(retry_after, "503 without Retry-After")
        retries = sum(metric(s.port, "mep_db_transaction_retries_total") for s in self.servers)
        grants = sum(1 for k, s, _ in statuses if k == "claim" and s == 201)
        print("%d operations, %d grants, %d transaction retries, %d answered 503" %
              (len(statuses), grants, retries, sum(1 for _, s, _ in statuses if s == 503)))
        self.assertGreater(grants, 20)
        self.assertGreater(retries, 0, "heavy contention under SERIALIZABLE retried nothing")
        self.assertOneLeasePerResource()


class DatabaseRestart(PgTestCase):
    def test_db_restart_under_load(self):
        cluster, server, token = self.private_server("restart")
        with server.client(token) as c:
            memories = [c.new_memory() for _ in range(8)]
        history, statuses = History(), []
        durations = []

        def load():
            self.storm(8, ["n%d" % i for i in range(8)], 14, history, statuses, lambda i: token, lambda i: memories)

        t = threading.Thread(target=load, daemon=True)
        t.start()
        time.sleep(3)
        cluster.stop()
        stopped_at = time.monotonic()
        # While it is down: quick 503s with Retry-After, and /readyz not ready.
        with server.client(token) as c:
            deadline = time.monotonic() + 10
            seen_503 = False
            while time.monotonic() < deadline and not seen_503:
                t0 = time.monotonic()
                r = c.claim(unique_name(), memories[0], "probe")
                durations.append(time.monotonic() - t0)
                if r.status == 503:
                    seen_503 = True
                    self.assertEqual(r.code, "unavailable", r)
                    self.assertIsNotNone(r.header("Retry-After"), r)
            self.assertTrue(seen_503, "no 503 while the database was down")
            ready = c.get("/readyz")
            self.assertEqual(ready.status, 503, ready)
        # Down for 8 s at least: the sweeper fails at most five times (1, 2, 4, 8 s apart), not
        # once a second.
        time.sleep(max(2.0, 8.0 - (time.monotonic() - stopped_at)))
        cluster.start()
        # Service resumes by itself.
        with server.client(token) as c:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and c.get("/readyz").status != 200:
                time.sleep(0.2)
            self.assertEqual(c.get("/readyz").status, 200, "not ready again after the database came back")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                r = c.claim(unique_name("back"), memories[-1], "after")
                if r.status in (201, 423):
                    break
                time.sleep(0.2)
            self.assertIn(r.status, (201, 423), r)
        t.join(timeout=120)
        self.assertFalse(t.is_alive())
        self.assertTrue(server.running(), "mep server exited")
        self.assertLess(max(durations), REQUEST_BOUND_S)
        codes = {s for _, s, _ in statuses}
        self.assertNotIn(500, codes)
        self.assertIn(503, codes)
        for _, status, retry_after in statuses:
            if status == 503:
                self.assertIsNotNone(retry_after)
        self.assertConsistent(history)
        grants_after = sum(1 for op in history.ops if op["kind"] == "claim" and op["status"] == 201)
        print("%d operations, %d grants, %d answered 503 while the database was down" %
              (len(statuses), grants_after, sum(1 for _, s, _ in statuses if s == 503)))
        self.assertOneLeasePerResource()
        # One line per log entry: libpq's text about the lost connection runs over lines
        # ("server closed the connection unexpectedly\n\tThis probably means…").
        continued = [l for l in server.stderr_text().splitlines() if l[:1] in ("\t", " ")]
        self.assertEqual(continued, [], server.stderr_text()[-2000:])
        # The sweeper's failures are not logged once a second while the database is down.
        sweeper = [l for l in server.stderr_text().splitlines() if "sweeper: " in l]
        warned = [l for l in sweeper if "sweeping again" not in l]
        self.assertTrue(warned, "no sweeper failure logged while the database was down")
        self.assertLessEqual(len(warned), 5, "\n".join(warned))
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and "sweeper: sweeping again" not in server.stderr_text():
            time.sleep(0.5)
        self.assertIn("sweeper: sweeping again", server.stderr_text())


def new_claims(memories):
    """{i: a call claiming a new name on memories[i]} (i from 0), for ApiClient calls."""
    return {i: (lambda c, m=m, i=i: c.claim(unique_name(), m, "owner-new-%d" % i)) for i, m in enumerate(memories)}


def renewals_of(held):
    """{100 + i: a call renewing held[i] as owner-i}."""
    return {100 + i: (lambda c, g=g, i=i: c.renew(g["canonical_name"], g["memory_instance_id"], g["fencing_token"],
                                                  "owner-%d" % i)) for i, g in enumerate(held)}


def releases_of(held):
    """{200 + i: a call releasing held[i] as owner-i}."""
    return {200 + i: (lambda c, g=g, i=i: c.release(g["canonical_name"], g["memory_instance_id"], g["fencing_token"],
                                                    "owner-%d" % i)) for i, g in enumerate(held)}


def cluster_pids(cluster):
    """The postmaster and its children (the whole database server)."""
    with open(os.path.join(cluster.dir, "data", "postmaster.pid")) as f:
        postmaster = int(f.readline())
    out = subprocess.run(["pgrep", "-P", str(postmaster)], capture_output=True, text=True).stdout.split()
    return [postmaster] + [int(p) for p in out]


class DatabaseFrozen(PgTestCase):
    def test_db_frozen_requests_bounded(self):
        cluster, server, token = self.private_server("frozen")
        with server.client(token) as c:
            memory = c.new_memory()
            r = c.claim(unique_name(), memory, "before", ttl=300)
            self.assertEqual(r.status, 201, r)
            held = r.json
        pids = cluster_pids(cluster)
        stopped = []

        def thaw():
            for pid in stopped:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass

        self.addCleanup(thaw)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        # Connections stay open; nothing answers. Every request still ends, soon, in a 503.
        with ApiClient(server.port, token, timeout=60) as c:
            for call in (lambda: c.claim(unique_name(), memory, "frozen"),
                         lambda: c.renew(held["canonical_name"], memory, held["fencing_token"], "before"),
                         lambda: c.get("/readyz"),
                         lambda: c.get_lease(held["canonical_name"])):
                t0 = time.monotonic()
                r = call()
                took = time.monotonic() - t0
                self.assertEqual(r.status, 503, r)
                self.assertIsNotNone(r.header("Retry-After"), r)
                self.assertLess(took, 20, "a request waited %.1f s for a frozen database" % took)
        thaw()
        # Service resumes by itself.
        with ApiClient(server.port, token, timeout=60) as c:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and c.get("/readyz").status != 200:
                time.sleep(0.2)
            self.assertEqual(c.get("/readyz").status, 200)
            r = c.renew(held["canonical_name"], memory, held["fencing_token"], "before")
            self.assertEqual(r.status, 200, r)
        self.assertTrue(server.running())

    def test_the_server_stops_at_once_with_the_database_frozen(self):
        # The listener's statement (its heartbeat, every second) waited for the frozen
        # database until its 15 s client-side limit before the server could exit; its socket
        # is now shut down when the store closes.
        cluster, server, token = self.private_server("frozen-exit")
        pids = cluster_pids(cluster)
        self.addCleanup(lambda: [os.kill(p, signal.SIGCONT) for p in pids])
        # The listener in its loop: its first clock reading (one a second) is logged.
        deadline = time.monotonic() + 30
        while "watching the database clock" not in server.stderr_text():
            self.assertLess(time.monotonic(), deadline, server.stderr_text()[-2000:])
            time.sleep(0.05)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(2.5)  # its next heartbeat waits on the frozen database
        t0 = time.monotonic()
        rc = server.stop(timeout=60)
        took = time.monotonic() - t0
        self.assertEqual(rc, 0, server.stderr_text()[-2000:])
        after = server.stderr_text().split("shutting down", 1)[-1]
        self.assertNotIn("cannot listen for releases", after)
        self.assertLess(took, 10, "the server took %.1f s to stop" % took)


class SweepSpacing(PgTestCase):
    def test_sweeps_of_a_large_table_are_spaced_by_their_cost(self):
        # Since v7 `leases` has no index on expires_at (renewals are HOT updates), so each
        # sweep scans the table. With a million live leases a sweep takes a tenth of a
        # second here; one a second would cost the database a tenth of a core per server.
        # The server spaces them by sweep_spacing: k_sweep_cost_ratio (50) times as long as
        # the last one took. PostgreSQL's own function statistics say how many ran and for
        # how long each. Spaced by the last one's cost, the sweeps before the last took
        # 50 × their costs at least, so about 1 + elapsed / (50 × mean) can have started; but
        # one slow sweep (a busy machine) weighs on the mean and not on the time elapsed, so
        # the bound is twice that, plus one: below one sweep a second while a sweep takes
        # 50 ms or more (about 100 ms here).
        self.db = pgfixture.PgDb()
        create_token(self.db, "tenant-a")  # the schema
        self.db.execute('ALTER DATABASE "%s" SET track_functions = \'pl\'' % self.db.name)
        self.db.execute(
            "INSERT INTO leases(lease_id, tenant_id, canonical_name, display_name, skeleton, memory_id, "
            "fencing_token, owner_client_id, ttl_seconds, expires_at, acquired_at) "
            "SELECT 'l' || i, 't', 'n' || i, 'n' || i, 's' || i, 'm' || i, 1, 'o', 60, 9999999999999, 0 "
            "FROM generate_series(1, 1000000) i")
        self.db.execute("VACUUM ANALYZE leases")
        began = time.monotonic()
        self.servers = start_servers(self.dir, self.db, 1)
        time.sleep(12)
        self.servers[0].stop()  # its sessions end and report their statistics
        elapsed = time.monotonic() - began
        rows = []
        for _ in range(50):  # a session's statistics reach the shared ones when it ends
            rows = db_query(self.db, "SELECT calls, total_time FROM pg_stat_user_functions "
                                     "WHERE funcname = 'mep_sweep_r' AND calls > 0")
            if rows:
                break
            time.sleep(0.1)
        self.assertTrue(rows, "the server never swept")
        calls, total_ms = int(rows[0][0]), float(rows[0][1])
        mean_s = total_ms / calls / 1000
        most = 2 + 2 * elapsed / max(1.0, 50 * mean_s)
        print("sweeps: %d in %.1f s, %.0f ms each on average; at most %.1f may start" %
              (calls, elapsed, mean_s * 1000, most))
        self.assertLessEqual(calls, most)


class RenewSignatures(PgTestCase):
    def test_servers_of_an_earlier_version_renew_and_verify_through_the_v1_signatures(self):
        # Schema v8 added the clock's bound to mep_renew, mep_renew_batch and mep_verify; a server of an
        # earlier version, during a rolling upgrade, still calls them without it.
        self.db = pgfixture.PgDb()
        token = create_token(self.db, "tenant-a")
        self.servers = start_servers(self.dir, self.db, 1)
        with self.servers[0].client(token) as c:
            name, mem = unique_name(), c.new_memory()
            got = c.claim(name, mem, "owner-a", ttl=10)
            self.assertEqual(got.status, 201, got)
        tid = db_query(self.db, "SELECT tenant_id FROM tenants")[0][0]
        tok = got.json["fencing_token"]
        before = db_query(self.db, "SELECT expires_at FROM leases WHERE canonical_name = ?", (name,))[0][0]
        one = db_query(self.db, "SELECT mep_renew('%s', '%s', '%s', %d, 'owner-a', 60, 'req-1')::text"
                       % (tid, name, mem, tok))[0][0]
        self.assertIn('"ttl_seconds": 60', one)
        many = db_query(self.db, "SELECT mep_renew_batch('%s', ARRAY['%s'], ARRAY['%s'], ARRAY[%d::bigint], "
                        "ARRAY['owner-a'], ARRAY[60::bigint], 'req-2')::text" % (tid, name, mem, tok))[0][0]
        self.assertIn('"ttl_seconds": 60', many)
        after = db_query(self.db, "SELECT expires_at FROM leases WHERE canonical_name = ?", (name,))[0][0]
        self.assertGreater(after, before + 40000)
        verified = db_query(self.db, "SELECT mep_verify('%s', '%s', %d, 'req-3')::text" % (tid, mem, tok))[0][0]
        self.assertIn('"fencing_token": %d' % tok, verified)


class ClaimPaths(PgTestCase):
    def test_an_own_lease_that_expired_unswept_is_taken_over_and_an_attempt_keeps_no_refusal(self):
        """Since v9 a claim looks first at its name's row alone: the caller's own live
        lease is re-claimed there. An own lease that has expired but is not swept yet is
        not: it is taken over (audited as expired) and the claim is a new grant, with a new
        lease id. v8's signatures stay as wrappers: mep_claim answers as before, and
        mep_claim_attempt (a waiting claim's attempt) keeps no refusal under its key."""
        self.db = pgfixture.PgDb()
        token = create_token(self.db, "tenant-a")
        self.servers = start_servers(self.dir, self.db, 1)
        with self.servers[0].client(token) as c:
            name, mem, other_mem = unique_name(), c.new_memory(), c.new_memory()
            first = c.claim(name, mem, "owner-a", ttl=30)
            self.assertEqual(first.status, 201, first)
            again = c.claim(name, mem, "owner-a", ttl=30)
            self.assertEqual(again.status, 201, again)
            lease_id, tok = first.json["lease_id"], first.json["fencing_token"]
            self.assertEqual((again.json["lease_id"], again.json["fencing_token"]), (lease_id, tok + 1))
        tid, owner, skel = db_query(self.db, "SELECT tenant_id, owner_client_id, skeleton FROM leases "
                                             "WHERE canonical_name = ?", (name,))[0]

        def claim_sql(fn, key, memory, owner_id, lease, tail):
            return ("SELECT %s('%s', '%s', 'fp', 'req', NULL, '%s', '%s', '%s', '%s', '%s', 30, '%s', 'u', 'i', "
                    "NULL, NULL, NULL, 'nh', 'mh'%s)" % (fn, tid, key, name, name, skel, memory, owner_id, lease, tail))

        # In one transaction, so that the sweeper (which skips locked rows) cannot take it first.
        key = new_key()
        self.db.execute("BEGIN; UPDATE leases SET expires_at = 1 WHERE canonical_name = '%s'; %s; COMMIT;"
                        % (name, claim_sql("mep_claim_t", key, mem, owner, "lease-new", ", true")))
        body = json.loads(db_query(self.db, "SELECT body FROM idempotency WHERE idem_key = ?", (key,))[0][0])
        self.assertEqual((body["outcome"], body["lease_id"], body["fencing_token"]), ("granted", "lease-new", tok + 2))
        self.assertEqual(db_query(self.db, "SELECT lease_id, fencing_token FROM leases WHERE canonical_name = ?",
                                  (name,)), [("lease-new", tok + 2)])
        self.assertEqual(db_query(self.db, "SELECT event_type FROM audit_events WHERE fencing_token = ? "
                                           "AND event_type <> 'LEASE_ACQUIRED' ORDER BY event_type", (tok + 1,)),
                         [("LEASE_EXPIRED",), ("LEASE_TAKEOVER",)])
        # The v8 wrappers: a re-claim through mep_claim; another owner's attempt is refused
        # (423) and nothing is kept under its key, so its next attempt runs again.
        got = json.loads(db_query(self.db, claim_sql("mep_claim", new_key(), mem, owner, "unused", "") + "::text")[0][0])
        self.assertEqual((got["status"], got["result"]["outcome"], got["result"]["lease_id"]),
                         (201, "reclaimed", "lease-new"))
        key = new_key()
        got = json.loads(db_query(self.db, claim_sql("mep_claim_attempt", key, other_mem, "owner-b", "lease-b", "")
                                  + "::text")[0][0])
        self.assertEqual((got["status"], got["result"]["code"]), (423, "name-held"))
        self.assertEqual(db_query(self.db, "SELECT count(*) FROM idempotency WHERE idem_key = ?", (key,)), [(0,)])


def pg_counters(server, token):
    """The server's mep_pg_* counters from /metrics, by name."""
    with server.client(token) as c:
        text = c.get("/metrics", token=None).raw.decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("mep_pg_")}


class ClaimBatches(PgTestCase):
    def test_claims_sent_together_are_each_answered_as_if_alone(self):
        """With --db-pool 4 a server runs claims in one lane, so clients claiming at once
        are sent in batches (mep_claim_batch, one transaction): the metrics count batches
        of more than one claim. Each claim still gets its own answer: re-claims their next
        fencing token, two clients that want one name get one grant and one 423, a key sent
        twice at once is granted once and replayed once. A claim with text PostgreSQL
        cannot hold (a NUL in the owner) fails its whole batch, whose claims are then sent
        one by one: that claim answers 400, the others as they would have."""
        self.db = pgfixture.PgDb()
        token = create_token(self.db, "tenant-a")
        self.servers = start_servers(self.dir, self.db, 1, ["--db-pool", "4"])
        server = self.servers[0]
        with server.client(token) as c:
            mems = [c.new_memory() for _ in range(48)]
        rivals = [unique_name() for _ in range(4)]
        dup_key, dup_name = new_key(), unique_name()
        barrier = threading.Barrier(48)
        results, errors = {}, []

        def reclaimer(i):  # 36 of them: a grant, then 9 re-claims of it
            name, got = unique_name(), []
            with server.client(token) as c:
                barrier.wait()
                for _ in range(10):
                    got.append(c.claim(name, mems[i], "owner-%d" % i))
            results[i] = got

        def rival(i):  # 8 of them: two for each of 4 names, on their own memories
            with server.client(token) as c:
                barrier.wait()
                results[i] = [c.claim(rivals[i % 4], mems[i], "owner-%d" % i)]

        def duplicate(i):  # 2 of them: the same key and body
            with server.client(token) as c:
                barrier.wait()
                results[i] = [c.claim(dup_name, mems[44], "owner-dup", key=dup_key)]

        def bad(i):  # 2 of them: a NUL in the owner, three times each
            with server.client(token) as c:
                barrier.wait()
                results[i] = []
                for _ in range(3):
                    results[i].append(c.claim(unique_name(), mems[i], "owner\u0000%d" % i))
                    time.sleep(0.01)

        roles = [reclaimer] * 36 + [rival] * 8 + [duplicate] * 2 + [bad] * 2

        def run(i):
            try:
                roles[i](i)
            except Exception as e:  # reported below
                errors.append((i, e))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(48)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        self.assertEqual(errors, [])
        for i in range(36):
            got = results[i]
            self.assertEqual([r.status for r in got], [201] * 10, [r.json for r in got])
            self.assertEqual([r.json["fencing_token"] for r in got], list(range(1, 11)))
            self.assertEqual({r.json["lease_id"] for r in got}, {got[0].json["lease_id"]})
        for n in range(4):
            pair = sorted(results[i][0].status for i in range(36, 44) if i % 4 == n)
            self.assertEqual(pair, [201, 423], rivals[n])
        dup = [results[i][0] for i in (44, 45)]
        self.assertEqual(sorted(r.status for r in dup), [200, 201], [r.json for r in dup])
        self.assertEqual({r.json["fencing_token"] for r in dup}, {1})
        for i in (46, 47):
            for r in results[i]:
                self.assertEqual(r.status, 400, r.json)
        self.assertEqual(db_query(self.db, "SELECT count(*) FROM leases"), [(36 + 4 + 1,)])
        counters = pg_counters(server, token)
        batches, batched = counters["mep_pg_claim_batches_total"], counters["mep_pg_batched_claims_total"]
        self.assertGreater(batches, 0, counters)
        self.assertGreater(batched, batches, counters)  # more than one claim per batch
        # Whether a NUL claim above shared a batch depends on timing. Until one has (a
        # bounded number of tries), send NUL claims at once with good ones: the batch they
        # share falls back, and each claim still gets the answer it would get alone.
        for _ in range(5):
            if pg_counters(server, token)["mep_pg_claim_batch_fallbacks_total"] > 0:
                break
            with server.client(token) as c:
                fresh = [c.new_memory() for _ in range(16)]
            burst = threading.Barrier(16)
            answers, errors = {}, []

            def claim_at_once(i):
                try:
                    with server.client(token) as c:
                        burst.wait()
                        answers[i] = c.claim(unique_name(), fresh[i], ("owner\u0000%d" if i % 2 else "owner-%d") % i)
                except Exception as e:  # reported below
                    errors.append((i, e))

            threads = [threading.Thread(target=claim_at_once, args=(i,)) for i in range(16)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            self.assertEqual(errors, [])
            for i in range(16):
                self.assertEqual(answers[i].status, 400 if i % 2 else 201, answers[i].json)
        counters = pg_counters(server, token)
        self.assertGreater(counters["mep_pg_claim_batch_fallbacks_total"], 0, counters)


class ClaimLanes(PgTestCase):
    def test_a_second_lane_opens_for_a_full_batch_or_a_long_wait(self):
        """With the default pool (16 connections) claims may run on two lanes, but the
        second opens only while a full batch (32 claims) waits, or when a claim has waited
        100 ms: fewer, larger batches cost the database less per claim, and a call blocked
        in the database holds the claims behind it no longer than that. A re-claim blocked
        on a row lock holds the first lane. 5 claims sent then wait for it, and after 100 ms
        go on the second lane; 32 sent together go there at once, as a full batch (the
        metrics say why each extra lane opened). The blocked re-claim is answered once the
        lock goes."""
        self.db = pgfixture.PgDb()
        token = create_token(self.db, "tenant-a")
        self.servers = start_servers(self.dir, self.db, 1)
        server = self.servers[0]
        with server.client(token) as c:
            mems = [c.new_memory() for _ in range(38)]
            first = c.claim(unique_name(), mems[0], "owner-0")
            self.assertEqual(first.status, 201, first.json)
        blocked_name = first.json["canonical_name"]

        def wait_for(sql, want, what):
            deadline = time.monotonic() + 10
            while db_query(self.db, sql) != [(want,)]:
                self.assertLess(time.monotonic(), deadline, what)
                time.sleep(0.02)

        def extra_lanes(reason):
            return metric(server.port, 'mep_pg_extra_lanes_total{reason="%s"}' % reason)

        # A session of its own holds the lease row (psql reads statements as they come).
        unlock = self.hold_in_transaction("SELECT 1 FROM leases WHERE canonical_name = '%s' FOR UPDATE"
                                          % blocked_name, "%FOR UPDATE%")
        locked_at = time.monotonic()
        results, took, errors = {}, {}, []

        def claim(i, name, barrier=None):
            try:
                with ApiClient(server.port, token, timeout=30) as c:
                    c.get("/healthz")  # connected before the claims go together
                    if barrier:
                        barrier.wait()
                    t0 = time.monotonic()
                    results[i] = c.claim(name, mems[i], "owner-%d" % i)
                    took[i] = time.monotonic() - t0
            except Exception as e:  # reported below
                errors.append((i, e))

        def wave(ids):
            barrier = threading.Barrier(len(ids))
            threads = [threading.Thread(target=claim, args=(i, unique_name(), barrier), daemon=True) for i in ids]
            for t in threads:
                t.start()
            return threads

        def join(threads):
            # A claim waits at most lock_timeout (5 s) for a row lock, then its call fails and
            # the lane is free: these must be answered before, while the first lane is blocked.
            for t in threads:
                t.join(timeout=max(0.0, locked_at + 4.5 - time.monotonic()))
            self.assertEqual(errors, [])

        blocked = threading.Thread(target=claim, args=(0, blocked_name), daemon=True)
        blocked.start()
        wait_for("SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND wait_event_type = 'Lock' "
                 "AND query LIKE 'SELECT mep_claim%'", 1, "the re-claim is not blocked on the lock")
        join(wave(range(1, 6)))
        self.assertEqual(sorted(results), list(range(1, 6)), "claims waited out the blocked lane")
        for i in range(1, 6):
            self.assertEqual(results[i].status, 201, results[i].json)
            self.assertGreater(took[i], 0.05, "claim %d went on a second lane before it waited" % i)
        self.assertGreaterEqual(extra_lanes("waited"), 1)
        self.assertEqual(extra_lanes("full_batch"), 0)
        # The full batch: 32 connections opened beforehand, their requests written in one
        # tight loop (Python threads behind a barrier took more than the 100 ms patience to
        # all send on a loaded machine, and the lane opened as "waited").
        socks = [socket.create_connection((HOST, server.port), timeout=10) for _ in range(32)]
        self.addCleanup(lambda: [s.close() for s in socks])
        requests = []
        for i in range(6, 38):
            body = json.dumps({"display_name": unique_name(), "memory_instance_id": mems[i],
                               "owner_client_id": "owner-%d" % i}).encode()
            requests.append(("POST /v1/leases HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                             "Idempotency-Key: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                             % (token, new_key(), len(body))).encode() + body)
        for s, request in zip(socks, requests):
            s.sendall(request)
        for i, s in zip(range(6, 38), socks):
            buf, body = b"", None
            while body is None and time.monotonic() < locked_at + 4.5:
                part = s.recv(65536)
                self.assertTrue(part, "claim %d: the connection closed unanswered" % i)
                buf += part
                status, _, body = _split_response(buf)
            self.assertIsNotNone(body, "claim %d was not answered while the first lane was blocked" % i)
            self.assertEqual(status, 201, buf[:400])
        self.assertEqual(extra_lanes("full_batch"), 1)
        unlock()
        blocked.join(timeout=30)
        self.assertEqual(errors, [])
        self.assertEqual(results[0].status, 201, results[0].json)
        self.assertEqual(results[0].json["fencing_token"], 2)


class LockedTable(PgTestCase):
    def test_operations_under_a_locked_table_are_refused_within_the_bound(self):
        """A session holds the leases table locked. Each batch of claims or renewals waits
        out lock_timeout (5 s) once and is answered 503 as a whole: it was sent again one
        item at a time, each waiting 5 s more, and the last of 12 claims was answered after
        40 s, against the 15 s mep-server(8) gives a lease operation."""
        server, token, mems, held, unlock = self.server_under_a_locked_table(20)
        results, took, errors = {}, {}, []

        def call(i, barrier, op):
            try:
                with ApiClient(server.port, token, timeout=90) as c:
                    c.get("/healthz")
                    barrier.wait()
                    t0 = time.monotonic()
                    results[i] = op(c)
                    took[i] = time.monotonic() - t0
            except Exception as e:  # reported below
                errors.append((i, e))

        def together(ops):
            barrier = threading.Barrier(len(ops))
            threads = [threading.Thread(target=call, args=(i, barrier, op), daemon=True) for i, op in ops.items()]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)

        for ops in (new_claims(mems[8:20]), renewals_of(held)):
            together(ops)
            self.assertEqual(errors, [])
            for i in ops:
                self.assertEqual(results[i].status, 503, results[i].json)
                self.assertIsNotNone(results[i].header("Retry-After"))
                # A bound on an answer, not a measure of speed: 15 s is the documented limit.
                self.assertLess(took[i], 15, "answered after %.1f s" % took[i])
        unlock()
        with server.client(token) as c:
            r = c.claim(unique_name(), mems[19], "owner-after")
            self.assertEqual(r.status, 201, r.json)


class ShutdownUnderALock(PgTestCase):
    def test_every_request_is_answered_when_the_server_stops_under_a_held_lock(self):
        """SIGTERM while operations wait behind a held lock: after the 5 s drain the server
        stopped its I/O, and the requests still in the database (running, or queued behind
        the running batch) got no answer at all. Now the queued ones are answered 503 (they
        never ran) and the running ones get until the statement timeout: every request has
        its answer, and the server still exits."""
        # One database connection: one batch runs, the rest wait their turn behind it. The
        # lock lets reads through, so /metrics can say when every operation is in the server.
        server, token, mems, held, unlock = self.server_under_a_locked_table(20, ["--db-pool", "1"], "EXCLUSIVE")
        results, errors = {}, []

        def call(i, op, barrier):
            try:
                with ApiClient(server.port, token, timeout=90) as c:
                    c.get("/healthz")  # connected before the server stops listening
                    barrier.wait()
                    results[i] = op(c)
            except Exception as e:  # reported below
                errors.append((i, repr(e)))

        ops = {**new_claims(mems[8:20]), **renewals_of(held), **releases_of(held[:4])}
        barrier = threading.Barrier(len(ops))
        threads = [threading.Thread(target=call, args=(i, op, barrier), daemon=True) for i, op in ops.items()]
        for t in threads:
            t.start()
        # Once they all wait in the server: in the call blocked on the lock, or queued behind it.
        deadline = time.monotonic() + 30

        def in_server():
            got = pg_counters(server, token)
            return got.get("mep_pg_running_operations", 0) + sum(
                got.get('mep_pg_queued_operations{kind="%s"}' % k, 0) for k in ("claim", "renew", "release"))

        while db_query(self.db, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'") == [(0,)] \
                or in_server() != len(ops):
            self.assertLess(time.monotonic(), deadline, ("not every operation waits in the server",
                                                         pg_counters(server, token)))
            time.sleep(0.05)
        rc = server.stop(timeout=60)
        for t in threads:
            t.join(timeout=60)
            self.assertFalse(t.is_alive(), "a request is still waiting after the server stopped")
        self.assertEqual(errors, [], "requests that got no answer: %s\n%s" % (errors, server.stderr_text()[-3000:]))
        self.assertEqual(rc, 0, server.stderr_text()[-3000:])
        self.assertEqual(set(results), set(ops))
        for i, r in results.items():
            self.assertEqual(r.status, 503, (i, r.json))
            self.assertIsNotNone(r.header("Retry-After"), (i, r.json))
        # None of the claims was carried out.
        unlock()
        granted = db_query(self.db, "SELECT count(*) FROM leases WHERE memory_id IN (%s)"
                           % ", ".join("'%s'" % m for m in mems[8:20]))
        self.assertEqual(granted, [(0,)])


class RenewBatches(PgTestCase):
    def test_renewals_sent_together_are_each_answered_as_if_alone(self):
        """With --db-pool 4 a server runs single renewals in one lane, so clients renewing at
        once are sent in batches (mep_renew_many, one transaction). Each renewal still gets
        its own answer: a live lease its new expiry (and TTL), a superseded token 409, a
        released lease 410, another tenant's lease 404, a bad TTL 422, two renewals of one
        lease both 200. A renewal with a NUL fails its whole batch, whose renewals are then
        sent one by one: it answers 400, the others as they would have."""
        self.db = pgfixture.PgDb()
        token, other = create_token(self.db, "tenant-a"), create_token(self.db, "tenant-b")
        self.servers = start_servers(self.dir, self.db, 1, ["--db-pool", "4"])
        server = self.servers[0]
        leases = []  # (name, memory, owner, token)
        with server.client(token) as c:
            for i in range(46):
                name, mem, who = unique_name(), c.new_memory(), "owner-%d" % i
                r = c.claim(name, mem, who)
                self.assertEqual(r.status, 201, r.json)
                leases.append((name, mem, who, 1))
            stale = leases[30]  # re-claimed: token 1 is superseded
            self.assertEqual(c.claim(stale[0], stale[1], stale[2]).status, 201)
            gone = leases[31]
            self.assertEqual(c.release(gone[0], gone[1], 1, gone[2]).status, 204)
        with server.client(other) as c:
            name, mem = unique_name(), c.new_memory()
            self.assertEqual(c.claim(name, mem, "owner-b").status, 201)
            foreign = (name, mem, "owner-b", 1)
        barrier = threading.Barrier(48)
        results, errors = {}, []
        want = {}

        def renewer(i, lease, ttl, expect, rounds=5, tok=token):
            want[i] = expect
            with server.client(tok if lease is not foreign else token) as c:
                barrier.wait()
                results[i] = [c.renew(lease[0], lease[1], lease[3], lease[2], ttl=ttl) for _ in range(rounds)]

        plan = [(i, leases[i], 60 if i % 2 else None, 200) for i in range(30)]
        plan += [(30, stale, None, 409), (31, gone, None, 410), (32, foreign, None, 404),
                 (33, leases[33], 301, 422), (34, leases[34], None, 200), (35, leases[34], 45, 200)]
        plan += [(i, leases[i], None, 200) for i in range(36, 46)]
        bad = [(46, leases[38]), (47, leases[39])]

        def bad_renewer(i, lease):
            want[i] = 400
            with server.client(token) as c:
                barrier.wait()
                results[i] = []
                for _ in range(3):
                    results[i].append(c.renew(lease[0], lease[1], lease[3], lease[2] + "\u0000"))
                    time.sleep(0.01)

        def run(f, *args):
            try:
                f(*args)
            except Exception as e:  # reported below
                errors.append((args[0], e))

        threads = [threading.Thread(target=run, args=(renewer,) + p) for p in plan]
        threads += [threading.Thread(target=run, args=(bad_renewer,) + b) for b in bad]
        self.assertEqual(len(threads), 48)
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        self.assertEqual(errors, [])
        for i, got in results.items():
            self.assertEqual({r.status for r in got}, {want[i]}, (i, [r.json for r in got]))
        codes = {30: "stale-fence", 31: "lease-expired", 32: "lease-not-found", 33: "invalid-ttl"}
        for i, code in codes.items():
            self.assertEqual({r.json.get("code") for r in results[i]}, {code}, i)
        with server.client(token) as c:
            for i in range(30):
                got = c.get_lease(leases[i][0]).json
                self.assertEqual(got["ttl_seconds"], 60 if i % 2 else 30, i)
                self.assertEqual(got["expires_at"], results[i][-1].json["expires_at"], i)
            self.assertEqual(c.get_lease(leases[33][0]).json["ttl_seconds"], 30)
        with server.client(other) as c:
            self.assertEqual(c.get_lease(foreign[0]).json["ttl_seconds"], 30)
        counters = pg_counters(server, token)
        batches, batched = counters["mep_pg_renew_batches_total"], counters["mep_pg_batched_renewals_total"]
        self.assertGreater(batches, 0, counters)
        self.assertGreater(batched, batches, counters)  # more than one renewal per batch
        self.assertGreater(counters["mep_pg_renew_batch_fallbacks_total"], 0, counters)


class ReleaseBatches(PgTestCase):
    CASES = ("live", "stale", "gone", "foreign", "other-owner", "nul")

    def test_releases_sent_together_answer_as_one_by_one(self):
        """With --db-pool 4 a server runs releases in one lane, so clients releasing at once
        are sent in batches (mep_release_many, one transaction). Each kind of release (a live
        lease, a superseded token, a lease already released, another tenant's lease, another
        owner, a NUL in the owner) is done once alone first; the same kinds sent at once must
        answer as those did, and leave the leases as those did."""
        self.db = pgfixture.PgDb()
        token, other = create_token(self.db, "tenant-a"), create_token(self.db, "tenant-b")
        self.servers = start_servers(self.dir, self.db, 1, ["--db-pool", "4"])
        server = self.servers[0]

        def setup(kind):
            """A lease ready for a release of this kind; returns (client token, release args)."""
            with server.client(other if kind == "foreign" else token) as c:
                name, mem, who = unique_name(), c.new_memory(), "owner-" + unique_name()
                self.assertEqual(c.claim(name, mem, who).status, 201)
                if kind == "stale":
                    self.assertEqual(c.claim(name, mem, who).status, 201)  # token 2
                if kind == "gone":
                    self.assertEqual(c.release(name, mem, 1, who).status, 204)
            owner = {"other-owner": "someone-else", "nul": who + "\u0000"}.get(kind, who)
            return (name, mem, 1, owner)

        def outcome(args):
            """What is left of the lease: its fencing token, or None."""
            with server.client(token) as c:
                r = c.get_lease(args[0])
            if r.status == 404:
                with server.client(other) as c:
                    r = c.get_lease(args[0])
            return r.json["fencing_token"] if r.status == 200 else None

        alone = {}
        with server.client(token) as c:
            for kind in self.CASES:
                args = setup(kind)
                r = c.release(*args)
                alone[kind] = (r.status, r.json.get("code") if r.json else None, outcome(args))
        self.assertEqual(alone["live"], (204, None, None))
        self.assertEqual(alone["nul"][0], 400)

        def at_once(plan):
            """Sends the releases of `plan` at once while the release lane is held: a live
            release waits in the database behind a lock on audit_events (which every release
            that ends a lease writes; the reads of /metrics and of the leases go on), and the
            releases are sent only then. Once the server's queue holds every one of them the
            lock goes: they are sent in batches, whatever the machine's speed."""
            blocker = setup("live")
            barrier = threading.Barrier(len(plan) + 1)
            results, errors = {}, []

            def release(i, args):
                try:
                    with server.client(token) as c:
                        c.get("/healthz")  # connected before the lane is held
                        if i >= 0:
                            barrier.wait()
                        r = c.release(*args)
                        results[i] = (r.status, r.json.get("code") if r.json else None)
                except Exception as e:  # reported below
                    errors.append((i, e))

            threads = [threading.Thread(target=release, args=(i, args)) for i, (_, args) in enumerate(plan)]
            for t in threads:
                t.start()
            unlock = self.hold_in_transaction("LOCK TABLE audit_events IN EXCLUSIVE MODE", "LOCK TABLE%")
            first = threading.Thread(target=release, args=(-1, blocker))
            first.start()
            deadline = time.monotonic() + 30
            while db_query(self.db, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'") == [(0,)]:
                self.assertLess(time.monotonic(), deadline, "the first release does not wait for the lock")
                time.sleep(0.02)
            barrier.wait()
            queued = 'mep_pg_queued_operations{kind="release"}'
            while pg_counters(server, token).get(queued) != len(plan):
                self.assertLess(time.monotonic(), deadline, ("the releases are not queued", pg_counters(server, token)))
                time.sleep(0.02)
            unlock()
            for t in threads + [first]:
                t.join(timeout=60)
            self.assertEqual(errors, [])
            self.assertEqual(results[-1] + (outcome(blocker),), alone["live"])
            for i, (kind, args) in enumerate(plan):
                self.assertEqual(results[i] + (outcome(args),), alone[kind], (kind, i))
            return got_counters()

        def got_counters():
            got = pg_counters(server, token)
            self.assertEqual(got['mep_pg_queued_operations{kind="release"}'], 0, got)
            return got

        # Every kind but the NUL, 8 of each at once: batches of more than one release (32 at most).
        got = at_once([(kind, setup(kind)) for kind in self.CASES if kind != "nul" for _ in range(8)])
        self.assertEqual(got["mep_pg_release_batches_total"], 2, got)
        self.assertEqual(got["mep_pg_batched_releases_total"], 40, got)
        self.assertEqual(got["mep_pg_release_batch_fallbacks_total"], 0, got)
        released = db_query(self.db, "SELECT count(*) FROM audit_events WHERE event_type = 'LEASE_RELEASED'")
        # "gone" set-ups and "live" releases, alone and at once, and the lane's first release
        self.assertEqual(released, [(2 * (1 + 8) + 1,)])
        # A NUL among live releases fails its batch, sent again one by one: the same answers.
        got = at_once([(kind, setup(kind)) for kind in ("nul", "live") for _ in range(4)])
        self.assertEqual(got["mep_pg_release_batches_total"], 2, got)
        self.assertEqual(got["mep_pg_release_batch_fallbacks_total"], 1, got)


class ReadOnlyRole(PgTestCase):
    def test_reading_commands_need_no_right_to_create(self):
        """Every open of a current database ran CREATE TABLE IF NOT EXISTS schema_version,
        so a role that may only read (for mep token list and mep server audit) was refused:
        "permission denied for schema public"."""
        self.db = pgfixture.PgDb()
        create_token(self.db, "tenant-a")
        role = "mep_ro_%d" % os.getpid()
        self.db.execute('CREATE ROLE "%s" LOGIN; GRANT SELECT ON ALL TABLES IN SCHEMA public TO "%s"; '
                        'REVOKE CREATE ON SCHEMA public FROM PUBLIC' % (role, role))
        # Cleanups run after tearDown has dropped the database, and its grants with it.
        admin = self.db.admin_url
        self.addCleanup(lambda: pgfixture._psql(admin, 'DROP ROLE IF EXISTS "%s"' % role))
        url = re.sub(r"^postgresql://[^@]*@", "postgresql://%s@" % role, self.db.url)
        self.assertNotEqual(url, self.db.url)
        for args in (["token", "list", "--db", url, "--json"], ["server", "audit", "--db", url, "--json"]):
            p = subprocess.run([mep_bin(), *args], stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
            self.assertEqual(p.returncode, 0, (args, p.stderr))
        listed = json.loads(subprocess.run([mep_bin(), "token", "list", "--db", url, "--json"], capture_output=True,
                                           timeout=60).stdout)
        self.assertEqual(len(listed["tokens"]), 1)
        # And writing still needs the rights to write.
        p = subprocess.run([mep_bin(), "token", "create", "--db", url, "--tenant", "t"], capture_output=True,
                           timeout=60)
        self.assertEqual(p.returncode, 1, p.stderr)


class ForeignTables(PgTestCase):
    def test_a_database_with_someone_elses_leases_table_is_refused_untouched(self):
        # A database that already had a table named as one of mep's (an application's own
        # `leases`) failed with 'column "expires_at" does not exist' and was left with a
        # schema_version table at version 0.
        self.db = pgfixture.PgDb()
        self.db.execute("CREATE TABLE leases (id integer PRIMARY KEY, holder text)")
        for args in (["token", "create", "--tenant", "t"], ["server", "--listen", "127.0.0.1:0"],
                     ["token", "list"], ["server", "audit"]):
            p = subprocess.run([mep_bin(), *args, "--db", self.db.url], stdin=subprocess.DEVNULL,
                               capture_output=True, timeout=60)
            self.assertEqual(p.returncode, 1, (args, p.stderr))
            err = p.stderr.decode()
            self.assertIn("already has tables named as mep's (leases)", err, args)
            self.assertEqual(len(err.strip().splitlines()), 1, (args, err))
        tables = [r[0] for r in self.db.query("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")]
        self.assertEqual(tables, ["leases"])
        # A database that mep's schema_version was left in at 0 (by an older mep) is refused too.
        self.db.execute("CREATE TABLE schema_version (id INTEGER PRIMARY KEY, version INTEGER NOT NULL); "
                        "INSERT INTO schema_version VALUES (1, 0)")
        p = subprocess.run([mep_bin(), "token", "list", "--db", self.db.url], stdin=subprocess.DEVNULL,
                           capture_output=True, timeout=60)
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn(b"already has tables named as mep's (leases)", p.stderr)
        # mep's own database, made by two servers at once, is no one else's.
        fresh = pgfixture.PgDb()
        self.addCleanup(fresh.drop)
        procs = [subprocess.Popen([mep_bin(), "token", "create", "--tenant", "t%d" % i, "--db", fresh.url],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for i in range(4)]
        for proc in procs:
            out, err = proc.communicate(timeout=60)
            self.assertEqual(proc.returncode, 0, err)


class AuditHashes(PgTestCase):
    def test_audit_hashes_of_ended_leases(self):
        self.db = pgfixture.PgDb()
        token_a, token_b = create_token(self.db, "tenant-a"), create_token(self.db, "tenant-b")
        self.servers = start_servers(self.dir, self.db, 1)
        tenants = {name: (tid, salt) for tid, name, salt in
                   db_query(self.db, "SELECT tenant_id, name, audit_salt FROM tenants")}

        def h(tenant, text):
            return hmac.new(tenants[tenant][1].encode(), text.encode(), hashlib.sha256).hexdigest()

        with self.servers[0].client(token_a) as a, self.servers[0].client(token_b) as b:
            held = []  # tenant A's leases: (name, memory)
            for _ in range(4):
                name, mem = unique_name(), a.new_memory()
                self.assertEqual(a.claim(name, mem, "owner-a").status, 201)
                held.append((name, mem))
            mem_b, mem_a2 = b.new_memory(), a.new_memory()
        # Each row keeps its HMACs, which the server computed under tenant A's salt.
        for name, mem in held:
            self.assertEqual(db_query(self.db, "SELECT name_hash, memory_hash FROM leases WHERE canonical_name = ?",
                                      (name,)), [(h("tenant-a", name), h("tenant-a", mem))])
        (n0, m0), (n1, m1), (n2, m2), (n3, m3) = held
        skel = dict(db_query(self.db, "SELECT canonical_name, skeleton FROM leases"))
        tid_a, tid_b = tenants["tenant-a"][0], tenants["tenant-b"][0]
        # In one transaction, so that the sweeper (which skips locked rows) cannot take
        # them first: n0 and n1 expire, n1 as a row written before v7 (no hashes); tenant B
        # claims n0 through the v7 signature with the server's hashes, tenant A claims n1
        # through v6's signature (the database hashes). Then n2 and n3 (no hashes) are swept.
        hb_name, hb_mem = h("tenant-b", n0), h("tenant-b", mem_b)
        self.db.execute(
            "BEGIN; "
            "UPDATE leases SET expires_at = 1 WHERE canonical_name = '%s'; "
            "UPDATE leases SET expires_at = 1, name_hash = NULL, memory_hash = NULL WHERE canonical_name = '%s'; "
            "SELECT mep_claim('%s', '%s', 'fp-b', 'req-b', NULL, '%s', '%s', '%s', '%s', 'owner-b', 30, 'lease-b', "
            "'u', 'i', NULL, NULL, 'event-b', '%s', '%s'); "
            "SELECT mep_claim('%s', '%s', 'fp-a', 'req-a', NULL, '%s', '%s', '%s', '%s', 'owner-a2', 30, 'lease-a2', "
            "'u', 'i', NULL, NULL); "
            "COMMIT; "
            "BEGIN; "
            "UPDATE leases SET expires_at = 1 WHERE canonical_name = '%s'; "
            "UPDATE leases SET expires_at = 1, name_hash = NULL, memory_hash = NULL WHERE canonical_name = '%s'; "
            "SELECT mep_sweep(NULL::bigint); "
            "COMMIT;" % (n0, n1, tid_b, new_key(), n0, n0, skel[n0], mem_b, hb_name, hb_mem,
                         tid_a, new_key(), n1, n1, skel[n1], mem_a2, n2, n3))
        self.assertEqual(db_query(self.db, "SELECT canonical_name, tenant_id, memory_id, fencing_token, name_hash, "
                                           "memory_hash FROM leases WHERE canonical_name IN (?, ?) ORDER BY lease_id",
                                  (n0, n1)),
                         [(n1, tid_a, mem_a2, 1, h("tenant-a", n1), h("tenant-a", mem_a2)),
                          (n0, tid_b, mem_b, 1, hb_name, hb_mem)])
        self.assertEqual(db_query(self.db, "SELECT count(*) FROM leases WHERE canonical_name IN (?, ?)", (n2, n3)),
                         [(0,)])
        rows = db_query(self.db, "SELECT event_type, tenant_id, redacted_name_hash, redacted_memory_hash, "
                                 "fencing_token FROM audit_events WHERE event_type <> 'AUTH_FAILED'")

        def count(event, tenant, name, mem, token):
            return rows.count((event, tenants[tenant][0], h(tenant, name), h(tenant, mem), token))

        # The expired leases, under their own tenant's salt; the takeovers under the
        # claimer's (as the SQLite backend writes them); the grants.
        for name, mem in held:
            self.assertEqual(count("LEASE_EXPIRED", "tenant-a", name, mem, 1), 1, (name, rows))
        self.assertEqual(count("LEASE_TAKEOVER", "tenant-b", n0, m0, 1), 1, rows)
        self.assertEqual(count("LEASE_TAKEOVER", "tenant-a", n1, m1, 1), 1, rows)
        self.assertEqual(count("LEASE_ACQUIRED", "tenant-b", n0, mem_b, 1), 1, rows)
        self.assertEqual(count("LEASE_ACQUIRED", "tenant-a", n1, mem_a2, 1), 1, rows)
        self.assertIn("event-b", [r[0] for r in db_query(self.db, "SELECT event_id FROM audit_events")])


if __name__ == "__main__":
    unittest.main()
