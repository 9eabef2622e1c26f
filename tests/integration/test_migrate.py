"""mep migrate (SPEC §10) against real binaries: collisions, resumption, the gate, the map.
ctest runs it on SQLite and on PostgreSQL (MEP_TEST_BACKEND; a fresh database per test), and
`CrossBackend` runs one input on both and compares the reports.

Every process started here is ended by its PID; every wait is bounded.
"""
import csv
import json
import os
import signal
import sqlite3
import subprocess
import tempfile
import time
import unittest
import urllib.request
import urllib.error

import pgfixture

MEP = os.environ["MEP_BIN"]
MEPD = os.environ.get("MEPD_BIN", os.path.join(os.path.dirname(os.path.dirname(MEP)), "daemon", "mepd"))


def mep(*args, timeout=120, check=True):
    p = subprocess.run([MEP, *args], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"mep {' '.join(args)} -> {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def read_report(path):
    with open(path, encoding="utf-8") as f:
        return {r["legacy_id"]: r for r in map(json.loads, f)}


def db_rows(db, sql):
    """Rows of `sql` on a SQLite path or a pgfixture.PgDb, as tuples."""
    if isinstance(db, pgfixture.PgDb):
        return db.query(sql)
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def report_shape(report, given_ids=()):
    """What two runs of one input must agree on, whatever the random parts: per legacy row,
    the action, the reason, the kept name or the stem of a suffixed one, and the memory id
    when the input gave it, else which rows share one (by the smallest legacy id using it)."""
    first_of = {}
    for lid in sorted(report, key=lambda x: (len(x), x)):
        first_of.setdefault(report[lid]["memory_instance_id"], lid)
    shape = {}
    for lid, r in report.items():
        name = r["canonical_name"]
        if r["action"] != "kept":
            name = name.rsplit("-", 1)[0]
        mid = r["memory_instance_id"]
        shape[lid] = (r["action"], r.get("reason"), name, mid if mid in given_ids else "same as " + first_of[mid])
    return shape


def claim_once_open(server, token, body, within_s):
    """Claims `body` until the migration gate has opened (servers notice within a second),
    for at most `within_s`: the last (status, lease)."""
    deadline = time.monotonic() + within_s
    status, lease = None, None
    while time.monotonic() < deadline:
        status, _, lease = server.request("POST", "/v1/leases", token, body, {"Idempotency-Key": "k2"})
        if status == 201:
            break
        time.sleep(0.2)
    return status, lease


class Server:
    """A real `mep server` on a database, stopped by PID."""

    def __init__(self, url, workdir):
        # In the test's directory, which tearDown removes.
        self.log = open(os.path.join(workdir, "mep-server.log"), "w+b")
        self.proc = subprocess.Popen([MEP, "server", "--db", url, "--listen", "127.0.0.1:0"],
                                     stderr=self.log, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        self.url = None
        while time.monotonic() < deadline and self.url is None:
            with open(self.log.name) as f:
                for line in f:
                    if "listening on http://" in line:
                        self.url = line.split("listening on ")[1].strip()
            time.sleep(0.05)
        if self.url is None:
            self.stop()
            raise AssertionError("mep server did not start:\n" + open(self.log.name).read())

    def request(self, method, path, token, body=None, headers=None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        for k, v in (headers or {}).items():
            req.add_header(k, v)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, dict(r.headers), json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), json.loads(e.read() or b"null")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


class MigrateTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="mep-migrate-")
        self.dir = self.tmp.name
        self.pg = pgfixture.backend() == "postgresql"
        if self.pg:
            self.db = pgfixture.PgDb()
            self.url = self.db.url
        else:
            self.db = os.path.join(self.dir, "control.db")
            self.url = f"sqlite:{self.db}"

    def tearDown(self):
        if self.pg:
            self.db.drop()
        self.tmp.cleanup()

    def snapshot(self):
        """Everything the database holds."""
        if self.pg:
            return self.db.snapshot(ignore_auth_failures=False)
        with open(self.db, "rb") as f:
            raw = f.read()
        con = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True)
        try:
            return raw, list(con.iterdump())
        finally:
            con.close()

    def test_activate_refuses_an_unreachable_or_missing_database_without_creating_anything(self):
        for url in ("postgresql://mep@127.0.0.1:1/nodb", "sqlite:" + os.path.join(self.dir, "missing.db")):
            p = subprocess.run([MEP, "migrate", "activate", "--db", url], capture_output=True, text=True,
                               timeout=60, cwd=self.dir)
            self.assertEqual(p.returncode, 1, (url, p.stdout, p.stderr))
            self.assertEqual(p.stderr.count("\n"), 1, p.stderr)
            self.assertTrue(p.stderr.startswith("mep migrate: "), p.stderr)
        self.assertEqual(os.listdir(self.dir), [], "activate created files")

    def test_migrate_oldest_wins_others_suffixed(self):
        rows = [
            # case and width variants of one name: the oldest keeps it
            {"legacy_id": "1", "display_name": "PayPal", "created_at": "2021-01-01T00:00:00Z", "legacy_memory_ref": "m1"},
            {"legacy_id": "2", "display_name": "paypal", "created_at": "2019-01-01T00:00:00Z", "legacy_memory_ref": "m2"},
            {"legacy_id": "3", "display_name": "ＰＡＹＰＡＬ", "created_at": "2020-01-01T00:00:00Z", "legacy_memory_ref": "m3"},
            # NFC: composed and decomposed é
            {"legacy_id": "4", "display_name": "caf\u00e9", "created_at": "2020-01-01T00:00:00Z", "legacy_memory_ref": "m4"},
            {"legacy_id": "5", "display_name": "cafe\u0301", "created_at": "2018-01-01T00:00:00Z", "legacy_memory_ref": "m5"},
            # confusables: all-Latin "paypa" vs all-Cyrillic "раура" share a skeleton
            {"legacy_id": "6", "display_name": "paypa", "created_at": "2020-05-05T00:00:00Z", "legacy_memory_ref": "m6"},
            {"legacy_id": "7", "display_name": "раура", "created_at": "2016-05-05T00:00:00Z", "legacy_memory_ref": "m7"},
            # a tie on created_at: the smallest legacy id (numerically) wins
            {"legacy_id": "10", "display_name": "TieBot", "created_at": "2020-01-01T00:00:00Z", "legacy_memory_ref": "m10"},
            {"legacy_id": "9", "display_name": "tiebot", "created_at": "2020-01-01T00:00:00Z", "legacy_memory_ref": "m9"},
        ]
        src = os.path.join(self.dir, "legacy.jsonl")
        write_jsonl(src, rows)
        report = os.path.join(self.dir, "report.jsonl")
        mep("migrate", "run", "--db", self.url, "--input", src, "--report", report)
        r = read_report(report)
        self.assertEqual(len(r), len(rows))
        self.assertEqual((r["2"]["action"], r["2"]["canonical_name"]), ("kept", "paypal"))
        for loser in ("1", "3"):
            self.assertEqual(r[loser]["action"], "renamed")
            self.assertRegex(r[loser]["canonical_name"], r"^paypal-[0-9a-f]{8,32}$")
        self.assertEqual((r["5"]["action"], r["5"]["canonical_name"]), ("kept", "caf\u00e9"))
        self.assertEqual(r["4"]["action"], "renamed")
        self.assertEqual((r["7"]["action"], r["7"]["canonical_name"]), ("kept", "раура"))
        self.assertEqual(r["6"]["action"], "renamed")
        self.assertTrue(r["6"]["canonical_name"].startswith("paypa-"))
        self.assertEqual((r["9"]["action"], r["10"]["action"]), ("kept", "renamed"))
        names = [x["canonical_name"] for x in r.values()]
        self.assertEqual(len(names), len(set(names)))
        self.assertTrue(all(len(n) <= 64 for n in names))
        # Every renamed name is itself a valid canonical name.
        out = mep("canonicalize", "--json", *names).stdout.splitlines()
        self.assertTrue(all("error" not in json.loads(line) for line in out))
        # The database agrees with the report; skeletons are unique.
        got = dict(db_rows(self.db, "SELECT legacy_id, canonical_name FROM migration_rows"))
        self.assertEqual(got, {k: v["canonical_name"] for k, v in r.items()})
        sk = [s for (s,) in db_rows(self.db, "SELECT skeleton FROM migration_rows")]
        self.assertEqual(len(sk), len(set(sk)))

    def test_a_losing_name_in_another_script_gets_a_digit_suffix(self):
        # Hex letters are Latin: "раура-1f3a…" would be mixed-script, and the run used to
        # draw suffixes forever. Digits belong to every script.
        rows = [{"legacy_id": str(i), "display_name": name, "created_at": "2020-01-0%dT00:00:00Z" % (1 + i),
                 "legacy_memory_ref": "r%d" % i}
                for i, name in enumerate(["раура", "РАУРА", "Ελλάδα", "ελλάδα", "中文", "中文"])]
        src = os.path.join(self.dir, "legacy.jsonl")
        write_jsonl(src, rows)
        report = os.path.join(self.dir, "report.jsonl")
        mep("migrate", "run", "--db", self.url, "--input", src, "--report", report, timeout=60)
        r = read_report(report)
        self.assertEqual([r[k]["action"] for k in "012345"], ["kept", "renamed"] * 3)
        for k, stem in (("1", "раура"), ("3", "ελλάδα")):
            self.assertRegex(r[k]["canonical_name"], "^" + stem + r"-[0-9]{8,32}$")
        # Han may stand beside Latin (UTS #39's highly restrictive level): hex is fine there.
        self.assertRegex(r["5"]["canonical_name"], r"^中文-[0-9a-f]{8,32}$")

    def test_names_that_cannot_be_canonicalized_are_generated(self):
        rows = [
            {"legacy_id": "1", "display_name": "bad!", "created_at": "2020-01-01T00:00:00Z", "legacy_memory_ref": "a"},
            {"legacy_id": "2", "display_name": "my\u0430gent", "created_at": "2020-01-01T00:00:00Z", "legacy_memory_ref": "b"},
            {"legacy_id": "3", "display_name": "", "created_at": "2020-01-01T00:00:00Z", "legacy_memory_ref": "c"},
            {"legacy_id": "4", "display_name": "x" * 80, "created_at": "2020-01-01T00:00:00Z", "legacy_memory_ref": "d"},
        ]
        src = os.path.join(self.dir, "legacy.jsonl")
        write_jsonl(src, rows)
        report = os.path.join(self.dir, "report.jsonl")
        mep("migrate", "run", "--db", self.url, "--input", src, "--report", report)
        r = read_report(report)
        expect = {"1": "disallowed-character", "2": "mixed-script", "3": "empty", "4": "too-long"}
        for lid, reason in expect.items():
            self.assertEqual(r[lid]["action"], "generated")
            self.assertEqual(r[lid]["reason"], reason)
            self.assertRegex(r[lid]["canonical_name"], r"^agent-[0-9a-f]{32}$")

    def test_csv_input_and_memory_ids_and_identity_map(self):
        src = os.path.join(self.dir, "legacy.csv")
        given = "01890f4e-7a3b-7c2d-8e1f-0a1b2c3d4e5f"
        with open(src, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["legacy_id", "display_name", "created_at", "legacy_memory_ref", "memory_instance_id"])
            w.writerow(["1", "Alpha, Inc", "2020-01-01T00:00:00Z", "ref-a", ""])
            w.writerow(["2", "Beta", "2020-01-01T00:00:00Z", "ref-a", ""])
            w.writerow(["3", "Gamma", "2020-01-01T00:00:00Z", "ref-g", given])
        report = os.path.join(self.dir, "report.jsonl")
        mep("migrate", "run", "--db", self.url, "--input", src, "--report", report)
        r = read_report(report)
        self.assertEqual(r["1"]["action"], "generated")  # the comma is not allowed in a name
        self.assertEqual(r["1"]["memory_instance_id"], r["2"]["memory_instance_id"])  # one id per reference
        self.assertEqual(r["3"]["memory_instance_id"], given)
        m = dict(db_rows(self.db, "SELECT legacy_memory_ref, memory_instance_id FROM migration_identity_map"))
        self.assertEqual(m, {"ref-a": r["1"]["memory_instance_id"], "ref-g": given})
        st = json.loads(mep("--json", "migrate", "status", "--db", self.url).stdout)
        self.assertEqual((st["rows"], st["identity_map_entries"], st["migration_state"]), (3, 2, "in-progress"))

    def test_from_table(self):
        mep("token", "create", "--db", self.url, "--tenant", "default")  # creates the database
        if self.pg:
            # The column types a legacy PostgreSQL table would have: ids as integers, times as
            # timestamptz (read as RFC 3339 in UTC), memory ids as uuid.
            self.db.execute("CREATE TABLE legacy_agents (legacy_id integer, display_name text, created_at timestamptz, "
                            "legacy_memory_ref text, memory_instance_id uuid); "
                            "INSERT INTO legacy_agents VALUES (1, 'Zed', '2020-01-01 00:00:00+00', 'z1', NULL), "
                            "(2, 'zed', '2019-06-01 02:00:00+02', 'z2', '01890f4e-7a3b-7c2d-8e1f-0a1b2c3d4e5f')")
        else:
            con = sqlite3.connect(self.db)
            con.execute("CREATE TABLE legacy_agents (legacy_id INTEGER, display_name TEXT, created_at TEXT, legacy_memory_ref TEXT)")
            con.executemany("INSERT INTO legacy_agents VALUES (?, ?, ?, ?)",
                            # SQLite's own text form (datetime()): UTC without a zone.
                            [(1, "Zed", "2020-01-01T00:00:00Z", "z1"), (2, "zed", "2019-01-01 00:00:00", "z2")])
            con.commit()
            con.close()
        report = os.path.join(self.dir, "report.jsonl")
        mep("migrate", "run", "--db", self.url, "--from-table", "legacy_agents", "--report", report)
        r = read_report(report)
        self.assertEqual((r["2"]["action"], r["1"]["action"]), ("kept", "renamed"))
        if self.pg:
            self.assertEqual(r["2"]["memory_instance_id"], "01890f4e-7a3b-7c2d-8e1f-0a1b2c3d4e5f")
            (created,) = db_rows(self.db, "SELECT legacy_created_at FROM migration_rows WHERE legacy_id = '2'")[0]
            self.assertEqual(created, "2019-06-01T00:00:00.000Z")
        if self.pg:
            self.db.execute("CREATE TABLE bad_agents (legacy_id integer, display_name text, created_at text, "
                            "legacy_memory_ref text); INSERT INTO bad_agents VALUES (7, 'Bad', 'soon', 'b7')")
        else:
            con = sqlite3.connect(self.db)
            con.execute("CREATE TABLE bad_agents (legacy_id INTEGER, display_name TEXT, created_at TEXT, legacy_memory_ref TEXT)")
            con.execute("INSERT INTO bad_agents VALUES (7, 'Bad', 'soon', 'b7')")
            con.commit()
            con.close()
        p = mep("migrate", "plan", "--db", self.url, "--from-table", "bad_agents", check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("table bad_agents, the row with legacy_id '7': created_at is not an RFC 3339 time", p.stderr)
        p = mep("migrate", "run", "--db", self.url, "--from-table", "no_such; DROP TABLE x", check=False)
        self.assertEqual(p.returncode, 2)
        p = mep("migrate", "run", "--db", self.url, "--from-table", "no_such_table", check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("no table named no_such_table", p.stderr)

    def test_dry_run_writes_nothing(self):
        rows = [{"legacy_id": str(i), "display_name": f"agent{i % 5}", "created_at": "2020-01-01T00:00:00Z",
                 "legacy_memory_ref": f"r{i}"} for i in range(50)]
        src = os.path.join(self.dir, "legacy.jsonl")
        write_jsonl(src, rows)
        # On a database that does not exist (PostgreSQL: one without the schema): nothing is created.
        p = mep("migrate", "plan", "--db", self.url, "--input", src)
        if self.pg:
            self.assertEqual(self.db.snapshot(), {})
        else:
            self.assertFalse(os.path.exists(self.db))
        plan = [json.loads(l) for l in p.stdout.splitlines()]
        self.assertEqual(len(plan), 50)
        self.assertEqual(sum(1 for x in plan if x["action"] == "kept"), 5)
        # On an existing database: the file and every table are unchanged. (A read-only
        # SQLite connection may create the empty -wal/-shm companions of a WAL database.)
        mep("token", "create", "--db", self.url, "--tenant", "default")
        before = self.snapshot()
        report = os.path.join(self.dir, "plan.jsonl")
        mep("migrate", "plan", "--db", self.url, "--input", src, "--report", report)
        self.assertEqual(before, self.snapshot())
        self.assertEqual(len(read_report(report)), 50)
        self.assertEqual(db_rows(self.db, "SELECT count(*) FROM migration_rows"), [(0,)])

    def test_second_run_changes_nothing(self):
        rows = [{"legacy_id": str(i), "display_name": f"bot{i % 7}", "created_at": f"20{10 + i % 9}-01-01T00:00:00Z",
                 "legacy_memory_ref": f"r{i}"} for i in range(40)]
        src = os.path.join(self.dir, "legacy.jsonl")
        write_jsonl(src, rows)
        r1 = os.path.join(self.dir, "r1.jsonl")
        r2 = os.path.join(self.dir, "r2.jsonl")
        mep("migrate", "run", "--db", self.url, "--input", src, "--report", r1)
        snap = db_rows(self.db, "SELECT * FROM migration_rows ORDER BY legacy_id")
        mep("migrate", "run", "--db", self.url, "--input", src, "--report", r2)
        self.assertEqual(snap, db_rows(self.db, "SELECT * FROM migration_rows ORDER BY legacy_id"))
        self.assertEqual(read_report(r1), read_report(r2))

    def start_long_run(self, display_name, n=60000, stderr=subprocess.DEVNULL):
        """A `mep migrate run` of `n` rows (names display_name(i)) in batches of 200, long enough
        to be caught halfway; (the input file, the process)."""
        rows = [{"legacy_id": str(i), "display_name": display_name(i), "created_at": "2020-01-01T00:00:00Z",
                 "legacy_memory_ref": f"ref{i}"} for i in range(n)]
        src = os.path.join(self.dir, "legacy.jsonl")
        write_jsonl(src, rows)
        proc = subprocess.Popen([MEP, "migrate", "run", "--db", self.url, "--input", src, "--batch", "200"],
                                stdout=subprocess.DEVNULL, stderr=stderr, text=True)
        return src, proc

    def wait_written(self, proc, at_least, timeout=60):
        """Waits until the run `proc` has written `at_least` rows; False if it ended first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                (count,) = db_rows(self.db, "SELECT count(*) FROM migration_rows")[0]
            except (sqlite3.OperationalError, AssertionError):  # not created yet
                count = 0
            if count >= at_least:
                return True
            time.sleep(0.01)
        return False

    def test_kill9_halfway_then_resume_each_row_once(self):
        n = 60000
        src, proc = self.start_long_run(lambda i: f"worker{i % 50000}", n)
        try:
            caught = self.wait_written(proc, 2000)
            if caught:
                proc.send_signal(signal.SIGKILL)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        if not caught:
            self.skipTest("the run finished before it could be interrupted (machine too fast for this input)")
        (partial,) = db_rows(self.db, "SELECT count(*) FROM migration_rows")[0]
        self.assertLess(partial, n, "the kill came after the run finished")
        print(f"killed with {partial} of {n} rows written; resuming")
        report = os.path.join(self.dir, "report.jsonl")
        mep("migrate", "run", "--db", self.url, "--input", src, "--report", report, timeout=300)
        ids = [i for (i,) in db_rows(self.db, "SELECT legacy_id FROM migration_rows")]
        self.assertEqual(len(ids), n)
        self.assertEqual(set(ids), {str(i) for i in range(n)})
        (distinct,) = db_rows(self.db, "SELECT count(DISTINCT canonical_name) FROM migration_rows")[0]
        self.assertEqual(distinct, n)
        r = read_report(report)
        self.assertEqual(len(r), n)
        self.assertEqual(sum(1 for x in r.values() if x["action"] == "kept"), 50000)

    def test_a_second_run_while_one_is_writing_is_refused_and_writes_nothing(self):
        n = 60000
        err_path = os.path.join(self.dir, "first.err")  # a file, not a pipe: its progress lines never block it
        with open(err_path, "w") as err:
            src, first = self.start_long_run(lambda i: f"agent{i}", n, stderr=err)
        try:
            if not self.wait_written(first, 400):
                self.skipTest("the first run finished before a second could start (machine too fast for this input)")
            # Stopped while it holds the run (perhaps inside a batch's transaction): the second
            # run must be refused at once, not wait for it nor fail on its rows.
            first.send_signal(signal.SIGSTOP)
            try:
                (before,) = db_rows(self.db, "SELECT count(*) FROM migration_rows")[0]
                second = mep("migrate", "run", "--db", self.url, "--input", src, check=False, timeout=60)
                self.assertEqual(second.returncode, 3, second.stderr)
                self.assertIn("another 'mep migrate run' is writing to this database", second.stderr)
                self.assertEqual(second.stderr.count("\n"), 1, second.stderr)
            finally:
                first.send_signal(signal.SIGCONT)
            self.assertEqual(first.wait(timeout=300), 0, open(err_path).read())
        finally:
            if first.poll() is None:
                first.kill()
                first.wait(timeout=10)
        self.assertGreaterEqual(before, 400)
        # The first run wrote every row once; once it has ended, a run is let in again.
        again = json.loads(mep("--json", "migrate", "run", "--db", self.url, "--input", src).stdout)
        self.assertEqual((again["already_migrated"], again["written"]), (n, 0))
        (count,) = db_rows(self.db, "SELECT count(DISTINCT legacy_id) FROM migration_rows")[0]
        self.assertEqual(count, n)

    def test_activation_gate(self):
        token = mep("token", "create", "--db", self.url, "--tenant", "default").stdout.strip()
        src = os.path.join(self.dir, "legacy.jsonl")
        write_jsonl(src, [{"legacy_id": "1", "display_name": "Gated", "created_at": "2020-01-01T00:00:00Z",
                           "legacy_memory_ref": "g"}])
        report = os.path.join(self.dir, "report.jsonl")
        mep("migrate", "run", "--db", self.url, "--input", src, "--report", report)
        memory = read_report(report)["1"]["memory_instance_id"]
        server = Server(self.url, self.dir)
        try:
            body = {"display_name": "Gated", "memory_instance_id": memory, "owner_client_id": "o1"}
            status, headers, problem = server.request("POST", "/v1/leases", token, body, {"Idempotency-Key": "k1"})
            self.assertEqual(status, 503)
            self.assertEqual(problem["code"], "migration-in-progress")
            self.assertIn("Retry-After", headers)
            self.assertEqual(server.request("GET", "/healthz", token)[0], 200)
            mep("migrate", "activate", "--db", self.url)
            status, lease = claim_once_open(server, token, body, 30)
            self.assertEqual(status, 201)
            self.assertEqual(lease["canonical_name"], "gated")
            st = json.loads(mep("--json", "migrate", "status", "--db", self.url).stdout)
            self.assertEqual(st["migration_state"], "active")
        finally:
            server.stop()

    def test_identity_map_reaches_daemon(self):
        token = mep("token", "create", "--db", self.url, "--tenant", "default").stdout.strip()
        legacy_file = os.path.join(self.dir, "old-agent.uai")
        with open(legacy_file, "w") as f:
            f.write("legacy memory bytes\n")
        src = os.path.join(self.dir, "legacy.jsonl")
        write_jsonl(src, [{"legacy_id": "1", "display_name": "Old Agent", "created_at": "2020-01-01T00:00:00Z",
                           "legacy_memory_ref": legacy_file}])
        report = os.path.join(self.dir, "report.jsonl")
        mep("migrate", "run", "--db", self.url, "--input", src, "--report", report)
        mep("migrate", "activate", "--db", self.url)
        memory = read_report(report)["1"]["memory_instance_id"]
        server = Server(self.url, self.dir)
        token_file = os.path.join(self.dir, "token")
        with open(token_file, "w") as f:
            f.write(token + "\n")
        sock = os.path.join(self.dir, "mepd.sock")
        dlog = open(os.path.join(self.dir, "mepd.log"), "w")
        daemon = subprocess.Popen([MEPD, "--socket", sock, "--state-dir", os.path.join(self.dir, "mepd"),
                                   "--control-plane", server.url, "--token-file", token_file],
                                  stdout=subprocess.DEVNULL, stderr=dlog)
        try:
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and not os.path.exists(sock):
                time.sleep(0.05)
            if not os.path.exists(sock):
                with open(dlog.name) as f:
                    self.fail("mepd did not start:\n" + f.read())
            out = json.loads(mep("--json", "--socket", sock, "identify", legacy_file).stdout)
            self.assertEqual(out["memory_instance_id"], memory)
            lease = json.loads(mep("--json", "--socket", sock, "claim", "Old Agent", legacy_file).stdout)
            self.assertEqual(lease["memory_instance_id"], memory)
            with open(dlog.name) as f:
                self.assertNotIn(legacy_file, f.read())
        finally:
            dlog.close()
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(timeout=10)
            server.stop()

    def test_a_name_claimed_through_the_server_is_not_given_to_a_legacy_row(self):
        # "No two live names share a skeleton": a name claimed before the migration keeps
        # it; the legacy rows of that name, or of a confusable one, are renamed.
        token = mep("token", "create", "--db", self.url, "--tenant", "default").stdout.strip()
        server = Server(self.url, self.dir)
        try:
            status, _, memory = server.request("POST", "/v1/memories", token,
                                               {"memory_instance_id": "01a24530-0000-7000-8000-000000000001"},
                                               {"Idempotency-Key": "m1"})
            self.assertIn(status, (200, 201), memory)
            status, _, lease = server.request("POST", "/v1/leases", token,
                                              {"display_name": "Alice", "memory_instance_id": memory["memory_instance_id"],
                                               "owner_client_id": "o1"}, {"Idempotency-Key": "k1"})
            self.assertEqual(status, 201, lease)
        finally:
            server.stop()
        src = os.path.join(self.dir, "legacy.jsonl")
        write_jsonl(src, [{"legacy_id": "23", "display_name": "alice", "created_at": "2001-01-01T00:00:00Z",
                           "legacy_memory_ref": "a"},
                          {"legacy_id": "24", "display_name": "ALICE", "created_at": "2002-01-01T00:00:00Z",
                           "legacy_memory_ref": "b"}])
        report = os.path.join(self.dir, "report.jsonl")
        mep("migrate", "run", "--db", self.url, "--input", src, "--report", report)
        r = read_report(report)
        for lid in ("23", "24"):
            self.assertEqual(r[lid]["action"], "renamed", r[lid])
            self.assertRegex(r[lid]["canonical_name"], r"^alice-[0-9a-f]{8,32}$")
        owners = db_rows(self.db, "SELECT canonical_name FROM agent_names WHERE canonical_name LIKE 'alice%'")
        self.assertEqual(len(owners), 3, owners)

    def test_a_report_that_cannot_be_written_stops_the_run_before_any_write(self):
        src = os.path.join(self.dir, "legacy.jsonl")
        write_jsonl(src, [{"legacy_id": "1", "display_name": "Kept", "created_at": "2020-01-01T00:00:00Z",
                           "legacy_memory_ref": "k"}])
        mep("token", "create", "--db", self.url, "--tenant", "default")  # the database exists
        before = db_rows(self.db, "SELECT count(*) FROM migration_rows")
        p = mep("migrate", "run", "--db", self.url, "--input", src, "--report",
                os.path.join(self.dir, "no-such-dir", "report.jsonl"), check=False)
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn("nothing was migrated", p.stderr)
        self.assertEqual(db_rows(self.db, "SELECT count(*) FROM migration_rows"), before)
        st = json.loads(mep("--json", "migrate", "status", "--db", self.url).stdout)
        self.assertNotEqual(st["migration_state"], "in-progress", st)

    def test_a_quote_left_open_in_a_csv_is_an_error_naming_its_line(self):
        # It swallowed the rows after it into one field, and the run reported fewer rows.
        src = os.path.join(self.dir, "legacy.csv")
        with open(src, "w", encoding="utf-8") as f:
            f.write("legacy_id,display_name,created_at,legacy_memory_ref\n"
                    "1,one,2020-01-01T00:00:00Z,a\n"
                    '2,"two,2020-01-01T00:00:00Z,b\n'
                    "3,three,2020-01-01T00:00:00Z,c\n")
        p = mep("migrate", "run", "--db", self.url, "--input", src, check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("legacy.csv:3: a quoted field is not closed", p.stderr)

    def test_a_row_that_fails_the_checks_stops_the_command_naming_its_line(self):
        # Before, each of these was migrated: a missing field as an empty one (every name
        # "generated" when the export used other field names), a created_at that does not
        # parse as the newest (it lost every collision), the nil UUID as a memory id.
        head = "legacy_id,display_name,created_at,legacy_memory_ref\n"
        ok = '{"legacy_id": "1", "display_name": "one", "created_at": "2020-01-01T00:00:00Z", "legacy_memory_ref": "a"}\n'
        cases = [
            ("fields.jsonl", ok + '{"legacy_id": "2", "name": "two", "created_at": "2020-01-01T00:00:00Z", '
                                  '"legacy_memory_ref": "b"}\n', "fields.jsonl:2: the field display_name is missing"),
            ("time.jsonl", ok + '{"legacy_id": "2", "display_name": "two", "created_at": "yesterday", '
                                '"legacy_memory_ref": "b"}\n', "time.jsonl:2: created_at is not an RFC 3339 time"),
            ("notime.jsonl", ok + '{"legacy_id": "2", "display_name": "two", "created_at": "", '
                                  '"legacy_memory_ref": "b"}\n', "notime.jsonl:2: created_at is missing"),
            ("nil.jsonl", ok + '{"legacy_id": "2", "display_name": "two", "created_at": "2020-01-01T00:00:00Z", '
                               '"legacy_memory_ref": "b", "memory_instance_id": "00000000-0000-0000-0000-000000000000"}\n',
             "nil.jsonl:2: memory_instance_id is the nil UUID"),
            # Blank lines before the first row still count.
            ("blank.jsonl", "\n\n" + ok + ok, "blank.jsonl:4: legacy_id 1 appears twice (first on line 3)"),
            # JSON, but not an object per line: not read as a CSV without the columns.
            ("array.jsonl", '[{"legacy_id": "1"}]\n', "array.jsonl:1: a line of JSON Lines must be a JSON object"),
            ("short.csv", head + "1,one,2020-01-01T00:00:00Z,a\n2,two,2020-01-01T00:00:00Z\n",
             "short.csv:3: 3 fields where the header has 4"),
            ("comma.csv", head + "1,Smith, John,2020-01-01T00:00:00Z,a\n", "comma.csv:2: 5 fields where the header has 4"),
            # A quoted field over two lines: the line numbers after it are still the file's.
            ("multi.csv", head + '1,"two\nlines",2020-01-01T00:00:00Z,a\n2,two,2020-13-01T00:00:00Z,b\n',
             "multi.csv:4: created_at is not an RFC 3339 time"),
        ]
        for name, text, message in cases:
            with self.subTest(name):
                src = os.path.join(self.dir, name)
                with open(src, "w", encoding="utf-8") as f:
                    f.write(text)
                for verb in ("plan", "run"):
                    p = mep("migrate", verb, "--db", self.url, "--input", src, check=False)
                    self.assertEqual(p.returncode, 2, p.stderr)
                    self.assertIn(message, p.stderr)
                    self.assertEqual(p.stdout, "")
                if not self.pg:  # nothing was written: not even a database
                    self.assertFalse(os.path.exists(self.db))
                else:
                    self.assertEqual(self.db.snapshot(), {})

    def test_a_database_a_newer_mep_upgraded_is_refused_by_every_subcommand(self):
        # status, plan and activate opened it anyway (activate wrote into it), where the
        # servers, mep token and migrate run refuse it.
        mep("token", "create", "--db", self.url, "--tenant", "default")
        if self.pg:
            self.db.execute("UPDATE schema_version SET version = 999")
        else:
            con = sqlite3.connect(self.db)
            con.execute("INSERT INTO schema_version(version) VALUES (999)")
            con.commit()
            con.close()
        src = os.path.join(self.dir, "one.jsonl")
        write_jsonl(src, [{"legacy_id": "1", "display_name": "a", "created_at": "2020-01-01T00:00:00Z",
                           "legacy_memory_ref": "x"}])
        for args in (("status",), ("activate",), ("plan", "--input", src), ("run", "--input", src)):
            with self.subTest(args[0]):
                p = mep("migrate", *args, "--db", self.url, check=False)
                self.assertEqual(p.returncode, 1, p.stderr)
                self.assertIn("database schema version 999 is newer than this mep", p.stderr)
        if self.pg:
            self.assertEqual(self.db.query("SELECT value FROM settings WHERE key = 'migration_state'"), [])

    def test_times_with_a_space_and_empty_input(self):
        src = os.path.join(self.dir, "space.jsonl")
        write_jsonl(src, [{"legacy_id": "1", "display_name": "Sp", "created_at": "2021-01-01 00:00:00Z", "legacy_memory_ref": "a"},
                          {"legacy_id": "2", "display_name": "sp", "created_at": "2020-06-01 00:00:00+02:00", "legacy_memory_ref": "b"}])
        report = os.path.join(self.dir, "report.jsonl")
        mep("migrate", "run", "--db", self.url, "--input", src, "--report", report)
        r = read_report(report)
        self.assertEqual((r["2"]["action"], r["1"]["action"]), ("kept", "renamed"))
        empty = os.path.join(self.dir, "empty.jsonl")
        open(empty, "w").close()
        p = mep("--json", "migrate", "plan", "--db", self.url, "--input", empty)
        self.assertIn("the input holds no rows", p.stderr)
        self.assertEqual(json.loads(p.stdout.splitlines()[-1])["rows"], 0)

    def test_usage_errors(self):
        self.assertEqual(mep("migrate", "run", "--db", self.url, check=False).returncode, 2)
        self.assertEqual(mep("migrate", "run", "--db", self.url, "--input", "/nonexistent.jsonl", check=False).returncode, 2)
        bad = os.path.join(self.dir, "bad.jsonl")
        with open(bad, "w") as f:
            f.write('{"legacy_id": "1", "display_name": "a", "created_at": "2020-01-01T00:00:00Z", '
                    '"legacy_memory_ref": "x"}\n{broken\n')
        p = mep("migrate", "run", "--db", self.url, "--input", bad, check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn(":2:", p.stderr)
        if not self.pg:  # an input that does not parse changes nothing: not even a new database
            self.assertEqual([n for n in os.listdir(self.dir) if n.startswith("control.db")], [])
        dup = os.path.join(self.dir, "dup.jsonl")
        write_jsonl(dup, [{"legacy_id": "1", "display_name": "a", "created_at": "2020-01-01T00:00:00Z", "legacy_memory_ref": "x"}] * 2)
        self.assertEqual(mep("migrate", "run", "--db", self.url, "--input", dup, check=False).returncode, 2)


if __name__ == "__main__":
    unittest.main()


@unittest.skipUnless(pgfixture.backend() == "postgresql", "compares SQLite with PostgreSQL (runs in the _pg variant)")
class CrossBackend(unittest.TestCase):
    """One input, one run on SQLite and one on PostgreSQL: the same report."""

    def test_sqlite_and_postgresql_produce_the_same_report(self):
        tmp = tempfile.TemporaryDirectory(prefix="mep-migrate-x-")
        self.addCleanup(tmp.cleanup)
        pgdb = pgfixture.PgDb()
        self.addCleanup(pgdb.drop)
        given = "01890f4e-7a3b-7c2d-8e1f-0a1b2c3d4e5f"
        rows = []
        for i in range(3000):
            rows.append({"legacy_id": str(i), "display_name": ["PayPal", "paypal", "ＰＡＹＰＡＬ", "раура", "paypa",
                                                             "caf\u00e9", "cafe\u0301", "bad!", "", "x" * 80,
                                                             "Agent %d" % (i % 700), "worker-%d" % i][i % 12],
                         "created_at": "20%02d-0%d-01T00:00:00Z" % (10 + i % 13, 1 + i % 9),
                         "legacy_memory_ref": "ref-%d" % (i % 2500),
                         **({"memory_instance_id": given} if i == 42 else {})})
        src = os.path.join(tmp.name, "legacy.jsonl")
        write_jsonl(src, rows)
        reports = {}
        for label, url in (("sqlite", "sqlite:" + os.path.join(tmp.name, "c.db")), ("postgresql", pgdb.url)):
            out = os.path.join(tmp.name, label + ".jsonl")
            p = mep("--json", "migrate", "run", "--db", url, "--input", src, "--report", out, "--batch", "700")
            reports[label] = (json.loads(p.stdout), read_report(out))
        (s_sum, s_rep), (p_sum, p_rep) = reports["sqlite"], reports["postgresql"]
        self.assertEqual(s_sum, p_sum)
        self.assertEqual(len(s_rep), 3000)
        self.assertEqual(report_shape(s_rep, {given}), report_shape(p_rep, {given}))
        print("\nsame report on both backends: %s" % json.dumps(s_sum))
        # And the databases agree with their reports.
        got = dict(db_rows(pgdb, "SELECT legacy_id, canonical_name FROM migration_rows"))
        self.assertEqual(got, {k: v["canonical_name"] for k, v in p_rep.items()})
        (mapped,) = db_rows(pgdb, "SELECT count(*) FROM migration_identity_map")[0]
        self.assertEqual(mapped, 2500)
