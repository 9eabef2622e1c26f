"""The control plane (`mep server`, SPEC §6) end to end over real HTTP: every control-plane
acceptance case of SPEC §13 under its own name, plus renew-batch, fence verify, admin revoke,
pagination, memory registration, re-claim, the error shape, health endpoints and SIGTERM.

Runs the real binary from $MEP_BIN on a fresh SQLite file per test class (serverfixture).
Expiry cases use TTL 5 s, the smallest the API allows."""
import concurrent.futures
import hashlib
import hmac
import json
import os
import re
import signal
import socket
import sqlite3
import struct
import subprocess
import tempfile
import threading
import time
import unittest
import urllib.parse

import pgfixture

from mephelpers import mep_bin, read_to_close, send_expecting_continue
from serverfixture import (HEX64_RE, PROBLEM_BASE, RFC3339_MS_RE, UUID_RE, ApiClient, MepServer,
                           ServerTestCase, create_token, db_execute, db_query, db_url, new_key, parse_rfc3339_ms,
                           drop_db, new_db, raw_exchange, revoke_token, run_mep, token_id_of, unique_name, uuid7)

SHORT_TTL = 5
EXPIRY_SLACK_S = 0.4      # past expires_at before we rely on expiry (same host clock)
# How long a test waits for the sweeper. Sweeps are spaced by their cost (50 times as long as
# the last one took), at most 30 s apart (server/mep/sweeper.hpp): a sweep of a loaded Spanner
# emulator takes over 0.6 s, so the next comes 30 s later, and takes seconds itself.
SWEEP_WAIT_S = 45
GRANT_FIELDS = {"lease_id", "canonical_name", "display_name", "memory_instance_id",
                "fencing_token", "expires_at", "ttl_seconds", "server_time"}
# A lease as the reads show it: the grant, its owner, who holds it and since when.
LEASE_FIELDS = GRANT_FIELDS | {"owner_client_id", "holder", "granted_at", "renewed_at", "renewals", "hold_until"}
RENEW_FIELDS = {"expires_at", "ttl_seconds", "server_time"}
MEMORY_FIELDS = {"memory_instance_id", "parent_memory_instance_id", "branched_at_token",
                 "created_at", "fencing_token_high_water"}
SPEC_METRICS = ["mep_lease_renewal_latency_seconds", "mep_fencing_rejections_total",
                "mep_idempotency_lookups_total", "mep_claims_total", "mep_leases_active",
                "mep_http_request_duration_seconds", "mep_db_transaction_retries_total",
                "mep_rate_limited_total"]


def owner():
    return "owner-" + uuid7()


def counter_of(db_path, memory_id):
    rows = db_query(db_path, "SELECT fence_counter FROM memories WHERE memory_id = ?", (memory_id,))
    return rows[0][0] if rows else None


def lease_rows(db_path, where, params):
    return db_query(db_path, "SELECT canonical_name, memory_id, fencing_token, owner_client_id "
                             "FROM leases WHERE " + where, params)


def sleep_until_expired(grant_body):
    """Sleeps (bounded by the TTL) until the lease of this grant has expired by the server's
    clock, which is this host's clock."""
    exp = parse_rfc3339_ms(grant_body["expires_at"]) / 1000.0
    delay = exp - time.time() + EXPIRY_SLACK_S
    assert delay < 310, delay
    if delay > 0:
        time.sleep(delay)


def run_concurrently(n, fn, timeout=120):
    """Runs fn(i, barrier) in n threads that start together; returns the results in order."""
    barrier = threading.Barrier(n, timeout=60)
    with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(fn, i, barrier) for i in range(n)]
        return [f.result(timeout=timeout) for f in futures]


