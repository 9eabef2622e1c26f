"""The threaded SDK against a real mepd in embedded mode (its control plane in-process)."""
import contextvars
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import unittest

from . import SOURCE_ROOT
from .harness import DaemonTestCase, mep_bin, wait_until

import mep


class AcquireReleaseTest(DaemonTestCase):
    def test_acquire_and_release(self):
        d = self.start_mepd()
        c = d.client()
        path = self.new_memory(c)
        ident = c.identify(path)
        with c.lease("My Agent", path, ttl=30) as lease:
            self.assertIsInstance(lease, mep.Lease)
            self.assertEqual(lease.canonical_name, "myagent")
            self.assertEqual(lease.display_name, "My Agent")
            self.assertEqual(lease.memory_instance_id, ident.memory_instance_id)
            self.assertEqual(lease.path, os.path.abspath(path))
            self.assertGreaterEqual(lease.token, 1)
            self.assertEqual(lease.fencing_headers(), {"Fencing-Token": str(lease.token)})
            self.assertEqual(lease.ttl_seconds, 30)
            self.assertIsNotNone(lease.expires_at.tzinfo)
            self.assertFalse(lease.lost.is_set())
            self.assertFalse(lease.at_risk.is_set())
            lease.check()
            listed = {l.canonical_name: l for l in c.leases()}
            self.assertEqual(listed["myagent"].bind_pid, os.getpid(), "bound to this process")
            self.assertEqual(listed["myagent"].fencing_token, lease.token)
            self.assertEqual(c.get_lease("My Agent").lease_id, lease.lease_id)
        self.assertEqual(c.leases(), [])
        self.assertTrue(lease.released)
        self.assertFalse(lease.lost.is_set(), "an own release is not a loss")
        with self.assertRaises(mep.LeaseLost) as cm:
            lease.check()
        self.assertEqual(cm.exception.reason, "closed")
        # The token is not handed out any more either, as check() says (strict=False does).
        with self.assertRaises(mep.LeaseLost) as cm:
            lease.fencing_headers()
        self.assertEqual(cm.exception.reason, "closed")
        self.assertEqual(lease.fencing_headers(strict=False), {"Fencing-Token": str(lease.token)})
        # Claimed again: a larger token.
        with c.lease("My Agent", path) as again:
            self.assertGreater(again.token, lease.token)

    def test_module_level_functions_use_the_socket_from_the_environment(self):
        d = self.start_mepd()
        old = os.environ.get("MEP_SOCKET")
        os.environ["MEP_SOCKET"] = d.socket_path
        self.addCleanup(lambda: os.environ.pop("MEP_SOCKET") if old is None else os.environ.__setitem__("MEP_SOCKET", old))
        path = os.path.join(self.work, "m.uai")
        created = mep.init(path)
        self.assertEqual(mep.identify(path).memory_instance_id, created.memory_instance_id)
        self.assertEqual(mep.health().status, "ok")
        with mep.lease("env agent", path, ttl=10) as lease:
            self.assertEqual([l.canonical_name for l in mep.status()], ["envagent"])
            self.assertIs(mep.current_lease(), lease)
        self.assertEqual(mep.status(), [])
        lease2 = mep.acquire("env agent", path)
        try:
            self.assertIsNone(mep.current_lease(), "acquire() alone does not set the context variable")
        finally:
            lease2.release()
            lease2.release()  # idempotent
        self.assertEqual(mep.status(), [])

    def test_exception_in_block_propagates_and_releases(self):
        d = self.start_mepd()
        c = d.client()
        path = self.new_memory(c)

        class Boom(Exception):
            pass

        with self.assertRaises(Boom):
            with c.lease("boom", path) as lease:
                self.assertIs(mep.current_lease(), lease)
                raise Boom()
        self.assertEqual(c.leases(), [])
        self.assertIsNone(mep.current_lease())
        # Also when releasing fails (the daemon is gone): the block's exception wins.
        c2 = mep.Client(d.socket_path, timeout=5)
        with self.assertLogs("mep", "WARNING") as logs:
            with self.assertRaises(Boom):
                with c2.lease("boom", path, ttl=30):
                    d.stop()
                    raise Boom()
        self.assertIn("not running", "\n".join(logs.output))

    def test_context_variable(self):
        d = self.start_mepd()
        c = d.client()
        p1, p2 = self.new_memory(c, "a.uai"), self.new_memory(c, "b.uai")
        self.assertIsNone(mep.current_lease())
        seen = {}
        with c.lease("outer", p1) as outer:
            self.assertIs(mep.current_lease(), outer)
            with c.lease("inner", p2) as inner:
                self.assertIs(mep.current_lease(), inner)
                t = threading.Thread(target=lambda: seen.__setitem__("plain", mep.current_lease()))
                t.start()
                t.join()
                ctx = contextvars.copy_context()
                t = threading.Thread(target=lambda: ctx.run(lambda: seen.__setitem__("copied", mep.current_lease())))
                t.start()
                t.join()
            self.assertIs(mep.current_lease(), outer)
        self.assertIsNone(mep.current_lease())
        self.assertIsNone(seen["plain"], "a plain thread starts with an empty context")
        self.assertIs(seen["copied"], inner)


