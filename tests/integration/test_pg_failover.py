"""PostgreSQL failover (issue 23): a primary with a streaming standby, two `mep server`
processes given one multi-host URL (`host=a,b`, `target_session_attrs=read-write`), and a
storm of claims, renewals, verifications, branches and releases from 100 clients. The
primary is SIGKILLed mid-storm (every process of it) and the standby promoted; the servers
find the new primary by themselves, without a restart, and answer 503 with Retry-After in
the gap.

In both, the standby is behind when the primary dies: the primary's WAL sender is paused
for 1.5 s first, as a slow link would hold the WAL back.

- Synchronous standby (`synchronous_standby_names`, `synchronous_commit=on`): nothing is
  acknowledged while the standby lags, so the history checker finds no two live holders, no
  fencing token granted twice or lower than one granted before, and every acknowledged
  grant was on the standby when it took over.
- Asynchronous standby: acknowledged grants are lost and tokens are handed out again —
  what the README warns about, counted here — and `mep store`, whose mark had been
  advanced for the lost grants (as mepd does before handing a token out), refuses the
  reissued lower tokens.

Real processes, throwaway clusters made with initdb and pg_basebackup, loopback only.
"""
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import unittest

from history import History
from mephelpers import free_port
from serverfixture import ApiClient, MepServer, create_token
from storefixture import MepStore, StoreClient, new_store_token

CLIENTS = 100
STORM_BEFORE_S = 4
GAP_S = 2
STORM_AFTER_S = 8


def children_of(pid):
    """Every descendant of `pid` (from /proc), deepest last."""
    parents = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
        except (OSError, IndexError, ValueError):
            pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in parents.get(p, []):
            out.append(c)
            todo.append(c)
    return out


class PgPair:
    """A primary and a streaming standby in one temporary directory."""

    def __init__(self, synchronous):
        dirs = glob.glob("/usr/lib/postgresql/*/bin/initdb")
        if not dirs:
            raise unittest.SkipTest("PostgreSQL server binaries are not installed (postgresql-15)")
        if not shutil.which("psql"):
            raise unittest.SkipTest("psql is not installed (postgresql-client-15)")
        self.bindir = os.path.dirname(sorted(dirs)[-1])
        self.synchronous = synchronous
        self.dir = tempfile.mkdtemp(prefix="mep-pgfo-")
        os.chmod(self.dir, 0o755)
        self.ports = {"primary": free_port(), "standby": free_port()}
        self.root = os.geteuid() == 0

    def _as_owner(self, argv, **kw):
        if self.root:
            argv = ["runuser", "-u", "postgres", "--"] + argv
        return subprocess.run(argv, capture_output=True, timeout=kw.pop("timeout", 120), **kw)

    def _mkdir(self, name):
        d = os.path.join(self.dir, name)
        os.makedirs(d, exist_ok=True)
        if self.root:
            shutil.chown(d, "postgres", "postgres")
        os.chmod(d, 0o700)
        return d

    def _pg_ctl_start(self, name):
        port = self.ports[name]
        d = os.path.join(self.dir, name)
        opts = ("-c listen_addresses=127.0.0.1 -p %d -k %s -c max_connections=400 -c wal_level=replica "
                "-c max_wal_senders=8 -c wal_keep_size=512MB -c synchronous_commit=on -c shared_buffers=64MB" % (port, d))
        p = self._as_owner([os.path.join(self.bindir, "pg_ctl"), "-D", os.path.join(d, "data"), "-l",
                            os.path.join(d, "server.log"), "-w", "-t", "60", "-o", opts, "start"])
        if p.returncode != 0:
            raise AssertionError("pg_ctl start %s failed: %s %s" % (name, p.stderr.decode(), self.log(name)))

    def log(self, name):
        try:
            with open(os.path.join(self.dir, name, "server.log"), errors="replace") as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def start(self):
        d = self._mkdir("primary")
        p = self._as_owner([os.path.join(self.bindir, "initdb"), "-D", os.path.join(d, "data"), "-U", "mep",
                            "--auth=trust", "--no-sync", "-E", "UTF8", "--locale=C.UTF-8"])
        if p.returncode != 0:
            raise AssertionError("initdb failed: %s" % p.stderr.decode())
        self._pg_ctl_start("primary")
        self.psql("primary", "CREATE DATABASE mep")
        s = self._mkdir("standby")
        p = self._as_owner([os.path.join(self.bindir, "pg_basebackup"), "-h", "127.0.0.1", "-p",
                            str(self.ports["primary"]), "-U", "mep", "-D", os.path.join(s, "data"), "-X", "stream",
                            "-R", "--checkpoint=fast"])
        if p.returncode != 0:
            raise AssertionError("pg_basebackup failed: %s" % p.stderr.decode())
        conf = os.path.join(s, "data", "postgresql.auto.conf")
        with open(conf, "a") as f:
            f.write("primary_conninfo = 'host=127.0.0.1 port=%d user=mep application_name=standby1'\n"
                    % self.ports["primary"])
        self._pg_ctl_start("standby")
        if self.synchronous:
            # Only now: a primary waiting for a standby that does not exist yet commits nothing.
            self.psql("primary", "ALTER SYSTEM SET synchronous_standby_names = 'standby1'")
            self.psql("primary", "SELECT pg_reload_conf()")
        want = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = self.psql("primary", "SELECT sync_state FROM pg_stat_replication WHERE application_name = 'standby1' "
                                         "AND state = 'streaming'").strip()
            if state == want:
                return self
            time.sleep(0.2)
        raise AssertionError("the standby did not stream (%s) within 60 s: %s" % (want, self.log("standby")))

    @property
    def url(self):
        return ("postgresql://mep@127.0.0.1:%d,127.0.0.1:%d/mep?target_session_attrs=read-write"
                % (self.ports["primary"], self.ports["standby"]))

    def psql(self, name, sql, db=None):
        p = subprocess.run(["psql", "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1", "-p",
                            str(self.ports[name]), "-U", "mep", "-d", db or ("mep" if "DATABASE" not in sql else "postgres"),
                            "-c", sql], capture_output=True, timeout=60)
        if p.returncode != 0:
            raise AssertionError("psql on %s failed: %s" % (name, p.stderr.decode()))
        return p.stdout.decode()

    def postmaster(self, name):
        with open(os.path.join(self.dir, name, "data", "postmaster.pid")) as f:
            return int(f.readline())

    def kill_primary(self):
        """SIGKILL the postmaster and every process of it at once: a crashed machine."""
        pm = self.postmaster("primary")
        for pid in [pm] + children_of(pm):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def walsender(self):
        """The primary's process that streams WAL to the standby."""
        pm = self.postmaster("primary")
        for pid in children_of(pm):
            try:
                with open("/proc/%d/cmdline" % pid, "rb") as f:
                    if b"walsender" in f.read():
                        return pid
            except OSError:
                pass
        return None

    def promote(self):
        p = self._as_owner([os.path.join(self.bindir, "pg_ctl"), "-D", os.path.join(self.dir, "standby", "data"),
                            "-w", "-t", "60", "promote"])
        if p.returncode != 0:
            raise AssertionError("promote failed: %s %s" % (p.stderr.decode(), self.log("standby")))

    def destroy(self):
        for name in ("standby", "primary"):
            data = os.path.join(self.dir, name, "data")
            if os.path.exists(os.path.join(data, "postmaster.pid")):
                self._as_owner([os.path.join(self.bindir, "pg_ctl"), "-D", data, "-m", "immediate", "-w", "-t", "30",
                                "stop"])
        shutil.rmtree(self.dir, ignore_errors=True)


