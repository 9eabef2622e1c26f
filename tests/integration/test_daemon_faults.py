"""Faults under mepd's own state directory (SPEC §3 L4, issue 21): with the state on a
small tmpfs (root only: mount), mepd keeps running and keeps renewing what it holds when
that disk is full or read-only, answers new work with a 503 problem that says why, logs
it once, and recovers when space returns; a state database deleted under it does not end
it either. And a write refused between an attach's two writes (its claim intent, then the
lease) does not make the daemon claim again later what its agent has let go. And the states
a power loss can leave (a lease's row and the delete of its intent are written without an
fsync) are re-adopted through the durable intent, never past the grant's expiry, and a
released lease's row brought back does not bring the lease back. And the renewer's resend
of pending intents does not resend one whose attach ended while it waited for another.
"""
import os
import shutil
import sqlite3
import subprocess
import threading
import time
import unittest

from daemonfixture import Hold, Mepd, RecordingProxy
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


class StateDbCase(DaemonTestCase):
    MODE = "remote"

    def state_db(self):
        db = sqlite3.connect(os.path.join(self.mepd.state_dir, "mepd.db"), timeout=10)
        self.addCleanup(db.close)
        return db

    def behind_proxy(self):
        """Restarts the daemon (same state) with its control plane behind a RecordingProxy."""
        proxy = RecordingProxy("127.0.0.1", self.server.port)
        self.addCleanup(proxy.stop)
        self.mepd.stop()
        d = Mepd(self.tmp, self.env, control_plane=proxy.url, token=self.token, tag="behind-proxy")
        d.state_dir = self.mepd.state_dir
        self._sources.append(("behind-proxy", d))
        self.addCleanup(d.stop)
        self.mepd = d.start()
        self.client = self.mepd.client()
        return proxy


class StateWriteRefused(StateDbCase):
    """Writes refused by the state database itself while the daemon runs, injected with a
    trigger on its own database (SQLite's RAISE), so that exactly one kind of write fails:
    no mount, no root, no hook in the daemon."""

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
        proxy = self.behind_proxy()
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
        self.assertEqual(r.json["code"], "control-plane-unreachable", r.json)
        self.assertEqual(db.execute("SELECT count(*) FROM intents").fetchone()[0], 1)
        proxy.refuse(False)
        released = lambda: "releasing lease unknown-agent" in self.mepd.log_text()
        self.assertTrue(self.poll(released, 15), "the resent intent's grant was not released")
        self.assertNotIn("from a pending claim intent", self.mepd.log_text())
        self.assertNotIn("unknown-agent", self.client.leases())
        self.assertEqual(self.poll(lambda: self.server_lease("unknown-agent").status == 404, 5), True)
        self.assertEqual(db.execute("SELECT count(*) FROM intents").fetchone()[0], 0)


def claim_of(name):
    """Matches the first chunk of a claim (POST /v1/leases) of `name`."""
    return lambda data: data.startswith(b"POST /v1/leases HTTP/") and (b'"%s"' % name.encode()) in data


UNAVAILABLE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/problem+json\r\n"
               b"Content-Length: 2\r\n\r\n{}")


class ResendRace(StateDbCase):
    """The renewer resends pending claim intents every 2 s, skipping those an attach is still
    sending. It reads the intents first and then waits for each claim it resends, so an
    attach in flight at the read can end while it waits: that intent must not be resent
    (its grant, replayed, was adopted again over whatever its agent did since)."""

    def test_an_intent_whose_attach_ended_since_the_read_is_not_resent(self):
        proxy = self.behind_proxy()
        # An intent left pending (its outcome unknown), resent by every pass; the proxy holds
        # each resend until let go, then answers 503: the pass waits there, and it stays.
        orphan = self.new_file("race-orphan.uai")
        self.attach_ok("race-orphan", orphan, ttl_seconds=30)  # registered: then only claims
        self.assertEqual(self.client.detach("race-orphan").status, 204)
        resend = proxy.hold(Hold(claim_of("race-orphan"), UNAVAILABLE))
        self.addCleanup(proxy.unhold, resend)
        proxy.refuse(True)
        self.assertEqual(self.client.attach("race-orphan", orphan, ttl_seconds=30).status, 503)
        proxy.refuse(False)
        live_file = self.new_file("race-live.uai")
        self.attach_ok("race-live", live_file, ttl_seconds=30)
        self.assertEqual(self.client.detach("race-live").status, 204)
        live_claim = proxy.hold(Hold(claim_of("race-live")))
        self.addCleanup(proxy.unhold, live_claim)

        self.assertTrue(resend.arrival(10), "the pending intent was not resent")  # pass 1 waits
        answer = {}
        attach = threading.Thread(target=lambda: answer.update(r=self.client.attach("race-live", live_file,
                                                                                    ttl_seconds=30)))
        attach.start()
        self.assertTrue(live_claim.arrival(10), "the attach's claim did not leave")  # its intent is written
        resend.let_go()  # pass 1 ends
        self.assertTrue(resend.arrival(10), "no second pass")  # pass 2 has read both intents
        live_claim.let_go()
        attach.join(15)
        self.assertFalse(attach.is_alive())
        self.assertEqual(answer["r"].status, 201, answer["r"])
        proxy.unhold(live_claim)  # a resend of its intent would now reach the server
        claims = proxy.count(claim_of("race-live"))
        self.assertEqual(claims, 2)
        resend.let_go()  # pass 2 goes on to the attach's intent, ended meanwhile
        self.assertTrue(resend.arrival(10), "no third pass")  # pass 2 is over
        self.assertEqual(proxy.count(claim_of("race-live")), claims, "the ended attach's intent was resent")
        self.assertNotIn("adopted lease race-live", self.mepd.log_text())
        self.assertEqual(self.client.detach("race-live").status, 204)
        self.assertEqual(self.server_lease("race-live").status, 404)