class ConflictTest(DaemonTestCase):
    def setUp(self):
        super().setUp()
        self.d = self.start_mepd()
        self.c = self.d.client()

    def test_name_held(self):
        p1, p2 = self.new_memory(self.c, "a.uai"), self.new_memory(self.c, "b.uai")
        with self.c.lease("worker", p1):
            with self.assertRaises(mep.NameHeld) as cm:
                with self.c.lease("Worker", p2):
                    self.fail("must not get here")
            e = cm.exception
            self.assertIsInstance(e, mep.Held)
            self.assertEqual((e.code, e.status), ("name-held", 423))
            self.assertIsNotNone(e.retry_after)
            self.assertGreater(e.retry_after, 0)
            self.assertTrue(e.title)
            self.assertIn("worker", e.detail)
        self.assertEqual(self.c.leases(), [])

    def test_name_confusable(self):
        # "pаypal" (Cyrillic а among Latin letters) is refused outright as mixed-script;
        # a confusable that is itself valid is a single-script look-alike: "раура" is all
        # Cyrillic and has the skeleton of the Latin "paypa" (SPEC §5).
        p1, p2 = self.new_memory(self.c, "a.uai"), self.new_memory(self.c, "b.uai")
        with self.c.lease("paypa", p1):
            with self.assertRaises(mep.NameConfusable) as cm:
                self.c.acquire("\u0440\u0430\u0443\u0440\u0430", p2)
            self.assertEqual((cm.exception.code, cm.exception.status), ("name-confusable", 423))
            self.assertIsInstance(cm.exception, mep.Held)
            with self.assertRaises(mep.InvalidName) as cm2:
                self.c.acquire("p\u0430ypal", p2)
            self.assertEqual(cm2.exception.reason, "mixed-script")
        self.assertEqual(self.c.leases(), [])

    def test_memory_attached(self):
        p = self.new_memory(self.c)
        with self.c.lease("first", p):
            with self.assertRaises(mep.MemoryAttached) as cm:
                self.c.acquire("second", p)
            self.assertEqual((cm.exception.code, cm.exception.status), ("memory-attached", 423))
            self.assertIsNotNone(cm.exception.retry_after)
            self.assertEqual([l.canonical_name for l in self.c.leases()], ["first"])

    def test_invalid_name_with_reason(self):
        p = self.new_memory(self.c)
        with self.assertRaises(mep.InvalidName) as cm:
            self.c.acquire("agent!", p)
        e = cm.exception
        self.assertEqual((e.code, e.status, e.reason, e.codepoint, e.index),
                         ("invalid-name", 422, "disallowed-character", "U+0021", 5))
        with self.assertRaises(mep.InvalidName) as cm:
            self.c.acquire("   ", p)
        self.assertEqual(cm.exception.reason, "empty")

    def test_invalid_ttl_and_missing_file(self):
        p = self.new_memory(self.c)
        with self.assertRaises(mep.InvalidTtl) as cm:
            self.c.acquire("agent", p, ttl=2)
        self.assertEqual(cm.exception.status, 422)
        with self.assertRaises(mep.InvalidRequest):
            self.c.acquire("agent", os.path.join(self.work, "missing.uai"))
        with self.assertRaises(ValueError):
            self.c.lease("agent", p, bind="thread")
        self.assertEqual(self.c.leases(), [])

    def test_wait_for_a_held_name(self):
        p1, p2 = self.new_memory(self.c, "a.uai"), self.new_memory(self.c, "b.uai")
        holder = self.c.attach("waited", p1, bind="none")
        got = {}

        def waiter():
            try:
                with self.c.lease("waited", p2, ttl=10, wait=15) as l:
                    got["token"] = l.token
            except mep.MepError as e:
                got["error"] = e

        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(1.0)
        self.assertNotIn("error", got)
        self.assertNotIn("token", got, "must wait while the name is held")
        self.c.detach(holder.canonical_name)
        t.join(20)
        self.assertFalse(t.is_alive())
        self.assertIn("token", got, got.get("error"))


