"""Faults under mepd's own state directory (SPEC §3 L4, issue 21): with the state on a
small tmpfs (root only: mount), mepd keeps running and keeps renewing what it holds when
that disk is full or read-only, answers new work with a 503 problem that says why, logs
it once, and recovers when space returns; a state database deleted under it does not end
it either.
"""
import os
import shutil
import subprocess
import time
import unittest

from daemonfixture import Mepd
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


if __name__ == "__main__":
    unittest.main()
