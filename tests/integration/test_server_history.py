"""Concurrency under contention, checked by the history checker (SPEC §3, S1–S4).

Clients race on a few names and memories with claims, renews, releases, branches,
verifies, stale-token mutations and abandoned leases that expire and are taken over;
every operation is recorded with its window and answer, and history.check() must find no
violation. The checker itself is tested on hand-made bad histories, so it can fail.
"""
import random
import shutil
import tempfile
import threading
import time
import unittest
import os

from history import History
from serverfixture import MepServer, create_token, drop_db, new_db, uuid7


def grant(start, end, memory, name, owner, token, server_ms, expiry_ms):
    def ts(ms):
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + ".%03dZ" % (ms % 1000)
    return {"kind": "claim", "start": start, "end": end, "status": 201, "name": name, "memory": memory,
            "owner": owner, "token": None,
            "body": {"fencing_token": token, "memory_instance_id": memory, "canonical_name": name,
                     "server_time": ts(server_ms), "expires_at": ts(expiry_ms)}}


class CheckerSelfTest(unittest.TestCase):
    """The checker flags the violations it exists for."""

    def test_token_reuse_and_order(self):
        h = History()
        h.ops = [grant(0, 1, "m", "a", "o1", 5, 1000, 2000), grant(2, 3, "m", "b", "o2", 5, 3000, 4000)]
        self.assertTrue(any(v.startswith("S3") for v in h.check()))
        h.ops = [grant(0, 1, "m", "a", "o1", 6, 1000, 2000), grant(2, 3, "m", "b", "o2", 5, 3000, 4000)]
        self.assertTrue(any(v.startswith("S3") for v in h.check()))

    def test_stale_mutation_accepted(self):
        h = History()
        h.ops = [grant(0, 1, "m", "a", "o1", 1, 1000, 2000), grant(2, 3, "m", "a", "o2", 2, 3000, 4000),
                 {"kind": "renew", "start": 4, "end": 5, "status": 200, "name": "a", "memory": "m",
                  "owner": "o1", "token": 1, "body": {"expires_at": "1970-01-01T00:00:09.000Z"}}]
        self.assertTrue(any(v.startswith("S4") for v in h.check()))

    def test_overlapping_holders(self):
        h = History()
        h.ops = [grant(0, 1, "m1", "a", "o1", 1, 1000, 9000), grant(2, 3, "m2", "a", "o2", 1, 3000, 4000)]
        self.assertTrue(any(v.startswith("S1") for v in h.check()))
        h.ops = [grant(0, 1, "m", "a", "o1", 1, 1000, 9000), grant(2, 3, "m", "b", "o2", 2, 3000, 4000)]
        self.assertTrue(any(v.startswith("S2") for v in h.check()))

    def test_release_outcomes(self):
        """A release ends a grant when it succeeded or its outcome is unknown (no answer, 503);
        a rejected one (409) does not."""
        def release(status):
            return {"kind": "release", "start": 1.5, "end": 1.6, "status": status, "name": "a", "memory": "m1",
                    "owner": "o1", "token": 1, "body": {}}
        base = [grant(0, 1, "m1", "a", "o1", 1, 1000, 9000), grant(2, 3, "m2", "a", "o2", 1, 3000, 4000)]
        for status, violation in ((204, False), (None, False), (503, False), (409, True)):
            h = History()
            h.ops = base + [release(status)]
            self.assertEqual(any(v.startswith("S1") for v in h.check()), violation, status)

    def test_consistent_history_passes(self):
        h = History()
        h.ops = [grant(0, 1, "m", "a", "o1", 1, 1000, 2000), grant(2, 3, "m", "b", "o2", 2, 3000, 4000)]
        self.assertEqual(h.check(), [])


class ContentionTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="mep-history-")
        self.db = new_db(self.dir, "control.db")
        self.token = create_token(self.db, "history")
        self.server = MepServer(self.dir, self.db, ["--rate-limit", "0"]).start()

    def tearDown(self):
        self.server.stop()
        drop_db(self.db)
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_contention_history_is_consistent(self):
        with self.server.client(self.token) as c:
            memories = [c.new_memory() for _ in range(4)]
        names = ["alpha", "bravo", "charlie", "delta"]
        history = History()
        # At least 9 s of contention, and on until the history holds enough grants to mean
        # something (a slow backend, such as the Spanner emulator on a loaded machine, takes
        # longer), 60 s at most.
        start = time.monotonic()
        counts = {"granted": 0, "locked": 0, "stale": 0}
        lock = threading.Lock()

        def running():
            elapsed = time.monotonic() - start
            with lock:
                enough = counts["granted"] > 50 and counts["locked"] > 0
            return elapsed < 9 or (not enough and elapsed < 60)

        def worker(seed):
            rnd = random.Random(seed)
            owner = "owner-%d" % seed
            old_tokens = {}
            with self.server.client(self.token) as c:
                while running():
                    name, memory = rnd.choice(names), rnd.choice(memories)
                    t0 = history.begin()
                    r = c.claim(name, memory, owner, ttl=5)
                    history.record("claim", t0, r.status, name=name, memory=memory, owner=owner, body=r.json)
                    if r.status == 423:
                        with lock:
                            counts["locked"] += 1
                        time.sleep(0.01)
                        continue
                    if r.status != 201:
                        continue
                    with lock:
                        counts["granted"] += 1
                    tok, cname = r.json["fencing_token"], r.json["canonical_name"]
                    # A stale token from an earlier grant on this memory must be refused.
                    if memory in old_tokens and rnd.random() < 0.5:
                        t0 = history.begin()
                        s = c.renew(cname, memory, old_tokens[memory], owner)
                        history.record("renew", t0, s.status, name=cname, memory=memory, owner=owner,
                                       token=old_tokens[memory], body=s.json)
                        with lock:
                            counts["stale"] += s.status == 409
                    old_tokens[memory] = tok
                    t0 = history.begin()
                    s = c.renew(cname, memory, tok, owner, ttl=5)
                    history.record("renew", t0, s.status, name=cname, memory=memory, owner=owner, token=tok, body=s.json)
                    t0 = history.begin()
                    v = c.verify(memory, tok)
                    history.record("verify", t0, v.status, memory=memory, token=tok, body=v.json)
                    if rnd.random() < 0.1:
                        t0 = history.begin()
                        b = c.branch(memory, tok)
                        history.record("branch", t0, b.status, memory=memory, token=tok, body=b.json)
                    if rnd.random() < 0.15:
                        continue  # abandon: it expires and someone takes it over
                    t0 = history.begin()
                    s = c.release(cname, memory, tok, owner)
                    history.record("release", t0, s.status, name=cname, memory=memory, owner=owner, token=tok, body=s.json)

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        violations = History.check(history)
        print(f"{len(history.ops)} operations, counts {counts}")
        self.assertEqual(violations, [])
        self.assertGreater(counts["granted"], 50)
        self.assertGreater(counts["locked"], 0, "no contention happened")


if __name__ == "__main__":
    unittest.main()