class ProcessBindingTest(DaemonTestCase):
    def test_lease_released_when_the_agent_is_sigkilled(self):
        d = self.start_mepd()
        c = d.client()
        path = self.new_memory(c)
        child = self.start_child(
            "import sys, time, mep\n"
            "lease = mep.Client(%r).acquire('killed agent', %r, ttl=30)\n"
            "print('ready', lease.token, flush=True)\n"
            "time.sleep(120)\n" % (d.socket_path, path))
        line = child.readline(20)
        self.assertTrue(line.startswith("ready"), line)
        listed = c.leases()
        self.assertEqual([(l.canonical_name, l.bind_pid) for l in listed], [("killedagent", child.pid)])
        child.kill9()
        # Released when the pid goes, long before the 30 s TTL (no bound on this machine's speed).
        self.assertTrue(wait_until(lambda: c.leases() == [], 10.0),
                        "the daemon still lists %r 10 s after the agent died (TTL 30 s)" % c.leases())


class ReleaseRetryTest(DaemonTestCase):
    """A release that fails (the daemon is down) raises, and the lease can be released
    by calling release() again once the daemon is back: it is not leaked for the life of
    the process."""

    def test_failed_release_is_retried_after_a_daemon_restart(self):
        d = self.start_mepd()
        c = d.client(timeout=5)
        path = self.new_memory(c)
        lease = c.acquire("stuck", path, ttl=10)
        d.stop()  # SIGTERM: the daemon keeps the lease and re-adopts it on restart
        with self.assertRaises(mep.DaemonNotRunning):
            lease.release()
        self.assertFalse(lease.released)
        with self.assertRaises(mep.LeaseLost) as cm:
            lease.check()  # the holder gave it up: the token is not to be used
        self.assertEqual(cm.exception.reason, "closed")
        with self.assertRaises(mep.LeaseLost):
            lease.fencing_headers()
        with self.assertRaises(mep.DaemonNotRunning):
            lease.release()  # still down: raises again
        d.start()
        self.assertEqual([(l.lease_id, l.state) for l in c.leases()], [(lease.lease_id, "held")],
                         "the restarted daemon re-adopted the lease")
        lease.release()
        self.assertTrue(lease.released)
        self.assertFalse(lease.lost.is_set())
        self.assertEqual(c.leases(), [])
        with c.lease("stuck", path) as again:  # another agent gets the name at once
            self.assertGreater(again.token, lease.token)
        lease.release()  # idempotent once released

    def test_leaving_the_block_while_the_daemon_is_down(self):
        d = self.start_mepd()
        c = d.client(timeout=5)
        path = self.new_memory(c)
        with self.assertRaises(mep.DaemonNotRunning):
            with c.lease("stuck block", path, ttl=10) as lease:
                d.stop()
        self.assertFalse(lease.released)
        self.assertIsNone(mep.current_lease())
        d.start()
        lease.release()
        self.assertTrue(lease.released)
        self.assertEqual(c.leases(), [])
        with c.lease("stuck block", path):
            pass


