"""Waiting for a lease (RFC 7240 `Prefer: wait=N` on POST /v1/leases; `mep claim/run --wait`).

Against the real `mep server` (SQLite, or PostgreSQL with MEP_TEST_BACKEND=postgresql) over
real TCP, and real mepd daemons over their Unix sockets:
- a waiting claim is granted when the holder releases, when its lease expires, or when a
  pid-bound holder dies; a wait that ends without the lease is the usual 423 + Retry-After;
- waiters are served first come, first served: the order of grants is the order in which
  the server queued the claims (20 workers on 3 daemons, never two holders at once);
- a waiter whose client goes away leaves the queue at once; a retry with the same
  Idempotency-Key takes its place back; waits are capped at 300 s (Preference-Applied);
- a server that stops ends its waits with 503 + Retry-After.
No test asserts a timing beyond "this happened before that" and generous upper bounds.
"""
import json
import os
import re
import select
import signal
import socket
import subprocess
import tempfile
import threading
import time
import unittest
import uuid

from daemonfixture import MepServer as DaemonMepServer, Mepd, clean_env
from mephelpers import mep_bin, wait_for
from serverfixture import (HOST, ApiClient, MepServer, ServerTestCase, db_url, new_key, unique_name)

WAIT_S = 30


def metric(port, name):
    """A gauge or counter from the server's /metrics (open on loopback)."""
    c = ApiClient(port, None)
    try:
        r = c.get("/metrics", token=None)
    finally:
        c.close()
    for line in r.raw.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def grants_in_turn(test, ws, name, mem, token, clients):
    """Releases the lease (the holder's, then each granted waiter's: owner "w<i>") through
    `clients` in turn, once per waiter in `ws` (RawClaims), and returns the order in which
    the waiters were granted: exactly one per release, each with the next fencing token."""
    order, owner = [], "holder"
    for _ in ws:
        r = clients[len(order) % len(clients)].release(name, mem, token, owner)
        test.assertEqual(r.status, 204, r)
        got = wait_for(lambda: [i for i, w in enumerate(ws) if w.done.is_set() and i not in order], timeout=15)
        test.assertTrue(got, "nobody was granted after a release")
        test.assertEqual(len(got), 1, "two waiters answered at once: %r" % [ws[i].result for i in got])
        status, _, doc = ws[got[0]].result
        test.assertEqual(status, 201, doc)
        test.assertEqual(doc["fencing_token"], token + 1)
        token, owner = doc["fencing_token"], "w%d" % got[0]
        order.append(got[0])
    return order


