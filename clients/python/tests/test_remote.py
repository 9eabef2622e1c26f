"""The SDK against a mepd that uses a remote control plane (a real ``mep server``)."""
import asyncio
import datetime
import os
import signal
import socket
import subprocess
import threading
import time
import unittest

from .harness import DaemonTestCase, mep_bin, wait_until

import mep
import mep.aio


class RemoteTest(DaemonTestCase):
    def test_acquire_and_release_through_a_remote_server(self):
        server, d = self.start_remote()
        c = d.client()
        self.assertIn(server.url, c.health().control_plane or "")
        path = self.new_memory(c)
        with c.lease("Remote Agent", path, ttl=10) as lease:
            self.assertEqual(lease.canonical_name, "remoteagent")
            self.assertEqual([l.lease_id for l in c.leases()], [lease.lease_id])
            first = lease.token
        self.assertEqual(c.leases(), [])
        # A second daemon (another host, as far as the server knows) sees the name as free
        # again, and then held by it.
        _, d2 = self.start_remote(tag="mepd2", server=server)
        c2 = d2.client()
        path2 = self.new_memory(c2, "other.uai")
        with c2.lease("Remote Agent", path2):
            with self.assertRaises(mep.NameHeld):
                c.acquire("remote agent", path)
        with c.lease("Remote Agent", path) as again:
            self.assertGreater(again.token, first)

    def test_control_plane_stopped_at_risk_then_lost(self):
        server, d = self.start_remote()
        c = d.client(timeout=10)
        calls = []
        order = []
        with c.events() as stream:
            path = self.new_memory(c)
            with c.lease("Partitioned", path, ttl=5) as lease:
                lease.on_lost(lambda l: calls.append(threading.current_thread()))
                threading.Thread(target=lambda: lease.at_risk.wait(15) and order.append("at_risk"), daemon=True).start()
                threading.Thread(target=lambda: lease.lost.wait(15) and order.append("lost"), daemon=True).start()
                # Let one renewal through, then freeze the control plane.
                renewed = stream.next(5)
                while renewed is not None and renewed.event != "renewed":
                    renewed = stream.next(5)
                self.assertIsNotNone(renewed, "the daemon renews at ttl/3")
                server.proc.signal(signal.SIGSTOP)
                try:
                    self.assertTrue(lease.at_risk.wait(8), "at risk once the renewals fail")
                    self.assertTrue(lease.at_risk_reason.startswith("degraded"), lease.at_risk_reason)
                    self.assertTrue(lease.lost.wait(8), "lost at the local deadline")
                    # Lost before the server could let the lease expire: checked below on the
                    # daemon's event times, not on this process's stopwatch (slow under load).
                    self.assertIn(lease.lost_reason, ("local-deadline", "deadline"))
                    self.assertTrue(wait_until(lambda: len(order) == 2, 5))
                    self.assertEqual(order, ["at_risk", "lost"])
                    self.assertTrue(wait_until(lambda: len(calls) == 1, 5), "on_lost callback")
                    self.assertIsNot(calls[0], threading.current_thread())
                    with self.assertRaises(mep.LeaseLost) as cm:
                        lease.check()
                    self.assertIsInstance(cm.exception, mep.LeaseGone)
                    with self.assertRaises(mep.LeaseGone):
                        lease.verify()
                    with self.assertRaises(mep.LeaseGone):
                        lease.sync()
                    # The daemon reaches the same verdict on its own deadline.
                    self.assertTrue(wait_until(lambda: c.get_lease("Partitioned").state == "lost", 5))
                    try:
                        c.verify("Partitioned")
                        self.fail("the daemon must refuse to verify a lost lease")
                    except mep.NotSupported:
                        pass  # this mepd predates POST /v1/verify (test_verify covers it when present)
                    except mep.LeaseExpired:
                        pass
                finally:
                    server.proc.signal(signal.SIGCONT)
            self.assertEqual(len(calls), 1)
            # What the daemon said, in order: degraded before lost.
            kinds = []
            expiry, lost_at = renewed.expires_at, None
            ev = stream.next(2)
            while ev is not None:
                if ev.canonical_name == "partitioned":
                    kinds.append(ev.event)
                    if ev.event == "renewed" and lost_at is None:
                        expiry = max(expiry, ev.expires_at)  # a renewal heard after the first one
                    if ev.event == "lost":
                        lost_at = ev.at
                ev = stream.next(0.5)
        self.assertLess(kinds.index("degraded"), kinds.index("lost"), kinds)
        self.assertIsNotNone(lost_at, "the lost event has its time")
        self.assertLess(lost_at, expiry, "lost before the server could let the lease expire")
        self.assertEqual(c.leases(), [], "leaving the block forgets the lost lease")

    def test_verify(self):
        server, d = self.start_remote()
        c = d.client(timeout=10)
        path = self.new_memory(c)
        with c.lease("verified", path, ttl=10) as lease:
            try:
                result = lease.verify()
            except mep.NotSupported as e:
                self.skipTest("this mepd has no POST /v1/verify yet: %s" % e)
            self.assertEqual((result.canonical_name, result.memory_instance_id, result.fencing_token),
                             (lease.canonical_name, lease.memory_instance_id, lease.token))
        with self.assertRaises(mep.LeaseNotFound):
            c.verify("verified")

    def test_a_release_the_control_plane_did_not_confirm_is_reported(self):
        server, d = self.start_remote()
        c = d.client(timeout=10)
        path = self.new_memory(c)
        confirmed = c.acquire("confirmed", path, ttl=10)
        self.assertIsNone(confirmed.release())
        self.assertIsNone(confirmed.release_problem)
        lease = c.acquire("unconfirmed", path, ttl=10)
        other = c.acquire("unconfirmed two", self.new_memory(c, "two.uai"), ttl=10)
        c.attach("unconfirmed three", self.new_memory(c, "three.uai"), ttl=10)
        server.stop()
        # Released here all the same (the daemon keeps nothing), but the control plane,
        # which holds the name until the lease expires there, was not reached.
        with self.assertLogs("mep", "WARNING") as logged:
            problem = lease.release()
        self.assertIsInstance(problem, mep.Unavailable)
        self.assertIs(lease.release_problem, problem)
        self.assertTrue(lease.released)
        self.assertIn("did not confirm", logged.output[0])
        self.assertIs(lease.release(), problem, "a second call answers the same")
        with self.assertLogs("mep", "WARNING"):
            with other:
                pass
        self.assertIsInstance(other.release_problem, mep.Unavailable)
        # The bare client call says the same.
        self.assertIsInstance(c.detach("unconfirmed three"), mep.Unavailable)
        self.assertEqual(c.leases(), [])

    def test_async_release_the_control_plane_did_not_confirm(self):
        server, d = self.start_remote()
        path = self.new_memory(d.client())

        async def main():
            c = mep.aio.AsyncClient(d.socket_path, timeout=10)
            lease = await c.acquire("async unconfirmed", path, ttl=10)
            server.stop()
            with self.assertLogs("mep", "WARNING"):
                problem = await lease.release()
            self.assertIsInstance(problem, mep.Unavailable)
            self.assertIs(lease.release_problem, problem)
            self.assertEqual(await c.leases(), [])

        asyncio.run(asyncio.wait_for(main(), 60))