class DetachTest(DaemonTestCase):
    def test_detach_by_lease_id_never_takes_a_successor(self):
        # A stale holder's detach names its own lease: a lease granted under the same name
        # after it ended (here to the same client, as another agent would get it) stays.
        d = self.start_mepd()
        c = d.client()
        path = self.new_memory(c)
        first = c.attach("successor test", path, ttl=30)
        c.detach("successor test", first.lease_id)
        second = c.attach("successor test", path, ttl=30)
        self.assertNotEqual(first.lease_id, second.lease_id)
        with self.assertRaises(mep.LeaseNotFound):
            c.detach("successor test", first.lease_id)
        self.assertEqual([l.lease_id for l in c.leases()], [second.lease_id])
        c.detach("successor test", second.lease_id)
        self.assertEqual(c.leases(), [])


class LossTest(DaemonTestCase):
    def test_verify_is_of_this_lease_not_a_later_one_under_the_name(self):
        # verify sent only the name and compared only the token: a lease released and its
        # name claimed by another agent on another memory (whose first token is 1 too) was
        # verified, when the SDK had not yet heard the events (a busy process).
        d = self.start_mepd()
        c = d.client()
        one, two = self.new_memory(c, "one.uai"), self.new_memory(c, "two.uai")
        with c.lease("verified race", one, ttl=30, bind="none") as lease:
            lease._tracker._apply = lambda ev, now: None  # the events not yet heard
            for args in (["release", "verified race"], ["claim", "verified race", two]):
                p = subprocess.run([mep_bin(), "--socket", d.socket_path, *args], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, env=self.env, timeout=20)
                self.assertEqual(p.returncode, 0, p.stderr)
            other = c.get_lease("verified race")
            self.assertEqual(other.fencing_token, lease.token)
            self.assertNotEqual(other.lease_id, lease.lease_id)
            with self.assertRaises((mep.LeaseGone, mep.LeaseNotFound)):
                lease.verify()
            self.assertTrue(lease.lost.is_set())
        # Leaving the block does not take the other agent's lease.
        self.assertEqual([l.lease_id for l in c.leases()], [other.lease_id])

    def test_released_by_someone_else_is_lost(self):
        d = self.start_mepd()
        c = d.client()
        path = self.new_memory(c)
        calls = []
        with c.lease("released elsewhere", path, ttl=30) as lease:
            lease.on_lost(lambda l: calls.append((l, threading.current_thread())))
            p = subprocess.run([mep_bin(), "--socket", d.socket_path, "release", "released elsewhere"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env, timeout=20)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertTrue(lease.lost.wait(5), "lost must be set when the daemon says released")
            # "not-held" when the event stream had ended before (the re-check found no lease).
            self.assertIn(lease.lost_reason, ("released", "not-held"))
            self.assertTrue(wait_until(lambda: len(calls) == 1, 5))
            self.assertIs(calls[0][0], lease)
            self.assertIsNot(calls[0][1], threading.current_thread(), "callbacks run on the SDK's thread")
            with self.assertRaises(mep.LeaseLost) as cm:
                lease.check()
            self.assertEqual(cm.exception.reason, lease.lost_reason)
            with self.assertRaises(mep.LeaseLost):
                lease.fencing_headers()
            self.assertEqual(lease.fencing_headers(strict=False), {"Fencing-Token": str(lease.token)})
            late = []
            lease.on_lost(lambda l: late.append(threading.current_thread()))
            self.assertEqual(late, [threading.current_thread()], "registered after the loss: called at once")
        self.assertEqual(len(calls), 1, "called once")
        self.assertEqual(c.leases(), [])

    def test_daemon_stopped_lost_on_the_local_deadline(self):
        # SIGSTOP the daemon: the stream stays open but says nothing; the SDK declares
        # the lease lost on its own clock at attach-send + ttl - margin at the latest.
        d = self.start_mepd()
        c = d.client(timeout=5)
        path = self.new_memory(c)
        with c.lease("silent daemon", path, ttl=5) as lease:
            seen = []
            lease.on_lost(lambda l: seen.append(time.monotonic()))
            d.proc.signal(signal.SIGSTOP)
            try:
                self.assertTrue(lease.lost.wait(10))
                self.assertEqual(lease.lost_reason, "local-deadline")
                # Decided by the deadline (the last sending heard of + ttl - margin, the
                # tracker's unit tests check the arithmetic), not early. How soon after it
                # depends on this machine's load: not asserted.
                deadline = lease._tracker.deadline
                self.assertIsNotNone(deadline)
                self.assertTrue(wait_until(lambda: seen, 5.0))
                self.assertGreaterEqual(seen[0], deadline)
                self.assertTrue(lease.at_risk.is_set())
                with self.assertRaises(mep.LeaseLost):
                    lease.verify()  # refused locally, without asking the stopped daemon
            finally:
                d.proc.signal(signal.SIGCONT)
        self.assertTrue(wait_until(lambda: c.leases() == [], 5), c.leases())

    def test_daemon_restart_readopts_and_the_lease_stays(self):
        d = self.start_mepd()
        c = d.client()
        path = self.new_memory(c)
        with c.lease("restarted", path, ttl=30) as lease:
            d.stop()
            self.assertTrue(lease.at_risk.wait(5), "the stream ended: at risk")
            self.assertEqual(lease.at_risk_reason, "daemon-unreachable")
            d.start()
            self.assertTrue(wait_until(lambda: not lease.at_risk.is_set(), 10),
                            "re-checked and held again: %s" % lease.at_risk_reason)
            self.assertFalse(lease.lost.is_set(), lease.lost_reason)
            info = c.get_lease("restarted")
            self.assertEqual((info.lease_id, info.fencing_token, info.state), (lease.lease_id, lease.token, "held"))
            lease.check()
        self.assertEqual(c.leases(), [])

    def test_daemon_gone_for_good(self):
        d = self.start_mepd()
        c = d.client(timeout=5)
        path = self.new_memory(c)
        with c.lease("abandoned", path, ttl=5) as lease:
            d.proc.kill9()
            self.assertTrue(lease.lost.wait(10))
            self.assertEqual(lease.lost_reason, "local-deadline")
        # Leaving the block does not raise: the lost lease has nothing left to release.


class HolderAndMaxHoldTest(DaemonTestCase):
    """Labels and max_hold sent with the attach; the holder in a refused claim; the loss of
    a lease that reached its max hold."""

    def setUp(self):
        super().setUp()
        self.d = self.start_mepd()
        self.c = self.d.client()

    def test_labels_and_max_hold_are_taken_and_a_refusal_names_the_holder(self):
        p1, p2 = self.new_memory(self.c, "a.uai"), self.new_memory(self.c, "b.uai")
        before = datetime.datetime.now(datetime.timezone.utc)
        with self.c.lease("Builder 7", p1, ttl=10, labels={"job": "ci-42", "team": "infra"}, max_hold=600) as lease:
            self.assertEqual([l.lease_id for l in self.c.leases()], [lease.lease_id])
            other = self.d.client()  # a second client of the same tenant
            with self.assertRaises(mep.NameHeld) as cm:
                other.acquire("builder 7", p2, labels={"job": "ci-43"})
            now = datetime.datetime.now(datetime.timezone.utc)
            h = cm.exception.holder
            self.assertIsInstance(h, mep.Holder)
            self.assertEqual(h.display_name, "Builder 7")
            self.assertEqual(h.host, socket.gethostname())
            # The control plane's clock is this host's (embedded): a little slack for rounding.
            slack = datetime.timedelta(seconds=1)
            self.assertLessEqual(h.since, now)
            self.assertGreaterEqual(h.since, before - slack)
            self.assertGreater(h.expires_at, h.since)
            self.assertGreater(h.expires_at, now - slack, "the live lease's expiry")
            self.assertEqual(set(h.raw), {"display_name", "host", "since", "expires_at"}, "no lease id, owner or token")
            # The memory, and a name that looks the same, say the same of their holder.
            with self.assertRaises(mep.MemoryAttached) as cm:
                other.acquire("someone else", p1)
            self.assertEqual(cm.exception.holder.display_name, "Builder 7")
            self.assertEqual(cm.exception.holder.since, h.since)
        with self.c.lease("paypa", p1):
            with self.assertRaises(mep.NameConfusable) as cm:
                self.c.acquire("\u0440\u0430\u0443\u0440\u0430", p2, max_hold=60)
            self.assertEqual(cm.exception.holder.display_name, "paypa")
        # The bare attach takes them too.
        info = self.c.attach("bare", p2, ttl=10, bind="none", labels={"k": "v"}, max_hold=30)
        self.assertEqual((info.canonical_name, info.state), ("bare", "held"))
        self.assertIsNone(self.c.detach("bare", info.lease_id))
        self.assertEqual(self.c.leases(), [])

    def test_max_hold_reached_is_lost_with_reason_max_hold(self):
        path = self.new_memory(self.c)
        calls = []
        with self.c.events() as stream:
            with self.c.lease("short hold", path, ttl=5, max_hold=6) as lease:
                lease.on_lost(lambda l: calls.append(l.lost_reason))
                self.assertTrue(lease.lost.wait(15), "lost once a renewal would pass the max hold")
                # Told by the daemon (its first renewal is refused), not found by the SDK's
                # local deadline (4 s after the attach): the daemon's reason is kept.
                self.assertEqual(lease.lost_reason, "max-hold")
                with self.assertRaises(mep.LeaseLost) as cm:
                    lease.check()
                self.assertEqual(cm.exception.reason, "max-hold")
                self.assertTrue(wait_until(lambda: calls == ["max-hold"], 5), calls)
                info = self.c.get_lease("short hold")
                self.assertEqual((info.state, info.lost_reason), ("lost", "max-hold"))
            ev = stream.next(5)
            while ev is not None and ev.event != "lost":
                ev = stream.next(5)
            self.assertIsNotNone(ev)
            self.assertEqual((ev.canonical_name, ev.reason, ev.lease_id), ("shorthold", "max-hold", lease.lease_id))
        self.assertEqual(self.c.leases(), [], "leaving the block forgets the lost lease")


class DaemonNotRunningTest(DaemonTestCase):
    def test_helpful_error(self):
        sock = os.path.join(self.dir, "nobody", "mepd.sock")
        c = mep.Client(sock)
        with self.assertRaises(mep.DaemonNotRunning) as cm:
            with c.lease("agent", os.path.join(self.work, "m.uai")):
                pass
        e = cm.exception
        self.assertIsInstance(e, mep.Unavailable)
        self.assertEqual((e.code, e.status), ("unavailable", 503))
        self.assertIn(sock, str(e))
        self.assertIn("start it with", str(e))
        with self.assertRaises(mep.DaemonNotRunning):
            c.leases()


class MemoriesTest(DaemonTestCase):
    def test_init_branch_identify_lineage(self):
        d = self.start_mepd()
        c = d.client()
        path = os.path.join(self.work, "parent.uai")
        created = c.init(path)
        self.assertEqual(created.path, path)
        self.assertIsNone(created.parent_memory_instance_id)
        with self.assertRaises(mep.InvalidRequest):
            c.init(path)  # exists
        child_path = os.path.join(self.work, "child.uai")
        with self.assertRaises(mep.LeaseNotFound):
            c.branch(path, child_path)  # needs a live lease
        with c.lease("brancher", path) as lease:
            with open(path, "wb") as f:
                f.write(b"memories")
            b = c.branch(path, child_path)
        self.assertEqual((b.parent_memory_instance_id, b.branched_at_token), (created.memory_instance_id, lease.token))
        with open(child_path, "rb") as f:
            self.assertEqual(f.read(), b"memories")
        ident = c.identify(child_path)
        self.assertEqual((ident.memory_instance_id, ident.parent_memory_instance_id, ident.branched_at_token),
                         (b.memory_instance_id, created.memory_instance_id, lease.token))
        by_path = c.lineage(child_path)
        self.assertEqual(by_path.memory_instance_id, b.memory_instance_id)
        self.assertEqual([a["memory_instance_id"] for a in by_path.ancestors], [created.memory_instance_id])
        by_id = c.lineage(created.memory_instance_id)
        self.assertEqual([x["memory_instance_id"] for x in by_id.children], [b.memory_instance_id])
        with self.assertRaises(mep.MemoryNotFound):
            c.lineage("01a23331-0cc3-7298-afd1-580522a5ec00")

    def test_canonicalize_through_the_cli(self):
        cn = mep.canonicalize("My Agent")
        self.assertEqual((cn.input, cn.canonical_name), ("My Agent", "myagent"))
        self.assertTrue(cn.skeleton)
        self.assertEqual(cn.scripts, ["Latin"])
        self.assertEqual(mep.canonicalize("\u039f\u0394\u039f\u03a3").canonical_name, "\u03bf\u03b4\u03bf\u03c2")
        with self.assertRaises(mep.InvalidName) as cm:
            mep.canonicalize("agent!")
        self.assertEqual((cm.exception.reason, cm.exception.codepoint, cm.exception.index),
                         ("disallowed-character", "U+0021", 5))
        with self.assertRaises(mep.InvalidName) as cm:
            mep.canonicalize("-leading")  # not taken for an option
        self.assertEqual(cm.exception.reason, "disallowed-character")
        with self.assertRaises(mep.CliNotFound):
            mep.find_mep_bin({"MEP_BIN": os.path.join(self.dir, "no-such-mep")})
        with self.assertRaises(mep.CliNotFound):
            mep.find_mep_bin({"PATH": self.dir})
        with self.assertRaises(mep.MepError):
            mep.Client(mep_bin=os.path.join(self.dir, "no-such-mep")).canonicalize("x")


class EventsAndStatusTest(DaemonTestCase):
    def test_events_stream(self):
        d = self.start_mepd()
        c = d.client()
        with c.events() as stream:
            path = self.new_memory(c)
            with c.lease("watched", path, ttl=5) as lease:
                ev = stream.next(5)
                self.assertIsNotNone(ev)
                self.assertEqual((ev.event, ev.canonical_name, ev.fencing_token), ("granted", "watched", lease.token))
                self.assertEqual(ev.memory_instance_id, lease.memory_instance_id)
                renewed = stream.next(5)
                self.assertEqual(renewed.event, "renewed")
                self.assertTrue(wait_until(lambda: lease.expires_at == renewed.expires_at, 2),
                                "expires_at follows the renewals")
            ev = stream.next(5)
            self.assertEqual((ev.event, ev.canonical_name), ("released", "watched"))
        # The stream ends when the daemon stops.
        stream = c.events()
        d.stop()
        self.assertEqual(list(stream), [])
        self.assertTrue(stream.ended)

    def test_python_m_mep_status(self):
        d = self.start_mepd()
        c = d.client()
        path = self.new_memory(c)
        env = dict(self.env, PYTHONPATH=SOURCE_ROOT, MEP_SOCKET=d.socket_path)

        def run(*args):
            return subprocess.run([sys.executable, "-m", "mep"] + list(args), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, env=env, timeout=30)

        p = run("status")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn(b"no leases", p.stdout)
        with c.lease("Status Agent", path) as lease:
            p = run("status")
            self.assertEqual(p.returncode, 0, p.stderr)
            out = p.stdout.decode()
            self.assertIn("NAME", out)
            self.assertIn("statusagent", out)
            self.assertIn(lease.memory_instance_id, out)
            self.assertIn("held", out)
            p = run("status", "--json")
            self.assertEqual(p.returncode, 0, p.stderr)
            doc = json.loads(p.stdout)
            self.assertEqual([(l["canonical_name"], l["fencing_token"]) for l in doc["leases"]],
                             [("statusagent", lease.token)])
            p = run("--socket", os.path.join(self.dir, "none.sock"), "status")
            self.assertEqual(p.returncode, 5)
            self.assertIn(b"not running", p.stderr)


if __name__ == "__main__":
    unittest.main()