class RawClaim:
    """A claim on its own connection, sent now and read later (so that a test can close the
    connection while the claim waits)."""

    def __init__(self, port, token, name, memory_id, owner, wait, key=None, ttl=None):
        self.key = key or new_key()
        body = {"display_name": name, "memory_instance_id": memory_id, "owner_client_id": owner}
        if ttl is not None:
            body["ttl_seconds"] = ttl
        data = json.dumps(body).encode()
        head = ("POST /v1/leases HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nIdempotency-Key: %s\r\n"
                "Content-Type: application/json\r\nContent-Length: %d\r\nPrefer: wait=%d\r\nConnection: close\r\n\r\n"
                % (token, self.key, len(data), wait))
        self.sock = socket.create_connection((HOST, port), timeout=WAIT_S + 320)
        self.sock.sendall(head.encode() + data)
        self.result = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        buf = b""
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
        except OSError:
            pass
        self.answered_at = time.monotonic()
        if buf:
            head, _, body = buf.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers = {}
            for l in lines[1:]:
                k, _, v = l.partition(":")
                headers[k.strip().lower()] = v.strip()
            try:
                doc = json.loads(body)
            except ValueError:
                doc = None
            self.result = (status, headers, doc)
        self.done.set()

    def wait(self, timeout=WAIT_S):
        assert self.done.wait(timeout), "no answer in %s s" % timeout
        return self.result

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class ServerWaits(ServerTestCase):
    def setUp(self):
        super().setUp()
        self.raws = []
        self.c = self.client()

    def tearDown(self):
        for r in self.raws:
            r.close()
        super().tearDown()

    def raw(self, *a, **kw):
        r = RawClaim(self.port, self.token_a, *a, **kw)
        self.raws.append(r)
        return r

    def waiters(self):
        return metric(self.port, "mep_lease_waiters")

    def hold(self, ttl=None):
        name, mem = unique_name(), self.c.new_memory()
        r = self.c.claim(name, mem, "holder", ttl=ttl)
        self.assertEqual(r.status, 201, r)
        return name, mem, r.json["fencing_token"]

    def queued(self, n):
        self.assertTrue(wait_for(lambda: self.waiters() >= n), "never %d waiters (%s)" % (n, self.waiters()))

    def test_granted_when_the_holder_releases(self):
        name, mem, token = self.hold()
        w = self.raw(name, mem, "waiter", 20)
        self.queued(1)
        self.assertFalse(w.done.is_set(), "answered while the name was held: %r" % (w.result,))
        self.assertEqual(self.c.release(name, mem, token, "holder").status, 204)
        status, headers, doc = w.wait()
        self.assertEqual(status, 201, doc)
        self.assertEqual(doc["fencing_token"], token + 1)
        self.assertEqual(headers.get("preference-applied"), "wait=20")
        self.assertGreater(int(headers.get("mep-waited-ms", "0")), 0)
        self.assertTrue(wait_for(lambda: self.waiters() == 0))

    def test_a_revocation_wakes_a_claim_waiting_for_the_memory(self):
        # The waiter wants the memory under another name: only the memory is contended, so
        # only a wake-up on the memory (the revoked lease's, which the 204 does not carry)
        # grants it before the holder's TTL.
        name, mem, token = self.hold(ttl=120)
        w = self.raw(unique_name(), mem, "waiter", 20)
        self.queued(1)
        admin = self.client(self.admin_a)
        r = admin.post("/v1/admin/leases/revoke", {"canonical_name": name})
        self.assertEqual(r.status, 204, r)
        status, _, doc = w.wait()
        self.assertEqual(status, 201, "the revocation did not wake the memory's waiter: %r" % (doc,))
        self.assertEqual(doc["fencing_token"], token + 1)

    def test_a_wait_that_ends_is_423_with_retry_after(self):
        name, mem, _ = self.hold()
        start = time.monotonic()
        status, headers, doc = self.raw(name, mem, "waiter", 2).wait()
        self.assertGreaterEqual(time.monotonic() - start, 1.9)
        self.assertEqual(status, 423, doc)
        self.assertEqual(doc["code"], "name-held")
        self.assertGreaterEqual(int(headers["retry-after"]), 1)
        # Nothing was recorded under the key: the same key claims again (and waits again).
        again = self.c.claim(name, mem, "waiter", key=self.raws[-1].key)
        self.assertEqual(again.status, 423, again)
        self.assertIsNone(again.header("Idempotent-Replayed"))

    def test_fail_fast_claims_say_how_many_wait(self):
        name, mem, _ = self.hold()
        self.raw(name, mem, "w1", 20)
        self.raw(name, mem, "w2", 20)
        self.queued(2)
        r = self.c.claim(name, mem, "other")
        self.assertProblem(r, 423, "name-held")
        self.assertEqual(r.json.get("waiters"), 2, r)

    def test_first_come_first_served(self):
        name, mem, token = self.hold()
        ws = []
        for i in range(6):
            ws.append(self.raw(name, mem, "w%d" % i, 60))
            self.queued(i + 1)  # queued in this order
        order = grants_in_turn(self, ws, name, mem, token, [self.c])
        self.assertEqual(order, list(range(6)))

    def test_expiry_hands_the_lease_over(self):
        name, mem, token = self.hold(ttl=5)
        granted_at = time.monotonic()
        status, _, doc = self.raw(name, mem, "waiter", 30).wait(timeout=40)
        waited = time.monotonic() - granted_at
        self.assertEqual(status, 201, doc)
        self.assertEqual(doc["fencing_token"], token + 1)
        self.assertGreaterEqual(waited, 4.5, "granted before the holder's lease expired")
        self.assertLess(waited, 20, "the expiry did not hand the lease over")

    def test_a_waiter_that_goes_away_leaves_the_queue(self):
        name, mem, token = self.hold()
        first = self.raw(name, mem, "gone", 60)
        self.queued(1)
        second = self.raw(name, mem, "next", 60)
        self.queued(2)
        first.close()
        self.assertTrue(wait_for(lambda: self.waiters() == 1), "the closed waiter is still counted")
        self.assertEqual(self.c.release(name, mem, token, "holder").status, 204)
        status, _, doc = second.wait()
        self.assertEqual(status, 201, doc)
        # Nothing was granted to the dead connection.
        lease = self.c.get_lease(name)
        self.assertEqual(lease.json["owner_client_id"], "next", lease)

    def test_a_retry_with_the_same_key_keeps_its_place(self):
        name, mem, token = self.hold()
        first = self.raw(name, mem, "first", 60)
        self.queued(1)
        second = self.raw(name, mem, "second", 60)
        self.queued(2)
        key = first.key
        first.close()
        self.assertTrue(wait_for(lambda: self.waiters() == 1))
        again = self.raw(name, mem, "first", 60, key=key)  # the same request, retried
        self.queued(2)
        self.assertEqual(self.c.release(name, mem, token, "holder").status, 204)
        status, _, doc = again.wait()
        self.assertEqual(status, 201, doc)
        self.assertFalse(second.done.is_set(), "the later waiter was served first")
        self.assertEqual(self.c.release(name, mem, doc["fencing_token"], "first").status, 204)
        status, _, doc2 = second.wait()
        self.assertEqual(status, 201, doc2)

    def test_same_key_other_request_is_422(self):
        name, mem, _ = self.hold()
        first = self.raw(name, mem, "first", 30)
        self.queued(1)
        other = self.raw(name, mem, "someone-else", 30, key=first.key)
        status, _, doc = other.wait()
        self.assertEqual(status, 422, doc)
        self.assertEqual(doc["code"], "idempotency-key-reused")

    def test_a_wait_above_300_s_is_capped(self):
        name, mem, token = self.hold()
        w = self.raw(name, mem, "waiter", 1000)
        self.queued(1)
        self.assertEqual(self.c.release(name, mem, token, "holder").status, 204)
        status, headers, doc = w.wait()
        self.assertEqual(status, 201, doc)
        self.assertEqual(headers.get("preference-applied"), "wait=300")

    def test_other_names_and_tenants_are_not_held_up(self):
        name, mem, _ = self.hold()
        for i in range(5):
            self.raw(name, mem, "w%d" % i, 60)
        self.queued(5)
        other = self.client(self.token_b)
        r = other.claim(unique_name(), other.new_memory(), "b", headers={"Prefer": "wait=30"})
        self.assertEqual(r.status, 201, r)
        self.assertEqual(self.waiters(), 5, "the other claim did not go past the queue")

    def test_a_claim_without_wait_on_a_free_name_is_not_queued(self):
        r = self.c.claim(unique_name(), self.c.new_memory(), "o", headers={"Prefer": "wait=10"})
        self.assertEqual(r.status, 201, r)
        self.assertEqual(r.header("Preference-Applied"), "wait=10")

    def test_a_claim_without_wait_does_not_go_ahead_of_waiters(self):
        # The waiter wants a free name with a held memory: the name is free all along, yet a
        # claim that does not wait may not take it (with another memory, or through a
        # confusable spelling). The holder's re-claim of its own lease still goes through.
        name, mem, token = self.hold()
        wanted = unique_name()
        w = self.raw(wanted, mem, "waiter", 30)
        self.queued(1)
        for display in (wanted, wanted.upper()):
            r = self.c.claim(display, self.c.new_memory(), "jumper")
            self.assertProblem(r, 423, "name-held")
            self.assertEqual(r.json.get("waiters"), 1, r)
            self.assertGreaterEqual(int(r.header("Retry-After")), 1)
        again = self.c.claim(name, mem, "holder")
        self.assertEqual(again.status, 201, again)
        self.assertFalse(w.done.is_set(), "the waiter was answered while the memory was held: %r" % (w.result,))
        self.assertEqual(self.c.release(name, mem, again.json["fencing_token"], "holder").status, 204)
        status, _, doc = w.wait()
        self.assertEqual(status, 201, doc)
        self.assertEqual(doc["canonical_name"], wanted)
        # Granted, it is out of the queue: the name is held now, not waited for.
        r = self.c.claim(wanted, self.c.new_memory(), "jumper")
        self.assertProblem(r, 423, "name-held")
        self.assertIsNone(r.json.get("waiters"), r)

    def test_waiters_of_one_tenant_are_bounded_at_1024(self):
        # 4 names x 256 waiters (the bound per resource) = 1024 waiting claims of tenant a,
        # each on its own connection; the next one is 429 with the bound, while tenant b
        # still waits. Needs more than 1024 descriptors here (the server raises its own).
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and hard < 1200:
            self.skipTest("needs 1200 open files, the hard limit is %d" % hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 4096, hard))
        self.addCleanup(resource.setrlimit, resource.RLIMIT_NOFILE, (soft, hard))
        # Held for 300 s (the longest TTL): on a loaded Spanner emulator queueing 1024 claims
        # took longer than the default TTL, and a holder's expiry handed its name over.
        held = [self.hold(ttl=300) for _ in range(5)]
        socks = []

        def send(port, token, name, mem, owner):
            body = json.dumps({"display_name": name, "memory_instance_id": mem, "owner_client_id": owner}).encode()
            head = ("POST /v1/leases HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nIdempotency-Key: %s\r\n"
                    "Content-Type: application/json\r\nContent-Length: %d\r\nPrefer: wait=300\r\n\r\n"
                    % (token, new_key(), len(body)))
            s = socket.create_connection((HOST, port), timeout=30)
            socks.append(s)
            s.sendall(head.encode() + body)
            return s

        def close_all():
            for s in socks:
                s.close()
        self.addCleanup(close_all)
        waiting = {}  # socket -> (name, mem, owner) of a claim not answered yet
        for k in range(4):
            name, mem, _ = held[k]
            for i in range(256):
                waiting[send(self.port, self.token_a, name, mem, "w%d-%d" % (k, i))] = (name, mem, "w%d-%d" % (k, i))
                time.sleep(0.002)  # within the token's rate limit (1000/s, a fifth kept for renewals)

        def answered():
            # A waiting claim is not answered. One that was told to come back (503: the store
            # was busy, e.g. the Spanner emulator aborting one transaction too many) is sent
            # again, as a client would; any other answer fails the test, saying what it was
            # (a 201 here once showed the names' holders expiring under a slow emulator).
            poll = select.poll()  # not select(): the descriptors go past 1024
            by_fd = {s.fileno(): s for s in waiting}
            for fd in by_fd:
                poll.register(fd, select.POLLIN)
            for fd, _ in poll.poll(0):
                s = by_fd[fd]
                reply = s.recv(65536).decode("latin-1")
                self.assertTrue(reply.startswith("HTTP/1.1 503"), "a waiting claim was answered: %r" % reply[:300])
                name, mem, who = waiting.pop(s)
                waiting[send(self.port, self.token_a, name, mem, who)] = (name, mem, who)
            return self.waiters() == 1024

        # Until all 1024 wait: as long as their number grows (a loaded Spanner emulator
        # queued 915 in the first 60 s), inside the waits (300 s) and the holds (300 s).
        deadline, last, grew = time.monotonic() + 240, -1, time.monotonic()
        while not answered():
            n = self.waiters()
            if n != last:
                last, grew = n, time.monotonic()
            self.assertLess(time.monotonic() - grew, 60, "the waiters stopped growing at %s" % n)
            self.assertLess(time.monotonic(), deadline, "never 1024 waiters (%s)" % n)
            time.sleep(0.2)
        name, mem, _ = held[4]
        s = send(self.port, self.token_a, name, mem, "one-too-many")
        reply = s.recv(65536).decode("latin-1")
        self.assertTrue(reply.startswith("HTTP/1.1 429"), reply[:200])
        doc = json.loads(reply.partition("\r\n\r\n")[2])
        self.assertEqual(doc["code"], "rate-limited", doc)
        self.assertEqual(doc["limit"], 1024, doc)
        # The bound is the tenant's: another tenant's claim still waits (and is answered
        # when its wait ends, 1 s later).
        other = self.client(self.token_b)
        bname, bmem = unique_name(), other.new_memory()
        self.assertEqual(other.claim(bname, bmem, "b-holder").status, 201)
        r = other.claim(bname, bmem, "b-waiter", headers={"Prefer": "wait=1"})
        self.assertProblem(r, 423, "name-held")
        self.assertEqual(r.header("Preference-Applied"), "wait=1")

    def test_malformed_prefer_is_ignored(self):
        name, mem, _ = self.hold()
        for value in ("wait=", "wait=-1", "wait=abc", "wait=1e3", "respond-async"):
            r = self.c.claim(name, mem, "o", headers={"Prefer": value})
            self.assertProblem(r, 423, "name-held")
            self.assertIsNone(r.header("Preference-Applied"), value)