class Db:
    """What serverfixture's helpers take for --db."""

    def __init__(self, url):
        self.url = url


class Storm:
    """100 clients across the servers: claim, renew, verify, sometimes branch, release."""

    def __init__(self, servers, token, memories, names):
        self.servers = servers
        self.token = token
        self.memories = memories
        self.names = names
        self.history = History()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.statuses = {}
        self.bad = []  # answers no request may get: 500, a 503 without Retry-After, a dead socket
        self.threads = []

    def note(self, r, phase):
        with self.lock:
            key = (phase(), r.status)
            self.statuses[key] = self.statuses.get(key, 0) + 1
            if r.status >= 500 and (r.status != 503 or r.header("Retry-After") is None):
                self.bad.append((r.status, r.json))

    def worker(self, i, phase):
        rnd = random.Random(i)
        owner = "owner-%d" % i
        port = self.servers[i % len(self.servers)].port
        c = ApiClient(port, self.token, timeout=30)
        h = self.history
        try:
            while not self.stop.is_set():
                name, memory = rnd.choice(self.names), rnd.choice(self.memories)
                try:
                    t0 = h.begin()
                    r = c.claim(name, memory, owner, ttl=5)
                    h.record("claim", t0, r.status, name=name, memory=memory, owner=owner, body=r.json)
                    self.note(r, phase)
                    if r.status != 201:
                        time.sleep(0.02 if r.status == 423 else 0.2)
                        continue
                    tok, cname = r.json["fencing_token"], r.json["canonical_name"]
                    t0 = h.begin()
                    s = c.renew(cname, memory, tok, owner, ttl=5)
                    h.record("renew", t0, s.status, name=cname, memory=memory, owner=owner, token=tok, body=s.json)
                    self.note(s, phase)
                    t0 = h.begin()
                    v = c.verify(memory, tok)
                    h.record("verify", t0, v.status, memory=memory, token=tok, body=v.json)
                    self.note(v, phase)
                    if rnd.random() < 0.1:
                        t0 = h.begin()
                        b = c.branch(memory, tok)
                        h.record("branch", t0, b.status, memory=memory, token=tok, body=b.json)
                        self.note(b, phase)
                    t0 = h.begin()
                    s = c.release(cname, memory, tok, owner)
                    h.record("release", t0, s.status, name=cname, memory=memory, owner=owner, token=tok, body=s.json)
                    self.note(s, phase)
                except OSError as e:  # no answer: the outcome is unknown (recorded as such)
                    with self.lock:
                        self.bad.append(("no answer", str(e)))
                    c.close()
                    time.sleep(0.2)
        finally:
            c.close()

    def start(self, phase):
        for i in range(CLIENTS):
            t = threading.Thread(target=self.worker, args=(i, phase), daemon=True)
            t.start()
            self.threads.append(t)

    def finish(self):
        self.stop.set()
        for t in self.threads:
            t.join(90)


