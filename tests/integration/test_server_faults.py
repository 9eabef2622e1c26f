"""Faults against the control plane: SIGKILL during a claim storm, and a SIGSTOPped holder.

`server_kill9_mid_claims_consistent` (SPEC §13): every grant the server acknowledged is on
disk after a SIGKILL (S3: a fencing token is never issued twice), the database holds no
partial claim (S5), and service resumes on the same file with strictly larger tokens. (A
process kill checks that replies follow the commit; power loss, which fsync guards
against, cannot be simulated here.)

`zombie_sigstop_write_rejected`: a lease holder paused past its TTL, while another owner
takes over, has every mutation rejected with 409 stale-fence when it resumes (S4).

A full disk under the SQLite store (a small tmpfs in a mount namespace of the test's own):
requests get 503 problems, the server stays up, and once there is space again it serves,
with every grant it acknowledged before still there.
"""
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import pgfixture
from history import History
from mephelpers import wait_for
from serverfixture import (ApiClient, MepServer, create_token, db_query, drop_db, new_db, parse_rfc3339_ms,
                           unique_name)


class ServerKill9Test(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="mep-faults-")
        self.db = new_db(self.dir, "control.db")
        self.token = create_token(self.db, "faults")
        self.server = MepServer(self.dir, self.db, ["--rate-limit", "0"]).start()

    def tearDown(self):
        self.server.stop()
        drop_db(self.db)
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_server_kill9_mid_claims_consistent(self):
        memories = []
        with self.server.client(self.token) as c:
            for _ in range(16):
                memories.append(c.new_memory())
        acked = {m: [] for m in memories}  # acknowledged fencing tokens per memory
        lock = threading.Lock()
        stop = threading.Event()
        history = History()

        def storm(memory):
            name = unique_name("storm")
            owner = "owner-" + memory
            try:
                with self.server.client(self.token) as c:
                    while not stop.is_set():
                        t0 = history.begin()
                        r = c.claim(name, memory, owner)
                        history.record("claim", t0, r.status, name=name, memory=memory, owner=owner, body=r.json)
                        if r.status != 201:
                            continue
                        with lock:
                            acked[memory].append(r.json["fencing_token"])
                        t0 = history.begin()
                        s = c.release(r.json["canonical_name"], memory, r.json["fencing_token"], owner)
                        history.record("release", t0, s.status, name=r.json["canonical_name"], memory=memory,
                                       owner=owner, token=r.json["fencing_token"], body=s.json)
            except Exception:
                return  # the server died under us: expected

        threads = [threading.Thread(target=storm, args=(m,), daemon=True) for m in memories]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sum(len(v) for v in acked.values()) < 300:
            time.sleep(0.02)
        self.server.kill()  # SIGKILL in the middle of the storm
        stop.set()
        for t in threads:
            t.join(timeout=30)
        total = sum(len(v) for v in acked.values())
        self.assertGreater(total, 0, "no claim was acknowledged before the kill")
        self.assertEqual(history.check(), [])
        print(f"{total} grants acknowledged before SIGKILL")

        # The database is consistent and every acknowledged grant survived.
        if isinstance(self.db, str):
            con = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True)
            try:
                self.assertEqual(con.execute("PRAGMA integrity_check").fetchone()[0], "ok")
            finally:
                con.close()
        counters = dict(db_query(self.db, "SELECT memory_id, fence_counter FROM memories"))
        for m, tokens in acked.items():
            self.assertEqual(len(tokens), len(set(tokens)), f"token issued twice on {m}")
            self.assertEqual(tokens, sorted(tokens), f"tokens not increasing on {m}")
            if tokens:
                self.assertGreaterEqual(counters[m], max(tokens), f"an acknowledged grant on {m} was lost")
        # No partial claim: every lease's token is its memory's current counter.
        for memory, token in db_query(self.db, "SELECT memory_id, fencing_token FROM leases"):
            self.assertEqual(token, counters[memory])

        # Service resumes on the same file; new grants are larger than anything acknowledged.
        self.server = MepServer(self.dir, self.db, ["--rate-limit", "0"]).start()
        with self.server.client(self.token) as c:
            for m in memories:
                r = c.claim(unique_name("after"), m, "owner-new-" + m)
                if r.status == 423:  # a lease acknowledged just before the kill is still live
                    continue
                self.assertEqual(r.status, 201, r)
                if acked[m]:
                    self.assertGreater(r.json["fencing_token"], max(acked[m]))