class HolderRemoteTest(DaemonTestCase):
    """Labels, max_hold and the holder, read back from a real ``mep server``."""

    LABELS = {"job": "ci-42", "team": "infra", "note": "caf\u00e9 \u2615"}

    def check_server_lease(self, server, d, name, labels, max_hold):
        doc = server.get_lease(name, d.token_file)
        holder = doc.get("holder")
        self.assertIsInstance(holder, dict, doc)
        self.assertEqual(holder.get("labels"), labels)
        self.assertEqual(holder.get("pid"), os.getpid())
        self.assertEqual(holder.get("host"), socket.gethostname())
        self.assertEqual(holder.get("exe"), os.path.basename(os.readlink("/proc/self/exe")))
        granted = mep.types.parse_time(doc["granted_at"])
        self.assertEqual(mep.types.parse_time(doc["hold_until"]) - granted, datetime.timedelta(seconds=max_hold))
        return doc

    def test_labels_and_max_hold_reach_the_control_plane(self):
        server, d = self.start_remote()
        c = d.client(timeout=10)
        path = self.new_memory(c)
        with c.lease("Builder 7", path, ttl=10, labels=self.LABELS, max_hold=600) as lease:
            doc = self.check_server_lease(server, d, "builder7", self.LABELS, 600)
            self.assertEqual((doc["lease_id"], doc["fencing_token"]), (lease.lease_id, lease.token))
            # Another daemon of the tenant (another host, as far as the server knows) is
            # refused, and told who holds the name: never the lease id, owner or token.
            _, d2 = self.start_remote(tag="mepd2", server=server)
            c2 = d2.client(timeout=10)
            with self.assertRaises(mep.NameHeld) as cm:
                c2.acquire("builder 7", self.new_memory(c2, "other.uai"))
            h = cm.exception.holder
            self.assertEqual((h.display_name, h.host), ("Builder 7", socket.gethostname()))
            self.assertEqual(h.since, mep.types.parse_time(doc["granted_at"]))
            self.assertLessEqual(h.since, datetime.datetime.now(datetime.timezone.utc))
            self.assertGreater(h.expires_at, h.since)
            self.assertEqual(set(h.raw), {"display_name", "host", "since", "expires_at"})
        # No labels and no max_hold: none sent, none kept.
        info = c.attach("plain", path, ttl=10, bind="none")
        doc = server.get_lease("plain", d.token_file)
        self.assertNotIn("labels", doc["holder"] or {})
        self.assertIsNone(doc["hold_until"])
        self.assertIsNone(c.detach("plain", info.lease_id))

    def test_an_anonymous_holder_sends_nothing_of_itself(self):
        server, d = self.start_remote(extra_args=["--anonymous-holder"])
        c = d.client(timeout=10)
        path = self.new_memory(c)
        with c.lease("Quiet Agent", path, ttl=10, labels=self.LABELS, max_hold=300):
            doc = server.get_lease("quietagent", d.token_file)
            self.assertFalse(doc.get("holder"), doc)  # no host, pid, executable or labels
            self.assertIsNotNone(doc["hold_until"], "the max hold still applies")
            _, d2 = self.start_remote(tag="mepd2", server=server)
            c2 = d2.client(timeout=10)
            with self.assertRaises(mep.NameHeld) as cm:
                c2.acquire("quiet agent", self.new_memory(c2, "other.uai"))
            self.assertEqual((cm.exception.holder.display_name, cm.exception.holder.host), ("Quiet Agent", None))

    def test_max_hold_reached_is_lost_with_reason_max_hold(self):
        server, d = self.start_remote()
        c = d.client(timeout=10)
        path = self.new_memory(c)
        with c.lease("remote short hold", path, ttl=5, max_hold=6) as lease:
            # Renewed, it would be held for good: lost, and for this reason, is the hold's end
            # (no stopwatch: a loaded machine hears it late, never early).
            self.assertTrue(lease.lost.wait(15))
            self.assertEqual(lease.lost_reason, "max-hold")
            with self.assertRaises(mep.LeaseLost) as cm:
                lease.check()
            self.assertEqual(cm.exception.reason, "max-hold")

    def test_revoked_by_an_operator_is_lost_with_reason_revoked(self):
        server, d = self.start_remote()
        admin = server.token_file(name="admin.token", scope="admin")
        c = d.client(timeout=10)
        path = self.new_memory(c)
        with c.lease("Revoked Agent", path, ttl=6) as lease:
            p = subprocess.run([mep_bin(), "lease", "revoke", "Revoked Agent", "--server", server.url,
                                "--token-file", admin, "--reason", "test"],
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=self.env, timeout=20, check=False)
            self.assertEqual(p.returncode, 0, p.stderr.decode())
            # Learnt at the next renewal (every ttl/3), before the lease's TTL could run out.
            self.assertTrue(lease.lost.wait(10), "lost once the daemon's renewal is refused")
            self.assertEqual(lease.lost_reason, "revoked")
            with self.assertRaises(mep.LeaseLost) as cm:
                lease.check()
            self.assertEqual(cm.exception.reason, "revoked")
        self.assertEqual(c.leases(), [])

    def test_async_labels_and_max_hold_reach_the_control_plane(self):
        server, d = self.start_remote()
        path = self.new_memory(d.client())
        _, d2 = self.start_remote(tag="mepd2", server=server)
        other = self.new_memory(d2.client(), "other.uai")

        async def main():
            c = mep.aio.AsyncClient(d.socket_path, timeout=10)
            async with c.lease("Async Builder", path, ttl=10, labels=self.LABELS, max_hold=900) as lease:
                loop = asyncio.get_running_loop()
                doc = await loop.run_in_executor(
                    None, lambda: self.check_server_lease(server, d, "asyncbuilder", self.LABELS, 900))
                self.assertEqual(doc["lease_id"], lease.lease_id)
                c2 = mep.aio.AsyncClient(d2.socket_path, timeout=10)
                with self.assertRaises(mep.NameHeld) as cm:
                    await c2.acquire("async builder", other)
                self.assertEqual(cm.exception.holder.display_name, "Async Builder")
                self.assertEqual(cm.exception.holder.since, mep.types.parse_time(doc["granted_at"]))

        asyncio.run(asyncio.wait_for(main(), 60))


if __name__ == "__main__":
    unittest.main()
