"""The token carried into writes, against a real data plane (``mep store``): sync, fetch
on a second daemon, and a stale token refused. Skipped (with the reason printed) while
``$MEP_BIN`` has no ``mep store``."""
import asyncio
import os
import signal
import threading
import time
import unittest

from .harness import DaemonTestCase, require_store

import mep
import mep.aio


def all_stopped(pid):
    """Whether every thread of process `pid` is stopped (state T in /proc/PID/task/*/stat)."""
    try:
        tasks = os.listdir("/proc/%d/task" % pid)
        states = []
        for t in tasks:
            with open("/proc/%d/task/%s/stat" % (pid, t)) as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
    except OSError:
        return False
    return bool(states) and all(st in ("T", "t") for st in states)


class StoreTest(DaemonTestCase):
    def setUp(self):
        super().setUp()
        require_store()

    def test_sync_fetch_and_stale_token_refused(self):
        store = self.start_store()
        server, d1 = self.start_remote(tag="host1", store=store)
        _, d2 = self.start_remote(tag="host2", server=server, store=store)
        c1, c2 = d1.client(), d2.client()
        path = self.new_memory(c1, "host1.uai")
        with open(path, "wb") as f:
            f.write(b"memories of host 1")
        with c1.lease("Traveller", path, ttl=10) as old:
            try:
                result = old.sync()
            except mep.NotSupported as e:
                self.skipTest("this mepd has no POST /v1/sync yet: %s" % e)
            self.assertEqual((result.canonical_name, result.memory_instance_id, result.fencing_token, result.size),
                             ("traveller", old.memory_instance_id, old.token, len(b"memories of host 1")))
            self.assertTrue(result.etag)
        # The memory moves to host 2.
        path2 = os.path.join(self.work, "host2.uai")
        fetched = c2.fetch(old.memory_instance_id, path2)
        self.assertEqual((fetched.memory_instance_id, fetched.size), (old.memory_instance_id, len(b"memories of host 1")))
        with open(path2, "rb") as f:
            self.assertEqual(f.read(), b"memories of host 1")
        self.assertEqual(c2.identify(path2).memory_instance_id, old.memory_instance_id)
        with self.assertRaises(mep.InvalidRequest):
            c2.fetch(old.memory_instance_id, path2)  # the file must be new
        with c2.lease("Traveller", path2, ttl=10) as new:
            self.assertGreater(new.token, old.token)
            # The zombie's token: the daemon advanced the store's mark before handing out
            # the new one, so the old token is refused.
            with self.assertRaises(mep.LeaseLost):
                old.fencing_headers()  # released: the SDK refuses to hand out the token
            status, body = store.put(old.memory_instance_id, b"zombie write", old.fencing_headers(strict=False))
            self.assertEqual(status, 409, body)
            self.assertIn(b"stale-fence", body)
            status, body = store.put(new.memory_instance_id, b"fresh write", new.fencing_headers())
            self.assertLess(status, 300, body)
            with open(path2, "wb") as f:
                f.write(b"memories of host 2")
            self.assertEqual(new.sync().fencing_token, new.token)
        with self.assertRaises(mep.MemoryNotFound):
            c2.fetch("01a23331-0cc3-7298-afd1-580522a5ec00", os.path.join(self.work, "nothing.uai"))

    def test_sync_and_fetch_are_not_cut_by_the_request_timeout(self):
        # mepd answers a sync or a fetch only once the transfer is done, so a large file
        # keeps the socket silent for as long as it takes: the client's per-request timeout
        # (1 s here) must not cut it. The store is paused (SIGSTOP) for 3 s meanwhile.
        store = self.start_store()
        _, d = self.start_remote(store=store)
        c = d.client()
        path = self.new_memory(c)
        with open(path, "wb") as f:
            f.write(b"a large memory " * 10000)

        def stop_store():
            # Stopped for certain before the call is made: every thread of the store in
            # state T (a call it still answered would make the pause meaningless; run 13 of
            # the CI series saw a fetch answered in 23 ms right after the SIGSTOP).
            store.proc.signal(signal.SIGSTOP)
            deadline = time.monotonic() + 10
            while not all_stopped(store.proc.pid):
                self.assertLess(time.monotonic(), deadline, "the store did not stop")
                time.sleep(0.01)

        def paused(fn, seconds=3.0):
            stop_store()
            timer = threading.Timer(seconds, store.proc.signal, (signal.SIGCONT,))
            timer.start()
            try:
                t0 = time.monotonic()
                return fn(), time.monotonic() - t0
            finally:
                timer.cancel()
                timer.join()
                store.proc.signal(signal.SIGCONT)

        with c.lease("slow store", path, ttl=30) as lease:
            c.timeout = 1.0
            try:
                try:
                    result, took = paused(lease.sync)
                except mep.NotSupported as e:
                    self.skipTest("this mepd has no POST /v1/sync yet: %s" % e)
                self.assertGreater(took, 2.5)
                self.assertEqual((result.fencing_token, result.size), (lease.token, os.path.getsize(path)))
                # An explicit timeout still bounds it.
                with self.assertRaises(mep.DaemonTimeout):
                    paused(lambda: lease.sync(timeout=0.5))
                with self.assertRaises(ValueError):
                    lease.sync(timeout=0)
            finally:
                c.timeout = 20.0
        c.timeout = 1.0
        fetched, took = paused(lambda: c.fetch(lease.memory_instance_id, os.path.join(self.work, "copy.uai")))
        self.assertGreater(took, 2.5)
        self.assertEqual(fetched.size, os.path.getsize(path))

        async def aio():
            ac = mep.aio.AsyncClient(d.socket_path, timeout=20)
            async with ac.lease("slow store", path, ttl=30) as alease:
                ac.timeout = 1.0
                loop = asyncio.get_running_loop()
                stop_store()
                loop.call_later(3.0, store.proc.signal, signal.SIGCONT)
                try:
                    t0 = time.monotonic()
                    r = await alease.sync()
                    self.assertGreater(time.monotonic() - t0, 2.5)
                    self.assertEqual(r.fencing_token, alease.token)
                finally:
                    store.proc.signal(signal.SIGCONT)
                    ac.timeout = 20.0

        asyncio.run(asyncio.wait_for(aio(), 60))

    def test_sync_without_a_store(self):
        d = self.start_mepd()
        c = d.client()
        path = self.new_memory(c)
        with c.lease("no store", path) as lease:
            try:
                lease.sync()
                self.fail("a mepd without --store cannot sync")
            except mep.NotSupported as e:
                self.skipTest("this mepd has no POST /v1/sync yet: %s" % e)
            except mep.StoreNotConfigured as e:
                self.assertEqual(e.status, 501)
            self.assertFalse(lease.lost.is_set(), "a daemon without a store does not cost the lease")


if __name__ == "__main__":
    unittest.main()