class RenewalsFromMemoryKill9Test(unittest.TestCase):
    """SQLite answers a lease's renewals from memory once its commit thread has renewed it,
    and writes them up to 50 ms later. A SIGKILL loses the unwritten ones; the restart must
    still honour every expiry the server acknowledged (nobody else gets the name before
    it), and after a clean stop it extends nothing."""

    TTL = 5

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="mep-renew-kill-")
        self.db = new_db(self.dir, "control.db")
        if not isinstance(self.db, str):
            drop_db(self.db)
            shutil.rmtree(self.dir, ignore_errors=True)
            self.skipTest("SQLite only: PostgreSQL syncs every renewal before it answers")
        self.token = create_token(self.db, "renew-kill")
        self.server = MepServer(self.dir, self.db, ["--rate-limit", "0"]).start()

    def tearDown(self):
        self.server.stop()
        drop_db(self.db)
        shutil.rmtree(self.dir, ignore_errors=True)

    def renew_storm(self, leases, seconds):
        """Renews every lease in a loop for `seconds` (a thread each); returns the latest
        expiry acknowledged per lease (Unix ms)."""
        acked = {}
        lock = threading.Lock()
        stop = threading.Event()

        def storm(lease):
            name, memory, token = lease
            try:
                with self.server.client(self.token) as c:
                    while not stop.is_set():
                        r = c.renew(name, memory, token, "holder", ttl=self.TTL)
                        if r.status != 200:
                            continue
                        at = parse_rfc3339_ms(r.json["expires_at"])
                        with lock:
                            acked[name] = max(acked.get(name, 0), at)
            except Exception:
                return  # the server died under us: expected

        threads = [threading.Thread(target=storm, args=(lease,), daemon=True) for lease in leases]
        for t in threads:
            t.start()
        # Every lease renewed at least once (an event, however slow this machine), then the
        # storm goes on for `seconds`.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(t.is_alive() for t in threads):
            with lock:
                if len(acked) == len(leases):
                    break
            time.sleep(0.01)
        time.sleep(seconds)
        return acked, stop, threads

    def claim_leases(self, n):
        leases = []
        with self.server.client(self.token) as c:
            for _ in range(n):
                memory = c.new_memory()
                r = c.claim(unique_name("kept"), memory, "holder", ttl=self.TTL)
                self.assertEqual(r.status, 201, r)
                leases.append((r.json["canonical_name"], memory, r.json["fencing_token"]))
        return leases

    def expiry_after_restart(self, name):
        with self.server.client(self.token) as c:
            r = c.get_lease(name)
            self.assertEqual(r.status, 200, r)
            return parse_rfc3339_ms(r.json["expires_at"])

    def test_server_kill9_honours_renewals_answered_from_memory(self):
        leases = self.claim_leases(8)
        acked, stop, threads = self.renew_storm(leases, 1.5)
        self.server.kill()  # SIGKILL while renewals stream
        stop.set()
        for t in threads:
            t.join(timeout=30)
        self.assertEqual(len(acked), len(leases), "a lease was never renewed before the kill")
        time.sleep(1.0)  # the restart comes later than any acknowledged renewal
        self.server = MepServer(self.dir, self.db, ["--rate-limit", "0"]).start()
        with self.server.client(self.token) as c:
            for name, memory, token in leases:
                after = self.expiry_after_restart(name)
                self.assertGreaterEqual(after, acked[name], f"{name}: an acknowledged expiry was cut short")
                # Nobody else gets the name, and the holder goes on with its token.
                other = c.claim(name, c.new_memory(), "another-owner", ttl=self.TTL)
                self.assertEqual(other.status, 423, other)
                self.assertEqual(c.renew(name, memory, token, "holder", ttl=self.TTL).status, 200)
        self.assertIn("did not stop cleanly", self.server.stderr_text())

    def test_clean_stop_writes_them_and_extends_nothing(self):
        leases = self.claim_leases(4)
        acked, stop, threads = self.renew_storm(leases, 1.0)
        stop.set()
        for t in threads:
            t.join(timeout=30)
        self.assertEqual(self.server.stop(), 0)
        time.sleep(1.5)
        self.server = MepServer(self.dir, self.db, ["--rate-limit", "0"]).start()
        self.assertNotIn("did not stop cleanly", self.server.stderr_text())
        for name, _, _ in leases:
            after = self.expiry_after_restart(name)
            # The last acknowledged expiry, to within the wall clock's reading of the lease
            # clock (a few ms); an extension would add the 1.5 s pause.
            self.assertLess(abs(after - acked[name]), 500, f"{name}: acknowledged {acked[name]}, now {after}")


