"""The asyncio SDK (:mod:`mep.aio`) against a real mepd."""
import asyncio
import datetime
import os
import signal
import socket
import unittest

from .harness import DaemonTestCase, mep_bin

import mep
import mep.aio


class AioTest(DaemonTestCase):
    def setUp(self):
        super().setUp()
        self.d = self.start_mepd()
        self.c = mep.aio.AsyncClient(self.d.socket_path, timeout=10)

    def run_async(self, coro, timeout=60):
        return asyncio.run(asyncio.wait_for(coro, timeout))

    def test_acquire_and_release(self):
        async def main():
            path = os.path.join(self.work, "m.uai")
            created = await self.c.init(path)
            async with self.c.lease("Async Agent", path, ttl=10) as lease:
                self.assertIsInstance(lease, mep.aio.AsyncLease)
                self.assertEqual(lease.canonical_name, "asyncagent")
                self.assertEqual(lease.memory_instance_id, created.memory_instance_id)
                self.assertIs(mep.current_lease(), lease)
                self.assertIsInstance(lease.lost, asyncio.Event)
                listed = await self.c.leases()
                self.assertEqual([(l.canonical_name, l.bind_pid) for l in listed], [("asyncagent", os.getpid())])
                self.assertEqual(lease.fencing_headers(), {"Fencing-Token": str(lease.token)})
                with self.assertRaises(mep.NameHeld):
                    await self.c.acquire("async agent", path)
            self.assertIsNone(mep.current_lease())
            self.assertEqual(await self.c.leases(), [])
            with self.assertRaises(mep.LeaseLost):
                lease.fencing_headers()  # released: as check()
            self.assertEqual((await self.c.identify(path)).memory_instance_id, created.memory_instance_id)
            self.assertEqual((await self.c.canonicalize("My Agent")).canonical_name, "myagent")

        self.run_async(main())

    def test_exception_propagates_and_releases(self):
        async def main():
            path = os.path.join(self.work, "m.uai")
            await self.c.init(path)
            with self.assertRaises(KeyError):
                async with self.c.lease("raiser", path):
                    raise KeyError("x")
            self.assertEqual(await self.c.leases(), [])

        self.run_async(main())

    def test_failed_release_is_retried_after_a_daemon_restart(self):
        async def main():
            path = os.path.join(self.work, "m.uai")
            await self.c.init(path)
            loop = asyncio.get_running_loop()
            lease = await self.c.acquire("aio stuck", path, ttl=10)
            await loop.run_in_executor(None, self.d.stop)
            with self.assertRaises(mep.DaemonNotRunning):
                await lease.release()
            self.assertFalse(lease.released)
            with self.assertRaises(mep.LeaseLost):
                lease.check()
            with self.assertRaises(mep.LeaseLost):
                lease.fencing_headers()
            await loop.run_in_executor(None, self.d.start)
            await lease.release()
            self.assertTrue(lease.released)
            self.assertEqual(await self.c.leases(), [])
            async with self.c.lease("aio stuck", path) as again:
                self.assertGreater(again.token, lease.token)
            # Leaving an `async with` block normally while the daemon is down raises too,
            # and the lease can still be released.
            with self.assertRaises(mep.DaemonNotRunning):
                async with self.c.lease("aio stuck", path, ttl=10) as blocked:
                    await loop.run_in_executor(None, self.d.stop)
            await loop.run_in_executor(None, self.d.start)
            await blocked.release()
            self.assertEqual(await self.c.leases(), [])

        self.run_async(main())

    def test_lost_wait_when_released_elsewhere(self):
        async def main():
            path = os.path.join(self.work, "m.uai")
            await self.c.init(path)
            calls = []

            async def async_cb(lease):
                calls.append("async")

            async with self.c.lease("aio released", path, ttl=30) as lease:
                lease.on_lost(lambda l: calls.append("sync"))
                lease.on_lost(async_cb)
                proc = await asyncio.create_subprocess_exec(mep_bin(), "--socket", self.d.socket_path, "release",
                                                            "aio released", env=self.env,
                                                            stdout=asyncio.subprocess.DEVNULL)
                self.assertEqual(await proc.wait(), 0)
                await asyncio.wait_for(lease.lost.wait(), 5)
                self.assertIn(lease.lost_reason, ("released", "not-held"))
                self.assertTrue(lease.at_risk.is_set())
                for _ in range(50):
                    if len(calls) == 2:
                        break
                    await asyncio.sleep(0.05)
                self.assertEqual(sorted(calls), ["async", "sync"])
                with self.assertRaises(mep.LeaseLost):
                    lease.check()
                with self.assertRaises(mep.LeaseGone):
                    await lease.verify()
            self.assertEqual(sorted(calls), ["async", "sync"], "each callback once")
            self.assertEqual(await self.c.leases(), [])

        self.run_async(main())

    def test_local_deadline_when_the_daemon_is_frozen(self):
        async def main():
            path = os.path.join(self.work, "m.uai")
            await self.c.init(path)
            async with self.c.lease("aio frozen", path, ttl=5) as lease:
                self.d.proc.signal(signal.SIGSTOP)
                try:
                    await asyncio.wait_for(lease.lost.wait(), 8)
                    self.assertEqual(lease.lost_reason, "local-deadline")
                finally:
                    self.d.proc.signal(signal.SIGCONT)

        self.run_async(main())

    def test_daemon_restart_keeps_the_lease(self):
        async def main():
            path = os.path.join(self.work, "m.uai")
            await self.c.init(path)
            async with self.c.lease("aio restarted", path, ttl=30) as lease:
                await asyncio.get_running_loop().run_in_executor(None, self.d.stop)
                await asyncio.wait_for(lease.at_risk.wait(), 5)
                await asyncio.get_running_loop().run_in_executor(None, self.d.start)
                for _ in range(200):
                    if not lease.at_risk.is_set():
                        break
                    await asyncio.sleep(0.05)
                self.assertFalse(lease.at_risk.is_set(), lease.at_risk_reason)
                self.assertFalse(lease.lost.is_set())
            self.assertEqual(await self.c.leases(), [])

        self.run_async(main())

    def test_events(self):
        async def main():
            path = os.path.join(self.work, "m.uai")
            async with self.c.events() as stream:
                await self.c.init(path)
                async with self.c.lease("aio events", path, ttl=5) as lease:
                    ev = await stream.next(5)
                    self.assertEqual((ev.event, ev.canonical_name, ev.fencing_token),
                                     ("granted", "aioevents", lease.token))
                seen = []
                async for ev in stream:
                    seen.append(ev.event)
                    if ev.event == "released":
                        break
                self.assertEqual(seen[-1], "released")
            # `async for` on the module-level stream, which ends with the daemon.
            old = os.environ.get("MEP_SOCKET")
            os.environ["MEP_SOCKET"] = self.d.socket_path
            try:
                stream = mep.aio.events()
                await stream.open()
                await asyncio.get_running_loop().run_in_executor(None, self.d.stop)
                self.assertEqual([e async for e in stream], [])
            finally:
                if old is None:
                    os.environ.pop("MEP_SOCKET", None)
                else:
                    os.environ["MEP_SOCKET"] = old

        self.run_async(main())

    def test_context_variable_per_task(self):
        async def main():
            p1, p2 = os.path.join(self.work, "a.uai"), os.path.join(self.work, "b.uai")
            await self.c.init(p1)
            await self.c.init(p2)

            async def agent(name, path):
                async with self.c.lease(name, path) as lease:
                    await asyncio.sleep(0.2)
                    return mep.current_lease() is lease, lease.canonical_name

            results = await asyncio.gather(agent("task one", p1), agent("task two", p2))
            self.assertEqual(results, [(True, "taskone"), (True, "tasktwo")])
            self.assertIsNone(mep.current_lease())

        self.run_async(main())

    def test_labels_max_hold_and_the_holder_of_a_refused_claim(self):
        async def main():
            p1, p2 = os.path.join(self.work, "a.uai"), os.path.join(self.work, "b.uai")
            await self.c.init(p1)
            await self.c.init(p2)
            before = datetime.datetime.now(datetime.timezone.utc)
            async with self.c.lease("Async Builder", p1, ttl=10, labels={"job": "ci-7"}, max_hold=600) as lease:
                self.assertEqual([l.lease_id for l in await self.c.leases()], [lease.lease_id])
                other = mep.aio.AsyncClient(self.d.socket_path, timeout=10)
                with self.assertRaises(mep.NameHeld) as cm:
                    await other.acquire("async builder", p2, labels={"job": "ci-8"}, max_hold=60)
                now = datetime.datetime.now(datetime.timezone.utc)
                h = cm.exception.holder
                self.assertIsInstance(h, mep.Holder)
                self.assertEqual((h.display_name, h.host), ("Async Builder", socket.gethostname()))
                self.assertLessEqual(h.since, now)
                self.assertGreaterEqual(h.since, before - datetime.timedelta(seconds=1))
                self.assertGreater(h.expires_at, h.since)
                with self.assertRaises(mep.MemoryAttached) as cm:
                    async with other.lease("another", p1, max_hold=60):
                        self.fail("must not get here")
                self.assertEqual(cm.exception.holder.display_name, "Async Builder")
            info = await self.c.attach("async bare", p2, ttl=10, bind="none", labels={"k": "v"}, max_hold=30)
            self.assertEqual((info.canonical_name, info.state), ("asyncbare", "held"))
            self.assertIsNone(await self.c.detach("async bare", info.lease_id))
            self.assertEqual(await self.c.leases(), [])

        self.run_async(main())

    def test_max_hold_reached_is_lost_with_reason_max_hold(self):
        async def main():
            path = os.path.join(self.work, "m.uai")
            await self.c.init(path)
            calls = []
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            async with self.c.lease("aio short hold", path, ttl=5, max_hold=6) as lease:
                lease.on_lost(lambda l: calls.append(l.lost_reason))
                await asyncio.wait_for(lease.lost.wait(), 15)
                self.assertEqual(lease.lost_reason, "max-hold")
                self.assertLess(loop.time() - t0, 7)
                with self.assertRaises(mep.LeaseLost) as cm:
                    lease.check()
                self.assertEqual(cm.exception.reason, "max-hold")
                for _ in range(100):
                    if calls:
                        break
                    await asyncio.sleep(0.05)
                self.assertEqual(calls, ["max-hold"])
                info = await self.c.get_lease("aio short hold")
                self.assertEqual((info.state, info.lost_reason), ("lost", "max-hold"))
            self.assertEqual(await self.c.leases(), [])

        self.run_async(main())

    def test_daemon_not_running(self):
        async def main():
            c = mep.aio.AsyncClient(os.path.join(self.dir, "none.sock"))
            with self.assertRaises(mep.DaemonNotRunning):
                async with c.lease("x", os.path.join(self.work, "m.uai")):
                    pass

        self.run_async(main())


if __name__ == "__main__":
    unittest.main()