class FailoverCase(unittest.TestCase):
    SYNCHRONOUS = True

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="mep-failover-")
        self.pg = PgPair(self.SYNCHRONOUS)
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.addCleanup(self.pg.destroy)
        self.pg.start()
        db = Db(self.pg.url)
        self.token = create_token(db, "tenant-fo")
        self.servers = [MepServer(self.tmp, db).start() for _ in range(2)]
        for s in self.servers:
            self.addCleanup(s.stop)
        with ApiClient(self.servers[0].port, self.token) as c:
            self.memories = [c.new_memory() for _ in range(20)]
        self.names = ["fo-%d" % i for i in range(20)]

    def run_storm(self, before_kill=None):
        phase_box = ["before"]
        storm = Storm(self.servers, self.token, self.memories, self.names)
        storm.start(lambda: phase_box[0])
        # Phases end on what happened, not on a clock alone (a loaded machine is slower): the
        # storm runs at least STORM_BEFORE_S and until 60 grants were acknowledged.
        started = time.monotonic()
        time.sleep(STORM_BEFORE_S)
        while len(self.acked_grants(storm)) < 60 and time.monotonic() - started < 60:
            time.sleep(0.2)
        if before_kill:
            before_kill(storm)
        self.killed_at = time.monotonic()
        self.pg.kill_primary()
        phase_box[0] = "gap"
        # What the standby has when it takes over (a hot standby answers reads): every
        # memory's counter, before the new primary grants anything.
        self.surviving = self.counters()
        time.sleep(max(0.0, GAP_S - (time.monotonic() - self.killed_at)))
        self.pg.promote()
        self.promoted_at = time.monotonic()
        phase_box[0] = "after"
        # At least STORM_AFTER_S, and until each server has had a grant since the promotion.
        time.sleep(STORM_AFTER_S)
        while (not all(self.granted_through(storm, s) for s in self.servers)
               and time.monotonic() - self.promoted_at < 60):
            time.sleep(0.2)
        storm.finish()
        for s in self.servers:
            self.assertTrue(s.running(), "a server died:\n" + s.stderr_text()[-2000:])
        return storm

    def lag(self, storm):
        """The standby falls behind before the primary dies: the primary's WAL sender paused
        for 1.5 s (the WAL stays on the primary, as behind a slow link). An asynchronous
        primary goes on acknowledging grants meanwhile; a synchronous one cannot."""
        pid = self.pg.walsender()
        self.assertIsNotNone(pid, "no WAL sender on the primary")
        os.kill(pid, signal.SIGSTOP)
        paused = time.monotonic()
        time.sleep(1.5)
        # An asynchronous primary: until it has acknowledged grants the standby lacks (a
        # loaded machine's storm may have sent few in 1.5 s), 60 s at most.
        while (not self.SYNCHRONOUS and time.monotonic() - paused < 60
               and len([g for g in self.acked_grants(storm) if g["start"] > paused]) < 10):
            time.sleep(0.1)

    def acked_grants(self, storm):
        return [o for o in list(storm.history.ops) if o["kind"] == "claim" and o["status"] == 201]

    def granted_through(self, storm, server):
        """Whether a claim through `server` was granted after the promotion."""
        return any(g["start"] > self.promoted_at and storm.servers[int(g["owner"].split("-")[1]) % 2] is server
                   for g in self.acked_grants(storm))

    def counters(self):
        rows = self.pg.psql("standby", "SELECT memory_id::text || ' ' || fence_counter FROM memories").split()
        return {rows[i]: int(rows[i + 1]) for i in range(0, len(rows), 2)}