class ServerShutdownWaits(unittest.TestCase):
    def test_a_stopping_server_ends_waits_with_503(self):
        from serverfixture import create_token, drop_db, new_db
        with tempfile.TemporaryDirectory(prefix="mep-wait-") as tmp:
            db = new_db(tmp)
            self.addCleanup(drop_db, db)
            token = create_token(db, "t")
            srv = MepServer(tmp, db)
            srv.start()
            self.addCleanup(srv.stop)
            c = ApiClient(srv.port, token)
            self.addCleanup(c.close)
            mem = c.register().json["memory_instance_id"]
            name = unique_name()
            self.assertEqual(c.claim(name, mem, "holder").status, 201)
            w = RawClaim(srv.port, token, name, mem, "waiter", 60)
            self.addCleanup(w.close)
            self.assertTrue(wait_for(lambda: metric(srv.port, "mep_lease_waiters") == 1))
            os.kill(srv.pid, signal.SIGTERM)
            status, headers, doc = w.wait()
            self.assertEqual(status, 503, doc)
            self.assertEqual(doc["code"], "unavailable")
            self.assertGreaterEqual(int(headers["retry-after"]), 1)


class CrossServerWaits(unittest.TestCase):
    """Two servers on one PostgreSQL database: a release through one wakes a claim waiting
    on the other at once (LISTEN/NOTIFY), long before the holder's lease would expire."""

    def test_a_release_on_another_server_wakes_the_waiter(self):
        import pgfixture
        from serverfixture import create_token, drop_db, new_db
        if pgfixture.backend() == "sqlite":
            self.skipTest("several servers share a database on PostgreSQL and Spanner (SQLite: one serving process)")
        with tempfile.TemporaryDirectory(prefix="mep-wait2-") as tmp:
            db = new_db(tmp)
            self.addCleanup(drop_db, db)
            token = create_token(db, "t")
            a, b = MepServer(tmp, db), MepServer(tmp, db)
            a.start()
            self.addCleanup(a.stop)
            b.start()
            self.addCleanup(b.stop)
            ca = ApiClient(a.port, token)
            self.addCleanup(ca.close)
            mem = ca.register().json["memory_instance_id"]
            name = unique_name()
            held = ca.claim(name, mem, "holder", ttl=120)
            self.assertEqual(held.status, 201, held)
            w = RawClaim(b.port, token, name, mem, "waiter", 30)
            self.addCleanup(w.close)
            self.assertTrue(wait_for(lambda: metric(b.port, "mep_lease_waiters") == 1))
            r = ca.release(name, mem, held.json["fencing_token"], "holder")
            self.assertEqual(r.status, 204, r)
            status, _, doc = w.wait(timeout=40)
            self.assertEqual(status, 201, "the waiter on the other server was not woken: %r" % (doc,))
            self.assertEqual(doc["fencing_token"], held.json["fencing_token"] + 1)