class ServerApi(ServerTestCase):
    # ---- helpers ---------------------------------------------------------------------------

    def lease(self, c=None, name=None, ttl=None, who=None):
        """Registers a memory and claims a fresh name for it; returns (name, memory, owner, body)."""
        c = c or self.client()
        name = name or unique_name()
        mem = c.new_memory()
        who = who or owner()
        r = c.claim(name, mem, who, ttl=ttl)
        self.assertStatus(r, 201)
        return name, mem, who, r.json

    def assertGrant(self, r, status=201):
        self.assertStatus(r, status)
        self.assertEqual((r.header("Content-Type") or "").split(";")[0], "application/json")
        self.assertEqual(set(r.json), GRANT_FIELDS, r)
        self.assertRegex(r.json["expires_at"], RFC3339_MS_RE)
        self.assertRegex(r.json["server_time"], RFC3339_MS_RE)
        self.assertEqual(parse_rfc3339_ms(r.json["expires_at"]) - parse_rfc3339_ms(r.json["server_time"]),
                         r.json["ttl_seconds"] * 1000)
        self.assertIsInstance(r.json["fencing_token"], int)
        return r.json

    # ---- §13: claims -----------------------------------------------------------------------

    def test_claim_fresh_returns_201_token_1(self):
        c = self.client()
        mem = c.new_memory()
        display = unique_name("Fresh-Agent")
        who = owner()
        r = c.claim(display, mem, who)
        g = self.assertGrant(r)
        self.assertEqual(g["fencing_token"], 1)
        self.assertEqual(g["canonical_name"], display.lower())
        self.assertEqual(g["display_name"], display)
        self.assertEqual(g["memory_instance_id"], mem)
        self.assertEqual(g["ttl_seconds"], 30)
        self.assertRegex(g["lease_id"], UUID_RE)
        self.assertEqual(g["lease_id"][14], "7", "lease_id is not a UUIDv7")
        self.assertIsNone(r.header("Idempotent-Replayed"))
        self.assertTrue(r.header("X-Request-Id"))
        # The server clock is this host's clock.
        self.assertLess(abs(parse_rfc3339_ms(g["server_time"]) / 1000 - time.time()), 5)
        got = c.get_lease(g["canonical_name"])
        self.assertStatus(got, 200)
        self.assertEqual(got.json["lease_id"], g["lease_id"])
        self.assertEqual(got.json["fencing_token"], 1)
        self.assertEqual(got.json["owner_client_id"], who)
        m = c.get("/v1/memories/" + mem)
        self.assertStatus(m, 200)
        self.assertEqual(m.json["fencing_token_high_water"], 1)
        self.assertEqual(counter_of(self.db_path, mem), 1)

    def test_display_name_trimmed_and_nfc(self):
        c = self.client()
        base = unique_name("eclair")
        shown = "\u00e9" + base                       # é (NFC)
        g = self.assertGrant(c.claim("  e\u0301" + base + "\u3000 ", c.new_memory(), owner()))
        self.assertEqual(g["display_name"], shown)   # NFC, outer whitespace trimmed
        self.assertEqual(g["canonical_name"], shown)
        self.assertEqual(c.get_lease(shown).json["display_name"], shown)
        self.assertProblem(c.claim(shown.upper(), c.new_memory(), owner()), 423, "name-held")

    def test_claim_live_name_other_owner_423(self):
        c = self.client()
        name, mem, who, g = self.lease(c)
        other_mem = c.new_memory()
        key, other = new_key(), owner()
        r = c.claim(name, other_mem, other, key=key)
        self.assertProblem(r, 423, "name-held")
        self.assertRetryAfter(r, 30)
        # Its replay is the stored answer, Retry-After included.
        again = c.claim(name, other_mem, other, key=key)
        self.assertEqual((again.status, again.header("Idempotent-Replayed")), (423, "true"))
        self.assertEqual(again.raw, r.raw)
        self.assertEqual(again.header("Retry-After"), r.header("Retry-After"))
        # The same owner with another memory is not a re-claim either.
        r = c.claim(name, other_mem, who)
        self.assertProblem(r, 423, "name-held")
        # Names are global: another tenant cannot take it.
        cb = self.client(self.token_b)
        r = cb.claim(name, cb.new_memory(), owner())
        self.assertProblem(r, 423, "name-held")
        self.assertRetryAfter(r, 30)
        got = c.get_lease(name)
        self.assertStatus(got, 200)
        self.assertEqual((got.json["owner_client_id"], got.json["fencing_token"]), (who, 1))
        self.assertEqual(counter_of(self.db_path, other_mem), 0)

    def test_claim_live_memory_other_name_423(self):
        c = self.client()
        name, mem, who, g = self.lease(c)
        other = unique_name()
        r = c.claim(other, mem, owner())
        self.assertProblem(r, 423, "memory-attached")
        self.assertRetryAfter(r, 30)
        r = c.claim(other, mem, who)  # same owner, another name: still attached
        self.assertProblem(r, 423, "memory-attached")
        self.assertProblem(c.get_lease(other), 404, "lease-not-found")
        self.assertEqual(counter_of(self.db_path, mem), 1)
        self.assertEqual(lease_rows(self.db_path, "memory_id = ?", (mem,)), [(name, mem, 1, who)])

    def test_claim_failure_leaves_no_partial_state(self):
        c = self.client()
        # An expired lease (started first; its TTL runs out while the other cases run).
        n4, m4, o4, g4 = self.lease(c, ttl=SHORT_TTL)
        name, mem, who, g = self.lease(c)
        history_before = db_query(self.db_path, "SELECT * FROM agent_names WHERE canonical_name = ?", (name,))

        # (a) the name is free, the memory is attached elsewhere: no name row, no lease, no bump.
        n2 = unique_name()
        self.assertProblem(c.claim(n2, mem, owner()), 423, "memory-attached")
        # (b) the name is held, the memory is fresh.
        fresh = c.new_memory()
        self.assertProblem(c.claim(name, fresh, owner()), 423, "name-held")
        # (c) the memory does not exist.
        ghost, n3 = uuid7(), unique_name()
        self.assertProblem(c.claim(n3, ghost, owner()), 404, "memory-not-found")
        # (d) an invalid name.
        self.assertProblem(c.claim("bad!name", fresh, owner()), 422, "invalid-name")
        # (e) an invalid TTL.
        n5 = unique_name()
        self.assertProblem(c.claim(n5, fresh, owner(), ttl=4), 422, "invalid-ttl")

        for n in (n2, n3, n5):
            self.assertEqual(lease_rows(self.db_path, "canonical_name = ?", (n,)), [], n)
            self.assertEqual(db_query(self.db_path, "SELECT * FROM agent_names WHERE canonical_name = ?", (n,)), [])
        self.assertEqual(lease_rows(self.db_path, "memory_id = ?", (mem,)), [(name, mem, 1, who)])
        self.assertEqual(lease_rows(self.db_path, "memory_id = ?", (fresh,)), [])
        self.assertEqual(counter_of(self.db_path, mem), 1)
        self.assertEqual(counter_of(self.db_path, fresh), 0)
        self.assertIsNone(counter_of(self.db_path, ghost))
        self.assertEqual(db_query(self.db_path, "SELECT * FROM agent_names WHERE canonical_name = ?", (name,)),
                         history_before)
        # The failed claims did not disturb the holder.
        self.assertStatus(c.renew(name, mem, 1, who), 200)

        # (f) a claim whose takeover step removes an expired lease and then fails: the
        # takeover is rolled back with it — no lease moved, no counter bumped, and no audit
        # row records a takeover that did not happen. (If the sweeper removed the expired row
        # first, this part holds trivially.)
        sleep_until_expired(g4)
        self.assertProblem(c.claim(n4, mem, owner()), 423, "memory-attached")
        self.assertEqual(counter_of(self.db_path, m4), 1)
        self.assertEqual(counter_of(self.db_path, mem), 1)
        self.assertIn(lease_rows(self.db_path, "canonical_name = ?", (n4,)), ([], [(n4, m4, 1, o4)]))
        self.assertEqual(lease_rows(self.db_path, "memory_id = ?", (mem,)), [(name, mem, 1, who)])
        salt = db_query(self.db_path, "SELECT audit_salt FROM tenants WHERE name = 'tenant-a'")[0][0]
        hashes = {hmac.new(k, n4.encode(), hashlib.sha256).hexdigest()
                  for k in (salt.encode(), bytes.fromhex(salt))}
        types = [r[0] for r in db_query(self.db_path, "SELECT event_type, redacted_name_hash FROM audit_events")
                 if r[1] in hashes]
        self.assertNotIn("LEASE_TAKEOVER", types, types)

    # ---- §13: idempotency --------------------------------------------------------------------

    def test_idempotent_retry_replays_identical_body(self):
        c = self.client()
        mem = c.new_memory()
        name, who, key = unique_name(), owner(), new_key()
        r1 = c.claim(name, mem, who, key=key)
        self.assertGrant(r1)
        self.assertIsNone(r1.header("Idempotent-Replayed"))
        r2 = c.claim(name, mem, who, key=key)
        self.assertStatus(r2, 200)
        self.assertEqual(r2.raw, r1.raw)
        self.assertEqual(r2.header("Idempotent-Replayed"), "true")
        self.assertEqual((r2.header("Content-Type") or "").split(";")[0], "application/json")
        # Same request with other member order and whitespace, and the key as an RFC 8941
        # sf-string: same fingerprint, same key → the same stored response.
        body = ' { "owner_client_id" : "%s", "memory_instance_id":"%s",\n "display_name": "%s" } ' % (who, mem, name)
        r3 = c.post("/v1/leases", body, idem='"%s"' % key)
        self.assertStatus(r3, 200)
        self.assertEqual(r3.raw, r1.raw)
        self.assertEqual(r3.header("Idempotent-Replayed"), "true")
        # One grant only.
        self.assertEqual(counter_of(self.db_path, mem), 1)
        self.assertEqual(len(lease_rows(self.db_path, "canonical_name = ?", (name,))), 1)
        # A registration replays too.
        mkey, mid = new_key(), uuid7()
        a = c.register(mid, key=mkey)
        self.assertStatus(a, 201)
        b = c.register(mid, key=mkey)
        self.assertStatus(b, 200)
        self.assertEqual(b.raw, a.raw)
        self.assertEqual(b.header("Idempotent-Replayed"), "true")
        # A definite 4xx outcome is stored and replayed byte for byte.
        pkey, pm, po = new_key(), c.new_memory(), owner()
        p1 = c.claim(name, pm, po, key=pkey)
        self.assertProblem(p1, 423, "name-held")
        p2 = c.claim(name, pm, po, key=pkey)
        self.assertProblem(p2, 423, "name-held", replay=True)
        self.assertEqual(p2.raw, p1.raw)
        self.assertEqual(p2.header("Idempotent-Replayed"), "true")

    def test_idempotency_key_reuse_other_body_422(self):
        c = self.client()
        mem = c.new_memory()
        name, who, key = unique_name(), owner(), new_key()
        self.assertGrant(c.claim(name, mem, who, key=key))
        r = c.claim(name, mem, owner(), key=key)
        self.assertProblem(r, 422, "idempotency-key-reused")
        r = c.claim(name, mem, who, ttl=60, key=key)
        self.assertProblem(r, 422, "idempotency-key-reused")
        # The path is part of the fingerprint.
        r = c.register(key=key)
        self.assertProblem(r, 422, "idempotency-key-reused")
        self.assertEqual(counter_of(self.db_path, mem), 1)
        self.assertEqual(lease_rows(self.db_path, "canonical_name = ?", (name,)), [(name, mem, 1, who)])

    def test_idempotency_records_retained_24h_then_swept(self):
        # A record lives 24 h from its request; once past that (here: the records written
        # until then are moved 24 h into the past, in the database) the sweeper deletes it,
        # and the key is free for another request (201, not 422); a record written later
        # stays and still replays.
        c = self.client()
        key, other = new_key(), new_key()
        r = c.claim(unique_name(), c.new_memory(), owner(), key=key)
        self.assertStatus(r, 201)
        kept_args = (unique_name(), c.new_memory(), owner())
        time.sleep(0.01)  # a later millisecond than the record that expires
        kept = c.claim(*kept_args, key=other)
        self.assertStatus(kept, 201)
        (created, expires), = db_query(self.db_path, "SELECT created_at, expires_at FROM idempotency "
                                                     "WHERE idem_key = ?", (key,))
        self.assertEqual(expires - created, 24 * 3600 * 1000)
        sql = ("UPDATE idempotency SET expires_at = created_at - 1 WHERE created_at <= "
               "%d" % created)
        db_execute(self.db_path, sql)
        deadline = time.monotonic() + SWEEP_WAIT_S
        while db_query(self.db_path, "SELECT 1 FROM idempotency WHERE idem_key = ?", (key,)) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        self.assertEqual(db_query(self.db_path, "SELECT 1 FROM idempotency WHERE idem_key = ?", (key,)), [])
        self.assertStatus(c.claim(unique_name(), c.new_memory(), owner(), key=key), 201)
        replay = c.claim(*kept_args, key=other)
        self.assertStatus(replay, 200)
        self.assertEqual((replay.header("Idempotent-Replayed"), replay.raw), ("true", kept.raw))

    def test_expired_idempotency_record_not_yet_swept_is_replaced(self):
        # An expired record is gone for the lookup even while its row is still there (on
        # SQLite the sweeper stops at the older, live record before it); a new request with
        # its key — another body, even — runs (201, not 422) and leaves one record.
        c = self.client()
        live, key = new_key(), new_key()
        self.assertStatus(c.claim(unique_name(), c.new_memory(), owner(), key=live), 201)
        self.assertStatus(c.claim(unique_name(), c.new_memory(), owner(), key=key), 201)
        sql = "UPDATE idempotency SET expires_at = created_at - 1 WHERE idem_key = '%s'" % key
        db_execute(self.db_path, sql)
        again_args = (unique_name(), c.new_memory(), owner())
        again = c.claim(*again_args, key=key)
        self.assertStatus(again, 201)
        rows = db_query(self.db_path, "SELECT status, expires_at - created_at FROM idempotency "
                                      "WHERE idem_key = ?", (key,))
        self.assertEqual(rows, [(201, 24 * 3600 * 1000)])
        replay = c.claim(*again_args, key=key)
        self.assertStatus(replay, 200)
        self.assertEqual(replay.raw, again.raw)
        self.assertProblem(c.claim(unique_name(), c.new_memory(), owner(), key=key), 422, "idempotency-key-reused")

    def test_idempotency_key_missing_400(self):
        c = self.client()
        name, mem, who, g = self.lease(c)
        count = db_query(self.db_path, "SELECT count(*) FROM memories")[0][0]
        n2, m2 = unique_name(), c.new_memory()
        count += 1
        requests = [
            ("/v1/memories", {}),
            ("/v1/memories", {"memory_instance_id": uuid7()}),
            ("/v1/leases", {"display_name": n2, "memory_instance_id": m2, "owner_client_id": owner()}),
            ("/v1/memories/branch", {"parent_memory_instance_id": mem, "parent_fencing_token": 1}),
        ]
        for path, body in requests:
            with self.subTest(path=path):
                self.assertProblem(c.post(path, body), 400, "idempotency-key-missing")
        # Present but invalid: empty, too long, not printable ASCII, repeated.
        for key in ["", " ", "a b", "x" * 256, '"unterminated', '"bad\\q"']:
            with self.subTest(key=key):
                r = c.post("/v1/leases", requests[2][1], idem=key)
                self.assertProblem(r, 400, "idempotency-key-invalid")
        r = c.post("/v1/leases", requests[2][1], headers=[("Idempotency-Key", "a1"), ("Idempotency-Key", "a1")])
        self.assertProblem(r, 400, "idempotency-key-invalid")
        # Nothing was created.
        self.assertEqual(db_query(self.db_path, "SELECT count(*) FROM memories")[0][0], count)
        self.assertEqual(lease_rows(self.db_path, "canonical_name = ?", (n2,)), [])
        self.assertEqual(counter_of(self.db_path, m2), 0)
        self.assertEqual(db_query(self.db_path, "SELECT count(*) FROM memories WHERE parent_memory_id = ?", (mem,))[0][0], 0)
        # The limits are inclusive: 255 printable characters work.
        r = c.post("/v1/leases", requests[2][1], idem="~" * 255)
        self.assertGrant(r)

    def test_idempotency_keys_scoped_per_tenant(self):
        ca, cb = self.client(self.token_a), self.client(self.token_b)
        key = new_key()
        ra = ca.register(key=key)
        rb = cb.register(key=key)
        self.assertStatus(ra, 201)
        self.assertStatus(rb, 201)
        self.assertIsNone(rb.header("Idempotent-Replayed"))
        self.assertNotEqual(ra.json["memory_instance_id"], rb.json["memory_instance_id"])
        # Each tenant's retry replays its own outcome.
        self.assertEqual(ca.register(key=key).raw, ra.raw)
        self.assertEqual(cb.register(key=key).raw, rb.raw)
        # Claims: same key, each tenant gets its own grant.
        k2 = new_key()
        na, nb = unique_name(), unique_name()
        ga = ca.claim(na, ra.json["memory_instance_id"], owner(), key=k2)
        gb = cb.claim(nb, rb.json["memory_instance_id"], owner(), key=k2)
        self.assertGrant(ga)
        self.assertGrant(gb)
        self.assertEqual(gb.json["canonical_name"], nb)

    def test_concurrent_same_key_one_lease(self):
        c = self.client()
        mem = c.new_memory()
        name, who, key = unique_name(), owner(), new_key()
        n = 50

        def worker(i, barrier):
            with ApiClient(self.port, self.token_a) as wc:
                self.assertStatus(wc.get("/healthz"), 200)  # connect before the start line
                barrier.wait()
                return wc.claim(name, mem, who, key=key)

        results = run_concurrently(n, worker)
        statuses = sorted(r.status for r in results)
        self.assertEqual(statuses.count(201), 1, statuses)
        self.assertEqual(statuses.count(200), n - 1, statuses)
        self.assertEqual(len({r.raw for r in results}), 1, "bodies differ")
        for r in results:
            self.assertEqual(r.header("Idempotent-Replayed"), "true" if r.status == 200 else None)
        self.assertEqual(results[0].json["fencing_token"], 1)
        self.assertEqual(len(lease_rows(self.db_path, "canonical_name = ?", (name,))), 1)
        self.assertEqual(counter_of(self.db_path, mem), 1)

    # ---- §13: races ----------------------------------------------------------------------

    def test_race_100_workers_same_name_one_winner(self):
        name, n = unique_name(), 100
        c = self.client()
        mems = [c.new_memory() for _ in range(n)]

        def worker(i, barrier):
            with ApiClient(self.port, self.token_a) as wc:
                self.assertStatus(wc.get("/healthz"), 200)
                barrier.wait()
                return wc.claim(name, mems[i], "owner-%d-%s" % (i, name))

        results = run_concurrently(n, worker)
        winners = [i for i, r in enumerate(results) if r.status == 201]
        self.assertEqual(len(winners), 1, [r.status for r in results])
        for i, r in enumerate(results):
            if i != winners[0]:
                self.assertProblem(r, 423, "name-held")
        self.assertEqual(results[winners[0]].json["fencing_token"], 1)
        rows = lease_rows(self.db_path, "canonical_name = ?", (name,))
        self.assertEqual(rows, [(name, mems[winners[0]], 1, "owner-%d-%s" % (winners[0], name))])
        counters = [counter_of(self.db_path, m) for m in mems]
        self.assertEqual(sorted(counters), [0] * (n - 1) + [1])

    def test_race_100_workers_same_memory_one_winner(self):
        n = 100
        c = self.client()
        mem = c.new_memory()
        names = [unique_name() for _ in range(n)]

        def worker(i, barrier):
            with ApiClient(self.port, self.token_a) as wc:
                self.assertStatus(wc.get("/healthz"), 200)
                barrier.wait()
                return wc.claim(names[i], mem, "owner-%d" % i)

        results = run_concurrently(n, worker)
        winners = [i for i, r in enumerate(results) if r.status == 201]
        self.assertEqual(len(winners), 1, [r.status for r in results])
        for i, r in enumerate(results):
            if i != winners[0]:
                self.assertProblem(r, 423, "memory-attached")
        self.assertEqual(lease_rows(self.db_path, "memory_id = ?", (mem,)),
                         [(names[winners[0]], mem, 1, "owner-%d" % winners[0])])
        self.assertEqual(counter_of(self.db_path, mem), 1)

    def test_distinct_claims_do_not_serialize(self):
        n = 100
        c = self.client()
        mems = [c.new_memory() for _ in range(n)]
        names = [unique_name() for _ in range(n)]

        def worker(i, barrier):
            with ApiClient(self.port, self.token_a) as wc:
                self.assertStatus(wc.get("/healthz"), 200)
                barrier.wait()
                return wc.claim(names[i], mems[i], "owner-%d" % i)

        results = run_concurrently(n, worker)
        for i, r in enumerate(results):
            g = self.assertGrant(r)
            self.assertEqual((g["canonical_name"], g["memory_instance_id"], g["fencing_token"]),
                             (names[i], mems[i], 1))
        rows = db_query(self.db_path, "SELECT count(*) FROM leases WHERE canonical_name IN (%s)"
                        % ",".join("?" * n), names)
        self.assertEqual(rows[0][0], n)

    # ---- §13: renew and release --------------------------------------------------------------

    def test_renew_extends_by_server_clock(self):
        c = self.client()
        name, mem, who, g = self.lease(c, ttl=SHORT_TTL)
        e0 = parse_rfc3339_ms(g["expires_at"])
        time.sleep(1.0)
        r = c.renew(name, mem, 1, who, ttl=SHORT_TTL)
        self.assertStatus(r, 200)
        self.assertEqual(set(r.json), RENEW_FIELDS)
        e1, now1 = parse_rfc3339_ms(r.json["expires_at"]), parse_rfc3339_ms(r.json["server_time"])
        self.assertEqual(e1, now1 + SHORT_TTL * 1000, r.json)
        self.assertGreaterEqual(e1 - e0, 900)  # about the second we slept, by the server's clock
        self.assertEqual(r.json["ttl_seconds"], SHORT_TTL)
        # A longer TTL.
        r = c.renew(name, mem, 1, who, ttl=300)
        self.assertStatus(r, 200)
        e2 = parse_rfc3339_ms(r.json["expires_at"])
        self.assertEqual(e2, parse_rfc3339_ms(r.json["server_time"]) + 300_000)
        # A shorter TTL never shortens the lease: max(expires_at, now + ttl).
        r = c.renew(name, mem, 1, who, ttl=SHORT_TTL)
        self.assertStatus(r, 200)
        self.assertEqual(parse_rfc3339_ms(r.json["expires_at"]), e2)
        # The default TTL is 30 s.
        r = c.renew(name, mem, 1, who)
        self.assertStatus(r, 200)
        self.assertEqual(r.json["ttl_seconds"], 30)
        got = c.get_lease(name)
        self.assertEqual(parse_rfc3339_ms(got.json["expires_at"]), e2)
        self.assertEqual(got.json["fencing_token"], 1)
        # Renewing does not grant: the token stays.
        self.assertEqual(counter_of(self.db_path, mem), 1)
        # Someone else's owner id or another name does not renew it.
        self.assertProblem(c.renew(name, mem, 1, owner()), 404, "lease-not-found")
        self.assertProblem(c.renew(unique_name(), mem, 1, who), 404, "lease-not-found")

    def test_renew_stale_token_409(self):
        c = self.client()
        name, mem, who, g = self.lease(c)
        r = c.claim(name, mem, who)  # same owner re-claim → token 2
        self.assertEqual(self.assertGrant(r)["fencing_token"], 2)
        r = c.renew(name, mem, 1, who)
        body = self.assertProblem(r, 409, "stale-fence")
        self.assertEqual(body.get("current_fencing_token", 2), 2)
        self.assertProblem(c.renew(name, mem, 3, who), 409, "stale-fence")  # never issued
        self.assertStatus(c.renew(name, mem, 2, who), 200)
        self.assertProblem(c.release(name, mem, 1, who), 409, "stale-fence")
        got = c.get_lease(name)
        self.assertStatus(got, 200)
        self.assertEqual(got.json["fencing_token"], 2)

    def test_renew_after_expiry_410(self):
        c = self.client()
        name, mem, who, g = self.lease(c, ttl=SHORT_TTL)
        sleep_until_expired(g)
        self.assertProblem(c.renew(name, mem, 1, who), 410, "lease-expired")
        self.assertProblem(c.verify(mem, 1), 410, "lease-expired")
        self.assertProblem(c.get_lease(name), 404, "lease-not-found")
        # After the sweeper removed the row it is still "expired", not "stale" or "unknown".
        deadline = time.monotonic() + SWEEP_WAIT_S
        while lease_rows(self.db_path, "memory_id = ?", (mem,)) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.assertEqual(lease_rows(self.db_path, "memory_id = ?", (mem,)), [], "expired row not swept")
        self.assertProblem(c.renew(name, mem, 1, who), 410, "lease-expired")
        # Releasing an expired lease with its current token is idempotent success.
        r = c.release(name, mem, 1, who)
        self.assertStatus(r, 204)
        self.assertEqual(r.raw, b"")

    def test_release_then_reclaim_token_increases(self):
        c = self.client()
        name, mem, who, g = self.lease(c)
        self.assertEqual(g["fencing_token"], 1)
        r = c.release(name, mem, 1, who)
        self.assertStatus(r, 204)
        self.assertEqual(r.raw, b"")
        self.assertProblem(c.get_lease(name), 404, "lease-not-found")
        self.assertStatus(c.release(name, mem, 1, who), 204)  # idempotent
        self.assertEqual(counter_of(self.db_path, mem), 1)  # never reset
        # Another owner, same name and memory: the counter only grows.
        o2 = owner()
        g2 = self.assertGrant(c.claim(name, mem, o2))
        self.assertEqual(g2["fencing_token"], 2)
        self.assertProblem(c.renew(name, mem, 1, who), 409, "stale-fence")
        self.assertStatus(c.release(name, mem, 2, o2), 204)
        # The same memory under another name: the counter is per memory, not per name.
        g3 = self.assertGrant(c.claim(unique_name(), mem, owner()))
        self.assertEqual(g3["fencing_token"], 3)
        self.assertEqual(c.get("/v1/memories/" + mem).json["fencing_token_high_water"], 3)
        # The released name is free for a fresh memory (token 1 of that memory).
        g4 = self.assertGrant(c.claim(name, c.new_memory(), owner()))
        self.assertEqual(g4["fencing_token"], 1)

    def test_expiry_takeover_token_increases(self):
        c = self.client()
        name, mem, who, g = self.lease(c, ttl=SHORT_TTL)
        o2 = owner()
        r = c.claim(name, mem, o2)
        self.assertProblem(r, 423, "name-held")
        self.assertRetryAfter(r, SHORT_TTL)
        sleep_until_expired(g)
        g2 = self.assertGrant(c.claim(name, mem, o2))
        self.assertEqual(g2["fencing_token"], 2)
        self.assertProblem(c.renew(name, mem, 1, who), 409, "stale-fence")
        self.assertProblem(c.verify(mem, 1), 409, "stale-fence")
        self.assertStatus(c.verify(mem, 2), 200)
        # The old holder cannot come back while the new lease is live.
        self.assertProblem(c.claim(name, mem, who), 423, "name-held")

    def test_takeover_memory_under_other_name(self):
        c = self.client()
        n1, mem, who, g = self.lease(c, ttl=SHORT_TTL)
        n2, o2 = unique_name(), owner()
        self.assertProblem(c.claim(n2, mem, o2), 423, "memory-attached")
        sleep_until_expired(g)
        g2 = self.assertGrant(c.claim(n2, mem, o2))
        self.assertEqual(g2["fencing_token"], 2)
        self.assertEqual(g2["canonical_name"], n2)
        # The old name no longer holds the memory and is free.
        self.assertProblem(c.get_lease(n1), 404, "lease-not-found")
        self.assertEqual(lease_rows(self.db_path, "canonical_name = ?", (n1,)), [])
        self.assertProblem(c.renew(n1, mem, 1, who), 409, "stale-fence")
        g3 = self.assertGrant(c.claim(n1, c.new_memory(), owner()))
        self.assertEqual(g3["fencing_token"], 1)

    def test_stale_release_does_not_delete_new_lease(self):
        c = self.client()
        name, mem, who, g = self.lease(c, ttl=SHORT_TTL)
        sleep_until_expired(g)
        o2 = owner()
        self.assertEqual(self.assertGrant(c.claim(name, mem, o2))["fencing_token"], 2)
        self.assertProblem(c.release(name, mem, 1, who), 409, "stale-fence")
        # Even when the zombie guesses the new owner's id.
        self.assertProblem(c.release(name, mem, 1, o2), 409, "stale-fence")
        got = c.get_lease(name)
        self.assertStatus(got, 200)
        self.assertEqual((got.json["owner_client_id"], got.json["fencing_token"]), (o2, 2))
        self.assertStatus(c.renew(name, mem, 2, o2), 200)
        self.assertEqual(lease_rows(self.db_path, "memory_id = ?", (mem,)), [(name, mem, 2, o2)])

    def test_release_frees_name_lookalikes_and_memory_and_audits_once(self):
        """A released lease blocks nothing (its name, its look-alikes and its memory are free at
        once), is 410 to its old token, is swept, and is audited once: no LEASE_EXPIRED or
        LEASE_TAKEOVER for a release, one LEASE_EXPIRED for a lease released after it expired."""
        _, out, _ = run_mep(["canonicalize", "--json", "xopa", "хора"])
        self.assertEqual([json.loads(line)["skeleton"] for line in out.splitlines()], ["xopa", "xopa"], out)
        c = self.client()
        _, m_exp, o_exp, g_exp = self.lease(c, ttl=SHORT_TTL)
        mem, who = c.new_memory(), owner()
        self.assertEqual(self.assertGrant(c.claim("xopa", mem, who))["fencing_token"], 1)
        self.assertStatus(c.release("xopa", mem, 1, who), 204)
        # The Cyrillic look-alike, on another memory, right away.
        m2 = c.new_memory()
        self.assertEqual(self.assertGrant(c.claim("хора", m2, owner()))["fencing_token"], 1)
        # The released memory under another name, and released again (twice: idempotent).
        n2, o2 = unique_name(), owner()
        self.assertEqual(self.assertGrant(c.claim(n2, mem, o2))["fencing_token"], 2)
        self.assertStatus(c.release(n2, mem, 2, o2), 204)
        self.assertStatus(c.release(n2, mem, 2, o2), 204)
        self.assertProblem(c.renew(n2, mem, 2, o2), 410, "lease-expired")
        self.assertProblem(c.verify(mem, 2), 410, "lease-expired")
        self.assertProblem(c.branch(mem, 2), 410, "lease-expired")
        self.assertProblem(c.get_lease(n2), 404, "lease-not-found")
        self.assertNotIn(n2, [l["canonical_name"] for l in c.get("/v1/leases?limit=1000").json["leases"]])
        self.assertProblem(c.claim("xopa", c.new_memory(), owner()), 423, "name-confusable")
        # The short lease, released by its holder after it expired.
        sleep_until_expired(g_exp)
        self.assertStatus(c.release(g_exp["canonical_name"], m_exp, 1, o_exp), 204)
        # The sweeper removes what is left of both; the counters stay.
        deadline = time.monotonic() + SWEEP_WAIT_S
        while (lease_rows(self.db_path, "memory_id IN (?, ?)", (mem, m_exp))
               and time.monotonic() < deadline):
            time.sleep(0.2)
        self.assertEqual(lease_rows(self.db_path, "memory_id IN (?, ?)", (mem, m_exp)), [])
        self.assertEqual((counter_of(self.db_path, mem), counter_of(self.db_path, m_exp)), (2, 1))
        self.assertEqual(sorted(self.audit_types(mem)),
                         ["LEASE_ACQUIRED", "LEASE_ACQUIRED", "LEASE_RELEASED", "LEASE_RELEASED",
                          "MEMORY_REGISTERED"])
        self.assertEqual(sorted(self.audit_types(m_exp)), ["LEASE_ACQUIRED", "LEASE_EXPIRED", "MEMORY_REGISTERED"])

    def audit_types(self, memory_id):
        """The event types audited for this memory of tenant-a (matched by its HMAC)."""
        salt = db_query(self.db_path, "SELECT audit_salt FROM tenants WHERE name = 'tenant-a'")[0][0]
        salt = salt.encode() if isinstance(salt, str) else bytes(salt)
        h = hmac.new(salt, memory_id.encode(), hashlib.sha256).hexdigest()
        return [r[0] for r in db_query(self.db_path, "SELECT event_type FROM audit_events "
                                                     "WHERE redacted_memory_hash = ?", (h,))]

    def test_name_history_follows_the_display_name(self):
        # agent_names is history: a later claim of the same canonical name under another
        # display form (here upper case) is recorded; the first claim time stays.
        c = self.client()
        base, mem, who = unique_name(), c.new_memory(), owner()
        g = self.assertGrant(c.claim(base, mem, who))
        history = "SELECT display_name, first_claimed_at FROM agent_names WHERE canonical_name = ?"
        (display, first), = db_query(self.db_path, history, (base,))
        self.assertEqual(display, base)
        self.assertStatus(c.release(base, mem, g["fencing_token"], who), 204)
        g2 = self.assertGrant(c.claim(base.upper(), mem, who))
        self.assertEqual((g2["canonical_name"], g2["display_name"]), (base, base.upper()))
        self.assertEqual(db_query(self.db_path, history, (base,)), [(base.upper(), first)])

    def test_ttl_bounds_enforced(self):
        c = self.client()
        mem = c.new_memory()
        for ttl in (4, 301, 0, -1, 86400):
            with self.subTest(ttl=ttl):
                self.assertProblem(c.claim(unique_name(), mem, owner(), ttl=ttl), 422, "invalid-ttl")
        self.assertEqual(counter_of(self.db_path, mem), 0)
        for ttl in (5, 300):
            with self.subTest(ttl=ttl):
                g = self.assertGrant(c.claim(unique_name(), c.new_memory(), owner(), ttl=ttl))
                self.assertEqual(g["ttl_seconds"], ttl)
        name, mem, who, g = self.lease(c)
        self.assertEqual(g["ttl_seconds"], 30)  # default
        for ttl in (4, 301, 0):
            with self.subTest(renew_ttl=ttl):
                self.assertProblem(c.renew(name, mem, 1, who, ttl=ttl), 422, "invalid-ttl")
        for ttl in (5, 300):
            with self.subTest(renew_ttl=ttl):
                r = c.renew(name, mem, 1, who, ttl=ttl)
                self.assertStatus(r, 200)
                self.assertEqual(r.json["ttl_seconds"], ttl)

    # ---- §13: names ----------------------------------------------------------------------

    def test_width_and_case_collide(self):
        c = self.client()
        mem, who = c.new_memory(), owner()
        g = self.assertGrant(c.claim("ＭｙＡｇｅｎｔ", mem, who))
        self.assertEqual(g["canonical_name"], "myagent")
        self.assertEqual(g["display_name"], "ＭｙＡｇｅｎｔ")
        for variant in ("myagent", "MYAGENT", "MyAgent", "My Agent", "ｍｙａｇｅｎｔ"):
            with self.subTest(variant=variant):
                r = c.claim(variant, c.new_memory(), owner())
                self.assertProblem(r, 423, "name-held")
        cb = self.client(self.token_b)
        self.assertProblem(cb.claim("MYAGENT", cb.new_memory(), owner()), 423, "name-held")
        # Lookups canonicalize too.
        for variant in ("myagent", "MYAGENT", "ＭｙＡｇｅｎｔ"):
            got = c.get_lease(variant)
            self.assertStatus(got, 200)
            self.assertEqual(got.json["lease_id"], g["lease_id"])
        # The holder renews by the canonical name.
        self.assertStatus(c.renew("myagent", mem, 1, who), 200)
        self.assertStatus(c.release("myagent", mem, 1, who), 204)

    def test_confusable_skeleton_collides_423(self):
        # Confirm the fixtures with the offline canonicalizer first (§5: `раура` ~ `paypa`).
        _, out, _ = run_mep(["canonicalize", "--json", "paypa", "раура", "coco", "сосо"])
        rows = [json.loads(line) for line in out.splitlines()]
        self.assertEqual([r.get("skeleton") for r in rows], ["paypa", "paypa", "coco", "coco"], out)
        self.assertEqual(rows[1]["scripts"], ["Cyrillic"])
        c = self.client()
        # Latin held → Cyrillic look-alike refused.
        latin_mem, latin_owner = c.new_memory(), owner()
        g = self.assertGrant(c.claim("paypa", latin_mem, latin_owner))
        r = c.claim("раура", c.new_memory(), owner())
        self.assertProblem(r, 423, "name-confusable")
        self.assertRetryAfter(r, 30)
        # The other direction, and across tenants.
        cb = self.client(self.token_b)
        self.assertGrant(cb.claim("сосо", cb.new_memory(), owner()))
        self.assertProblem(c.claim("coco", c.new_memory(), owner()), 423, "name-confusable")
        # agent_1 vs agent_l share a skeleton (§5).
        self.assertGrant(c.claim("agent_1", c.new_memory(), owner()))
        self.assertProblem(c.claim("agent_l", c.new_memory(), owner()), 423, "name-confusable")
        # Once the Latin name is released the Cyrillic one is free.
        self.assertStatus(c.release("paypa", latin_mem, g["fencing_token"], latin_owner), 204)
        g2 = self.assertGrant(c.claim("раура", c.new_memory(), owner()))
        self.assertEqual(g2["canonical_name"], "раура")
        self.assertProblem(c.claim("paypa", c.new_memory(), owner()), 423, "name-confusable")

    def test_mixed_script_rejected_422(self):
        c = self.client()
        mem = c.new_memory()
        body = self.assertProblem(c.claim("myаgent", mem, owner()), 422, "invalid-name")  # Cyrillic а
        self.assertEqual(body.get("reason"), "mixed-script", body)
        body = self.assertProblem(c.claim("agent!", mem, owner()), 422, "invalid-name")
        self.assertEqual(body.get("reason"), "disallowed-character")
        self.assertEqual(body.get("codepoint"), "U+0021")
        self.assertEqual(body.get("index"), 5)
        self.assertEqual(self.assertProblem(c.claim("   ", mem, owner()), 422, "invalid-name").get("reason"), "empty")
        self.assertEqual(self.assertProblem(c.claim("a" * 65, mem, owner()), 422, "invalid-name").get("reason"),
                         "too-long")
        self.assertEqual(counter_of(self.db_path, mem), 0)
        self.assertEqual(lease_rows(self.db_path, "memory_id = ?", (mem,)), [])

    # ---- §13: branches -----------------------------------------------------------------------

    def test_branch_records_lineage(self):
        c = self.client()
        name, root, who, g = self.lease(c)
        r = c.branch(root, 1)
        self.assertStatus(r, 201)
        self.assertEqual(set(r.json), {"memory_instance_id", "parent_memory_instance_id", "branched_at_token"})
        child = r.json["memory_instance_id"]
        self.assertEqual(child[14], "7")
        self.assertEqual((r.json["parent_memory_instance_id"], r.json["branched_at_token"]), (root, 1))
        m = c.get("/v1/memories/" + child)
        self.assertStatus(m, 200)
        self.assertEqual(set(m.json), MEMORY_FIELDS)
        self.assertEqual((m.json["parent_memory_instance_id"], m.json["branched_at_token"],
                          m.json["fencing_token_high_water"]), (root, 1, 0))
        self.assertRegex(m.json["created_at"], RFC3339_MS_RE)
        mr = c.get("/v1/memories/" + root)
        self.assertEqual((mr.json["parent_memory_instance_id"], mr.json["branched_at_token"],
                          mr.json["fencing_token_high_water"]), (None, None, 1))
        # A client-minted id; then a grandchild under a lease of the child.
        minted = uuid7()
        r2 = c.branch(root, 1, memory_id=minted)
        self.assertStatus(r2, 201)
        self.assertEqual(r2.json["memory_instance_id"], minted)
        # The same branch again under a new key (a client retry that lost its key) is 200 with
        # the same body, as for a memory id registered again; with another parent, token or
        # tenant that id is taken.
        again = c.branch(root, 1, memory_id=minted)
        self.assertStatus(again, 200)
        self.assertIsNone(again.header("Idempotent-Replayed"))
        self.assertEqual(again.json, r2.json)
        self.assertProblem(c.branch(child, 1, memory_id=minted), 409, "memory-id-taken")
        cb = self.client(self.token_b)
        nb, mb, wb, _ = self.lease(cb)
        self.assertProblem(cb.branch(mb, 1, memory_id=minted), 409, "memory-id-taken")
        self.assertEqual(db_query(self.db_path, "SELECT count(*) FROM memories WHERE memory_id = ?", (minted,))[0][0], 1)
        cname, cwho = unique_name(), owner()
        self.assertEqual(self.assertGrant(c.claim(cname, child, cwho))["fencing_token"], 1)
        r3 = c.branch(child, 1)
        self.assertStatus(r3, 201)
        grandchild = r3.json["memory_instance_id"]
        lin = c.get("/v1/memories/%s/lineage" % grandchild)
        self.assertStatus(lin, 200)
        self.assertEqual([a["memory_instance_id"] for a in lin.json["ancestors"]], [child, root])
        self.assertEqual(lin.json["children"], [])
        lin = c.get("/v1/memories/%s/lineage" % root)
        self.assertEqual(lin.json["ancestors"], [])
        self.assertEqual(sorted(ch["memory_instance_id"] for ch in lin.json["children"]), sorted([child, minted]))
        lin = c.get("/v1/memories/%s/lineage" % child)
        self.assertEqual([a["memory_instance_id"] for a in lin.json["ancestors"]], [root])
        self.assertEqual([ch["memory_instance_id"] for ch in lin.json["children"]], [grandchild])
        # S9: lineage does not change when the parent is re-granted.
        self.assertEqual(self.assertGrant(c.claim(name, root, who))["fencing_token"], 2)
        m2 = c.get("/v1/memories/" + child)
        self.assertEqual((m2.json["parent_memory_instance_id"], m2.json["branched_at_token"]), (root, 1))
        # A taken id → 409; a v4 id → 400.
        self.assertProblem(c.branch(root, 2, memory_id=minted), 409, "memory-id-taken")
        self.assertProblem(c.branch(root, 2, memory_id="6f1c2c52-2f8e-4b1e-9d7a-3a1e5f0b9c11"), 400,
                           "invalid-request")
        # A replayed branch is the same branch.
        key = new_key()
        b1, b2 = c.branch(root, 2, key=key), c.branch(root, 2, key=key)
        self.assertStatus(b1, 201)
        self.assertStatus(b2, 200)
        self.assertEqual(b1.raw, b2.raw)
        self.assertEqual(b2.header("Idempotent-Replayed"), "true")

    def test_branch_and_source_leased_concurrently(self):
        c = self.client()
        n1, parent, o1, g = self.lease(c)
        r = c.branch(parent, 1)
        self.assertStatus(r, 201)
        child = r.json["memory_instance_id"]
        n2, o2 = unique_name(), owner()
        g2 = self.assertGrant(c.claim(n2, child, o2))
        self.assertEqual(g2["fencing_token"], 1)
        for name, mem, who in ((n1, parent, o1), (n2, child, o2)):
            self.assertStatus(c.get_lease(name), 200)
            self.assertStatus(c.renew(name, mem, 1, who), 200)
            self.assertStatus(c.verify(mem, 1), 200)
        # The branch's name is not the parent's.
        self.assertProblem(c.claim(n1, child, o2), 423, "name-held")

    def test_branch_with_stale_token_409(self):
        c = self.client()
        name, mem, who, g = self.lease(c)
        self.assertEqual(self.assertGrant(c.claim(name, mem, who))["fencing_token"], 2)
        before = db_query(self.db_path, "SELECT count(*) FROM memories")[0][0]
        self.assertProblem(c.branch(mem, 1), 409, "stale-fence")
        self.assertProblem(c.branch(mem, 3), 409, "stale-fence")
        self.assertEqual(db_query(self.db_path, "SELECT count(*) FROM memories")[0][0], before)
        self.assertStatus(c.branch(mem, 2), 201)
        # Without a live lease the current token is "expired".
        self.assertStatus(c.release(name, mem, 2, who), 204)
        self.assertProblem(c.branch(mem, 2), 410, "lease-expired")
        self.assertProblem(c.branch(mem, 1), 409, "stale-fence")
        # A memory never leased: token 0 names no lease.
        self.assertProblem(c.branch(c.new_memory(), 0), 410, "lease-expired")
        self.assertProblem(c.branch(uuid7(), 1), 404, "memory-not-found")

    # ---- §13: expiry, isolation, auth, limits --------------------------------------------

    def test_crashed_owner_expires_without_intervention(self):
        c = self.client()
        m1, m2 = c.new_memory(), c.new_memory()
        n1, n2 = unique_name(), unique_name()
        crashed = owner()
        # The owner claims two leases on its own connection, then vanishes (RST, no release).
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        grants = []
        for n, m in ((n1, m1), (n2, m2)):
            body = json.dumps({"display_name": n, "memory_instance_id": m, "owner_client_id": crashed,
                               "ttl_seconds": SHORT_TTL}).encode()
            sock.sendall(b"POST /v1/leases HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + self.token_a.encode() +
                         b"\r\nIdempotency-Key: " + new_key().encode() + b"\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            buf = b""
            while b"\r\n\r\n" not in buf or not buf.endswith(b"}"):
                part = sock.recv(65536)
                self.assertTrue(part, "server closed the connection")
                buf += part
            self.assertTrue(buf.startswith(b"HTTP/1.1 201"), buf)
            grants.append(json.loads(buf.partition(b"\r\n\r\n")[2]))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
        granted_at = time.time()
        # While live, others are refused with a Retry-After within the TTL.
        o2 = owner()
        r = c.claim(n1, m1, o2)
        self.assertProblem(r, 423, "name-held")
        self.assertRetryAfter(r, SHORT_TTL)
        # L1: claimable within ttl of the last grant (plus scheduling slack), nobody cleaning up.
        deadline = granted_at + SHORT_TTL + 3
        while True:
            r = c.claim(n1, m1, o2)
            if r.status == 201 or time.time() > deadline:
                break
            self.assertProblem(r, 423, "name-held")
            time.sleep(0.25)
        self.assertEqual(self.assertGrant(r)["fencing_token"], 2)
        self.assertGreaterEqual(time.time(), parse_rfc3339_ms(grants[0]["expires_at"]) / 1000 - 0.5)
        # The other lease nobody claims is swept (L5) by the next sweep after it expired.
        deadline = time.monotonic() + SWEEP_WAIT_S
        while lease_rows(self.db_path, "memory_id = ?", (m2,)) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.assertEqual(lease_rows(self.db_path, "memory_id = ?", (m2,)), [])
        self.assertEqual(counter_of(self.db_path, m2), 1)  # the counter survives the sweep
        g = self.assertGrant(c.claim(n2, m2, owner()))
        self.assertEqual(g["fencing_token"], 2)

    def test_tenant_isolation(self):
        ca, cb = self.client(self.token_a), self.client(self.token_b)
        name, mem, who, g = self.lease(ca)
        child = ca.branch(mem, 1).json["memory_instance_id"]
        admin_b = create_token(self.db_path, "tenant-b", "admin")
        cb_admin = self.client(admin_b)
        self.assertProblem(cb.get_lease(name), 404, "lease-not-found")
        self.assertProblem(cb.get("/v1/memories/" + mem), 404, "memory-not-found")
        self.assertProblem(cb.get("/v1/memories/%s/lineage" % mem), 404, "memory-not-found")
        self.assertProblem(cb.get("/v1/memories/%s/lineage" % child), 404, "memory-not-found")
        self.assertProblem(cb.renew(name, mem, 1, who), 404, "lease-not-found")
        self.assertProblem(cb.release(name, mem, 1, who), 404, "lease-not-found")
        self.assertProblem(cb.verify(mem, 1), 404)
        self.assertProblem(cb.branch(mem, 1), 404, "memory-not-found")
        self.assertProblem(cb.claim(unique_name(), mem, owner()), 404, "memory-not-found")
        self.assertProblem(cb_admin.post("/v1/admin/leases/revoke", {"canonical_name": name}), 404, "lease-not-found")
        listing = cb.get("/v1/leases?limit=1000")
        self.assertStatus(listing, 200)
        self.assertNotIn(name, [l["canonical_name"] for l in listing.json["leases"]])
        listing = cb.get("/v1/leases?owner_client_id=" + urllib.parse.quote(who))
        self.assertEqual(listing.json["leases"], [])
        # A's lease is untouched.
        got = ca.get_lease(name)
        self.assertStatus(got, 200)
        self.assertEqual(got.json["fencing_token"], 1)
        self.assertEqual(counter_of(self.db_path, mem), 1)
        self.assertStatus(ca.renew(name, mem, 1, who), 200)
        # B sending A's exact request under A's Idempotency-Key gets its own outcome (A's
        # memory is not B's), never A's stored response.
        key = new_key()
        a_body = {"display_name": unique_name(), "memory_instance_id": ca.new_memory(), "owner_client_id": owner()}
        ra = ca.post("/v1/leases", a_body, idem=key)
        self.assertGrant(ra)
        rb = cb.post("/v1/leases", a_body, idem=key)
        self.assertProblem(rb, 404, "memory-not-found")
        self.assertIsNone(rb.header("Idempotent-Replayed"))
        self.assertNotEqual(rb.raw, ra.raw)
        # The same key for each tenant's own claim: two grants.
        key2 = new_key()
        ra2 = ca.claim(unique_name(), ca.new_memory(), owner(), key=key2)
        rb2 = cb.claim(unique_name(), cb.new_memory(), owner(), key=key2)
        self.assertGrant(ra2)
        self.assertGrant(rb2)
        self.assertIsNone(rb2.header("Idempotent-Replayed"))
        self.assertNotEqual(rb2.json["lease_id"], ra2.json["lease_id"])
        # A's retry still replays A's grant.
        self.assertEqual(ca.post("/v1/leases", a_body, idem=key).raw, ra.raw)

    def test_the_token_is_checked_before_anything_else(self):
        # SPEC §6: without a valid token a client learns nothing, not even which endpoints
        # exist or what they accept; with one, the same requests get what they deserve.
        big = b"{" + b" " * 20000 + b"}"
        cases = [("GET", "/v1/nope", None, 404, "not-found"),
                 ("DELETE", "/v1/leases/x", None, 405, "method-not-allowed"),
                 ("POST", "/v1/leases", big, 413, "payload-too-large"),
                 ("GET", "/v1/leases#f", None, 400, "invalid-request")]
        anonymous, known = self.client(token=None), self.client()
        for method, path, data, status, code in cases:
            with self.subTest(method=method, path=path):
                r = anonymous.request(method, path, data)
                self.assertProblem(r, 401, "unauthenticated")
                self.assertIsNone(r.header("Allow"), r)
                self.assertProblem(known.request(method, path, data), status, code)
        # The open endpoints stay open.
        for path in ("/healthz", "/readyz", "/metrics"):
            self.assertStatus(anonymous.get(path), 200)
        # The scheme is case-insensitive (RFC 9110 §11.1).
        for scheme in ("bearer", "BEARER", "BeArEr"):
            r = anonymous.request("GET", "/v1/leases", headers=[("Authorization", scheme + " " + self.token_a)])
            self.assertStatus(r, 200)

    def test_unauthenticated_401(self):
        c = self.client(token=None)
        body = {"display_name": unique_name(), "memory_instance_id": uuid7(), "owner_client_id": "o"}
        bad = [
            [],
            [("Authorization", "Basic dXNlcjpwYXNz")],
            [("Authorization", "Bearer")],
            [("Authorization", "Bearer ")],
            [("Authorization", "Token " + self.token_a)],
            [("Authorization", self.token_a)],
            [("Authorization", "Bearer mep_" + "0" * 64)],
            [("Authorization", "Bearer " + self.token_a + "x")],
            [("Authorization", "Bearer " + "a" * 600)],
            [("Authorization", "Bearer " + self.token_a), ("Authorization", "Bearer " + self.token_a)],
        ]
        for headers in bad:
            for method, path, data in (("GET", "/v1/leases", None), ("POST", "/v1/leases", body),
                                       ("POST", "/v1/leases", b"{not json"), ("GET", "/v1/memories/" + uuid7(), None)):
                with self.subTest(headers=headers, path=path, data=data):
                    r = c.request(method, path, data, headers=headers)
                    self.assertProblem(r, 401, "unauthenticated")
                    self.assertTrue((r.header("WWW-Authenticate") or "").startswith("Bearer"), r)
        # Revocation takes effect at once.
        create_token(self.db_path, "tenant-c", "lease")
        tok_c = create_token(self.db_path, "tenant-c", "lease")
        cc = self.client(tok_c)
        self.assertStatus(cc.get("/v1/leases"), 200)
        ids = token_id_of(self.db_path, "tenant-c")
        self.assertEqual(len(ids), 2)
        for tid in ids:
            revoke_token(self.db_path, tid)
        r = cc.get("/v1/leases")
        self.assertProblem(r, 401, "unauthenticated")
        self.assertTrue((r.header("WWW-Authenticate") or "").startswith("Bearer"))
        # Nothing was created by the unauthenticated claims.
        self.assertEqual(lease_rows(self.db_path, "canonical_name = ?", (body["display_name"],)), [])
        # Health needs no token.
        self.assertStatus(c.get("/healthz"), 200)
        self.assertStatus(c.get("/readyz"), 200)

    def test_audit_rows_hashed(self):
        c = self.client()
        name, mem, who, g = self.lease(c)
        m2, o2 = c.new_memory(), owner()
        self.assertProblem(c.claim(name, m2, o2), 423, "name-held")            # NAME_CONFLICT
        self.assertEqual(self.assertGrant(c.claim(name, mem, who))["fencing_token"], 2)
        self.assertProblem(c.renew(name, mem, 1, who), 409, "stale-fence")    # STALE_FENCE_REJECTED
        self.assertStatus(c.release(name, mem, 2, who), 204)                   # LEASE_RELEASED
        salt = db_query(self.db_path, "SELECT audit_salt FROM tenants WHERE name = 'tenant-a'")[0][0]
        keys = [salt.encode() if isinstance(salt, str) else bytes(salt)]
        try:
            keys.append(bytes.fromhex(salt if isinstance(salt, str) else bytes(salt).decode()))
        except ValueError:
            pass

        def candidates(text):
            return {hmac.new(k, text.encode(), hashlib.sha256).hexdigest() for k in keys}

        hn, hm, hm2 = candidates(name), candidates(mem), candidates(m2)
        rows = db_query(self.db_path, "SELECT event_type, redacted_name_hash, redacted_memory_hash, "
                                      "fencing_token FROM audit_events")
        mine = [r for r in rows if r[1] in hn or r[2] in hm or r[2] in hm2]
        types = {r[0] for r in mine}
        for t in ("LEASE_ACQUIRED", "NAME_CONFLICT", "STALE_FENCE_REJECTED", "LEASE_RELEASED"):
            self.assertIn(t, types, mine)
        self.assertTrue(any(r[0] == "LEASE_ACQUIRED" and r[1] in hn and r[2] in hm and r[3] == 1 for r in mine), mine)
        self.assertTrue(any(r[0] == "LEASE_ACQUIRED" and r[1] in hn and r[2] in hm and r[3] == 2 for r in mine), mine)
        self.assertTrue(any(r[0] == "LEASE_RELEASED" and r[1] in hn and r[2] in hm and r[3] == 2 for r in mine), mine)
        self.assertTrue(any(r[0] == "STALE_FENCE_REJECTED" and r[2] in hm and r[3] == 1 for r in mine), mine)
        self.assertTrue(any(r[0] == "NAME_CONFLICT" and r[1] in hn for r in mine), mine)
        # Every hash in the table is 64 hex digits (or empty where the event has no such object).
        cols = ("event_id", "tenant_id", "event_type", "redacted_name_hash", "redacted_memory_hash",
                "fencing_token", "created_at")
        all_rows = db_query(self.db_path, "SELECT %s FROM audit_events" % ", ".join(cols))
        for row in all_rows:
            rec = dict(zip(cols, row))
            for k in ("redacted_name_hash", "redacted_memory_hash"):
                self.assertTrue(rec[k] == "" or HEX64_RE.match(rec[k]), rec)
        for row in mine:
            if row[0] in ("LEASE_ACQUIRED", "LEASE_RELEASED", "NAME_CONFLICT", "LEASE_TAKEOVER", "LEASE_EXPIRED"):
                self.assertRegex(row[1], HEX64_RE)
            self.assertRegex(row[2], HEX64_RE)
        # The plaintext appears nowhere in the table.
        secrets_ = [name, mem, m2, who, o2, mem.replace("-", ""), m2.replace("-", "")]
        dump = "\n".join(repr(r) for r in all_rows)
        for s in secrets_:
            self.assertNotIn(s, dump)
            self.assertNotIn(s.upper(), dump.upper())
        # `mep server audit --json` lists them, hashed.
        _, out, _ = run_mep(["server", "audit", "--db", db_url(self.db_path), "--json", "--limit", "100000"])
        events = json.loads(out)["events"]
        times = [e["created_at"] for e in events]
        self.assertEqual(times, sorted(times, reverse=True))  # newest first
        listed = {(e["event_type"], e["redacted_name_hash"], e["redacted_memory_hash"]) for e in events}
        for r in mine:
            self.assertIn((r[0], r[1], r[2]), listed)
        for e in events:
            self.assertEqual(set(e) >= {"event_id", "event_type", "redacted_name_hash", "redacted_memory_hash",
                                        "created_at"}, True, e)
        for s in secrets_:
            self.assertNotIn(s, out)
        # The human table works too.
        rc, text, _ = run_mep(["server", "audit", "--db", db_url(self.db_path), "--tenant", "tenant-a"])
        self.assertIn("LEASE_RELEASED", text)
        for s in secrets_:
            self.assertNotIn(s, text)

    def test_metrics_prometheus_format(self):
        c = self.client()
        name, mem, who, g = self.lease(c)
        marker = unique_name("metricsprobe")
        self.assertProblem(c.get_lease(marker), 404)
        self.assertStatus(c.renew(name, mem, 1, who), 200)
        self.assertProblem(c.renew(name, mem, 7, who), 409, "stale-fence")
        key = new_key()
        m2 = c.new_memory()
        c.claim(unique_name(), m2, owner(), key=key)
        c.claim(unique_name(), m2, owner(), key=key)  # mismatch
        self.assertProblem(c.get("/v1/leases", token=None), 401, "unauthenticated")
        self.assertProblem(c.request("DELETE", "/v1/leases"), 405, "method-not-allowed")
        r = c.get("/metrics", token=None)
        self.assertStatus(r, 200)
        self.assertTrue((r.header("Content-Type") or "").startswith("text/plain"), r.header("Content-Type"))
        self.assertIn("version=0.0.4", r.header("Content-Type"))
        text = r.raw.decode("utf-8")
        self.assertTrue(text.endswith("\n"))
        families = parse_exposition(self, text)
        for m in SPEC_METRICS:
            self.assertIn(m, families, "missing metric family %s" % m)
        self.assertEqual(families["mep_lease_renewal_latency_seconds"]["type"], "histogram")
        self.assertEqual(families["mep_http_request_duration_seconds"]["type"], "histogram")
        self.assertEqual(families["mep_leases_active"]["type"], "gauge")
        for m in SPEC_METRICS:
            if m.endswith("_total"):
                self.assertEqual(families[m]["type"], "counter", m)
        # Values reflect what happened.
        if pgfixture.backend() == "sqlite":
            # Group commit: at least one commit, never fewer requests than commits, and one
            # COMMIT timing per commit.
            commits = sum(v for _, _, v in families["mep_sqlite_commits_total"]["samples"])
            committed = sum(v for _, _, v in families["mep_sqlite_committed_requests_total"]["samples"])
            timed = [v for n, _, v in families["mep_sqlite_commit_duration_seconds"]["samples"]
                     if n == "mep_sqlite_commit_duration_seconds_count"]
            self.assertGreaterEqual(commits, 4)
            # The renewal above committed without its fsync, the claims with theirs.
            syncs = {lab.get("sync") for _, lab, _ in families["mep_sqlite_commits_total"]["samples"]}
            self.assertEqual(syncs, {"fsync", "deferred"})
            self.assertGreaterEqual(committed, commits)
            self.assertEqual(len(timed), 1)
            # The sweeper may commit between the three updates of one commit.
            self.assertIn(timed[0] - commits, (0, 1))
        samples = families["mep_fencing_rejections_total"]["samples"]
        self.assertGreaterEqual(sum(v for _, _, v in samples), 1)
        self.assertEqual(families["mep_auth_failures_total"]["type"], "counter")
        self.assertGreaterEqual(sum(v for _, _, v in families["mep_auth_failures_total"]["samples"]), 1)
        self.assertGreaterEqual(sum(v for _, _, v in families["mep_leases_active"]["samples"]), 1)
        results = {lab.get("result") for _, lab, _ in families["mep_idempotency_lookups_total"]["samples"]} - {None}
        self.assertTrue(results <= {"hit", "miss", "mismatch"}, results)
        self.assertIn("mismatch", results)
        self.assertTrue(any(lab.get("route") == "/v1/leases/{canonical_name}" and lab.get("code") == "404"
                            for _, lab, _ in families["mep_http_request_duration_seconds"]["samples"]))
        self.assertTrue(any(lab.get("route") == "unmatched" and lab.get("code") == "405"
                            for _, lab, _ in families["mep_http_request_duration_seconds"]["samples"]))
        # A request refused before its route's checks (no token) is counted under its route.
        self.assertTrue(any(lab.get("route") == "/v1/leases" and lab.get("code") == "401"
                            for _, lab, _ in families["mep_http_request_duration_seconds"]["samples"]))
        # No names, ids or paths in labels: only known label names, and no value carries one.
        allowed = {"route", "code", "outcome", "result", "reason", "sync", "by", "le", "cause", "tenant", "kind"}
        routes = {"/healthz", "/readyz", "/metrics", "/v1/memories", "/v1/memories/branch",
                  "/v1/memories/{id}", "/v1/memories/{id}/lineage", "/v1/leases", "/v1/leases/renew",
                  "/v1/leases/renew-batch", "/v1/leases/claim-batch", "/v1/leases/release",
                  "/v1/leases/{canonical_name}", "/v1/fence/verify", "/v1/admin/leases/revoke",
                  "/v1/admin/leases/{canonical_name}/history", "/v1/admin/check", "unmatched"}
        for fam in families.values():
            for _, labels, _ in fam["samples"]:
                self.assertTrue(set(labels) <= allowed, labels)
                if "route" in labels:
                    self.assertIn(labels["route"], routes)
                if "reason" in labels:  # mep_pg_extra_lanes_total
                    self.assertIn(labels["reason"], {"full_batch", "waited"})
                if "kind" in labels:  # mep_pg_queued_operations
                    self.assertIn(labels["kind"], {"claim", "renew", "release"})
                if "sync" in labels:  # mep_sqlite_commits_total
                    self.assertIn(labels["sync"], {"fsync", "deferred"})
                if "by" in labels:  # mep_sqlite_checkpoints_total
                    self.assertIn(labels["by"], {"checkpointer", "writer"})
                if "code" in labels:
                    self.assertRegex(labels["code"], r"^\d{3}$")
                if "cause" in labels:  # mep_lease_ends_total
                    self.assertIn(labels["cause"], {"released", "expired", "revoked", "taken_over", "max_hold"})
                if "tenant" in labels:  # mep_leases_active_by_tenant: tenant names, not ids
                    self.assertIn(labels["tenant"], {"tenant-a", "tenant-b", "_other"})
                for v in labels.values():
                    self.assertIsNone(UUID_RE.search(v), labels)
        for s in (name, mem, who, marker, m2):
            self.assertNotIn(s, text)
        self.assertIsNone(UUID_RE.search(text))

    # ---- more of §6 ------------------------------------------------------------------------

    def test_renew_batch_mixed_results_each_lease_once(self):
        # Every lease named once (as mepd sends them; PostgreSQL renews such a batch in one
        # statement, then classifies what it did not renew).
        c = self.client()
        who = owner()
        live_n, live_m, _, _ = self.lease(c, who=who)
        stale_n, stale_m, _, _ = self.lease(c, who=who)
        self.assertGrant(c.claim(stale_n, stale_m, who))  # token 2 supersedes 1
        gone_n, gone_m, _, _ = self.lease(c, who=who)
        self.assertStatus(c.release(gone_n, gone_m, 1, who), 204)
        cb = self.client(self.token_b)
        b_n, b_m, _, _ = self.lease(cb, who=who)
        bad_n, bad_m, _, _ = self.lease(c, who=who)
        other_n, other_m, _, _ = self.lease(c, who=who)
        x_n, x_m, _, _ = self.lease(c, who=who)
        before = c.get_lease(other_n).json["expires_at"]
        body = {"owner_client_id": who, "leases": [
            {"canonical_name": stale_n, "memory_instance_id": stale_m, "fencing_token": 1},
            {"canonical_name": live_n, "memory_instance_id": live_m, "fencing_token": 1, "ttl_seconds": 60},
            {"canonical_name": gone_n, "memory_instance_id": gone_m, "fencing_token": 1},
            {"canonical_name": b_n, "memory_instance_id": b_m, "fencing_token": 1},
            {"canonical_name": bad_n, "memory_instance_id": bad_m, "fencing_token": 1, "ttl_seconds": 301},
            {"canonical_name": other_n, "memory_instance_id": other_m, "fencing_token": 1,
             "owner_client_id": owner()},
            {"canonical_name": x_n + "-x", "memory_instance_id": x_m, "fencing_token": 1},
        ]}
        self.assertEqual(len({i["memory_instance_id"] for i in body["leases"]}), len(body["leases"]))
        r = c.post("/v1/leases/renew-batch", body)
        self.assertStatus(r, 200)
        res = r.json["results"]
        self.assertEqual([x["canonical_name"] for x in res],
                         [stale_n, live_n, gone_n, b_n, bad_n, other_n, x_n + "-x"])
        self.assertEqual([x["status"] for x in res][:5], [409, 200, 410, 404, 422], res)
        self.assertEqual(res[4]["code"], "invalid-ttl")
        self.assertGreaterEqual(res[5]["status"], 400, res)  # not this owner's
        self.assertGreaterEqual(res[6]["status"], 400, res)  # not the name of that memory's lease
        self.assertEqual(c.get_lease(live_n).json["expires_at"], res[1]["expires_at"])
        self.assertEqual(c.get_lease(live_n).json["ttl_seconds"], 60)
        self.assertEqual(c.get_lease(other_n).json["expires_at"], before)
        self.assertEqual(c.get_lease(bad_n).json["ttl_seconds"], 30)
        self.assertEqual(cb.get_lease(b_n).json["ttl_seconds"], 30)
        # The same answers from a batch of each item alone.
        for item, want in zip(body["leases"], res):
            one = c.post("/v1/leases/renew-batch", {"owner_client_id": who, "leases": [item]})
            self.assertStatus(one, 200)
            self.assertEqual(one.json["results"][0]["status"], want["status"], (item, one.json))
            self.assertEqual(one.json["results"][0].get("code"), want.get("code"), (item, one.json))

    def test_claim_batch_decides_each_claim_as_if_alone(self):
        c = self.client()
        who = owner()
        free_n, free_m = unique_name(), c.new_memory()
        held_n, held_m, _, _ = self.lease(c)
        replay_n, replay_m, replay_key = unique_name(), c.new_memory(), new_key()
        first = c.claim(replay_n, replay_m, who, key=replay_key)
        self.assertGrant(first)
        reused_key = new_key()
        self.assertGrant(c.claim(unique_name(), c.new_memory(), who, key=reused_key))
        body = {"claims": [
            {"idempotency_key": new_key(), "display_name": free_n, "memory_instance_id": free_m,
             "owner_client_id": who, "ttl_seconds": 60},
            {"idempotency_key": new_key(), "display_name": held_n, "memory_instance_id": c.new_memory(),
             "owner_client_id": who},
            {"idempotency_key": replay_key, "display_name": replay_n, "memory_instance_id": replay_m,
             "owner_client_id": who},
            {"idempotency_key": reused_key, "display_name": unique_name(), "memory_instance_id": c.new_memory(),
             "owner_client_id": who},
            {"idempotency_key": new_key(), "display_name": unique_name(), "memory_instance_id": held_m,
             "owner_client_id": who, "ttl_seconds": 301},
        ]}
        r = c.post("/v1/leases/claim-batch", body)
        self.assertStatus(r, 200)
        res = r.json["results"]
        self.assertEqual([x["status"] for x in res], [201, 423, 200, 422, 422])
        self.assertEqual(set(res[0]["lease"]), GRANT_FIELDS)
        self.assertEqual(res[0]["lease"]["ttl_seconds"], 60)
        self.assertEqual(res[2]["lease"], first.json)  # the single claim's answer, replayed
        self.assertEqual([x["problem"]["code"] for x in res[1:2] + res[3:]],
                         ["name-held", "idempotency-key-reused", "invalid-ttl"])
        self.assertTrue(all("problem" not in x for x in res[:1] + res[2:3]))
        # The grant is a lease like any other, and a retry of the batch replays each claim.
        self.assertEqual(c.get_lease(res[0]["lease"]["canonical_name"]).json["fencing_token"],
                         res[0]["lease"]["fencing_token"])
        again = c.post("/v1/leases/claim-batch", body)
        self.assertEqual([x["status"] for x in again.json["results"]], [200, 423, 200, 422, 422])
        self.assertEqual(again.json["results"][0]["lease"], res[0]["lease"])
        # A single claim under the batch item's key replays it too.
        item = body["claims"][0]
        single = c.claim(free_n, free_m, who, ttl=60, key=item["idempotency_key"])
        self.assertStatus(single, 200)
        self.assertEqual(single.json, res[0]["lease"])

    def test_claim_batch_refuses_a_malformed_request_whole(self):
        c = self.client()
        who = owner()
        good = {"idempotency_key": new_key(), "display_name": unique_name(), "memory_instance_id": c.new_memory(),
                "owner_client_id": who}
        for bad, why in [
            ({}, "claims"),
            ({"claims": []}, "claims"),
            ({"claims": [good, {"display_name": unique_name(), "memory_instance_id": c.new_memory(),
                                "owner_client_id": who}]}, "idempotency_key"),
            ({"claims": [good, {"idempotency_key": new_key(), "display_name": unique_name(),
                                "memory_instance_id": c.new_memory(), "owner_client_id": who,
                                "ttl_seconds": "60"}]}, "claims[1]"),
            ({"claims": [good, 7]}, "claims[1]"),
            ({"claims": [dict(good, idempotency_key=new_key()) for _ in range(101)]}, "100"),
        ]:
            r = c.post("/v1/leases/claim-batch", bad)
            self.assertProblem(r, 400, "invalid-request")
            self.assertIn(why, r.json["detail"])
        # Nothing of a refused batch was claimed.
        self.assertStatus(c.get_lease(good["display_name"]), 404)
        self.assertProblem(c.post("/v1/leases/claim-batch", {"claims": [good]}, token=None), 401)

    def test_renew_batch_mixed_results(self):
        c = self.client()
        who = owner()
        live_n, live_m, _, _ = self.lease(c, who=who)
        stale_n, stale_m, _, _ = self.lease(c, who=who)
        self.assertGrant(c.claim(stale_n, stale_m, who))  # token 2 supersedes 1
        gone_n, gone_m, _, _ = self.lease(c, who=who)
        self.assertStatus(c.release(gone_n, gone_m, 1, who), 204)
        cb = self.client(self.token_b)
        b_n, b_m, _, _ = self.lease(cb, who=who)
        body = {"owner_client_id": who, "leases": [
            {"canonical_name": live_n, "memory_instance_id": live_m, "fencing_token": 1, "ttl_seconds": 60},
            {"canonical_name": stale_n, "memory_instance_id": stale_m, "fencing_token": 1},
            {"canonical_name": gone_n, "memory_instance_id": gone_m, "fencing_token": 1},
            {"canonical_name": b_n, "memory_instance_id": b_m, "fencing_token": 1},
            {"canonical_name": stale_n, "memory_instance_id": stale_m, "fencing_token": 2, "ttl_seconds": 4},
        ]}
        r = c.post("/v1/leases/renew-batch", body)
        self.assertStatus(r, 200)
        res = r.json["results"]
        self.assertEqual([x["canonical_name"] for x in res], [live_n, stale_n, gone_n, b_n, stale_n])
        self.assertEqual([x["status"] for x in res], [200, 409, 410, 404, 422])
        self.assertEqual([x.get("code") for x in res[1:]], ["stale-fence", "lease-expired", "lease-not-found",
                                                          "invalid-ttl"])
        self.assertRegex(res[0]["expires_at"], RFC3339_MS_RE)
        self.assertNotIn("code", res[0])
        got = c.get_lease(live_n)
        self.assertEqual(got.json["expires_at"], res[0]["expires_at"])
        self.assertEqual(got.json["ttl_seconds"], 60)
        # B's lease was not renewed by A.
        self.assertEqual(cb.get_lease(b_n).json["ttl_seconds"], 30)
        # An empty batch is fine; more than 1000 is not.
        r = c.post("/v1/leases/renew-batch", {"owner_client_id": who, "leases": []})
        self.assertStatus(r, 200)
        self.assertEqual(r.json["results"], [])
        # As many items as fit in the 16 KiB body limit are renewed in one call.
        item = {"canonical_name": live_n, "memory_instance_id": live_m, "fencing_token": 1}
        n = 1
        while len(json.dumps({"owner_client_id": who, "leases": [item] * (n + 1)})) <= 16 * 1024:
            n += 1
        r = c.post("/v1/leases/renew-batch", {"owner_client_id": who, "leases": [item] * n})
        self.assertStatus(r, 200)
        self.assertEqual(len(r.json["results"]), n)
        self.assertTrue(all(x["status"] == 200 for x in r.json["results"]))
        # The documented maximum, 1000 items (well over 16 KiB: renew-batch has a larger body
        # limit than the other routes), in one call.
        r = c.post("/v1/leases/renew-batch", {"owner_client_id": who, "leases": [item] * 1000})
        self.assertStatus(r, 200)
        self.assertEqual(len(r.json["results"]), 1000)
        self.assertTrue(all(x["status"] == 200 for x in r.json["results"]))
        # Over the maximum: refused, nothing renewed.
        before = c.get_lease(live_n).json["expires_at"]
        data = json.dumps({"owner_client_id": who, "leases": [item] * 1001}).encode()
        req = (b"POST /v1/leases/renew-batch HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + self.token_a.encode() +
               b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        status, _, body, _ = raw_exchange(self.port, req, timeout=10)
        self.assertIn(status, (400, 413), body)
        self.assertEqual(c.get_lease(live_n).json["expires_at"], before)

    def test_fence_verify_200_409_410(self):
        c = self.client()
        name, mem, who, g = self.lease(c)
        r = c.verify(mem, 1)
        self.assertStatus(r, 200)
        self.assertEqual((r.json["memory_instance_id"], r.json["fencing_token"]), (mem, 1))
        self.assertGrant(c.claim(name, mem, who))  # token 2
        self.assertProblem(c.verify(mem, 1), 409, "stale-fence")
        self.assertStatus(c.verify(mem, 2), 200)
        self.assertProblem(c.verify(mem, 3), 409, "stale-fence")
        self.assertStatus(c.release(name, mem, 2, who), 204)
        self.assertProblem(c.verify(mem, 2), 410, "lease-expired")
        self.assertProblem(c.verify(uuid7(), 1), 404)

    def test_admin_revoke(self):
        c, admin = self.client(), self.client(self.admin_a)
        name, mem, who, g = self.lease(c)
        r = c.post("/v1/admin/leases/revoke", {"canonical_name": name})
        self.assertProblem(r, 403, "forbidden")
        self.assertStatus(c.get_lease(name), 200)
        r = admin.post("/v1/admin/leases/revoke", {"canonical_name": name})
        self.assertStatus(r, 204)
        self.assertEqual(r.raw, b"")
        self.assertProblem(c.get_lease(name), 404, "lease-not-found")
        self.assertProblem(admin.post("/v1/admin/leases/revoke", {"canonical_name": name}), 404, "lease-not-found")
        o2 = owner()
        g2 = self.assertGrant(c.claim(name, mem, o2))
        self.assertGreater(g2["fencing_token"], g["fencing_token"])
        self.assertProblem(c.renew(name, mem, g["fencing_token"], who), 409, "stale-fence")
        self.assertProblem(c.release(name, mem, g["fencing_token"], who), 409, "stale-fence")
        self.assertStatus(c.get_lease(name), 200)
        types = [r[0] for r in db_query(self.db_path, "SELECT event_type FROM audit_events")]
        self.assertIn("LEASE_REVOKED", types)
        # The admin scope includes lease.
        self.assertStatus(admin.get("/v1/leases"), 200)

    def test_list_leases_pagination(self):
        c = self.client()
        who = owner()
        names = sorted(self.lease(c, who=who)[0] for _ in range(7))
        other = self.lease(c)[0]
        seen, cursor, pages = [], None, 0
        while True:
            q = {"owner_client_id": who, "limit": "3"}
            if cursor is not None:
                q["cursor"] = cursor
            r = c.get("/v1/leases?" + urllib.parse.urlencode(q))
            self.assertStatus(r, 200)
            self.assertEqual(set(r.json), {"leases", "next_cursor"})
            self.assertLessEqual(len(r.json["leases"]), 3)
            for l in r.json["leases"]:
                self.assertEqual(l["owner_client_id"], who)
                self.assertEqual(set(l), LEASE_FIELDS)
            seen += [l["canonical_name"] for l in r.json["leases"]]
            pages += 1
            cursor = r.json["next_cursor"]
            if cursor is None:
                break
            self.assertIsInstance(cursor, str)
            self.assertLess(pages, 10)
        self.assertEqual(seen, names)
        self.assertEqual(pages, 3)
        self.assertNotIn(other, seen)
        # Without the owner filter the tenant's leases include both.
        all_names, cursor = [], None
        for _ in range(1000):
            r = c.get("/v1/leases?limit=1000" + ("" if cursor is None else "&cursor=" + urllib.parse.quote(cursor)))
            all_names += [l["canonical_name"] for l in r.json["leases"]]
            cursor = r.json["next_cursor"]
            if cursor is None:
                break
        self.assertTrue(set(names) | {other} <= set(all_names))
        for q in ("limit=0", "limit=1001", "limit=abc", "limit=", "bogus=1", "limit=3&limit=4",
                  "cursor=garbage%20name", "cursor=AAAA", "cursor=%00", "cursor=x&cursor=y"):
            with self.subTest(q=q):
                self.assertProblem(c.get("/v1/leases?" + q), 400, "invalid-request")

    def test_register_memory_own_200_other_tenant_409(self):
        c, cb = self.client(), self.client(self.token_b)
        mid = uuid7()
        r = c.register(mid)
        self.assertStatus(r, 201)
        self.assertEqual(set(r.json), {"memory_instance_id", "created_at"})
        self.assertEqual(r.json["memory_instance_id"], mid)
        r2 = c.register(mid)  # another key: a re-registration, not a replay
        self.assertStatus(r2, 200)
        self.assertIsNone(r2.header("Idempotent-Replayed"))
        self.assertEqual(r2.json, r.json)
        self.assertProblem(cb.register(mid), 409, "memory-id-taken")
        self.assertEqual(db_query(self.db_path, "SELECT count(*) FROM memories WHERE memory_id = ?", (mid,))[0][0], 1)
        # A server-minted id is a UUIDv7.
        r3 = c.register()
        self.assertStatus(r3, 201)
        self.assertEqual(r3.json["memory_instance_id"][14], "7")
        # Only UUIDv7 ids are accepted from clients.
        self.assertProblem(c.register("6f1c2c52-2f8e-4b1e-9d7a-3a1e5f0b9c11"), 400, "invalid-request")

    def test_same_owner_reclaim_new_larger_token(self):
        c = self.client()
        name, mem, who, g = self.lease(c, ttl=60)
        tokens = [g["fencing_token"]]
        for ttl in (30, 90):
            g2 = self.assertGrant(c.claim(name, mem, who, ttl=ttl))
            self.assertEqual(g2["ttl_seconds"], ttl)
            tokens.append(g2["fencing_token"])
        self.assertEqual(tokens, [1, 2, 3])
        self.assertEqual(lease_rows(self.db_path, "memory_id = ?", (mem,)), [(name, mem, 3, who)])
        self.assertProblem(c.renew(name, mem, 2, who), 409, "stale-fence")
        self.assertStatus(c.renew(name, mem, 3, who), 200)

    def test_error_shape(self):
        c = self.client()
        name, mem, who, g = self.lease(c)
        cases = [
            (c.get("/nope"), 404, "not-found"),
            (c.get("/v1/leases/%s" % unique_name()), 404, "lease-not-found"),
            (c.get("/v1/memories/" + uuid7()), 404, "memory-not-found"),
            (c.post("/v1/leases/renew", b"{", content_type="application/json"), 400, "invalid-request"),
            (c.post("/v1/leases/renew", {"x": 1}), 400, "invalid-request"),
            (c.post("/v1/leases/renew", "{}", content_type="text/plain"), 415, "unsupported-media-type"),
            (c.post("/v1/leases", {}), 400, "invalid-request"),
            (c.claim(name, c.new_memory(), owner()), 423, "name-held"),
            (c.claim(unique_name(), mem, owner()), 423, "memory-attached"),
            (c.claim("x!", mem, owner()), 422, "invalid-name"),
            (c.claim(unique_name(), mem, who, ttl=1), 422, "invalid-ttl"),
            (c.renew(name, mem, 5, who), 409, "stale-fence"),
            (c.post("/v1/admin/leases/revoke", {"canonical_name": name}), 403, "forbidden"),
            (c.get("/v1/leases", token=None), 401, "unauthenticated"),
            (c.request("DELETE", "/v1/leases"), 405, "method-not-allowed"),
            (c.post("/v1/leases", b"{" + b" " * 20000 + b"}", idem=new_key()), 413, "payload-too-large"),
        ]
        for r, status, code in cases:
            with self.subTest(code=code):
                body = self.assertProblem(r, status, code)
                self.assertEqual(body["type"], PROBLEM_BASE + code)
        allow = cases[14][0].header("Allow")
        self.assertEqual(sorted(a.strip() for a in allow.split(",")), ["GET", "HEAD", "POST"])
        self.assertEqual(cases[5][0].json["code"], "unsupported-media-type")
        unknown = self.assertProblem(c.post("/v1/fence/verify", {"memory_instance_id": mem, "fencing_token": 1,
                                                                 "zzz_extra": 1}), 400, "invalid-request")
        self.assertIn("zzz_extra", unknown["detail"])
        # 5xx never leaks internals; there should be none here anyway.
        self.assertStatus(c.get("/healthz"), 200)

    def test_healthz_readyz(self):
        c = self.client(token=None)
        for path in ("/healthz", "/readyz"):
            r = c.get(path)
            self.assertStatus(r, 200)
            self.assertEqual(r.json, {"status": "ok"})
            self.assertEqual((r.header("Content-Type") or "").split(";")[0], "application/json")
            self.assertTrue(r.header("X-Request-Id"))
            r = c.post(path, {})
            self.assertProblem(r, 405, "method-not-allowed")
            self.assertEqual(r.header("Allow"), "GET, HEAD")

    def test_expect_100_continue(self):
        # A client that sends `Expect: 100-continue` waits for a 100 before it sends the
        # body (RFC 9110 §10.1.1); without one it stalls (curl for 1 s) or gives up.
        head = ("POST /v1/memories HTTP/1.1\r\nHost: mep\r\nAuthorization: Bearer %s\r\n"
                "Content-Type: application/json\r\nIdempotency-Key: %s\r\nExpect: 100-continue\r\n"
                "Connection: close\r\nContent-Length: 2\r\n\r\n" % (self.token_a, new_key())).encode()
        with socket.create_connection(("127.0.0.1", self.port), timeout=3) as s:
            send_expecting_continue(s, head, b"{}")
            reply = read_to_close(s)
        self.assertTrue(reply.startswith(b"HTTP/1.1 201 "), reply[:200])
        self.assertIn(b'"memory_instance_id"', reply)

    def test_expect_100_continue_over_the_limit(self):
        # A body announced over the route's limit is refused with the 413 in place of the
        # 100: the client never sends it. At the limit itself the 100 comes.
        def head(length, path="/v1/memories"):
            return ("POST %s HTTP/1.1\r\nHost: mep\r\nAuthorization: Bearer %s\r\n"
                    "Content-Type: application/json\r\nIdempotency-Key: %s\r\nExpect: 100-continue\r\n"
                    "Connection: close\r\nContent-Length: %d\r\n\r\n" % (path, self.token_a, new_key(), length)).encode()
        for path in ("/v1/memories", "/v1/leases", "/v1/leases/renew", "/v1/fence/verify?x=1"):
            with self.subTest(path=path), socket.create_connection(("127.0.0.1", self.port), timeout=3) as s:
                s.sendall(head(16 * 1024 + 1, path))
                reply = read_to_close(s)
                self.assertTrue(reply.startswith(b"HTTP/1.1 413 "), reply[:200])
                self.assertNotIn(b"100 Continue", reply)
                self.assertIn(b'"code":"payload-too-large"', reply)
        body = b"{}" + b" " * (16 * 1024 - 2)
        with socket.create_connection(("127.0.0.1", self.port), timeout=3) as s:
            send_expecting_continue(s, head(len(body)), body)
            self.assertTrue(read_to_close(s).startswith(b"HTTP/1.1 201 "))
        # renew-batch takes up to 512 KiB: the 100 comes, and the body is judged as JSON.
        body = b"{" + b" " * (16 * 1024) + b"}"
        with socket.create_connection(("127.0.0.1", self.port), timeout=3) as s:
            send_expecting_continue(s, head(len(body), "/v1/leases/renew-batch"), body)
            self.assertTrue(read_to_close(s).startswith(b"HTTP/1.1 400 "))

    def test_head_is_get_without_content(self):
        # RFC 9110 §9.3.2: the status and headers of GET, Content-Length included, no content.
        # The keep-alive connection then serves the next request (no stray bytes were sent).
        c = self.client()
        name, mem = unique_name(), c.new_memory()
        self.assertStatus(c.claim(name, mem, "owner-1"), 201)
        anon = self.client(token=None)
        for client, path in ((anon, "/healthz"), (anon, "/readyz"), (c, "/v1/leases/" + name),
                             (c, "/v1/memories/" + mem), (c, "/v1/memories/%s/lineage" % mem)):
            with self.subTest(path=path):
                got = client.get(path)
                self.assertStatus(got, 200)
                head = client.request("HEAD", path)
                self.assertStatus(head, 200)
                self.assertEqual(head.raw, b"")
                self.assertEqual(head.header("Content-Length"), str(len(got.raw)))
                self.assertEqual(head.header("Content-Type"), got.header("Content-Type"))
                again = client.get(path)  # same connection: it must start with a status line
                self.assertStatus(again, 200)
                self.assertIsNotNone(again.json)
        # The checks of GET hold: no token, unknown lease, a POST-only route.
        r = anon.request("HEAD", "/v1/leases/" + name)
        self.assertStatus(r, 401)
        self.assertEqual(r.raw, b"")
        self.assertTrue(r.header("WWW-Authenticate"))
        r = c.request("HEAD", "/v1/leases/" + unique_name())
        self.assertStatus(r, 404)
        self.assertEqual(r.header("Content-Type"), "application/problem+json")
        r = c.request("HEAD", "/v1/fence/verify")
        self.assertStatus(r, 405)
        self.assertEqual(r.header("Allow"), "POST")
        self.assertStatus(c.get("/v1/leases/" + name), 200)


# ---- the Prometheus text format ---------------------------------------------------------

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
_VALUE = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|[-+]?Inf|NaN"
SAMPLE_RE = re.compile(r"^(%s)(?:\{((?:%s)(?:,%s)*,?)?\})? (%s)(?: -?\d+)?$" % (_NAME, _LABEL, _LABEL, _VALUE))
HELP_RE = re.compile(r"^# HELP (%s) .*$" % _NAME)
TYPE_RE = re.compile(r"^# TYPE (%s) (counter|gauge|histogram|summary|untyped)$" % _NAME)
LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')


def parse_exposition(tc, text):
    """Checks every line of a Prometheus text exposition (format 0.0.4) and returns
    {family: {"type": t, "samples": [(name, labels, value)]}}. Families are contiguous,
    typed before their samples; histograms have cumulative buckets ending in +Inf = count."""
    families, current, done = {}, None, set()
    for i, line in enumerate(text.split("\n")[:-1]):
        where = "line %d: %r" % (i + 1, line)
        tc.assertTrue(line, "empty line in exposition: " + where)
        if line.startswith("#"):
            m = HELP_RE.match(line) or TYPE_RE.match(line)
            if not m and line.startswith(("# HELP", "# TYPE")):
                tc.fail("bad comment " + where)
            if m and line.startswith("# TYPE"):
                name = m.group(1)
                tc.assertNotIn(name, done, "family %s split: %s" % (name, where))
                if current:
                    done.add(current)
                current = name
                tc.assertNotIn(name, families, where)
                families[name] = {"type": m.group(2), "samples": []}
            continue
        m = SAMPLE_RE.match(line)
        tc.assertIsNotNone(m, "not an exposition line: " + where)
        sname, labels_text, value = m.group(1), m.group(2) or "", m.group(3)
        labels = dict(LABEL_RE.findall(labels_text))
        fam = current
        tc.assertIsNotNone(fam, "sample before any TYPE: " + where)
        ftype = families[fam]["type"]
        if ftype == "histogram":
            tc.assertIn(sname, (fam + "_bucket", fam + "_sum", fam + "_count"), where)
            if sname.endswith("_bucket"):
                tc.assertIn("le", labels, where)
        else:
            tc.assertEqual(sname, fam, where)
        families[fam]["samples"].append((sname, labels, float(value)))
    for name, fam in families.items():
        if fam["type"] != "histogram":
            continue
        series = {}
        for sname, labels, v in fam["samples"]:
            key = tuple(sorted((k, x) for k, x in labels.items() if k != "le"))
            series.setdefault(key, {"buckets": [], "count": None})
            if sname.endswith("_bucket"):
                series[key]["buckets"].append((labels["le"], v))
            elif sname.endswith("_count"):
                series[key]["count"] = v
        for key, s in series.items():
            values = [v for _, v in s["buckets"]]
            tc.assertEqual(values, sorted(values), "%s%s buckets not cumulative" % (name, key))
            tc.assertEqual(s["buckets"][-1][0], "+Inf", name)
            tc.assertEqual(s["buckets"][-1][1], s["count"], name)
    return families


class RateLimit(ServerTestCase):
    server_args = ("--rate-limit", "5")

    def test_rate_limit_429(self):
        c = self.client()
        started = time.monotonic()
        results = [c.get("/v1/leases") for _ in range(30)]
        elapsed = time.monotonic() - started
        statuses = [r.status for r in results]
        self.assertEqual(statuses[0], 200, statuses)
        self.assertIn(429, statuses)
        # A bucket of 5 refilled at 5/s: no more successes than that allows.
        self.assertLessEqual(statuses.count(200), 5 + int(5 * elapsed) + 1, (statuses, elapsed))
        self.assertEqual(set(statuses), {200, 429}, statuses)
        limited = [r for r in results if r.status == 429]
        for r in limited:
            self.assertProblem(r, 429, "rate-limited")
            self.assertRetryAfter(r, 5)
        # Per token: another tenant's token is not limited by A's burst.
        cb = self.client(self.token_b)
        self.assertStatus(cb.get("/v1/leases"), 200)
        # Creating requests are limited too, and a limited claim creates nothing.
        name = unique_name()
        limited_claims = []
        for _ in range(20):
            r = c.claim(name, "01900000-0000-7000-8000-000000000000", owner())
            if r.status == 429:
                limited_claims.append(r)
        self.assertTrue(limited_claims)
        # Health is not rate limited.
        for _ in range(20):
            self.assertStatus(c.get("/healthz", token=None), 200)
        # After Retry-After the token works again.
        wait = int(limited[-1].header("Retry-After"))
        time.sleep(wait + 0.2)
        self.assertStatus(c.get("/v1/leases"), 200)
        text = c.get("/metrics", token=None).raw.decode()
        m = re.search(r"^mep_rate_limited_total (\S+)$", text, re.M)
        self.assertIsNotNone(m, text)
        self.assertGreaterEqual(float(m.group(1)), len(limited))


class RateLimitPriority(ServerTestCase):
    server_args = ("--rate-limit", "5")

    def test_renewals_keep_a_reserve_that_claims_cannot_use(self):
        c = self.client()
        statuses = [c.claim(unique_name(), "01900000-0000-7000-8000-000000000000", owner()).status
                    for _ in range(10)]
        self.assertIn(429, statuses)
        # The bucket is empty for claims, not for renewals: a renew is answered by the store
        # (the lease does not exist), not by the rate limiter.
        r = c.renew("nosuchname", "01900000-0000-7000-8000-000000000000", 1, owner())
        self.assertNotEqual(r.status, 429, r)
        self.assertIn(r.status, (404, 409, 410), r)


class Lifecycle(ServerTestCase):
    def test_ready_line_once_and_sigterm_exits_0(self):
        srv = MepServer(self.workdir, os.path.join(self.workdir, "life.db"))
        srv.start()
        self.addCleanup(srv.stop)
        # A new database has no token: every request would get 401, and the log says why.
        self.assertIn("holds no token that is not revoked", srv.stderr_text())
        tok = create_token(srv.db_path, "t", "lease")
        c = ApiClient(srv.port, tok)
        self.addCleanup(c.close)
        mem, name, who = c.new_memory(), unique_name(), owner()
        g = c.claim(name, mem, who)
        self.assertStatus(g, 201)
        self.assertStatus(c.release(name, mem, 1, who), 204)
        # An idle keep-alive connection must not hold up shutdown.
        idle = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        self.addCleanup(idle.close)
        lines = [l for l in srv.stderr_text().splitlines() if l.startswith("mep server listening on ")]
        self.assertEqual(len(lines), 1, srv.stderr_text())
        started = time.monotonic()
        os.kill(srv.pid, signal.SIGTERM)
        srv.proc.wait(timeout=15)
        self.assertEqual(srv.stop(), 0, srv.stderr_text())
        self.assertLess(time.monotonic() - started, 10)
        # The acknowledged grant is durable: a new server on the same file sees it.
        srv2 = MepServer(self.workdir, srv.db_path).start()
        self.addCleanup(srv2.stop)
        self.assertNotIn("holds no token", srv2.stderr_text())
        with ApiClient(srv2.port, tok) as c2:
            r = c2.get("/v1/memories/" + mem)
            self.assertStatus(r, 200)
            self.assertEqual(r.json["fencing_token_high_water"], 1)
            # Tokens are never reused across a restart (§2.9).
            r = c2.claim(unique_name(), mem, owner())
            self.assertStatus(r, 201)
            self.assertEqual(r.json["fencing_token"], 2)
        self.assertEqual(srv2.stop(), 0)

    def test_unusable_database_is_one_line_and_exit_1(self):
        # An uncreatable SQLite path and a PostgreSQL that refuses connections: each command
        # that opens the store says so on one line (not "internal error") and exits 1.
        bad = ["sqlite:/proc/mep-no-such-dir/c.db", "postgresql://mep@127.0.0.1:1/postgres"]
        for url in bad:
            for args in (["token", "create", "--db", url, "--tenant", "t"], ["token", "list", "--db", url],
                         ["server", "audit", "--db", url],
                         ["server", "--db", url, "--listen", "127.0.0.1:0"]):
                rc, out, err = run_mep(args, check=False)
                lines = err.strip().splitlines()
                self.assertEqual(rc, 1, (args, err))
                self.assertEqual(out, "", args)
                self.assertEqual(len(lines), 1, (args, err))
                # (a service's log line starts with the time)
                self.assertRegex(lines[0], r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z )?mep", args)
                self.assertNotIn("internal error", err, args)

    def test_a_database_with_someone_elses_tables_is_refused_untouched(self):
        # A SQLite file with a table named as one of mep's (an application's own `leases`) got
        # mep's other tables and a schema_version, then failed on a column it lacked.
        d = tempfile.mkdtemp(prefix="mep-foreign-", dir=self.workdir)
        path = os.path.join(d, "app.db")
        conn = sqlite3.connect(path)
        conn.execute("CREATE TABLE leases (id INTEGER PRIMARY KEY, holder TEXT)")
        conn.execute("CREATE TABLE tokens (t TEXT)")
        conn.commit()
        conn.close()
        for args in (["token", "create", "--tenant", "t"], ["server", "--listen", "127.0.0.1:0"],
                     ["token", "list"], ["server", "audit"]):
            rc, out, err = run_mep([*args, "--db", "sqlite:" + path], check=False)
            self.assertEqual(rc, 1, (args, err))
            self.assertIn("already has tables named as mep's (tokens, leases)", err, args)
            self.assertEqual(len(err.strip().splitlines()), 1, (args, err))
        conn = sqlite3.connect(path)
        tables = sorted(r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'"))
        conn.close()
        self.assertEqual(tables, ["leases", "tokens"])

    def test_a_database_url_is_one_of_the_two_forms_and_its_password_never_shown(self):
        # Anything but sqlite: and postgresql:// became a SQLite file in the current
        # directory ("postgresql:/…" with a slash missing started a server on an empty
        # database); libpq's words about a URL it could not parse quoted the password.
        cwd = tempfile.mkdtemp(prefix="mep-dburl-", dir=self.workdir)
        for url in ("postgresql:/mep@127.0.0.1:1/x", "host=127.0.0.1 port=1 dbname=x", "plain.db", "sqlite:",
                    "mysql://u@127.0.0.1/x"):
            for args in (["token", "list", "--db", url], ["server", "--db", url, "--listen", "127.0.0.1:0"],
                         ["migrate", "status", "--db", url]):
                p = subprocess.run([mep_bin(), *args], cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
                                   timeout=30)
                self.assertEqual(p.returncode, 2, (args, p.stderr))
                self.assertEqual(len(p.stderr.strip().splitlines()), 1, (args, p.stderr))
                self.assertIn(b"--db", p.stderr)
        # An empty --db is a mistake (an unset variable), not a request for the default database.
        for args in (["token", "list", "--db", ""], ["server", "--db", "", "--listen", "127.0.0.1:0"],
                     ["migrate", "status", "--db", ""], ["token", "create", "--tenant", "t", "--db", ""],
                     ["server", "audit", "--db", ""]):
            p = subprocess.run([mep_bin(), *args], cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, timeout=30,
                               env={**os.environ, "XDG_STATE_HOME": cwd})
            self.assertEqual(p.returncode, 2, (args, p.stderr))
            self.assertIn(b"--db: must not be empty", p.stderr)
        self.assertEqual(os.listdir(cwd), [], "a database was created in the working directory")
        secrets = {"postgresql://u:Top%ZZSecret@127.0.0.1:1/x": ["Top", "ZZSecret"],
                   "postgresql://u:Top/SecretValue@127.0.0.1:1/x": ["Top", "SecretValue"],
                   "postgresql://u:p@ss:w/rd?#%x@127.0.0.1:1/x": ["p@ss", "ss:w", "#%x"],
                   "postgresql://u:Top:Secret@[::1:1/x": ["Top:Secret", "Secret"],
                   "PostgreSQL://u:Sesame@127.0.0.1:1/x": ["Sesame"]}
        for url, words in secrets.items():
            for args in (["token", "list", "--db", url], ["server", "--db", url, "--listen", "127.0.0.1:0"],
                         ["migrate", "status", "--db", url]):
                rc, out, err = run_mep(args, check=False)
                self.assertEqual(rc, 1, (args, err))
                self.assertEqual(len(err.strip().splitlines()), 1, (args, err))
                for w in words:
                    self.assertNotIn(w, err, (args, err))
        # The scheme in any case is PostgreSQL's: refused by the port, not as a bad URL.
        _, _, err = run_mep(["token", "list", "--db", "PostgreSQL://u:Sesame@127.0.0.1:1/x"], check=False)
        self.assertIn("cannot connect to PostgreSQL", err)

    def test_sigterm_exits_0_with_requests_in_flight(self):
        srv = MepServer(self.workdir, os.path.join(self.workdir, "life2.db")).start()
        self.addCleanup(srv.stop)
        tok = create_token(srv.db_path, "t", "lease")
        stop = threading.Event()
        errors = []

        def hammer():
            with ApiClient(srv.port, tok) as hc:
                while not stop.is_set():
                    try:
                        r = hc.register(retry=False)
                        if r.status >= 500:
                            errors.append(r)
                    except OSError:
                        return
                    except Exception:  # http.client errors once the server is gone
                        return

        threads = [threading.Thread(target=hammer) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        os.kill(srv.pid, signal.SIGTERM)
        try:
            srv.proc.wait(timeout=15)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
        self.assertEqual(srv.stop(), 0, srv.stderr_text())
        self.assertEqual(errors, [])


SCHEMA_V2_SQL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sqlite_schema_v2.sql")
UPGRADED_TABLES = ("tenants", "tokens", "memories", "leases", "agent_names", "idempotency", "audit_events")


@unittest.skipIf(pgfixture.backend() != "sqlite",
                 "the SQLite schema upgrade; the PostgreSQL and Spanner schemas are versioned on their own")
class SqliteSchemaUpgrade(ServerTestCase):
    """A database written at schema version 2 (the frozen schema in data/, filled with the
    rows a real server wrote) is upgraded in place by a new server: nothing is lost, the
    fence counters, names, skeletons, lineage and stored idempotent replies still hold."""

    assertGrant = ServerApi.assertGrant

    def test_version_2_database_upgrades_without_losing_state(self):
        c = self.client()
        mem, name, who = c.new_memory(), unique_name(), owner()
        self.assertStatus(c.release(name, mem, self.assertGrant(c.claim(name, mem, who))["fencing_token"], who), 204)
        key = new_key()
        first = c.claim(name, mem, who, key=key)
        grant = self.assertGrant(first)
        self.assertEqual(grant["fencing_token"], 2)
        child = c.branch(mem, 2)
        self.assertStatus(child, 201)
        child_id = child.json["memory_instance_id"]
        latin_mem = c.new_memory()
        self.assertGrant(c.claim("paypa", latin_mem, who))
        # Columns that version 2 had (idempotency.retry_after came with version 9, the
        # holder's and the revocation's with version 10).
        later = {"retry_after", "holder", "granted_at", "renewed_at", "renewals", "hold_until", "revoked_token",
                 "revoke_reason"}
        cols = {t: [r[1] for r in db_query(self.db_path, "PRAGMA table_info(%s)" % t) if r[1] not in later]
                for t in UPGRADED_TABLES}
        rows = {t: db_query(self.db_path, "SELECT %s FROM %s" % (", ".join(cols[t]), t)) for t in UPGRADED_TABLES}

        # The same rows in a version-2 database.
        old = os.path.join(self.workdir, "v2.db")
        conn = sqlite3.connect(old)
        with open(SCHEMA_V2_SQL, encoding="utf-8") as f:
            conn.executescript(f.read())
        for t in UPGRADED_TABLES:
            for r in rows[t]:
                conn.execute("INSERT INTO %s(%s) VALUES (%s)" % (t, ", ".join(cols[t]), ", ".join("?" * len(r))), r)
        conn.commit()
        conn.close()

        srv = MepServer(self.workdir, old).start()
        self.addCleanup(srv.stop)
        self.assertEqual(db_query(old, "SELECT max(version) FROM schema_version")[0][0], 10)
        for t in ("memories", "leases", "agent_names", "audit_events", "idempotency"):
            sql = db_query(old, "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (t,))[0][0]
            if t in ("audit_events", "idempotency"):
                self.assertNotIn("WITHOUT ROWID", sql, t)  # appended in rowid order
            else:
                self.assertIn("WITHOUT ROWID", sql, t)
        indexes = {r[0] for r in db_query(old, "SELECT name FROM sqlite_master WHERE type = 'index'")}
        self.assertTrue({"leases_expiry", "leases_owner_name", "leases_tenant_name", "memories_parent",
                         "idempotency_key"} <= indexes, indexes)
        self.assertFalse({"leases_owner", "idempotency_expiry", "sqlite_autoindex_idempotency_1",
                          "sqlite_autoindex_audit_events_1"} & indexes, indexes)
        for t in UPGRADED_TABLES:
            self.assertEqual(sorted(db_query(old, "SELECT %s FROM %s" % (", ".join(cols[t]), t))), sorted(rows[t]), t)

        with ApiClient(srv.port, self.token_a) as u:
            got = u.get_lease(name)
            self.assertStatus(got, 200)
            self.assertEqual((got.json["memory_instance_id"], got.json["fencing_token"]), (mem, 2))
            lin = u.get("/v1/memories/%s/lineage" % child_id)
            self.assertEqual([a["memory_instance_id"] for a in lin.json["ancestors"]], [mem])
            # The stored reply replays byte for byte.
            replay = u.claim(name, mem, who, key=key)
            self.assertStatus(replay, 200)
            self.assertEqual(replay.header("Idempotent-Replayed"), "true")
            self.assertEqual(replay.raw, first.raw)
            # Fencing: the current token renews, the superseded one is refused.
            self.assertStatus(u.renew(name, mem, 2, who), 200)
            self.assertProblem(u.renew(name, mem, 1, who), 409, "stale-fence")
            # The name, its skeleton and the memory are still held.
            self.assertProblem(u.claim(name, u.new_memory(), owner()), 423, "name-held")
            self.assertProblem(u.claim("раура", u.new_memory(), owner()), 423, "name-confusable")
            self.assertProblem(u.claim(unique_name(), mem, owner()), 423, "memory-attached")
            # Released, the memory's next grant continues its counter.
            self.assertStatus(u.release(name, mem, 2, who), 204)
            self.assertEqual(self.assertGrant(u.claim(unique_name(), mem, owner()))["fencing_token"], 3)

    def test_version_7_with_hashed_idempotency_keys_is_rebuilt(self):
        # Version 7 as 3810793 wrote it found idempotency records through a key_hash column
        # (NOT NULL, so a newer server inserting without it would fail every claim). Version
        # 8 rebuilds the table: the column is gone, the index is on the key, records replay.
        db = os.path.join(self.workdir, "v7hash.db")
        token = create_token(db, "t")
        srv = MepServer(self.workdir, db).start()
        with ApiClient(srv.port, token) as c:
            key, args = new_key(), (unique_name(), c.new_memory(), owner())
            first = c.claim(*args, key=key)
            self.assertGrant(first)
        self.assertEqual(srv.stop(), 0, srv.stderr_text())
        conn = sqlite3.connect(db)
        conn.executescript("""
            CREATE TABLE idem_h (key_hash INTEGER NOT NULL, tenant_id TEXT NOT NULL,
              idem_key TEXT NOT NULL, fingerprint TEXT NOT NULL, status INTEGER NOT NULL,
              body TEXT NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL);
            INSERT INTO idem_h SELECT 42, tenant_id, idem_key, fingerprint, status, body, created_at,
              expires_at FROM idempotency ORDER BY rowid;
            DROP TABLE idempotency;
            ALTER TABLE idem_h RENAME TO idempotency;
            CREATE INDEX idempotency_key ON idempotency(key_hash);
            DELETE FROM schema_version WHERE version > 7;
        """)
        conn.close()
        srv = MepServer(self.workdir, db).start()
        self.addCleanup(srv.stop)
        self.assertEqual(db_query(db, "SELECT max(version) FROM schema_version")[0][0], 10)
        self.assertNotIn("key_hash", [r[1] for r in db_query(db, "PRAGMA table_info(idempotency)")])
        self.assertEqual([r[2] for r in db_query(db, "PRAGMA index_info(idempotency_key)")], ["idem_key"])
        with ApiClient(srv.port, token) as c:
            replay = c.claim(*args, key=key)
            self.assertStatus(replay, 200)
            self.assertEqual(replay.raw, first.raw)
            self.assertGrant(c.claim(unique_name(), c.new_memory(), owner(), key=new_key()))

    def test_database_from_a_newer_mep_is_refused_untouched(self):
        # An older mep must not write to a schema it does not know (a downgrade after an
        # upgrade): the server and the token commands refuse it with one line, exit 1.
        db = os.path.join(self.workdir, "newer.db")
        run_mep(["token", "create", "--db", "sqlite:" + db, "--tenant", "t"])
        conn = sqlite3.connect(db)
        with conn:
            conn.execute("INSERT INTO schema_version(version) VALUES (999)")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.close()
        with open(db, "rb") as f:
            before = f.read()
        for args in (["server", "--db", "sqlite:" + db, "--listen", "127.0.0.1:0"],
                     ["token", "create", "--db", "sqlite:" + db, "--tenant", "t"],
                     ["token", "list", "--db", "sqlite:" + db]):
            rc, out, err = run_mep(args, check=False)
            self.assertEqual(rc, 1, (args, err))
            self.assertEqual(out, "", args)
            self.assertEqual(len(err.strip().splitlines()), 1, (args, err))
            self.assertIn("schema version 999 is newer than this mep", err, args)
        with open(db, "rb") as f:
            self.assertEqual(f.read(), before)

    @unittest.skipIf(pgfixture.backend() != "sqlite", "PostgreSQL and Spanner serve many servers by design")
    def test_second_server_on_one_sqlite_file_is_refused(self):
        # SQLite serves one process: a second mep server on the same file is refused at start
        # with one line, while this one keeps serving; token commands still run beside it.
        rc, out, err = run_mep(["server", "--db", "sqlite:" + self.db_path, "--listen", "127.0.0.1:0"], check=False)
        self.assertEqual(rc, 1, err)
        self.assertEqual(len(err.strip().splitlines()), 1, err)
        self.assertIn("serving " + self.db_path, err)
        self.assertIn("SQLite serves one process only", err)
        run_mep(["token", "create", "--db", "sqlite:" + self.db_path, "--tenant", "beside"])
        self.assertGrant(self.client().claim(unique_name(), self.client().new_memory(), owner(), key=new_key()))

    def test_lease_pages_are_read_from_an_index_in_name_order(self):
        # A page of GET /v1/leases must not sort all of a tenant's leases (190 ms for a page
        # of 100 out of 100,000 before schema v4): the tenant's names, and an owner's, are
        # each an index range in name order.
        for where, index in (("tenant_id = ?1 AND canonical_name > ?2", "leases_tenant_name"),
                             ("tenant_id = ?1 AND owner_client_id = ?3 AND canonical_name > ?2",
                              "leases_owner_name")):
            plan = db_query(self.db_path, "EXPLAIN QUERY PLAN SELECT * FROM leases WHERE " + where +
                            " AND expires_at > ?4 ORDER BY canonical_name LIMIT ?5", ("t", "", "o", 0, 100))
            details = " | ".join(r[3] for r in plan)
            self.assertIn("USING INDEX " + index, details)
            self.assertNotIn("TEMP B-TREE", details)


if __name__ == "__main__":
    unittest.main()


@unittest.skipIf(pgfixture.backend() != "sqlite",
                 "SQLite's group commit; PostgreSQL and Spanner run each request in its own transaction")
class SqliteGroupCommit(ServerTestCase):
    """Concurrent requests share one transaction and run without savepoints until one of
    them fails after writing: then the batch runs again with a savepoint per request. The
    failing request leaves nothing behind; the others are granted and on disk."""

    server_args = ("--rate-limit", "0")
    assertGrant = ServerApi.assertGrant

    def test_request_failing_after_writes_is_undone_alone(self):
        doomed = unique_name("doomed")
        c = self.client()
        doomed_mem = c.new_memory()
        others = [(unique_name("bystander"), c.new_memory(), owner()) for _ in range(40)]
        # The grant's lease INSERT fails for one name, after the claim has already raised
        # the memory's fence counter: only undoing the request restores the counter.
        conn = sqlite3.connect(self.db_path)
        conn.execute("CREATE TRIGGER test_fail_claim BEFORE INSERT ON leases WHEN NEW.canonical_name = '%s' "
                     "BEGIN SELECT RAISE(ABORT, 'injected failure'); END" % doomed)
        conn.commit()
        conn.close()
        try:
            def claim(args):
                name, mem, who = args
                with ApiClient(self.port, self.token_a) as cc:
                    return name, cc.claim(name, mem, who)

            jobs = others[:20] + [(doomed, doomed_mem, owner())] + others[20:]
            with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
                results = list(pool.map(claim, jobs))
        finally:
            conn = sqlite3.connect(self.db_path)
            conn.execute("DROP TRIGGER test_fail_claim")
            conn.commit()
            conn.close()
        for name, r in results:
            if name == doomed:
                self.assertProblem(r, 503, "unavailable")
            else:
                self.assertEqual(self.assertGrant(r)["fencing_token"], 1, name)
                self.assertEqual(len(lease_rows(self.db_path, "canonical_name = ?", (name,))), 1, name)
        # Nothing of the failed claim: no lease, no name history, the counter where it was.
        self.assertEqual(lease_rows(self.db_path, "canonical_name = ?", (doomed,)), [])
        self.assertEqual(db_query(self.db_path, "SELECT count(*) FROM agent_names WHERE canonical_name = ?",
                                  (doomed,))[0][0], 0)
        self.assertEqual(db_query(self.db_path, "SELECT fence_counter FROM memories WHERE memory_id = ?",
                                  (doomed_mem,))[0][0], 0)
        # The batches were committed as groups, and the server still grants.
        self.assertEqual(self.assertGrant(c.claim(doomed, doomed_mem, owner()))["fencing_token"], 1)
        self.assertStatus(c.get("/readyz"), 200)


@unittest.skipIf(pgfixture.backend() != "sqlite", "the SQLite store's files")
class SqliteFiles(unittest.TestCase):
    def test_new_directory_gets_private_database_and_token_epoch(self):
        # A database in a directory that does not exist yet (a first `mep token create`
        # with the default path): the directory is created 0700, and the database and the
        # revocation epoch beside it 0600 — the epoch too, so the server started next
        # caches tokens and still sees a revocation at once.
        with tempfile.TemporaryDirectory(prefix="mep-files-") as tmp:
            db = os.path.join(tmp, "state", "mep", "control.db")
            token = create_token(db, "t", "lease")
            self.assertEqual(os.stat(os.path.dirname(db)).st_mode & 0o777, 0o700)
            for path in (db, db + "-token-epoch"):
                self.assertEqual(os.stat(path).st_mode & 0o777, 0o600, path)
            srv = MepServer(tmp, db).start()
            self.addCleanup(srv.stop)
            with ApiClient(srv.port, token) as c:
                self.assertEqual(c.get("/v1/leases").status, 200)
                revoke_token(db, token_id_of(db, "t")[0])
                self.assertEqual(c.get("/v1/leases").status, 401)
            self.assertEqual(srv.stop(), 0, srv.stderr_text())

    def test_listing_and_revoking_make_no_database(self):
        # `token list`, `token revoke` and `server audit` on a path with no database (a
        # typo, a wrong $MEP_DB) say so in one line and exit 1, creating neither the
        # database nor its directory; `token create` is what makes one.
        with tempfile.TemporaryDirectory(prefix="mep-files-") as tmp:
            db = os.path.join(tmp, "typo", "control.db")
            for args in (["token", "list"], ["token", "revoke", "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"],
                         ["server", "audit"]):
                rc, out, err = run_mep(args + ["--db", db_url(db)], check=False)
                self.assertEqual(rc, 1, (args, out, err))
                self.assertEqual(len(err.strip().splitlines()), 1, err)
                self.assertIn("no database", err)
                self.assertFalse(os.path.exists(os.path.dirname(db)), args)
            create_token(db, "t", "lease")
            rc, out, err = run_mep(["token", "list", "--db", db_url(db)])
            self.assertEqual(rc, 0, err)
            self.assertIn(token_id_of(db, "t")[0], out)


    def test_a_rate_limit_that_is_not_a_number_is_a_usage_error(self):
        # "nan" parses as a double; it compared false with 0 and the server then answered
        # every request 429.
        with tempfile.TemporaryDirectory(prefix="mep-files-") as tmp:
            db = os.path.join(tmp, "control.db")
            for value in ("nan", "inf", "-1"):
                rc, out, err = run_mep(["server", "--db", db_url(db), "--listen", "127.0.0.1:0",
                                        "--rate-limit", value], check=False)
                self.assertEqual(rc, 2, (value, err))
                self.assertIn("--rate-limit must be 0 (off) or positive", err)

    def test_token_commands_print_json(self):
        # mep-token(1): with --json each prints a JSON document (hash: one per token, one per
        # line), and what it prints is what the plain form prints.
        with tempfile.TemporaryDirectory(prefix="mep-files-") as tmp:
            db = os.path.join(tmp, "control.db")
            fresh = json.loads(run_mep(["--json", "token", "new"])[1])
            self.assertRegex(fresh["token"], r"^mep_[0-9a-f]{64}$")
            plain = run_mep(["token", "hash", fresh["token"]])[1].strip()
            self.assertEqual(json.loads(run_mep(["token", "hash", "--json", fresh["token"]])[1]), {"sha256": plain})
            self.assertEqual(plain, hashlib.sha256(fresh["token"].encode()).hexdigest())
            p = subprocess.run([mep_bin(), "token", "hash", "--json"], input=b"a\n\nb\n", stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, timeout=30, check=False)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertEqual([json.loads(line) for line in p.stdout.decode().splitlines()],
                             [{"sha256": hashlib.sha256(t).hexdigest()} for t in (b"a", b"b")])
            create_token(db, "t", "lease")
            token_id = token_id_of(db, "t")[0]
            rc, out, err = run_mep(["token", "revoke", "--json", "--db", db_url(db), token_id])
            self.assertEqual((rc, json.loads(out)), (0, {"token_id": token_id, "revoked": True}), err)
            rc, out, err = run_mep(["--json", "token", "revoke", "--db", db_url(db), token_id], check=False)
            self.assertEqual((rc, out), (1, ""), err)
            self.assertIn("no active token with id", err)


@unittest.skipIf(pgfixture.backend() == "sqlite", "several servers share a database on PostgreSQL and Spanner only")
class TokenCacheTwoServers(unittest.TestCase):
    """PostgreSQL servers keep verified tokens for up to a second (no round trip per
    request); a revocation through any process reaches every server (LISTEN mep_tokens)
    before the next request."""

    def test_a_revoked_token_is_refused_on_the_next_request_by_every_server(self):
        with tempfile.TemporaryDirectory(prefix="mep-tokcache-") as tmp:
            db = new_db(tmp)
            self.addCleanup(drop_db, db)
            create_token(db, "keeper", "lease")
            servers = [MepServer(tmp, db).start() for _ in range(2)]
            for s in servers:
                self.addCleanup(s.stop)
            keep = create_token(db, "keeper", "lease")
            for round_ in range(8):
                tok = create_token(db, "victim-%d" % round_, "lease")
                clients = [ApiClient(s.port, tok) for s in servers]
                try:
                    for _ in range(5):  # warm both caches
                        for c in clients:
                            self.assertEqual(c.get("/v1/leases").status, 200)
                    revoke_token(db, token_id_of(db, "victim-%d" % round_)[0])
                    for i, c in enumerate(clients):
                        r = c.get("/v1/leases")
                        self.assertEqual(r.status, 401, "round %d, server %d still accepted a revoked token" % (round_, i))
                finally:
                    for c in clients:
                        c.close()
                # Another tenant's token is untouched on both.
                for s in servers:
                    with ApiClient(s.port, keep) as c:
                        self.assertEqual(c.get("/v1/leases").status, 200)
