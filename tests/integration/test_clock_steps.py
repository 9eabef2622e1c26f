"""Wall-clock steps cannot hand a live lease to another owner (SPEC §9). The clock that
decides expiry runs under Debian's libfaketime with FAKETIME_DONT_FAKE_MONOTONIC=1, so only
the wall clock moves, as an NTP step does (the step is written to FAKETIME_TIMESTAMP_FILE
while it runs).

On SQLite (`mep server` under libfaketime; its lease clock is monotonic):
- a forward step one second after a 30 s grant does not hand the lease to another owner;
- a backward step does not keep a dead holder's lease past its TTL;
- a restart with the wall clock stepped while the server was down keeps live leases live
  (the lease clock goes on from its checkpoint and the boot time since).

On PostgreSQL (the database under libfaketime, a cluster of the test's own; the database's
clock decides, and each server watches it against its own monotonic clock):
- a forward step one second after a 30 s grant: another owner's claim is refused at once
  (the claim's bound) and after the step is found (its record), also through a server
  started after the step; the holder renews; the step is counted and logged;
- the holder renews at once after a forward step that jumped over its lease's expiry, before
  any server has found the step, and fence/verify finds its token live (the bound, schema v8);
- a lease that expired inside the step is taken over one TTL after the step, not before;
- a backward step is counted and logged.
"""
import os
import shutil
import subprocess
import tempfile
import time
import unittest
from datetime import datetime

import pgfixture
from serverfixture import ApiClient, MepServer, create_token, new_key, unique_name

LIBFAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"


@unittest.skipIf(pgfixture.backend() != "sqlite", "SQLite's lease clock (PostgreSQL's and Spanner's are the database's)")
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


def metric(port, name):
    with ApiClient(port) as c:
        r = c.get("/metrics")
    for line in r.raw.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no metric %s" % name)