class TwoServerWaits(unittest.TestCase):
    """Two servers on one PostgreSQL database share one queue of waiting claims (schema v5's
    mep_waiters): the order of grants is the order of arrival across both, a claim that does
    not wait goes ahead of no waiter on either, and the waiters of a server that dies stop
    holding the others up within seconds."""

    def setUp(self):
        import pgfixture
        from serverfixture import create_token, drop_db, new_db
        if pgfixture.backend() == "sqlite":
            self.skipTest("several servers share a database on PostgreSQL and Spanner (SQLite: one serving process)")
        tmp = tempfile.TemporaryDirectory(prefix="mep-wait2-")
        self.addCleanup(tmp.cleanup)
        db = new_db(tmp.name)
        self.addCleanup(drop_db, db)
        self.token = create_token(db, "t")
        self.servers = []
        for _ in range(2):
            srv = MepServer(tmp.name, db)
            srv.start()
            self.addCleanup(srv.stop)
            self.servers.append(srv)
        self.clients = []
        for srv in self.servers:
            c = ApiClient(srv.port, self.token)
            self.addCleanup(c.close)
            self.clients.append(c)
        self.raws = []
        self.addCleanup(lambda: [r.close() for r in self.raws])

    def raw(self, server, *a, **kw):
        r = RawClaim(self.servers[server].port, self.token, *a, **kw)
        self.raws.append(r)
        return r

    def waiters(self):
        return sum(metric(s.port, "mep_lease_waiters") for s in self.servers if s.proc.poll() is None)

    def hold(self, ttl=None):
        c = self.clients[0]
        name, mem = unique_name(), c.new_memory()
        r = c.claim(name, mem, "holder", ttl=ttl)
        self.assertEqual(r.status, 201, r)
        return name, mem, r.json["fencing_token"]

    def test_waiters_on_two_servers_are_served_in_the_order_they_came(self):
        name, mem, token = self.hold()
        ws = []
        for i in range(8):
            ws.append(self.raw((i + 1) % 2, name, mem, "w%d" % i, 60))  # servers b, a, b, a, ...
            self.assertTrue(wait_for(lambda: self.waiters() == i + 1), "waiter %d never queued" % i)
        order = grants_in_turn(self, ws, name, mem, token, self.clients)  # releases through a, b, a, …
        print("order of grants across two servers:", order)
        self.assertEqual(order, list(range(8)))

    def test_a_claim_without_wait_goes_ahead_of_no_waiter_on_another_server(self):
        name, mem, token = self.hold()
        wanted = unique_name()
        w = self.raw(1, wanted, mem, "waiter", 30)  # its name is free, its memory held
        self.assertTrue(wait_for(lambda: self.waiters() == 1))
        r = self.clients[0].claim(wanted, self.clients[0].new_memory(), "jumper")
        self.assertEqual(r.status, 423, r)
        self.assertEqual(r.json["code"], "name-held", r)
        self.assertEqual(r.json.get("waiters"), 1, r)
        self.assertEqual(self.clients[0].release(name, mem, token, "holder").status, 204)
        status, _, doc = w.wait()
        self.assertEqual(status, 201, doc)
        self.assertEqual(doc["canonical_name"], wanted)

    def test_the_waiters_of_a_server_that_dies_stop_holding_others_up(self):
        name, mem, token = self.hold()
        first = self.raw(0, name, mem, "on-a", 60)
        self.assertTrue(wait_for(lambda: self.waiters() == 1))
        second = self.raw(1, name, mem, "on-b", 60)
        self.assertTrue(wait_for(lambda: self.waiters() == 2))
        os.kill(self.servers[0].pid, signal.SIGKILL)  # its ticket stays, unrenewed
        self.servers[0].proc.wait(timeout=10)
        r = self.clients[1].release(name, mem, token, "holder")
        self.assertEqual(r.status, 204, r)
        released = time.monotonic()
        status, _, doc = second.wait(timeout=40)
        self.assertEqual(status, 201, "the dead server's waiter held the live one up: %r" % (doc,))
        lease = self.clients[1].get_lease(name)
        self.assertEqual(lease.json["owner_client_id"], "on-b", lease)
        waited = time.monotonic() - released
        print("granted %.1f s after the release, past the dead server's waiter" % waited)
        self.assertLess(waited, 20)