class PowerLossStates(StateDbCase):
    """mepd writes a lease's row (with the delete of the claim intent that won it) and the
    delete of a released lease's row without an fsync: a power loss may take them back, and
    only them (the intent is written with one, before the claim leaves). Such a state is made
    here from the daemon's own rows, while it is down after a SIGKILL, and the daemon restarted
    on it: no power cut, but exactly what one may leave on disk."""

    def test_states_a_power_loss_may_leave(self):
        db = self.state_db()
        # Every intent the daemon deletes is kept aside, to be put back as a power loss would.
        db.execute("CREATE TABLE kept_intents AS SELECT * FROM intents WHERE 0")
        db.execute("CREATE TRIGGER keep_intents AFTER DELETE ON intents BEGIN "
                   "INSERT INTO kept_intents SELECT old.idem_key, old.body, old.path, old.bind_pid, old.created_at, "
                   "old.peer_uid, old.peer_gid; END")
        db.commit()
        live = self.attach_ok("pl-live", self.new_file("pl-live.uai"), ttl_seconds=30, bind="none")
        old = self.attach_ok("pl-old", self.new_file("pl-old.uai"), ttl_seconds=12, bind="none")
        gone = self.attach_ok("pl-gone", self.new_file("pl-gone.uai"), ttl_seconds=30, bind="none")
        gone_row = db.execute("SELECT * FROM leases WHERE canonical_name = 'pl-gone'").fetchall()
        self.assertEqual(len(gone_row), 1)
        self.assertEqual(self.client.detach("pl-gone").status, 204)
        self.assertEqual(self.server_lease("pl-gone").status, 404)
        live_before = self.lease_expiry("pl-live")
        self.mepd.proc.kill9()
        # pl-live and pl-old: the row and the intent's delete taken back; pl-gone: its delete.
        db.execute("DROP TRIGGER keep_intents")
        db.execute("DELETE FROM leases WHERE canonical_name IN ('pl-live', 'pl-old')")
        db.execute("INSERT INTO intents SELECT * FROM kept_intents WHERE body LIKE '%pl-live%' OR body LIKE '%pl-old%'")
        db.execute("INSERT INTO leases VALUES (%s)" % ", ".join("?" * len(gone_row[0])), gone_row[0])
        db.commit()
        self.assertEqual(db.execute("SELECT count(*) FROM intents").fetchone()[0], 2)
        time.sleep(12.5)  # pl-old's grant expires on the control plane meanwhile
        self.assertEqual(self.server_lease("pl-old").status, 404)
        self.mepd.start()

        # pl-live: the intent is resent under its key; the control plane answers with the same
        # grant, which is adopted and renewed at once (its expiry moves forward, same token).
        adopted = self.client.leases().get("pl-live")
        self.assertIsNotNone(adopted, "the lease was not re-adopted through its intent")
        self.assertEqual((adopted["lease_id"], adopted["fencing_token"]), (live["lease_id"], live["fencing_token"]))
        self.assertEqual(adopted["state"], "held")
        moved = lambda: self.lease_expiry("pl-live")[0] > live_before[0]
        self.assertTrue(self.poll(moved, 5, 0.2), "the adopted lease was not renewed at once")
        self.assertEqual(self.lease_expiry("pl-live")[1], live["fencing_token"])

        # pl-old: the same replayed grant, expired since: never held past its expiry. It is
        # renewed at once too, and the control plane says it is over (before: held locally
        # until its first renewal, ttl/3 after the restart, with nobody holding it any more).
        def not_held():
            lease = self.client.leases().get("pl-old")
            return lease is None or lease["state"] != "held"
        self.assertTrue(self.poll(not_held, 2), "a replayed grant that had expired is held: %r"
                        % self.client.leases().get("pl-old"))
        self.assertEqual(self.server_lease("pl-old").status, 404)

        # pl-gone: its row is back, but the release had reached the control plane: the renewal
        # learns it is over, and the lease is not taken again.
        def gone_not_held():
            lease = self.client.leases().get("pl-gone")
            return lease is None or lease["state"] != "held"
        self.assertTrue(self.poll(gone_not_held, 5), "a released lease's row brought it back")
        self.assertEqual(self.server_lease("pl-gone").status, 404)
        self.assertEqual(db.execute("SELECT count(*) FROM intents").fetchone()[0], 0)
        again = self.attach_ok("pl-gone", self.new_file("pl-gone-2.uai"), ttl_seconds=30)
        self.assertNotEqual(again["lease_id"], gone["lease_id"])
        self.assertEqual(self.client.detach("pl-live").status, 204)


if __name__ == "__main__":
    unittest.main()