class SynchronousStandby(FailoverCase):
    SYNCHRONOUS = True

    def test_failover_loses_no_grant_and_reuses_no_token(self):
        storm = self.run_storm(before_kill=self.lag)  # the same lag that costs the async standby grants
        grants = self.acked_grants(storm)
        before = [g for g in grants if g["end"] < self.killed_at]
        after = [g for g in grants if g["start"] > self.promoted_at]
        print("\nsynchronous standby: %d operations, %d grants acknowledged (%d before the kill, %d after the "
              "promotion); answers by phase: %s" % (len(storm.history.ops), len(grants), len(before), len(after),
                                                     json.dumps({"%s %s" % k: v for k, v in sorted(storm.statuses.items())})))
        self.assertGreater(len(before), 50, "the storm did not run before the kill")
        # Both servers found the new primary by themselves.
        for s in self.servers:
            self.assertTrue(self.granted_through(storm, s),
                            "no grant through the server on port %d after the promotion" % s.port)
        # The gap was answered, with 503 + Retry-After, never a 500 or silence.
        self.assertEqual(storm.bad, [])
        self.assertTrue(any(k[0] == "gap" and k[1] == 503 for k in storm.statuses), storm.statuses)
        # Every grant acknowledged before the kill was on the standby when it took over, and
        # every acknowledged grant is on the new primary at the end.
        lost = [g for g in before if self.surviving.get(g["body"]["memory_instance_id"], 0) < g["body"]["fencing_token"]]
        self.assertEqual(lost, [])
        counters = self.counters()
        lost = [g for g in grants if counters.get(g["body"]["memory_instance_id"], 0) < g["body"]["fencing_token"]]
        self.assertEqual(lost, [])
        branches = [o["body"]["memory_instance_id"] for o in storm.history.ops if o["kind"] == "branch" and o["status"] == 201]
        for b in branches:
            self.assertIn(b, counters, "an acknowledged branch is missing on the new primary")
        self.assertEqual(storm.history.check(), [])


class AsynchronousStandby(FailoverCase):
    SYNCHRONOUS = False

    def test_a_lagging_async_standby_loses_grants_and_the_store_refuses_the_reissued_tokens(self):
        tok, hashes = new_store_token(self.tmp)
        store = MepStore(self.tmp, os.path.join(self.tmp, "store"), ["--token-file", hashes]).start()
        self.addCleanup(store.stop)

        storm = self.run_storm(before_kill=self.lag)
        grants = self.acked_grants(storm)
        lost = [g for g in grants if g["end"] < self.killed_at
                and self.surviving.get(g["body"]["memory_instance_id"], 0) < g["body"]["fencing_token"]]
        seen = {}
        for g in grants:
            seen.setdefault((g["body"]["memory_instance_id"], g["body"]["fencing_token"]), []).append(g)
        twice = [k for k, gs in seen.items() if len(gs) > 1]
        violations = storm.history.check()
        # What mepd does before handing a token out: the store's mark is advanced to it. The
        # grants acknowledged before the kill (the lost ones included) first, then those of
        # the new primary, in order: a reissued token below the mark is refused.
        client = StoreClient(store.port, tok)
        for g in sorted((g for g in grants if g["end"] < self.killed_at), key=lambda g: g["end"]):
            r = client.advance(g["body"]["memory_instance_id"], g["body"]["fencing_token"])
            self.assertIn(r.status, (200, 409), r)
        refused, equal_accepted = 0, 0
        marks = {}
        for g in sorted((g for g in grants if g["start"] > self.promoted_at), key=lambda g: g["end"]):
            m, t = g["body"]["memory_instance_id"], g["body"]["fencing_token"]
            mark = marks.get(m)
            if mark is None:
                mark = client.fence(m).json()["fencing_token"]
            r = client.advance(m, t)
            if r.status == 409:
                refused += 1
                self.assertGreater(mark, t)
            else:
                self.assertEqual(r.status, 200, r)
                equal_accepted += (t == mark)
                marks[m] = t
        client.close()
        print("\nasynchronous standby behind by 1.5 s at the kill: %d grants acknowledged, %d of them lost, %d "
              "(memory, token) pairs granted twice, %d history violations; after the failover the store refused %d "
              "reissued tokens below its mark and accepted %d equal to it"
              % (len(grants), len(lost), len(twice), len(violations), refused, equal_accepted))
        for v in violations[:5]:
            print("  " + v)
        # What the README warns about, shown: acknowledged grants lost, tokens handed out again.
        self.assertGreater(len(lost), 0, "the lagging standby lost nothing: the test did not make it lag")
        self.assertGreater(len(twice), 0)
        self.assertTrue(any(v.startswith("S3") for v in violations), violations[:5])
        # And what the data plane still does: a writer with a reissued lower token is refused.
        self.assertGreater(refused, 0)
        self.assertEqual(storm.bad, [])


if __name__ == "__main__":
    unittest.main()
