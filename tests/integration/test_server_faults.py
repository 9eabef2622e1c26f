"""Crash safety of the SQLite control plane: SIGKILL during a claim storm.

`server_kill9_mid_claims_consistent` (SPEC §13): every grant the server acknowledged is on
disk after a SIGKILL (S3: a fencing token is never issued twice), the database holds no
partial claim (S5), and service resumes on the same file with strictly larger tokens. (A
process kill checks that replies follow the commit; power loss, which fsync guards
against, cannot be simulated here.)
"""
import os
import shutil
import sqlite3
import tempfile
import threading
import time
import unittest

from serverfixture import MepServer, create_token, unique_name


class ServerKill9Test(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="mep-faults-")
        self.db = os.path.join(self.dir, "control.db")
        self.token = create_token(self.db, "faults")
        self.server = MepServer(self.dir, self.db, ["--rate-limit", "0"]).start()

    def tearDown(self):
        self.server.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_server_kill9_mid_claims_consistent(self):
        memories = []
        with self.server.client(self.token) as c:
            for _ in range(16):
                memories.append(c.new_memory())
        acked = {m: [] for m in memories}  # acknowledged fencing tokens per memory
        lock = threading.Lock()
        stop = threading.Event()

        def storm(memory):
            name = unique_name("storm")
            try:
                with self.server.client(self.token) as c:
                    while not stop.is_set():
                        r = c.claim(name, memory, "owner-" + memory)
                        if r.status != 201:
                            continue
                        with lock:
                            acked[memory].append(r.json["fencing_token"])
                        c.release(r.json["canonical_name"], memory, r.json["fencing_token"], "owner-" + memory)
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
        print(f"{total} grants acknowledged before SIGKILL")

        # The file is consistent and every acknowledged grant survived.
        con = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True)
        try:
            self.assertEqual(con.execute("PRAGMA integrity_check").fetchone()[0], "ok")
            counters = dict(con.execute("SELECT memory_id, fence_counter FROM memories"))
            for m, tokens in acked.items():
                self.assertEqual(len(tokens), len(set(tokens)), f"token issued twice on {m}")
                self.assertEqual(tokens, sorted(tokens), f"tokens not increasing on {m}")
                if tokens:
                    self.assertGreaterEqual(counters[m], max(tokens), f"an acknowledged grant on {m} was lost")
            # No partial claim: every lease's token is its memory's current counter.
            for memory, token in con.execute("SELECT memory_id, fencing_token FROM leases"):
                self.assertEqual(token, counters[memory])
        finally:
            con.close()

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


if __name__ == "__main__":
    unittest.main()