# A lease holder that stops (SIGSTOP) past its TTL and wakes up believing it still holds
# the lease: it claims, reports its token, waits for "go" on stdin, then tries every
# mutation with that token and prints the statuses as one JSON line.
ZOMBIE = r"""
import json, sys
from serverfixture import ApiClient
port, token, memory, name = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
c = ApiClient(int(port), token)
r = c.claim(name, memory, "zombie", ttl=5)
print(json.dumps({"claimed": r.json["fencing_token"], "canonical_name": r.json["canonical_name"],
                  "status": r.status, "body": r.json}), flush=True)
sys.stdin.readline()
t, n = r.json["fencing_token"], r.json["canonical_name"]
out = {}
for op, call in (("renew", lambda: c.renew(n, memory, t, "zombie")), ("release", lambda: c.release(n, memory, t, "zombie")),
                 ("branch", lambda: c.branch(memory, t)), ("verify", lambda: c.verify(memory, t))):
    resp = call()
    out[op] = {"status": resp.status, "body": resp.json}
print(json.dumps(out), flush=True)
"""


class ZombieTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="mep-zombie-")
        self.db = new_db(self.dir, "control.db")
        self.token = create_token(self.db, "zombies")
        self.server = MepServer(self.dir, self.db).start()

    def tearDown(self):
        self.server.stop()
        drop_db(self.db)
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_zombie_sigstop_write_rejected(self):
        with self.server.client(self.token) as c:
            memory = c.new_memory()
        name = unique_name("zombie")
        history = History()
        t_spawn = history.begin()
        child = subprocess.Popen([sys.executable, "-c", ZOMBIE, str(self.server.port), self.token, memory, name],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 cwd=os.path.dirname(os.path.abspath(__file__)))
        try:
            first = json.loads(child.stdout.readline())
            history.record("claim", t_spawn, first["status"], name=name, memory=memory, owner="zombie",
                           body=first["body"])
            os.kill(child.pid, signal.SIGSTOP)  # the holder pauses past its TTL
            time.sleep(5.5)
            with self.server.client(self.token) as c:
                t0 = history.begin()
                r = c.claim(name, memory, "new-owner")
                history.record("claim", t0, r.status, name=name, memory=memory, owner="new-owner", body=r.json)
                self.assertEqual(r.status, 201, r)
                new_token = r.json["fencing_token"]
            self.assertGreater(new_token, first["claimed"])
            os.kill(child.pid, signal.SIGCONT)
            t_go = history.begin()
            child.stdin.write("go\n")
            child.stdin.flush()
            results = json.loads(child.stdout.readline())
            for op, res in results.items():
                history.record(op, t_go, res["status"], name=first["canonical_name"], memory=memory,
                               owner="zombie", token=first["claimed"], body=res["body"])
                self.assertEqual(res["body"].get("code"), "stale-fence", f"{op}: {res}")
            self.assertEqual(history.check(), [])
            with self.server.client(self.token) as c:
                lease = c.get_lease(first["canonical_name"])
                self.assertEqual(lease.status, 200)
                self.assertEqual(lease.json["fencing_token"], new_token)  # the new owner's lease is intact
        finally:
            try:
                os.kill(child.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            child.kill()
            child.wait(timeout=10)
            child.stdin.close()
            child.stdout.close()


if __name__ == "__main__":
    unittest.main()


def _mount_namespace_problem():
    """Why this machine cannot run a server on a tmpfs of its own, or None."""
    if os.geteuid() != 0:
        return "mounting a tmpfs in a mount namespace needs root"
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return tool + " (util-linux) is not installed"
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                       capture_output=True, timeout=10)
    if r.returncode != 0:
        return "unshare --mount is not permitted here: " + r.stderr.decode("utf-8", "replace").strip()
    return None


# Runs in a new mount namespace: a tmpfs of $SIZE on $1, a token for it into $2, then
# `exec "$@"` (the server command line, after `shift 2`), so the server is this process.
DISK_SCRIPT = '''set -e
mount -t tmpfs -o "size=$SIZE,mode=0700" mep-test-full "$1"
"$3" token create --db "sqlite:$1/control.db" --tenant full > "$2"
shift 2
exec "$@"
'''


