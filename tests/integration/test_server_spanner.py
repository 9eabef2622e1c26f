"""mep server on Cloud Spanner (issue 51), on the emulator: what only a shared database shows.

- several servers starting together on an empty database (the schema's DDL raced);
- a database with foreign tables of mep's names is refused and left untouched; one of a
  newer mep is refused;
- two servers on one database: 100 workers race for one name, then for one memory — one
  winner each; claim/release cycles on one memory through both servers give each token once,
  in order; a storm of claims, renewals and releases with kill -9 of one server in the middle
  is checked by the history checker (S1–S4), and the database holds one lease per name,
  skeleton and memory;
- the same with -enable_fault_injection (the emulator aborts commits at random): the retry
  loop keeps every answer right, and the retries are counted;
- the emulator dying under a server: requests end in 503 with Retry-After within their
  bound and /readyz says not ready.

The other control-plane suites run on Spanner too (ctest's *_spanner tests). The emulator is
no performance model: nothing here times Spanner.
"""
import os
import random
import shutil
import signal
import tempfile
import threading
import time
import unittest

import spannerfixture
from history import History, explain
from mephelpers import mep_bin
from serverfixture import ApiClient, MepServer, create_token, db_query, run_mep, unique_name, uuid7
from test_server_pg import metric, start_servers

REQUEST_BOUND_S = 25  # a request's retries are bounded by 10 s, and each call by 10 s


class SpannerCase(unittest.TestCase):
    fault_injection = False

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        spannerfixture.require_emulator()
        cls.emulator_url = None
        if cls.fault_injection:
            cls.emulator = spannerfixture.Emulator(fault_injection=True)
            cls.addClassCleanup(cls.emulator.stop)
            cls.emulator_url = cls.emulator.url

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="mep-spanner-it-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.servers = []
        self.db = spannerfixture.SpannerDb(self.emulator_url)
        self.addCleanup(self.db.drop)
        self.addCleanup(self.stop_servers)

    def stop_servers(self):
        for s in self.servers:
            s.stop()

    def retries(self):
        return sum(metric(s.port, "mep_db_transaction_retries_total") for s in self.servers if s.running())

    def assertConsistent(self, history):
        violations = history.check()
        if violations:
            self.fail("%s\n%s" % (violations, "\n\n".join(explain(history, v) for v in violations[:2])))

    def assertOneLeasePerResource(self):
        for col in ("canonical_name", "skeleton", "memory_id"):
            dup = db_query(self.db, "SELECT %s, COUNT(*) FROM leases GROUP BY %s HAVING COUNT(*) > 1" % (col, col))
            self.assertEqual(dup, [], col)


