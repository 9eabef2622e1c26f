"""Wall-clock steps cannot move a lease (SPEC §9), on SQLite: `mep server` runs under
Debian's libfaketime with FAKETIME_DONT_FAKE_MONOTONIC=1, so only the wall clock moves, as
an NTP step does (the step is written to FAKETIME_TIMESTAMP_FILE while it runs).

- a forward step one second after a 30 s grant does not hand the lease to another owner;
- a backward step does not keep a dead holder's lease past its TTL;
- a restart with the wall clock stepped while the server was down keeps live leases live
  (the lease clock goes on from its checkpoint and the boot time since).
"""
import os
import shutil
import subprocess
import tempfile
import time
import unittest

import pgfixture
from serverfixture import ApiClient, MepServer, create_token, new_key, unique_name

LIBFAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"


@unittest.skipIf(pgfixture.backend() == "postgresql", "SQLite's lease clock (PostgreSQL's is the database's)")
class ClockSteps(unittest.TestCase):
    def setUp(self):
        if not os.path.exists(LIBFAKETIME):
            self.skipTest("libfaketime is not installed (packaging/install-deps.sh installs it)")
        if os.environ.get("MEP_TEST_SANITIZED"):
            # libfaketime's clock_gettime recurses into AddressSanitizer's interceptors at start-up.
            self.skipTest("libfaketime cannot be preloaded into a sanitizer build (%s)" % os.environ["MEP_TEST_SANITIZED"])
        self.workdir = tempfile.mkdtemp(prefix="mep-clock-")
        self.addCleanup(shutil.rmtree, self.workdir, True)
        self.db = os.path.join(self.workdir, "c.db")
        self.token = create_token(self.db, "tenant-a")
        self.step_file = os.path.join(self.workdir, "faketime")
        self.step("+0")
        self.server = None

    def step(self, offset):
        """Sets the faked wall clock's offset from the real one ("+60", "-60")."""
        with open(self.step_file + ".tmp", "w") as f:
            f.write(offset + "\n")
        os.replace(self.step_file + ".tmp", self.step_file)
        time.sleep(0.1)  # libfaketime re-reads the file at each call (FAKETIME_NO_CACHE=1)

    def start(self):
        env_wrap = ["env", "LD_PRELOAD=" + LIBFAKETIME, "FAKETIME_DONT_FAKE_MONOTONIC=1",
                    "FAKETIME_TIMESTAMP_FILE=" + self.step_file, "FAKETIME_NO_CACHE=1"]
        self.server = MepServer(self.workdir, self.db, ("--rate-limit", "0"), wrap=lambda argv: env_wrap + argv).start()
        self.addCleanup(self.server.stop)
        return ApiClient(self.server.port, self.token)

    def claim(self, c, name, memory, owner, ttl=None):
        return c.claim(name, memory, owner, ttl=ttl, key=new_key())

    def test_forward_step_does_not_hand_a_live_lease_to_another_owner(self):
        c = self.start()
        memory, name = c.new_memory(), unique_name("fwd")
        first = self.claim(c, name, memory, "owner-a", ttl=30)
        self.assertEqual(first.status, 201, first)
        time.sleep(1)
        self.step("+60")
        other = self.claim(c, name, memory, "owner-b", ttl=30)
        self.assertEqual(other.status, 423, other)
        self.assertEqual(other.json["code"], "name-held")
        # The holder's renewal still works and its token is still the only one.
        r = c.renew(name, memory, first.json["fencing_token"], "owner-a", ttl=30)
        self.assertEqual(r.status, 200, r)

    def test_backward_step_does_not_stretch_a_dead_holders_lease(self):
        c = self.start()
        memory, name = c.new_memory(), unique_name("back")
        first = self.claim(c, name, memory, "owner-a", ttl=5)
        self.assertEqual(first.status, 201, first)
        self.step("-60")
        time.sleep(5.5)  # the TTL, by real (monotonic) time
        other = self.claim(c, name, memory, "owner-b", ttl=5)
        self.assertEqual(other.status, 201, other)
        self.assertGreater(other.json["fencing_token"], first.json["fencing_token"])

    def test_restart_with_a_step_while_down_keeps_live_leases(self):
        c = self.start()
        memory, name = c.new_memory(), unique_name("restart")
        first = self.claim(c, name, memory, "owner-a", ttl=60)
        self.assertEqual(first.status, 201, first)
        time.sleep(2.5)  # a clock checkpoint is saved with each sweep (once a second)
        self.server.stop()
        self.step("+120")  # the wall clock jumps past the lease's expiry while the server is down
        c = self.start()
        other = self.claim(c, name, memory, "owner-b", ttl=60)
        self.assertEqual(other.status, 423, other)
        r = c.renew(name, memory, first.json["fencing_token"], "owner-a", ttl=60)
        self.assertEqual(r.status, 200, r)


if __name__ == "__main__":
    unittest.main()