class ClockStepsPostgres(unittest.TestCase):
    def setUp(self):
        if not os.path.exists(LIBFAKETIME):
            self.skipTest("libfaketime is not installed (packaging/install-deps.sh installs it)")
        self.workdir = tempfile.mkdtemp(prefix="mep-clock-pg-")
        self.addCleanup(shutil.rmtree, self.workdir, True)
        os.chmod(self.workdir, 0o755)  # the cluster's user reads the step file
        self.step_file = os.path.join(self.workdir, "faketime")
        self.step("+0")
        cluster = pgfixture.PgCluster()
        self.addCleanup(cluster.destroy)
        cluster.start(env={"LD_PRELOAD": LIBFAKETIME, "FAKETIME_DONT_FAKE_MONOTONIC": "1",
                           "FAKETIME_TIMESTAMP_FILE": self.step_file, "FAKETIME_NO_CACHE": "1"})
        self.db = pgfixture.PgDb(cluster.url)
        self.token = create_token(self.db, "tenant-a")

    def step(self, offset):
        """Steps the clock; returns the monotonic time just before the step took effect, which
        no reading of the stepped clock can precede (the sleep after it may overrun)."""
        with open(self.step_file + ".tmp", "w") as f:
            f.write(offset + "\n")
        os.chmod(self.step_file + ".tmp", 0o644)
        before = time.monotonic()
        os.replace(self.step_file + ".tmp", self.step_file)
        time.sleep(0.1)
        return before

    def start(self):
        server = MepServer(self.workdir, self.db, ("--rate-limit", "0")).start()
        self.addCleanup(server.stop)
        # The server's first reading of the database clock, which later ones are compared with.
        deadline = time.monotonic() + 30
        while "watching the database clock" not in server.stderr_text():
            self.assertLess(time.monotonic(), deadline, server.stderr_text()[-2000:])
            time.sleep(0.05)
        client = ApiClient(server.port, self.token)
        self.addCleanup(client.close)
        return server, client

    def claim(self, c, name, memory, owner, ttl):
        return c.claim(name, memory, owner, ttl=ttl, key=new_key())

    def test_forward_step_does_not_hand_a_live_lease_to_another_owner(self):
        server, c = self.start()
        memory, name = c.new_memory(), unique_name("fwd")
        first = self.claim(c, name, memory, "owner-a", 30)
        self.assertEqual(first.status, 201, first)
        granted = time.monotonic()
        time.sleep(1)
        self.step("+60")
        # At once: the step is not found yet; the claim's bound refuses the takeover.
        other = self.claim(c, name, memory, "owner-b", 30)
        self.assertEqual(other.status, 423, other)
        self.assertEqual(other.json["code"], "name-held")
        # Once found (a reading a second), the step is recorded and the lease held back, on
        # every server: also one started after the step, whose clock readings know nothing of it.
        deadline = time.monotonic() + 10
        while metric(server.port, "mep_clock_steps_total") < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        self.assertEqual(metric(server.port, "mep_clock_steps_total"), 1)
        self.assertRegex(server.stderr_text(), r"the database clock stepped forward by (59|60)\.\d{3} s")
        late, c2 = self.start()
        for client in (c, c2):
            other = self.claim(client, name, memory, "owner-b", 30)
            self.assertEqual(other.status, 423, other)
        self.assertLess(time.monotonic() - granted, 30, "the checks must run inside the holder's TTL")
        # The holder's lease is still its own: renewed, and its token still the only one.
        r = c.renew(name, memory, first.json["fencing_token"], "owner-a", ttl=30)
        self.assertEqual(r.status, 200, r)
        other = self.claim(c2, name, memory, "owner-b", 30)
        self.assertEqual(other.status, 423, other)

    def test_the_holder_renews_at_once_after_a_forward_step(self):
        # The step jumps over the lease's expiry. Until a server finds it (a reading a
        # second) and records it, only the renewal's bound keeps the lease its holder's, as
        # the claim's bound keeps others out: without it (before schema v8) the holder was
        # told 410 lease-expired and gave up a lease no one else could have taken. A try
        # whose renewal ran after the step was found says nothing; then another step.
        server, c = self.start()
        before_found = 0
        for attempt in range(1, 9):  # each try may lose the race on a loaded machine
            memory, name = c.new_memory(), unique_name("renew")
            first = self.claim(c, name, memory, "owner-a", 30)
            self.assertEqual(first.status, 201, first)
            steps = metric(server.port, "mep_clock_steps_total")
            self.step("+%d" % (60 * attempt))
            # A data plane's check of the token (mep store --strict) still finds it live.
            v = c.post("/v1/fence/verify", {"memory_instance_id": memory, "fencing_token": first.json["fencing_token"]})
            self.assertEqual(v.status, 200, v)
            # As mepd renews (renew-batch), then on its own.
            b = c.post("/v1/leases/renew-batch", {"owner_client_id": "owner-a", "leases": [
                {"canonical_name": name, "memory_instance_id": memory,
                 "fencing_token": first.json["fencing_token"], "ttl_seconds": 30}]})
            self.assertEqual(b.status, 200, b)
            self.assertEqual(b.json["results"][0]["status"], 200, b.json)
            r = c.renew(name, memory, first.json["fencing_token"], "owner-a", ttl=30)
            self.assertEqual(r.status, 200, r)
            # The expiry is max(old, the database clock + ttl): past the step, as its clock reads.
            left = (datetime.fromisoformat(r.json["expires_at"].replace("Z", "+00:00")) -
                    datetime.fromisoformat(r.json["server_time"].replace("Z", "+00:00"))).total_seconds()
            self.assertGreaterEqual(left, 29, r.json)
            other = self.claim(c, name, memory, "owner-b", 30)
            self.assertEqual(other.status, 423, other)
            if metric(server.port, "mep_clock_steps_total") == steps:
                before_found += 1
                break
            deadline = time.monotonic() + 10  # found: wait for its record, then step again
            while metric(server.port, "mep_clock_steps_total") < steps + 1 and time.monotonic() < deadline:
                time.sleep(0.1)
        self.assertGreater(before_found, 0, "in eight tries the server found the step before the renewal ran")

    def test_a_lease_that_expired_in_the_step_is_taken_one_ttl_after_it(self):
        server, c = self.start()
        memory, name = c.new_memory(), unique_name("hold")
        first = self.claim(c, name, memory, "owner-a", 5)
        self.assertEqual(first.status, 201, first)
        stepped = self.step("+60")
        # Refused while the holder's own deadline (5 s after its grant) may not have passed.
        while time.monotonic() - stepped < 3.5:
            other = self.claim(c, name, memory, "owner-b", 5)
            self.assertEqual(other.status, 423, other)
            time.sleep(0.5)
        # One TTL after the step (found within a second of it) the lease is free.
        taken = None
        while time.monotonic() - stepped < 12:
            other = self.claim(c, name, memory, "owner-b", 5)
            if other.status == 201:
                taken = other
                break
            self.assertEqual(other.status, 423, other)
            time.sleep(0.2)
        self.assertIsNotNone(taken, "the lease was still held back 12 s after the step")
        self.assertGreaterEqual(time.monotonic() - stepped, 5)
        self.assertEqual(taken.json["fencing_token"], first.json["fencing_token"] + 1)

    def test_backward_step_is_counted_and_logged(self):
        server, c = self.start()
        self.assertEqual(metric(server.port, "mep_clock_steps_total"), 0)
        self.step("-60")
        deadline = time.monotonic() + 10
        while metric(server.port, "mep_clock_steps_total") < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        self.assertEqual(metric(server.port, "mep_clock_steps_total"), 1)
        self.assertRegex(server.stderr_text(), r"the database clock stepped back by (59|60)\.\d{3} s")


if __name__ == "__main__":
    unittest.main()