@unittest.skipIf(pgfixture.backend() != "sqlite", "the SQLite store's own files; PostgreSQL and Spanner manage their disks")
class DiskFullTest(unittest.TestCase):
    def setUp(self):
        why = _mount_namespace_problem()
        if why:
            self.skipTest(why)
        self.dir = tempfile.mkdtemp(prefix="mep-diskfull-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.fs = os.path.join(self.dir, "fs")
        os.mkdir(self.fs)
        self.token_file = os.path.join(self.dir, "token")

        def wrap(argv):
            return ["env", "SIZE=1200k", "unshare", "--mount", "--propagation", "private",
                    "sh", "-c", DISK_SCRIPT, "sh", self.fs, self.token_file, *argv]

        self.server = MepServer(self.dir, os.path.join(self.fs, "control.db"), ["--rate-limit", "0"], wrap=wrap)
        self.server.start()
        self.addCleanup(self.server.stop)
        with open(self.token_file, encoding="utf-8") as f:
            self.token = f.read().strip()

    def storm(self, prefix, max_failures, max_attempts):
        """8 clients register memories and claim names until max_failures requests failed
        (or max_attempts were made). Returns (acknowledged grants, failed responses)."""
        acked, failed, lock = [], [], threading.Lock()
        attempts = [0]

        def client(w):
            with ApiClient(self.server.port, self.token) as c:
                i = 0
                while True:
                    with lock:
                        if len(failed) >= max_failures or attempts[0] >= max_attempts:
                            return
                        attempts[0] += 1
                    i += 1
                    r = c.register()
                    if r.status != 201:
                        with lock:
                            failed.append(r)
                        continue
                    name = "%s-%d-%d" % (prefix, w, i)
                    g = c.claim(name, r.json["memory_instance_id"], "owner-%d" % w, ttl=300)
                    with lock:
                        (acked if g.status == 201 else failed).append((name, g.json) if g.status == 201 else g)

        threads = [threading.Thread(target=client, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        return acked, failed

    def test_disk_full_is_503_and_loses_no_grant(self):
        acked, failed = self.storm("full", max_failures=60, max_attempts=5000)
        self.assertGreaterEqual(len(failed), 60, "the 1200 KiB file system never filled up")
        self.assertGreater(len(acked), 0, "no claim was granted before the disk was full")
        for r in failed:
            self.assertEqual(r.status, 503, r)
            self.assertEqual((r.header("Content-Type") or "").split(";")[0], "application/problem+json", r)
            self.assertEqual(r.json["code"], "unavailable", r)
            self.assertTrue(r.header("Retry-After"), r)
            self.assertNotIn(self.fs, r.raw.decode("utf-8", "replace"))  # no paths in problems
        with ApiClient(self.server.port, self.token) as c:
            self.assertEqual(c.get("/healthz").status, 200)
        self.assertTrue(self.server.running())

        # Room again: the same process serves, and nothing it acknowledged is lost.
        subprocess.run(["nsenter", "-t", str(self.server.pid), "-m", "mount", "-o", "remount,size=32m", self.fs],
                       check=True, timeout=10)
        more, failed2 = self.storm("room", max_failures=1, max_attempts=40)
        self.assertEqual(failed2, [], [repr(r) for r in failed2[:3]])
        self.assertEqual(len(more), 40)
        with ApiClient(self.server.port, self.token) as c:
            self.assertEqual(c.get("/readyz").status, 200)
            for name, grant in acked + more:
                r = c.get("/v1/leases/" + name)
                self.assertEqual(r.status, 200, (name, r))
                self.assertEqual(r.json["fencing_token"], grant["fencing_token"], name)
                self.assertEqual(r.json["memory_instance_id"], grant["memory_instance_id"], name)
        self.assertEqual(self.server.stop(), 0, self.server.stderr_text()[-2000:])


class OutOfDescriptorsTest(unittest.TestCase):
    def test_failed_accepts_are_paced_and_reported_once(self):
        # Out of file descriptors, accept(2) fails at once and every time while connections
        # wait in the backlog. The server must not spin on it (a core, and a log line per
        # attempt: 20 MB in 3 s): it tries again later and later, says so once, and serves
        # again when descriptors are free.
        with tempfile.TemporaryDirectory(prefix="mep-nofile-") as tmp:
            db = os.path.join(tmp, "control.db")
            token = create_token(db, "t", "lease")
            srv = MepServer(tmp, db, wrap=lambda argv: ["prlimit", "--nofile=64:64", "--", *argv]).start()
            self.addCleanup(srv.stop)
            held = []
            try:
                for _ in range(120):
                    held.append(socket.create_connection(("127.0.0.1", srv.port), timeout=10))
                self.assertTrue(wait_for(lambda: "accept failed" in srv.stderr_text(), timeout=20),
                                "the server never ran out of descriptors:\n" + srv.stderr_text()[-2000:])
                time.sleep(3)  # the failures go on while the connections wait
                log = srv.stderr_text()
                self.assertEqual(log.count("accept failed"), 1, log[-2000:])
                self.assertLess(len(log), 64 * 1024)
            finally:
                for s in held:
                    s.close()
            with ApiClient(srv.port, token) as c:
                self.assertTrue(wait_for(lambda: c.get("/v1/leases").status == 200, timeout=20))
            self.assertTrue(wait_for(lambda: "accepting connections again" in srv.stderr_text(), timeout=10))
            self.assertEqual(srv.stop(), 0, srv.stderr_text()[-2000:])