class DaemonWaits(unittest.TestCase):
    """A real server and three mepd daemons (remote mode) on one memory file."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        mep_bin()
        cls._tmp = tempfile.TemporaryDirectory(prefix="mep-waitd-")
        cls.addClassCleanup(cls._tmp.cleanup)
        cls.home = cls._tmp.name
        cls.env = clean_env(cls.home)
        cls.server = DaemonMepServer(cls.home, cls.env)
        cls.addClassCleanup(cls.server.stop)
        cls.server.start()
        token = cls.server.token("tenant-wait")
        # On PostgreSQL a second server serves the same database, and the daemons use both:
        # the queue of waiting claims is the database's.
        cls.servers = [cls.server]
        if cls.server.pgdb is not None:
            second = DaemonMepServer(cls.home, cls.env, db=cls.server.db)
            cls.addClassCleanup(second.stop)
            cls.servers.append(second.start())
        cls.daemons = []
        for i in range(3):
            srv = cls.servers[i % len(cls.servers)]
            d = Mepd(cls.home, cls.env, control_plane=srv.url, token=token, tag="mepd%d" % i)
            cls.addClassCleanup(d.stop)
            cls.daemons.append(d.start())

    def setUp(self):
        self.popens = []
        self.addCleanup(self._end)

    def _end(self):
        for p in self.popens:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
            for f in (p.stdout, p.stderr):
                if f:
                    f.close()

    def run(self, result=None):
        before = (len(result.failures) + len(result.errors)) if result is not None else 0
        out = super().run(result)
        if result is not None and len(result.failures) + len(result.errors) > before:
            import sys
            sys.stderr.write("\n---- server log ----\n%s\n" % self.server.log_text()[-4000:])
            for d in self.daemons:
                sys.stderr.write("\n---- %s log ----\n%s\n" % (d.tag, d.log_text()[-3000:]))
        return out

    def mep(self, daemon, *args, timeout=60):
        p = subprocess.run([mep_bin(), "--socket", daemon.socket_path, *args], stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env, cwd=self.home,
                           timeout=timeout, check=False)
        return p.returncode, p.stdout.decode(), p.stderr.decode()

    def popen(self, daemon, *args):
        p = subprocess.Popen([mep_bin(), "--socket", daemon.socket_path, *args], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env, cwd=self.home,
                             start_new_session=True)
        self.popens.append(p)
        return p

    def new_memory(self):
        path = os.path.join(self.home, "m-%s.uai" % uuid.uuid4().hex[:8])
        rc, out, err = self.mep(self.daemons[0], "init", path)
        self.assertEqual(rc, 0, err)
        return path

    def waiters(self):
        return sum(metric(s.port, "mep_lease_waiters") for s in self.servers)

    def test_run_wait_exits_3_when_the_name_stays_held(self):
        path, name = self.new_memory(), "held-%s" % uuid.uuid4().hex[:8]
        rc, _, err = self.mep(self.daemons[0], "claim", name, path)
        self.assertEqual(rc, 0, err)
        start = time.monotonic()
        rc, out, err = self.mep(self.daemons[1], "run", "--wait", "4", name, path, "--", "true")
        self.assertEqual(rc, 3, out + err)
        self.assertGreaterEqual(time.monotonic() - start, 3.9)
        self.assertIn("held by ", err)  # by whom, when the holder is of the same tenant

    def test_on_a_terminal_claim_wait_says_what_it_waits_for(self):
        import pty
        path, name = self.new_memory(), "tty-%s" % uuid.uuid4().hex[:8]
        rc, _, err = self.mep(self.daemons[0], "claim", name, path)
        self.assertEqual(rc, 0, err)
        other = self.popen(self.daemons[2], "claim", "--wait", "30", name, path)  # one waiting ahead
        self.assertTrue(wait_for(lambda: self.waiters() == 1))
        master, slave = pty.openpty()
        try:
            p = subprocess.Popen([mep_bin(), "--socket", self.daemons[1].socket_path, "claim", "--wait", "2", name, path],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, env=self.env,
                                 cwd=self.home)
            os.close(slave)
            slave = None
            _, _ = p.communicate(timeout=30)
            text = b""
            while True:
                try:
                    chunk = os.read(master, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                text += chunk
        finally:
            if slave is not None:
                os.close(slave)
            os.close(master)
        self.assertEqual(p.returncode, 3, text)
        # What it waits for and who holds it: the holder is of the same tenant.
        self.assertRegex(text.decode("utf-8", "replace"),
                         r"waiting for %s, held by %s on \S+ since \d\d:\d\d, expires in \d+ s, 1 waiting ahead"
                         % (name, name))
        rc, _, err = self.mep(self.daemons[0], "release", name)
        self.assertEqual(rc, 0, err)
        _, err = other.communicate(timeout=30)
        self.assertEqual(other.returncode, 0, err)

    def test_run_wait_runs_the_command_once_the_name_is_released(self):
        path, name = self.new_memory(), "soon-%s" % uuid.uuid4().hex[:8]
        rc, _, err = self.mep(self.daemons[0], "claim", name, path)
        self.assertEqual(rc, 0, err)
        p = self.popen(self.daemons[1], "run", "--wait", "30", name, path, "--", "sh", "-c", "echo ran $MEP_FENCING_TOKEN")
        self.assertTrue(wait_for(lambda: self.waiters() == 1), "mep run --wait did not queue")
        time.sleep(2)
        self.assertIsNone(p.poll(), "mep run ended while the name was held")
        rc, _, err = self.mep(self.daemons[0], "release", name)
        self.assertEqual(rc, 0, err)
        out, err = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 0, err)
        self.assertEqual(out.decode().strip(), "ran 2")

    def test_a_wait_longer_than_the_ttl_keeps_the_lease_it_gets(self):
        # The lease is counted from the grant, not from the request: a 5 s TTL after an 8 s
        # wait is a live lease, renewed, until the command ends (exit 0, not 4 for lost).
        path, name = self.new_memory(), "long-%s" % uuid.uuid4().hex[:8]
        rc, _, err = self.mep(self.daemons[0], "claim", name, path)
        self.assertEqual(rc, 0, err)
        p = self.popen(self.daemons[1], "run", "--ttl", "5", "--wait", "60", name, path, "--",
                       "sh", "-c", "sleep 6; echo held $MEP_FENCING_TOKEN")
        self.assertTrue(wait_for(lambda: self.waiters() == 1))
        time.sleep(8)
        rc, _, err = self.mep(self.daemons[0], "release", name)
        self.assertEqual(rc, 0, err)
        out, err = p.communicate(timeout=60)
        self.assertEqual(p.returncode, 0, err.decode())
        self.assertEqual(out.decode().strip(), "held 2")

    def test_a_killed_holder_hands_over_to_the_first_waiter(self):
        path, name = self.new_memory(), "dies-%s" % uuid.uuid4().hex[:8]
        holder = self.popen(self.daemons[0], "run", name, path, "--", "sleep", "600")
        self.assertTrue(wait_for(lambda: self.lease_of(name)), "the holder never got the lease")
        first = self.popen(self.daemons[1], "run", "--wait", "60", name, path, "--", "sh", "-c", "echo first")
        self.assertTrue(wait_for(lambda: self.waiters() == 1))
        second = self.popen(self.daemons[2], "run", "--wait", "60", name, path, "--", "sh", "-c", "echo second")
        self.assertTrue(wait_for(lambda: self.waiters() == 2))
        os.killpg(holder.pid, signal.SIGKILL)  # mep run and its command: mepd sees the pid die
        out, err = first.communicate(timeout=30)
        self.assertEqual((first.returncode, out.decode().strip()), (0, "first"), err)
        out, err = second.communicate(timeout=30)
        self.assertEqual((second.returncode, out.decode().strip()), (0, "second"), err)

    def test_a_killed_waiter_leaves_the_queue(self):
        path, name = self.new_memory(), "wq-%s" % uuid.uuid4().hex[:8]
        rc, _, err = self.mep(self.daemons[0], "claim", name, path)
        self.assertEqual(rc, 0, err)
        gone = self.popen(self.daemons[1], "run", "--wait", "60", name, path, "--", "sh", "-c", "echo gone")
        self.assertTrue(wait_for(lambda: self.waiters() == 1))
        nxt = self.popen(self.daemons[2], "run", "--wait", "60", name, path, "--", "sh", "-c", "echo next")
        self.assertTrue(wait_for(lambda: self.waiters() == 2))
        os.killpg(gone.pid, signal.SIGKILL)
        gone.wait(timeout=10)
        self.assertTrue(wait_for(lambda: self.waiters() == 1, timeout=10), "the killed waiter stayed queued")
        rc, _, err = self.mep(self.daemons[0], "release", name)
        self.assertEqual(rc, 0, err)
        out, err = nxt.communicate(timeout=30)
        self.assertEqual((nxt.returncode, out.decode().strip()), (0, "next"), err)

    def lease_of(self, name):
        for d in self.daemons:
            rc, out, _ = self.mep(d, "--json", "status")
            if rc == 0 and name in out:
                return True
        return False

    def test_twenty_workers_on_three_daemons_are_served_in_order(self):
        path, name = self.new_memory(), "fair-%s" % uuid.uuid4().hex[:8]
        log = os.path.join(self.home, "fair-%s.log" % uuid.uuid4().hex[:6])
        rc, _, err = self.mep(self.daemons[0], "claim", name, path)
        self.assertEqual(rc, 0, err)
        # Each worker appends "start <i> <token>" and "end <i> <token>" around a short hold.
        script = ('echo "start $1 $MEP_FENCING_TOKEN $(date +%s.%N)" >> "$2"; sleep 0.2; '
                  'echo "end $1 $MEP_FENCING_TOKEN $(date +%s.%N)" >> "$2"')
        workers = []
        for i in range(20):
            d = self.daemons[i % 3]
            workers.append(self.popen(d, "run", "--wait", "120", name, path, "--", "sh", "-c", script, "sh", str(i), log))
            self.assertTrue(wait_for(lambda: self.waiters() == i + 1), "worker %d never queued" % i)
        rc, _, err = self.mep(self.daemons[0], "release", name)
        self.assertEqual(rc, 0, err)
        for i, w in enumerate(workers):
            out, err = w.communicate(timeout=120)
            self.assertEqual(w.returncode, 0, "worker %d: %s" % (i, err.decode()))
        with open(log) as f:
            lines = [l.split() for l in f.read().splitlines()]
        # Never two at once: the log alternates start/end of the same worker.
        self.assertEqual(len(lines), 40)
        for k in range(0, 40, 2):
            self.assertEqual((lines[k][0], lines[k + 1][0]), ("start", "end"), lines[k:k + 2])
            self.assertEqual(lines[k][1], lines[k + 1][1])
        order = [int(lines[k][1]) for k in range(0, 40, 2)]
        tokens = [int(lines[k][2]) for k in range(0, 40, 2)]
        # No worker waits longer than the holds ahead of it plus a bound: each hand-over (one
        # worker's end to the next one's start: release, wake-up, grant, fork) is short.
        gaps = [float(lines[k + 2][3]) - float(lines[k + 1][3]) for k in range(0, 38, 2)]
        print("order of grants:", order, "tokens:", tokens)
        print("hand-overs (s): median %.2f, longest %.2f" % (sorted(gaps)[len(gaps) // 2], max(gaps)))
        self.assertLess(max(gaps), 5.0, "a hand-over took %.1f s" % max(gaps))
        self.assertEqual(order, list(range(20)), "not first come, first served")
        self.assertEqual(tokens, sorted(tokens))
        self.assertEqual(len(set(tokens)), 20)


if __name__ == "__main__":
    unittest.main()
