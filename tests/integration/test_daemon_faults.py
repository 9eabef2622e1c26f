"""Faults under mepd's own state directory (SPEC §3 L4, issue 21): with the state on a
small tmpfs (root only: mount), mepd keeps running and keeps renewing what it holds when
that disk is full or read-only, answers new work with a 503 problem that says why, logs
it once, and recovers when space returns; a state database deleted under it does not end
it either. And a write refused between an attach's two writes (its claim intent, then the
lease) does not make the daemon claim again later what its agent has let go.
"""
import os
import shutil
import sqlite3
import subprocess
import time
import unittest

from daemonfixture import Mepd, RecordingProxy
from test_daemon import DaemonTestCase

TTL = 6


class StateDiskFaults(DaemonTestCase):
    MODE = "remote"

    def setUp(self):
        if os.geteuid() != 0 or not shutil.which("mount"):
            self.skipTest("needs root to mount a small tmpfs under the daemon's state directory")
        super().setUp()
        # The daemon again, its state directory on a 2 MiB tmpfs.
        self.mepd.stop()
        self.state = os.path.join(self.tmp, "small-state")
        os.makedirs(self.state)
        rc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", self.state]).returncode
        if rc != 0:
            self.skipTest("mount -t tmpfs is not permitted here")
        self.addCleanup(subprocess.run, ["umount", "-l", self.state])
        d = Mepd(self.tmp, self.env, control_plane=self.server.url, token=self.token, tag="small-disk")
        d.state_dir = self.state
        self._sources.append(("small-disk", d))
        self.addCleanup(d.stop)
        self.mepd = d.start()
        self.client = self.mepd.client()

    def fill(self):
        """Fills the tmpfs; returns the filler's path."""
        filler = os.path.join(self.state, "filler")
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        return filler

    def held(self, name):
        return self.client.leases()[name]

    def test_full_disk_keeps_renewing_refuses_new_work_and_recovers(self):
        path = self.new_file("held.uai")
        lease = self.attach_ok("held-agent", path, ttl_seconds=TTL)
        filler = self.fill()
        # New work: 503 with the reason, nothing sent to the control plane.
        other = self.new_file("other.uai")
        r = self.client.attach("new-agent", other, ttl_seconds=TTL)
        self.assertEqual(r.status, 503, r)
        self.assertEqual(r.json["code"], "unavailable")
        self.assertIn("state directory", r.json["detail"])
        self.assertIsNotNone(r.headers.get("retry-after"))
        # What it holds goes on being renewed past several TTLs.
        time.sleep(2 * TTL)
        self.assertTrue(self.mepd.proc.alive())
        held = self.held("held-agent")
        self.assertEqual(held["state"], "held")
        self.assertEqual(held["fencing_token"], lease["fencing_token"])
        server_side = self.server.request("GET", "/v1/leases/held-agent", self.token)
        self.assertEqual(server_side.status, 200, server_side)
        # Logged once for the whole run of failures.
        self.assertEqual(self.mepd.log_text().count("cannot write the state database"), 1, self.mepd.log_text())
        # Space returns: new work is accepted again, and the recovery is logged.
        os.unlink(filler)
        self.attach_ok("new-agent", other, ttl_seconds=TTL)
        self.assertIn("can be written again", self.mepd.log_text())

    def test_read_only_state_directory(self):
        # A state directory that turned read-only while the daemon was down (no writer may
        # keep it open for a remount): the daemon refuses to start with one line and exit 1,
        # touching nothing; once it is writable again it starts and re-adopts its lease.
        path = self.new_file("ro.uai")
        lease = self.attach_ok("ro-agent", path, ttl_seconds=30)
        self.mepd.stop()
        subprocess.run(["mount", "-o", "remount,ro", self.state], check=True)
        try:
            p = subprocess.run([self.mepd_argv0(), "--socket", self.mepd.socket_path, "--state-dir", self.state,
                                "--control-plane", self.server.url, "--token-file", self.mepd.token_file],
                               env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30)
            self.assertEqual(p.returncode, 1, p.stderr)
            self.assertNotIn(b"terminate called", p.stderr)
            self.assertTrue(p.stderr.strip(), "no reason given")
        finally:
            subprocess.run(["mount", "-o", "remount,rw", self.state], check=True)
        self.mepd.start()
        self.client = self.mepd.client()
        self.assertEqual(self.held("ro-agent")["fencing_token"], lease["fencing_token"])

    def mepd_argv0(self):
        from daemonfixture import mepd_bin
        return mepd_bin()

    def test_state_database_deleted_under_a_running_daemon(self):
        path = self.new_file("del.uai")
        self.attach_ok("del-agent", path, ttl_seconds=TTL)
        for suffix in ("", "-wal", "-shm"):
            try:
                os.unlink(os.path.join(self.state, "mepd.db" + suffix))
            except FileNotFoundError:
                pass
        time.sleep(TTL + 1)
        self.assertTrue(self.mepd.proc.alive())
        self.assertEqual(self.held("del-agent")["state"], "held")
        self.attach_ok("del-new", self.new_file("del-new.uai"), ttl_seconds=TTL)
        self.assertEqual(self.client.request("GET", "/healthz").status, 200)