class TwoServers(SpannerCase):
    """Two `mep server` processes on one database."""

    def race(self, n, claim_args):
        """n workers claim at once, worker i through server i mod 2; their statuses."""
        token = self.token
        barrier = threading.Barrier(n, timeout=60)
        out = [None] * n

        def go(i):
            with ApiClient(self.servers[i % 2].port, token, timeout=REQUEST_BOUND_S) as c:
                args = claim_args(i)
                barrier.wait()
                out[i] = c.claim(*args)
        threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=REQUEST_BOUND_S * 4)
            self.assertFalse(t.is_alive(), "a claim hung")
        return out

    def setUp(self):
        super().setUp()
        self.token = create_token(self.db, "tenant-a")
        self.servers = start_servers(self.dir, self.db, 2)

    def test_race_100_workers_same_name_one_winner(self):
        name = unique_name("race")
        with ApiClient(self.servers[0].port, self.token) as c:
            mems = [c.new_memory() for _ in range(100)]
        out = self.race(100, lambda i: (name, mems[i], "owner-%d" % i))
        statuses = [r.status for r in out]
        self.assertEqual(statuses.count(201), 1, statuses)
        self.assertEqual(statuses.count(423), 99, statuses)
        self.assertOneLeasePerResource()
        print("same name: %d retries of aborted transactions" % self.retries())

    def test_race_100_workers_same_memory_one_winner(self):
        with ApiClient(self.servers[0].port, self.token) as c:
            mem = c.new_memory()
        out = self.race(100, lambda i: (unique_name("mem%d" % i), mem, "owner-%d" % i))
        statuses = [r.status for r in out]
        self.assertEqual(statuses.count(201), 1, statuses)
        self.assertEqual({r.json["code"] for r in out if r.status != 201}, {"memory-attached"})
        self.assertOneLeasePerResource()

    def test_cycles_on_one_memory_give_each_token_once_in_order(self):
        with ApiClient(self.servers[0].port, self.token) as c:
            mem = c.new_memory()
        grants, lock = [], threading.Lock()
        stop = threading.Event()

        def worker(i):
            with ApiClient(self.servers[i % 2].port, self.token, timeout=REQUEST_BOUND_S) as c:
                while not stop.is_set():
                    owner, name = "owner-%d" % i, "cycle-%d" % i
                    r = c.claim(name, mem, owner, ttl=30)
                    if r.status != 201:
                        self.assertIn(r.status, (423, 503), r.json)
                        time.sleep(random.uniform(0, 0.01))
                        continue
                    with lock:
                        grants.append((time.monotonic(), r.json["fencing_token"]))
                    self.assertEqual(c.release(r.json["canonical_name"], mem, r.json["fencing_token"], owner).status,
                                     204)
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        # 6 s of cycles, and on until more than 10 (a loaded machine's emulator is slow).
        time.sleep(6)
        deadline = time.monotonic() + 60
        while len(grants) <= 10 and time.monotonic() < deadline:
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        tokens = [t for _, t in sorted(grants)]
        self.assertGreater(len(tokens), 10)
        self.assertEqual(sorted(tokens), list(range(1, len(tokens) + 1)), "each token once")
        self.assertEqual(tokens, sorted(tokens), "in the order granted")
        print("%d cycles through 2 servers, tokens 1..%d, %d retries" % (len(tokens), len(tokens), self.retries()))

    def test_kill9_of_a_server_mid_storm_keeps_the_history_consistent(self):
        with ApiClient(self.servers[0].port, self.token) as c:
            mems = [c.new_memory() for _ in range(5)]
        names = ["alpha", "bravo", "charlie", "delta"]
        names = [n + "-" + uuid7()[-6:] for n in names]
        history, stop = History(), threading.Event()
        killed = threading.Event()
        counts = {"granted": 0, "failed": 0}
        lock = threading.Lock()

        def run(i):
            rnd = random.Random(i)
            owner = "owner-%d" % i
            server = self.servers[i % 2]
            with ApiClient(server.port, self.token, timeout=REQUEST_BOUND_S) as c:
                while not stop.is_set():
                    if i % 2 == 0 and killed.is_set():
                        return  # its server is gone
                    name, memory = rnd.choice(names), rnd.choice(mems)
                    t0 = history.begin()
                    try:
                        r = c.claim(name, memory, owner, ttl=5)
                    except OSError:
                        history.record("claim", t0, None, name=name, memory=memory, owner=owner)
                        with lock:
                            counts["failed"] += 1
                        continue
                    history.record("claim", t0, r.status, name=name, memory=memory, owner=owner, body=r.json)
                    if r.status != 201:
                        time.sleep(rnd.uniform(0, 0.02))
                        continue
                    with lock:
                        counts["granted"] += 1
                    tok, cname = r.json["fencing_token"], r.json["canonical_name"]
                    for kind in ("renew", "release"):
                        t0 = history.begin()
                        try:
                            s = (c.renew(cname, memory, tok, owner, ttl=5) if kind == "renew"
                                 else c.release(cname, memory, tok, owner))
                        except OSError:
                            history.record(kind, t0, None, name=cname, memory=memory, owner=owner, token=tok)
                            break
                        history.record(kind, t0, s.status, name=cname, memory=memory, owner=owner, token=tok,
                                       body=s.json)

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(16)]
        for t in threads:
            t.start()
        time.sleep(3)
        self.servers[0].kill()  # SIGKILL mid-claims
        killed.set()
        # 5 s more, and on until more than 10 grants (a loaded machine's emulator is slow).
        time.sleep(5)
        deadline = time.monotonic() + 60
        while counts["granted"] <= 10 and time.monotonic() < deadline:
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(timeout=60)
            self.assertFalse(t.is_alive(), "a client hung")
        self.assertConsistent(history)
        self.assertOneLeasePerResource()
        self.assertGreater(counts["granted"], 10)
        print("%d operations, %d grants, %d cut off by the kill" %
              (len(history.ops), counts["granted"], counts["failed"]))