class StateWriteRefused(DaemonTestCase):
    """Writes refused by the state database itself while the daemon runs, injected with a
    trigger on its own database (SQLite's RAISE), so that exactly one kind of write fails:
    no mount, no root, no hook in the daemon."""

    MODE = "remote"

    def state_db(self):
        db = sqlite3.connect(os.path.join(self.mepd.state_dir, "mepd.db"), timeout=10)
        self.addCleanup(db.close)
        return db

    def test_lease_save_refused_after_the_intent_is_not_claimed_again(self):
        # The attach's intent goes in; the lease's first save (which also deletes the intent)
        # is refused. The agent has its lease, and lets it go. The daemon, which looks at
        # pending intents every 2 s, must not resend that intent: the control plane would
        # replay the grant, and the daemon would adopt, as held, a lease released since.
        db = self.state_db()
        db.execute("CREATE TRIGGER refuse_lease_saves BEFORE INSERT ON leases "
                   "BEGIN SELECT RAISE(ABORT, 'injected: lease saves refused'); END")
        db.commit()
        lease = self.attach_ok("ghost-agent", self.new_file("ghost.uai"), ttl_seconds=30)
        self.assertIn("cannot write the state database", self.mepd.log_text())
        r = self.client.detach("ghost-agent")
        self.assertEqual(r.status, 204, r)
        self.assertEqual(self.server_lease("ghost-agent").status, 404)
        intents = lambda: db.execute("SELECT count(*) FROM intents").fetchone()[0]
        # The intent row goes (the daemon deletes it instead of resending it) ...
        self.assertEqual(self.poll(lambda: intents() == 0, 10), True, "the claim intent is still there")
        time.sleep(2.5)  # ... and one more pass of the renewer adopts nothing.
        self.assertNotIn("ghost-agent", self.client.leases())
        self.assertNotIn("from a pending claim intent", self.mepd.log_text())
        self.assertEqual(self.server_lease("ghost-agent").status, 404)
        # Saves allowed again: the next attach of the name is a new lease, saved as usual.
        db.execute("DROP TRIGGER refuse_lease_saves")
        db.commit()
        again = self.attach_ok("ghost-agent", self.new_file("ghost-2.uai"), ttl_seconds=30)
        self.assertNotEqual(again["lease_id"], lease["lease_id"])
        saved = db.execute("SELECT lease_id FROM leases WHERE canonical_name = 'ghost-agent'").fetchall()
        self.assertEqual(saved, [(again["lease_id"],)])

    def test_unknown_outcome_not_written_down_is_not_adopted(self):
        # The control plane is unreachable, so the attach fails with 503 and an unknown
        # outcome: its intent stays, to be resent, and is marked so that a grant the resend
        # finds is released (the agent was told it failed). That mark is refused. When the
        # control plane is back, the resend's grant must still be released, not adopted.
        proxy = RecordingProxy("127.0.0.1", self.server.port)
        self.addCleanup(proxy.stop)
        self.mepd.stop()
        d = Mepd(self.tmp, self.env, control_plane=proxy.url, token=self.token, tag="behind-proxy")
        d.state_dir = self.mepd.state_dir
        self._sources.append(("behind-proxy", d))
        self.addCleanup(d.stop)
        self.mepd = d.start()
        self.client = self.mepd.client()
        db = self.state_db()
        db.execute("CREATE TRIGGER refuse_intent_marks BEFORE UPDATE ON intents "
                   "BEGIN SELECT RAISE(ABORT, 'injected: intent updates refused'); END")
        db.commit()
        path = self.new_file("unknown.uai")  # registered first: the attach below sends only its claim
        self.attach_ok("unknown-agent", path, ttl_seconds=30)
        self.assertEqual(self.client.detach("unknown-agent").status, 204)
        proxy.refuse(True)
        r = self.client.attach("unknown-agent", path, ttl_seconds=30)
        self.assertEqual(r.status, 503, r)
        self.assertEqual(db.execute("SELECT count(*) FROM intents").fetchone()[0], 1)
        proxy.refuse(False)
        released = lambda: "releasing lease unknown-agent" in self.mepd.log_text()
        self.assertTrue(self.poll(released, 15), "the resent intent's grant was not released")
        self.assertNotIn("from a pending claim intent", self.mepd.log_text())
        self.assertNotIn("unknown-agent", self.client.leases())
        self.assertEqual(self.poll(lambda: self.server_lease("unknown-agent").status == 404, 5), True)
        self.assertEqual(db.execute("SELECT count(*) FROM intents").fetchone()[0], 0)


if __name__ == "__main__":
    unittest.main()