class TwoServersFaultInjection(TwoServers):
    """The same on an emulator that aborts commits at random (-enable_fault_injection)."""

    fault_injection = True

    def test_aborted_commits_are_retried(self):
        # The emulator aborts about 5 % of read-write transactions (notes/spanner.md): 40
        # rounds saw none in a CI run (0.95^40 is 13 %). Rounds go on until a retry was
        # counted, 400 at most (0.95^400 is about 1e-9), every answer checked.
        rounds = 0
        with ApiClient(self.servers[0].port, self.token) as c:
            while rounds < 400 and (rounds < 40 or self.retries() == 0):
                rounds += 1
                mem = c.new_memory()
                g = c.claim(unique_name("fi"), mem, "owner")
                self.assertEqual(g.status, 201, g.json)
                self.assertEqual(c.renew(g.json["canonical_name"], mem, 1, "owner").status, 200)
                self.assertEqual(c.release(g.json["canonical_name"], mem, 1, "owner").status, 204)
        retries = self.retries()
        print("fault injection: %d transactions retried after an abort in %d rounds" % (retries, rounds))
        self.assertGreater(retries, 0, "the emulator aborted nothing, or nothing was retried")


class Schema(SpannerCase):
    def test_servers_start_together_on_an_empty_database(self):
        self.servers = start_servers(self.dir, self.db, 3)
        self.assertEqual(db_query(self.db, "SELECT version FROM schema_version"), [(1,)])
        tables = set(self.db.tables())
        self.assertTrue({"leases", "memories", "tenants", "tokens", "idempotency", "audit_events", "waiters",
                         "lease_frees", "schema_version"} <= tables, tables)
        token = create_token(self.db, "t")
        for s in self.servers:
            with s.client(token) as c:
                self.assertEqual(c.get("/readyz").status, 200)
                c.new_memory()

    def test_foreign_tables_are_refused_untouched(self):
        base = self.db.base
        status, op = spannerfixture._call(base, "PATCH", self.db.path + "/ddl", {
            "statements": ["CREATE TABLE leases (id INT64 NOT NULL, what STRING(MAX)) PRIMARY KEY (id)"]})
        self.assertEqual(status, 200, op)
        spannerfixture._wait_operation(base, op)
        before = self.db.tables()
        rc, _, err = run_mep(["server", "--db", self.db.url, "--listen", "127.0.0.1:0"], check=False, timeout=60)
        self.assertEqual(rc, 1, err)
        self.assertIn("leases", err)
        self.assertEqual(self.db.tables(), before)

    def test_a_database_of_a_newer_mep_is_refused(self):
        create_token(self.db, "t")  # the schema
        self.db.execute("INSERT INTO schema_version (version) VALUES (99)")
        rc, _, err = run_mep(["server", "--db", self.db.url, "--listen", "127.0.0.1:0"], check=False, timeout=60)
        self.assertEqual(rc, 1, err)
        self.assertIn("newer", err)

    def test_a_missing_database_is_said_plainly(self):
        url = self.db.url.replace(self.db.name, "nosuchdb")
        rc, _, err = run_mep(["token", "create", "--db", url, "--tenant", "t"], check=False, timeout=60)
        self.assertNotEqual(rc, 0)
        self.assertIn("does not exist", err)
        self.assertEqual(len(err.strip().splitlines()), 1, err)


class EmulatorDies(unittest.TestCase):
    """A server whose database goes away answers 503 with Retry-After in bounded time."""

    def test_requests_end_in_503_and_readyz_says_not_ready(self):
        spannerfixture.require_emulator()
        emu = spannerfixture.Emulator()
        self.addCleanup(emu.stop)
        db = spannerfixture.SpannerDb(emu.url)
        tmp = tempfile.mkdtemp(prefix="mep-spanner-die-")
        self.addCleanup(shutil.rmtree, tmp, True)
        token = create_token(db, "t")
        server = MepServer(tmp, db).start()
        self.addCleanup(server.stop)
        with server.client(token) as c:
            mem = c.new_memory()
            emu.stop()
            t0 = time.monotonic()
            r = c.claim(unique_name(), mem, "owner")
            took = time.monotonic() - t0
            self.assertEqual(r.status, 503, r.json)
            self.assertIsNotNone(r.header("Retry-After"))
            self.assertLess(took, REQUEST_BOUND_S)
            self.assertEqual(c.get("/readyz").status, 503)


if __name__ == "__main__":
    unittest.main()
