"""Hostile and malformed input to the control plane (SPEC §6, §6.2; L3): several hundred bad
requests — broken JSON, wrong types, huge, negative and fractional numbers, invalid UUIDs,
invalid UTF-8, unknown and missing fields, oversized bodies and headers, missing, doubled
and wrong headers, bad methods and paths, garbage on a raw socket, slow clients.

Each must get a 4xx problem (never a 5xx, never a hang); afterwards the server still answers
/healthz, and no row of any table changed (AUTH_FAILED audit rows aside). The requests
reference a real live lease and real memories, so a bad request that slipped through would
renew, release, revoke, branch or create something and show up in the snapshot.

A second test class checks that the un-mutated base requests are valid (on its own server),
so every rejection here is caused by the one thing each case breaks."""
import copy
import json
import re
import socket
import struct
import sys
import time
import unittest

import http.client

from mephelpers import read_to_close, send_all_then_read
from serverfixture import (HOST, PROBLEM_BASE, ApiClient, ServerTestCase, db_snapshot, head_header,
                           new_key, raw_exchange, unique_name, uuid7)

CLIENT_TIMEOUT_S = 10   # any single answer slower than this counts as a hang

V4_UUID = "6f1c2c52-2f8e-4b1e-9d7a-3a1e5f0b9c11"
NIL_UUID = "00000000-0000-0000-0000-000000000000"
MAX_UUID = "ffffffff-ffff-ffff-ffff-ffffffffffff"

# Bodies that are not a JSON object, or not JSON at all (sent as raw bytes).
SYNTAX_BODIES = [
    b"", b" ", b"{", b"}", b"[", b"{}}", b"{{}}", b'{"a":}', b'{"a" 1}', b"{'a':1}", b'{"a":1,}',
    b'{,"a":1}', b'{"a":1 "b":2}', b"[1,2]", b"[]", b'"str"', b"123", b"-1", b"null", b"true",
    b'{"a":1} trailing', b"{}{}", b"\x00", b"{\x00}", b'{"a":NaN}', b'{"a":Infinity}',
    b'{"a":-Infinity}', b'{"a":01}', b'{"a":-}', b'{"a":1e}', b'{"a":.5}', b'{"a":+1}',
    b'{"a":0x10}', b"/* c */{}", b"{} // c", b'{"a":"unterminated}', b'{"a":"bad \\x escape"}',
    b'{"a":"\\u12"}', b'{"a":"\\ud800"}', b'{"a":"\\udc00x"}', b'{"a":"tab\there"}',
    b'{"a":"nl\nhere"}', b"\xef\xbb\xbf{}", b"{" * 40 + b"}" * 40,
    b'{"a":' + b"[" * 100 + b"]" * 100 + b"}", b'{"a":tru}', b'{"a":nul}', b"{\"a\":\"\xff\"}",
    b"\xff\xfe{\x00}\x00", b'{"\xc0\xaf":1}', b"{\"a\":1}\x00",
]

# Invalid UTF-8 sequences put inside a JSON string value.
BAD_UTF8 = [b"\xff", b"\xfe", b"\x80", b"\xc0\xaf", b"\xc1\xbf", b"\xe0\x80\xaf", b"\xed\xa0\x80",
            b"\xed\xbf\xbf", b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80", b"\xe2\x82", b"\xc3",
            b"a\xc3(b", b"\x01", b"\x1f"]

WRONG_TYPES = [True, False, [], {}, [1], {"a": 1}]
STRING_BAD = WRONG_TYPES + [1, 0, -1, 1.5, 1e300]
UUID_BAD = STRING_BAD + ["", "x", "not-a-uuid", "0190", "zzzzzzzz-zzzz-7zzz-8zzz-zzzzzzzzzzzz",
                         "urn:uuid:" + V4_UUID, "{" + V4_UUID + "}", V4_UUID.replace("-", ""),
                         " " + V4_UUID, V4_UUID + " ", V4_UUID[:-1], V4_UUID + "0",
                         V4_UUID.replace("-", "_"), "g" + V4_UUID[1:], "\u0661" * 36, "x" * 5000]
TOKEN_BAD = WRONG_TYPES + ["1", "one", -1, -(2 ** 63), (2 ** 62) + 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64,
                           10 ** 30, 1.5, 0.5, -0.5, 1e300, -1e300, 1.0000001]
TTL_ROUTER_BAD = WRONG_TYPES + ["30", 2 ** 41, -(2 ** 41), 2 ** 63, 2 ** 64, 10 ** 30, 1.5, 30.25,
                                1e300, -1e300]
OWNER_BAD = STRING_BAD + ["", "x" * 256, "é" * 128]


class BadInputBase(ServerTestCase):
    """Builds the real objects the requests point at and the base (valid) bodies."""

    server_args = ("--rate-limit", "0")

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        with ApiClient(cls.port, cls.token_a) as c:
            cls.mem = c.new_memory()          # leased by cls.name
            cls.idle_mem = c.new_memory()     # registered, never leased
            cls.name = unique_name()
            cls.owner = "owner-badinput"
            r = c.claim(cls.name, cls.mem, cls.owner, ttl=300)
            assert r.status == 201, r
            cls.token = r.json["fencing_token"]

    def bodies(self):
        """(path, base body, creating?, admin?) for every POST endpoint; each base body is
        valid and would change the database if the server accepted it."""
        ref = {"canonical_name": self.name, "memory_instance_id": self.mem, "fencing_token": self.token,
               "owner_client_id": self.owner}
        return {
            "register": ("/v1/memories", {"memory_instance_id": uuid7()}, True, False),
            "claim": ("/v1/leases", {"display_name": unique_name(), "memory_instance_id": self.idle_mem,
                                     "owner_client_id": "owner-x", "ttl_seconds": 30}, True, False),
            "renew": ("/v1/leases/renew", dict(ref, ttl_seconds=300), False, False),
            "renew-batch": ("/v1/leases/renew-batch", {"owner_client_id": self.owner, "leases": [
                {"canonical_name": self.name, "memory_instance_id": self.mem, "fencing_token": self.token,
                 "ttl_seconds": 300}]}, False, False),
            "release": ("/v1/leases/release", dict(ref), False, False),
            "branch": ("/v1/memories/branch", {"parent_memory_instance_id": self.mem,
                                               "parent_fencing_token": self.token}, True, False),
            "verify": ("/v1/fence/verify", {"memory_instance_id": self.mem, "fencing_token": self.token},
                       False, False),
            "revoke": ("/v1/admin/leases/revoke", {"canonical_name": self.name}, False, True),
        }


class BaseBodiesAreValid(BadInputBase):
    """The un-mutated requests succeed, so the rejections in BadInput are caused by the
    mutation each case applies (this class has its own server and database)."""

    def test_base_bodies_succeed(self):
        c, admin = self.client(), self.client(self.admin_a)
        order = ["register", "claim", "verify", "renew", "renew-batch", "branch", "revoke"]
        bodies = self.bodies()
        for what in order:
            path, body, creating, is_admin = bodies[what]
            r = (admin if is_admin else c).post(path, body, idem=new_key() if creating else None)
            self.assertIn(r.status, (200, 201, 204), (what, r))
            if what == "renew-batch":
                self.assertEqual(r.json["results"][0]["status"], 200, r)
        # release (after a fresh claim, since revoke removed the lease)
        r = c.claim(self.name, self.mem, self.owner)
        self.assertStatus(r, 201)
        path, body, _, _ = self.bodies()["release"]
        body["fencing_token"] = r.json["fencing_token"]
        self.assertStatus(c.post(path, body), 204)


class BadInput(BadInputBase):
    total = 0

    @classmethod
    def tearDownClass(cls):
        sys.stderr.write("\n%d malformed requests answered\n" % cls.total)
        super().tearDownClass()

    def setUp(self):
        super().setUp()
        self.before = db_snapshot(self.db_path)
        self.c = self.client()
        self.c.timeout = CLIENT_TIMEOUT_S
        self.admin = self.client(self.admin_a)
        self.admin.timeout = CLIENT_TIMEOUT_S
        self.count = 0

    def tearDown(self):
        type(self).total += self.count
        try:
            with ApiClient(self.port, None, timeout=CLIENT_TIMEOUT_S) as h:
                self.assertEqual(h.get("/healthz").status, 200, "server unhealthy after bad input")
                self.assertEqual(h.get("/readyz").status, 200)
            self.assertTrue(self.server.running(), self.server.stderr_text())
            after = db_snapshot(self.db_path)
            for table in sorted(set(self.before) | set(after)):
                self.assertEqual(after.get(table), self.before.get(table), "table %s changed" % table)
        finally:
            super().tearDown()

    # ---- helpers ---------------------------------------------------------------------------

    def send(self, what, body, *, headers=None, idem=True, content_type="application/json", token=None):
        path, _, creating, is_admin = self.bodies()[what]
        c = self.admin if is_admin else self.c
        kw = {}
        if token is not None:
            kw["token"] = token
        return c.request("POST", path, body, idem=(new_key() if creating and idem is True else
                                                  (idem if isinstance(idem, str) else None)),
                         headers=headers, content_type=content_type, **kw)

    def expect(self, r, statuses, code=None, label=""):
        """A 4xx problem with the §6 shape (status in `statuses`, optional code)."""
        self.count += 1
        statuses = (statuses,) if isinstance(statuses, int) else tuple(statuses)
        msg = "%s → %r" % (label, r)
        self.assertLess(r.status, 500, msg)
        self.assertGreaterEqual(r.status, 400, msg)
        self.assertIn(r.status, statuses, msg)
        ctype = (r.header("Content-Type") or "").split(";")[0].strip()
        self.assertEqual(ctype, "application/problem+json", msg)
        body = r.json
        self.assertIsInstance(body, dict, msg)
        self.assertEqual(body.get("status"), r.status, msg)
        self.assertEqual(body.get("type"), PROBLEM_BASE + str(body.get("code")), msg)
        self.assertTrue(body.get("title"), msg)
        self.assertIsInstance(body.get("detail"), str, msg)
        self.assertEqual(body.get("instance"), r.header("X-Request-Id"), msg)
        if code is not None:
            self.assertEqual(body.get("code"), code, msg)
        return body

    def expect_raw(self, result, statuses, label=""):
        status, head, body, closed = result
        self.count += 1
        msg = "%s → status %r head %r body %r" % (label, status, head, body[:300])
        self.assertIsNotNone(status, "no answer (hang or bare close): " + msg)
        self.assertTrue(400 <= status < 500, msg)
        self.assertIn(status, statuses, msg)
        self.assertEqual((head_header(head, "Content-Type") or "").split(";")[0], "application/problem+json", msg)
        problem = json.loads(body)
        self.assertEqual(problem["status"], status, msg)
        self.assertEqual(problem["type"], PROBLEM_BASE + problem["code"], msg)
        self.assertEqual(problem["instance"], head_header(head, "X-Request-Id"), msg)
        return problem

    def raw_request(self, method, path, headers, body=b"", content_length=True):
        lines = [b"%s %s HTTP/1.1" % (method, path), b"Host: 127.0.0.1"]
        lines += headers
        if content_length:
            lines.append(b"Content-Length: %d" % len(body))
        return b"\r\n".join(lines) + b"\r\n\r\n" + body

    def auth(self, token=None):
        return b"Authorization: Bearer " + (token or self.token_a).encode()

    # ---- bodies ----------------------------------------------------------------------------

    def test_malformed_json(self):
        for what in self.bodies():
            for raw in SYNTAX_BODIES:
                if what == "register" and raw == b"":
                    continue  # an empty registration body means {} (SPEC §6: the id is optional)
                with self.subTest(endpoint=what, body=raw[:40]):
                    self.expect(self.send(what, raw), 400, "invalid-request", "%s %r" % (what, raw[:40]))
            # A valid body with one of its fields written twice (readers disagree on which
            # one counts): refused, naming the field.
            base = self.bodies()[what][1]
            if isinstance(base, dict) and base:
                field = sorted(base)[0]
                text = json.dumps(base)
                doubled = (text[:-1] + ", " + json.dumps(field) + ": " + json.dumps(base[field]) + "}").encode()
                with self.subTest(endpoint=what, doubled=field):
                    r = self.send(what, doubled)
                    self.expect(r, 400, "invalid-request", "%s doubled %s" % (what, field))
                    self.assertIn('field "%s" appears twice' % field, r.json["detail"], r.raw[:300])

    def test_invalid_utf8_in_strings(self):
        fields = {"register": "memory_instance_id", "claim": "display_name", "renew": "canonical_name",
                  "renew-batch": "owner_client_id", "release": "owner_client_id",
                  "branch": "parent_memory_instance_id", "verify": "memory_instance_id",
                  "revoke": "canonical_name"}
        for what, field in fields.items():
            base = self.bodies()[what][1]
            for bad in BAD_UTF8:
                body = dict(base)
                body[field] = "@@BAD@@"
                raw = json.dumps(body).encode().replace(b"@@BAD@@", bad)
                with self.subTest(endpoint=what, bytes=bad):
                    self.expect(self.send(what, raw), 400, "invalid-request", "%s %r" % (what, bad))
            # In a member name as well.
            raw = json.dumps(base).encode()[:-1] + b', "k\xff": 1}'
            self.expect(self.send(what, raw), 400, "invalid-request", what)

    def field_cases(self):
        """(endpoint, field, bad values) — every one rejected by request decoding."""
        return [
            ("register", "memory_instance_id", [v for v in UUID_BAD] + [V4_UUID, NIL_UUID, MAX_UUID,
                                                                       "01900000-0000-7000-c000-000000000000"]),
            ("claim", "display_name", [None] + STRING_BAD),
            ("claim", "memory_instance_id", [None] + UUID_BAD),
            ("claim", "owner_client_id", [None] + OWNER_BAD),
            ("claim", "ttl_seconds", TTL_ROUTER_BAD),
            ("renew", "canonical_name", [None] + STRING_BAD),
            ("renew", "memory_instance_id", [None] + UUID_BAD),
            ("renew", "fencing_token", [None] + TOKEN_BAD),
            ("renew", "owner_client_id", [None] + OWNER_BAD),
            ("renew", "ttl_seconds", TTL_ROUTER_BAD),
            ("renew-batch", "owner_client_id", [None] + OWNER_BAD),
            ("renew-batch", "leases", [None, True, 1, "x", {}, {"a": 1}, [1], ["x"], [None], [[]], [True]]),
            ("release", "canonical_name", [None] + STRING_BAD),
            ("release", "memory_instance_id", [None] + UUID_BAD),
            ("release", "fencing_token", [None] + TOKEN_BAD),
            ("release", "owner_client_id", [None] + OWNER_BAD),
            ("branch", "parent_memory_instance_id", [None] + UUID_BAD),
            ("branch", "parent_fencing_token", [None] + TOKEN_BAD),
            ("branch", "memory_instance_id", UUID_BAD + [V4_UUID, NIL_UUID, MAX_UUID]),
            ("verify", "memory_instance_id", [None] + UUID_BAD),
            ("verify", "fencing_token", [None] + TOKEN_BAD),
            ("revoke", "canonical_name", [None] + STRING_BAD),
        ]

    def test_wrong_types_and_out_of_range_values(self):
        for what, field, values in self.field_cases():
            base = self.bodies()[what][1]
            for v in values:
                body = copy.deepcopy(base)
                body[field] = v
                with self.subTest(endpoint=what, field=field, value=repr(v)[:40]):
                    p = self.expect(self.send(what, body), 400, "invalid-request", "%s.%s=%r" % (what, field, v))
                    self.assertIn(field, p["detail"])

    def test_wrong_values_inside_batch_items(self):
        base = self.bodies()["renew-batch"][1]
        item_cases = [("canonical_name", [None] + STRING_BAD), ("memory_instance_id", [None] + UUID_BAD),
                      ("fencing_token", [None] + TOKEN_BAD), ("ttl_seconds", TTL_ROUTER_BAD)]
        for field, values in item_cases:
            for v in values:
                body = copy.deepcopy(base)
                body["leases"][0][field] = v
                # A valid item next to the bad one is not renewed either: the request is
                # decoded as a whole before anything runs.
                body["leases"].insert(0, copy.deepcopy(base["leases"][0]))
                with self.subTest(field=field, value=repr(v)[:40]):
                    p = self.expect(self.send("renew-batch", body), 400, "invalid-request", "%s=%r" % (field, v))
                    self.assertIn("leases[1]", p["detail"])
        # Items with unknown, mistyped or missing members.
        for extra, value in (("zzz", 1), ("owner_client_id", 1), ("owner_client_id", []), ("owner_client_id", ""),
                             ("owner_client_id", "x" * 256)):
            body = copy.deepcopy(base)
            body["leases"][0][extra] = value
            p = self.expect(self.send("renew-batch", body), 400, "invalid-request", "item %s=%r" % (extra, value))
            self.assertIn(extra, p["detail"])
        for field in ("canonical_name", "memory_instance_id", "fencing_token"):
            body = copy.deepcopy(base)
            del body["leases"][0][field]
            p = self.expect(self.send("renew-batch", body), 400, "invalid-request")
            self.assertIn(field, p["detail"])
        # Too many items (1001 items cannot fit in 16 KiB: the size limit answers first).
        body = copy.deepcopy(base)
        body["leases"] = body["leases"] * 1001
        req = self.raw_request(b"POST", b"/v1/leases/renew-batch", [self.auth(), b"Content-Type: application/json"],
                               json.dumps(body).encode())
        self.expect_raw(raw_exchange(self.port, req, timeout=CLIENT_TIMEOUT_S), (400, 413), "1001 items")

    def test_renew_ttl_out_of_bounds(self):
        # Renew is not a creating request: the TTL is range-checked (422) and nothing changes.
        for what in ("renew", "renew-batch"):
            for ttl in (-1, 0, 4, 301, 86400, -(2 ** 40)):
                body = copy.deepcopy(self.bodies()[what][1])
                if what == "renew":
                    body["ttl_seconds"] = ttl
                    self.expect(self.send(what, body), 422, "invalid-ttl", "ttl %r" % ttl)
                else:
                    body["leases"][0]["ttl_seconds"] = ttl
                    r = self.send(what, body)
                    self.assertEqual(r.status, 200, r)  # per-item result
                    self.assertEqual((r.json["results"][0]["status"], r.json["results"][0]["code"]),
                                     (422, "invalid-ttl"))
                    self.count += 1

    def test_unknown_fields_named(self):
        for what in self.bodies():
            base = self.bodies()[what][1]
            for extra in ("extra", "Display_Name", "CANONICAL_NAME", "", "__proto__", "ttl", "fencingToken",
                          "path", "file", "é"):
                if extra in base:
                    continue
                body = dict(base)
                body[extra] = 1
                with self.subTest(endpoint=what, field=extra):
                    p = self.expect(self.send(what, body), 400, "invalid-request", "%s +%r" % (what, extra))
                    self.assertIn(json.dumps(extra, ensure_ascii=False), p["detail"])
                    self.assertEqual(p.get("unknown_fields"), [extra])
            # Several at once are all named.
            body = dict(base, zz1=1, zz2=[2])
            p = self.expect(self.send(what, body), 400, "invalid-request")
            self.assertEqual(sorted(p.get("unknown_fields", [])), ["zz1", "zz2"])

    def test_missing_fields_named(self):
        required = {"claim": ["display_name", "memory_instance_id", "owner_client_id"],
                    "renew": ["canonical_name", "memory_instance_id", "fencing_token", "owner_client_id"],
                    "renew-batch": ["owner_client_id", "leases"],
                    "release": ["canonical_name", "memory_instance_id", "fencing_token", "owner_client_id"],
                    "branch": ["parent_memory_instance_id", "parent_fencing_token"],
                    "verify": ["memory_instance_id", "fencing_token"],
                    "revoke": ["canonical_name"]}
        for what, fields in required.items():
            base = self.bodies()[what][1]
            for f in fields:
                body = dict(base)
                del body[f]
                with self.subTest(endpoint=what, missing=f):
                    p = self.expect(self.send(what, body), 400, "invalid-request", "%s -%s" % (what, f))
                    self.assertIn('"%s"' % f, p["detail"])
            with self.subTest(endpoint=what, missing="all"):
                self.expect(self.send(what, {}), 400, "invalid-request", what + " {}")

    def test_oversized_bodies(self):
        # Over 16 KiB through the keep-alive client: 413, then the client reconnects.
        for what in ("claim", "renew", "register"):
            base = self.bodies()[what][1]
            body = json.dumps(dict(base, pad="x" * 17000)).encode()
            self.expect(self.send(what, body), 413, "payload-too-large", what)
        # 1 MB with Content-Length, sent while we read: 413 (the server may then close).
        claim = json.dumps(self.bodies()["claim"][1]).encode()
        one_mb = claim[:-1] + b', "pad": "' + b"x" * (1 << 20) + b'"}'
        headers = [self.auth(), b"Idempotency-Key: " + new_key().encode(), b"Content-Type: application/json"]
        for path in (b"/v1/leases", b"/v1/leases/renew", b"/v1/memories"):
            res = raw_exchange(self.port, self.raw_request(b"POST", path, headers, one_mb), timeout=CLIENT_TIMEOUT_S)
            self.expect_raw(res, (413,), "1 MB %r" % path)
        # 200 KB to every route but renew-batch (16 KiB), and 600 KB to renew-batch.
        for what, (path, base, creating, is_admin) in self.bodies().items():
            size = 600 * 1024 if what == "renew-batch" else 200 * 1024
            data = json.dumps(dict(base, pad="x" * size)).encode()
            hdrs = [self.auth(self.admin_a if is_admin else None), b"Content-Type: application/json"]
            if creating:
                hdrs.append(b"Idempotency-Key: " + new_key().encode())
            res = raw_exchange(self.port, self.raw_request(b"POST", path.encode(), hdrs, data),
                               timeout=CLIENT_TIMEOUT_S)
            self.expect_raw(res, (413,), "%d KB to %s" % (size // 1024, what))
        # 1 MB chunked: the limit applies to the decoded body.
        chunks = b"".join(b"%x\r\n%s\r\n" % (65536, b" " * 65536) for _ in range(16)) + b"0\r\n\r\n"
        req = self.raw_request(b"POST", b"/v1/leases", headers + [b"Transfer-Encoding: chunked"], chunks,
                               content_length=False)
        self.expect_raw(raw_exchange(self.port, req, timeout=CLIENT_TIMEOUT_S), (413,), "1 MB chunked")
        # A Content-Length over the limit is refused before the body arrives.
        req = self.raw_request(b"POST", b"/v1/leases", headers + [b"Content-Length: 1048576"], b"",
                               content_length=False)
        self.expect_raw(raw_exchange(self.port, req, timeout=CLIENT_TIMEOUT_S), (413,), "announced 1 MB")
        req = self.raw_request(b"POST", b"/v1/leases", headers + [b"Content-Length: 16385"], b" " * 16385,
                               content_length=False)
        self.expect_raw(raw_exchange(self.port, req, timeout=CLIENT_TIMEOUT_S), (413,), "16 KiB + 1")
        req = self.raw_request(b"POST", b"/v1/leases", headers + [b"Expect: 100-continue",
                                                                   b"Content-Length: 5000000"], b"",
                               content_length=False)
        self.expect_raw(raw_exchange(self.port, req, timeout=CLIENT_TIMEOUT_S), (413, 417), "expect 100")

    def test_oversized_body_sent_before_reading_gets_413(self):
        # A client that sends the whole body before it reads (no Expect) reads the 413: the
        # server shuts down its side and drains what still arrives (lingering close)
        # instead of closing with unread bytes, which resets the connection and loses the
        # answer. 100 of 100 tries, a raw socket each; then Python's http.client.
        claim = json.dumps(self.bodies()["claim"][1]).encode()
        one_mb = claim[:-1] + b', "pad": "' + b"x" * (1 << 20) + b'"}'
        headers = [self.auth(), b"Idempotency-Key: " + new_key().encode(), b"Content-Type: application/json"]
        req = self.raw_request(b"POST", b"/v1/leases", headers, one_mb)
        before = db_snapshot(self.db_path)
        for attempt in range(100):
            with socket.create_connection((HOST, self.port), timeout=CLIENT_TIMEOUT_S) as s:
                status, reply = send_all_then_read(s, req)
            self.assertEqual(status, b"HTTP/1.1 413 Payload Too Large", "try %d: %r" % (attempt, reply[:200]))
            self.assertIn(b'"code":"payload-too-large"', reply)
        for attempt in range(20):
            conn = http.client.HTTPConnection(HOST, self.port, timeout=CLIENT_TIMEOUT_S)
            try:
                conn.request("POST", "/v1/leases", body=one_mb,
                             headers={"Authorization": "Bearer " + self.token_a, "Idempotency-Key": new_key(),
                                      "Content-Type": "application/json"})
                res = conn.getresponse()
                self.assertEqual(res.status, 413, "http.client try %d" % attempt)
                self.assertEqual(json.loads(res.read())["code"], "payload-too-large")
            finally:
                conn.close()
        self.assertEqual(db_snapshot(self.db_path), before)

    # ---- headers ---------------------------------------------------------------------------

    def test_content_type(self):
        for what in ("claim", "renew", "release", "branch", "verify", "register"):
            base = self.bodies()[what][1]
            for ctype in (None, "text/plain", "application/xml", "application/x-www-form-urlencoded",
                          "multipart/form-data; boundary=x", "application/jsonp", "application/json-patch+json",
                          "application/problem+json", "json", "", "application/", "*/*", "text/json",
                          "application/json5", "application/ json", "application/json; charset=utf-16",
                          "application/json;charset=latin1"):
                with self.subTest(endpoint=what, content_type=ctype):
                    r = self.send(what, base, content_type=ctype)
                    self.expect(r, 415, "unsupported-media-type", "%s %r" % (what, ctype))
            # What is JSON in UTF-8 is taken, however it is spelled: the body is read (and here
            # refused for an unknown member, which changes nothing).
            for ctype in ("Application/JSON", "application/json; charset=UTF-8", 'application/json;charset="utf-8"',
                          "application/json ; x=y"):
                with self.subTest(endpoint=what, content_type=ctype):
                    r = self.send(what, dict(base, zzz_unknown=1), content_type=ctype)
                    self.assertIn("zzz_unknown", self.expect(r, 400, "invalid-request", ctype)["detail"])
            # A body is never encoded: gzip is refused as such, not as JSON that does not parse.
            r = self.send(what, base, headers=[("Content-Encoding", "gzip")])
            self.expect(r, 415, "unsupported-media-type", what + " gzip")
            r = self.send(what, base, content_type=None,
                          headers=[("Content-Type", "application/json"), ("Content-Type", "application/json")])
            self.expect(r, 400, "invalid-request", what + " doubled Content-Type")

    def test_authorization_header(self):
        for what in ("claim", "renew", "release", "register", "revoke"):
            base = self.bodies()[what][1]
            for headers in ([("Authorization", "Basic dXNlcjpwYXNz")], [("Authorization", "Bearer")],
                            [("Authorization", "Bearer  ")], [("Authorization", "bearer" + self.token_a)],
                            [("Authorization", "Bearer mep_" + "f" * 64)],
                            [("Authorization", "Bearer " + self.token_a[:-1])],
                            [("Authorization", "Bearer " + self.token_a), ("Authorization", "Bearer " + self.token_a)],
                            [("Authorization", "Bearer " + self.token_a + ", Bearer x")],
                            [("Authorization", b"Bearer \xff\xfe")]):
                with self.subTest(endpoint=what, headers=repr(headers)[:60]):
                    path, _, creating, _ = self.bodies()[what]
                    r = self.c.request("POST", path, base, token=None, headers=headers,
                                       idem=new_key() if creating else None)
                    self.expect(r, 401, "unauthenticated", "%s %r" % (what, headers))
                    self.assertTrue((r.header("WWW-Authenticate") or "").startswith("Bearer"))
            r = self.c.request("POST", self.bodies()[what][0], base, token=None,
                               idem=new_key() if self.bodies()[what][2] else None)
            self.expect(r, 401, "unauthenticated", what + " no Authorization")
        # The lease scope cannot revoke.
        r = self.c.post("/v1/admin/leases/revoke", self.bodies()["revoke"][1])
        self.expect(r, 403, "forbidden")

    def test_idempotency_key_header(self):
        for what in ("claim", "register", "branch"):
            base = self.bodies()[what][1]
            self.expect(self.send(what, base, idem=False), 400, "idempotency-key-missing", what)
            for key in ("", " ", "a b", "x" * 256, '"unterminated', '"a"b"', '"bad\\q"', "tab\there",
                        b"caf\xc3\xa9", b"\xff", '""'):
                with self.subTest(endpoint=what, key=key):
                    r = self.send(what, base, idem=False, headers=[("Idempotency-Key", key)])
                    self.expect(r, 400, "idempotency-key-invalid", "%s %r" % (what, key))
            r = self.send(what, base, idem=False, headers=[("Idempotency-Key", "k1"), ("Idempotency-Key", "k1")])
            self.expect(r, 400, "idempotency-key-invalid", what + " doubled")
            r = self.send(what, base, idem=False, headers=[("Idempotency-Key", "k1"), ("Idempotency-Key", "k2")])
            self.expect(r, 400, "idempotency-key-invalid", what + " two keys")
        # A control character in the header value: refused by the HTTP parser or the key check.
        body = json.dumps(self.bodies()["claim"][1]).encode()
        req = self.raw_request(b"POST", b"/v1/leases", [self.auth(), b"Idempotency-Key: a\x01b",
                                                         b"Content-Type: application/json"], body)
        self.expect_raw(raw_exchange(self.port, req, timeout=CLIENT_TIMEOUT_S), (400,), "key with \\x01")

    def test_oversized_headers(self):
        big = [
            [b"X-Big: " + b"a" * 9000],
            [b"X-H%d: %s" % (i, b"v" * 40) for i in range(250)],
            [b"Authorization: Bearer " + b"t" * 9000],
            [b"Idempotency-Key: " + b"k" * 9000],
            [b"Cookie: " + b"c=" + b"x" * 20000],
        ]
        for headers in big:
            req = self.raw_request(b"POST", b"/v1/leases", headers + [b"Content-Type: application/json"],
                                   json.dumps(self.bodies()["claim"][1]).encode())
            self.expect_raw(raw_exchange(self.port, req, timeout=CLIENT_TIMEOUT_S), (400, 413, 431),
                            "headers %r" % headers[0][:30])
        req = b"GET /v1/leases/" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n" + self.auth() + b"\r\n\r\n"
        self.expect_raw(raw_exchange(self.port, req, timeout=CLIENT_TIMEOUT_S), (400, 404, 413, 414, 431),
                        "9000-char target")

    # ---- methods and paths -----------------------------------------------------------------

    def test_bad_methods_and_paths(self):
        mem = self.mem
        cases = [
            ("DELETE", "/v1/leases", 405), ("PUT", "/v1/memories", 405), ("PATCH", "/v1/leases/renew", 405),
            ("GET", "/v1/leases/renew-batch/x", 404), ("POST", "/healthz", 405), ("PUT", "/readyz", 405),
            ("DELETE", "/v1/memories/" + mem, 405), ("OPTIONS", "/v1/leases", 405), ("FOO", "/v1/leases", 405),
            ("PUT", "/v1/leases/" + self.name, 405), ("DELETE", "/v1/leases/" + self.name, 405),
            ("POST", "/metrics", 405), ("GET", "/v1/admin/leases/revoke", 405), ("GET", "/v1/fence/verify", 405),
            ("POST", "/v1/memories/" + mem, 405), ("POST", "/v1/memories/%s/lineage" % mem, 405),
            ("GET", "/", 404), ("GET", "/v1", 404), ("GET", "/v2/leases", 404), ("GET", "/v1/leases/", 404),
            ("GET", "//v1/leases", 404), ("GET", "/v1//leases", 404), ("GET", "/V1/LEASES", 404),
            ("POST", "/v1/leases/renew/", 404), ("GET", "/metrics/x", 404), ("GET", "/healthz/", 404),
            ("GET", "/v1/memories/%s/lineage/x" % mem, 404), ("GET", "/v1/memories/not-a-uuid", 400),
            ("GET", "/v1/memories/%2e%2e", 400), ("GET", "/v1/memories/../v1/leases", 404),
            ("GET", "/v1/memories/%s%%00" % mem, 400), ("GET", "/v1/memories/" + V4_UUID[:-1], 400),
            ("GET", "/v1/memories/%zz", 400), ("GET", "/v1/leases/%", 400), ("GET", "/v1/leases/%00", 404),
            ("GET", "/v1/leases/" + "a" * 4000, 404), ("GET", "/v1/leases/%FF%FE", 404),
            ("GET", "/v1/leases?limit=-1", 400), ("GET", "/v1/leases?limit=0", 400),
            ("GET", "/v1/leases?limit=1.5", 400), ("GET", "/v1/leases?limit=99999999999999999999", 400),
            ("GET", "/v1/leases?limit=1e3", 400), ("GET", "/v1/leases?limit=%201", 400),
            ("GET", "/v1/leases?x", 400), ("GET", "/v1/leases?owner=x", 400), ("GET", "/v1/leases?limit=", 400),
            ("GET", "/v1/leases?LIMIT=5", 400),
        ]
        for method, path, status in cases:
            with self.subTest(method=method, path=path[:60]):
                r = self.c.request(method, path, None)
                p = self.expect(r, (status,), None, "%s %s" % (method, path[:60]))
                if status == 405:
                    self.assertEqual(p["code"], "method-not-allowed")
                    self.assertTrue(r.header("Allow"), r)
                if status == 404 and path.count("/") <= 3 and "leases/" not in path and "memories/" not in path:
                    self.assertEqual(p["code"], "not-found")

    def test_garbage_on_raw_socket(self):
        tok = self.token_a.encode()
        claim = json.dumps(self.bodies()["claim"][1]).encode()
        cases = [
            b"\r\n\r\n", b"GARBAGE\r\n\r\n", b"GET\r\n\r\n", b"GET /healthz\r\n\r\n", b"GET /healthz HTTP/9.9\r\n\r\n",
            b"GET /healthz HTTP/1.1\r\nHost\r\n\r\n", b"GET /healthz HTTP/1.1\r\n: no-name\r\n\r\n",
            b"GET /healthz HTTP/1.1\r\nBad Header: x\r\n\r\n", bytes(range(256)) + b"\r\n\r\n",
            b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 32 + b"\r\n\r\n",
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
            b"POST /v1/leases HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
            b"POST /v1/leases HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
            b"POST /v1/leases HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n",
            b"POST /v1/leases HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n0\r\n\r\n",
            b"POST /v1/leases HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
            b"POST /v1/leases HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\nabc\r\n0\r\n\r\n",
            b"GET /healthz HTTP/1.1\nHost: x\n\n", b"GET /he\x00althz HTTP/1.1\r\n\r\n",
            b"GET /\xff\xfe HTTP/1.1\r\n\r\n", b"GET * HTTP/1.1\r\n\r\n", b"CONNECT 127.0.0.1:80 HTTP/1.1\r\n\r\n",
            b"GET  /healthz  HTTP/1.1\r\n\r\n", b"GET /heal thz HTTP/1.1\r\n\r\n", b"GET /healthz HTTP/1.1 x\r\n\r\n",
            b"get /healthz HTTP/1.1\r\n\r\n", b"GET /healthz http/1.1\r\n\r\n", b"GET /healthz HTTP/1.\r\n\r\n",
            b"A" * 5000 + b" / HTTP/1.1\r\n\r\n", b"\x00" * 64 + b"\r\n\r\n",
            b"GET /v1/leases HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n",
            b"GET /v1/leases HTTP/1.1\r\nHost: x\r\nX: a\x01b\r\n\r\n",
            b"GET /v1/leases HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n\r\n",
            b"GET /v1/leases HTTP/1.1\r\nHost: x\r\nAuthorization : Bearer " + tok + b"\r\n\r\n",
            b"POST /v1/leases HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + tok +
            b"\r\nIdempotency-Key: k\r\nContent-Type: application/json\r\nContent-Length: 3\r\n\r\n" + claim,
            b"POST /v1/leases HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + tok +
            b"\r\nIdempotency-Key: k\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" +
            b"%x\r\n%s\r\n" % (len(claim) - 5, claim) + b"0\r\n\r\n",
        ]
        for data in cases:
            with self.subTest(data=data[:50]):
                res = raw_exchange(self.port, data, timeout=CLIENT_TIMEOUT_S)
                self.expect_raw(res, range(400, 500), repr(data[:60]))

    # ---- slow and broken clients -----------------------------------------------------------

    def test_slow_client_does_not_block_others(self):
        socks = []
        try:
            half_head = socket.create_connection((HOST, self.port), timeout=CLIENT_TIMEOUT_S)
            socks.append(half_head)
            half_head.sendall(b"GET /healthz HTTP/1.1\r\nHo")
            half_body = socket.create_connection((HOST, self.port), timeout=CLIENT_TIMEOUT_S)
            socks.append(half_body)
            body = json.dumps(self.bodies()["renew"][1]).encode()
            half_body.sendall(b"POST /v1/leases/renew HTTP/1.1\r\nHost: x\r\n" + self.auth() +
                              b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (len(body) + 1) +
                              body[:10])
            for _ in range(60):  # a slowloris crowd
                s = socket.create_connection((HOST, self.port), timeout=CLIENT_TIMEOUT_S)
                s.sendall(b"POST /v1/leases HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                socks.append(s)
            silent = socket.create_connection((HOST, self.port), timeout=CLIENT_TIMEOUT_S)
            socks.append(silent)
            # Everyone else is still served promptly.
            with ApiClient(self.port, self.token_a, timeout=CLIENT_TIMEOUT_S) as other:
                for _ in range(10):
                    started = time.monotonic()
                    self.assertEqual(other.get("/healthz").status, 200)
                    self.assertEqual(other.get("/v1/leases").status, 200)
                    self.assertEqual(other.get_lease(self.name).status, 200)
                    self.assertLess(time.monotonic() - started, CLIENT_TIMEOUT_S)
            # The half request completes normally when the rest arrives.
            half_head.sendall(b"st: x\r\n\r\n")
            res = _read_response(half_head)
            self.assertEqual(res[0], 200, res)
            # The half body completed with a byte that breaks the JSON: a 400, nothing renewed.
            half_body.sendall(body[10:] + b"}")
            res = _read_response(half_body)
            self.assertEqual(res[0], 400, res)
            self.count += 2
        finally:
            for s in socks:
                s.close()

    def test_client_vanishing_mid_request(self):
        body = json.dumps(self.bodies()["release"][1]).encode()
        head = (b"POST /v1/leases/release HTTP/1.1\r\nHost: x\r\n" + self.auth() +
                b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        for cut in (5, 20, len(head) - 1, len(head), len(head) + 10, len(head) + len(body) - 1):
            data = (head + body)[:cut]
            for linger in (False, True):
                s = socket.create_connection((HOST, self.port), timeout=CLIENT_TIMEOUT_S)
                s.sendall(data)
                if linger:  # RST instead of FIN
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                else:
                    s.shutdown(socket.SHUT_WR)
                    s.settimeout(CLIENT_TIMEOUT_S)
                    try:
                        rest = s.recv(65536)
                    except (ConnectionResetError, socket.timeout):
                        rest = b""
                    # Either a bare close or a 4xx; never a 2xx (nothing was complete) or 5xx.
                    if rest:
                        self.assertRegex(rest[:12], rb"^HTTP/1\.1 4\d\d", rest[:200])
                s.close()
                self.count += 1
        with ApiClient(self.port, self.token_a, timeout=CLIENT_TIMEOUT_S) as other:
            self.assertEqual(other.get_lease(self.name).status, 200)

    def test_idle_half_request_is_disconnected(self):
        """The server does not keep a stalled request forever (its read deadline, 30 s)."""
        s = socket.create_connection((HOST, self.port), timeout=45)
        try:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            started = time.monotonic()
            try:
                data = s.recv(65536)
            except ConnectionResetError:
                data = b""
            waited = time.monotonic() - started
            # Closed (possibly with a 4xx) — not answered 2xx, not left open.
            self.assertTrue(data == b"" or data.startswith(b"HTTP/1.1 4"), data[:200])
            self.assertLess(waited, 45)
        except socket.timeout:
            self.fail("a stalled half request was kept open for 45 s")
        finally:
            s.close()

    def test_pipelined_bad_after_good(self):
        good = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        bad = b"GET /v1/leases HTTP/1.1\r\nHost: x\r\n\r\n"          # no token
        worse = b"BROKEN\r\n\r\n"
        s = socket.create_connection((HOST, self.port), timeout=CLIENT_TIMEOUT_S)
        try:
            s.sendall(good + bad + worse)
            statuses = []
            buf = b""
            deadline = time.monotonic() + CLIENT_TIMEOUT_S
            while len(statuses) < 3 and time.monotonic() < deadline:
                part = s.recv(65536)
                if not part:
                    break
                buf += part
                while b"\r\n\r\n" in buf:
                    head, _, rest = buf.partition(b"\r\n\r\n")
                    n = int(head_header(head, "Content-Length") or 0)
                    if len(rest) < n:
                        break
                    statuses.append(int(head.split(b" ")[1]))
                    buf = rest[n:]
            self.assertEqual(statuses, [200, 401, 400])
            self.count += 3
        finally:
            s.close()

    def test_ambiguous_framing_refused_and_closed(self):
        # RFC 9112 §6.1, §6.3: a body length that a proxy in front could read differently is
        # refused, and the connection closes, so that a request hidden in the body (here a
        # GET /healthz) is never served.
        smuggled = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        head = (b"POST /v1/fence/verify HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + self.token_a.encode() +
                b"\r\nContent-Type: application/json\r\n")
        cases = {
            "identity": b"Transfer-Encoding: identity\r\nContent-Length: 0\r\n\r\n" + smuggled,
            "identity alone": b"Transfer-Encoding: identity\r\n\r\n" + smuggled,
            "chunked twice": b"Transfer-Encoding: chunked, chunked\r\n\r\n0\r\n\r\n" + smuggled,
            "two headers": b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + smuggled,
            "gzip": b"Transfer-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(smuggled) + smuggled,
            "with length": b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n" + smuggled,
        }
        for label, rest in cases.items():
            with self.subTest(case=label):
                with socket.create_connection((HOST, self.port), timeout=CLIENT_TIMEOUT_S) as s:
                    s.sendall(head + rest)
                    reply = read_to_close(s)
                self.assertTrue(reply.startswith(b"HTTP/1.1 400 "), reply[:200])
                self.assertEqual(len(re.findall(rb"HTTP/1\.1 \d{3} ", reply)), 1, reply)
                self.count += 1
        # RFC 9112 §3.2: an HTTP/1.1 request names exactly one Host (HTTP/1.0 may name none).
        for label, req in (("no Host", b"GET /healthz HTTP/1.1\r\n\r\n"),
                           ("two Hosts", b"GET /healthz HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n")):
            with self.subTest(case=label), socket.create_connection((HOST, self.port), timeout=CLIENT_TIMEOUT_S) as s:
                s.sendall(req + smuggled)
                reply = read_to_close(s)
                self.assertTrue(reply.startswith(b"HTTP/1.1 400 "), reply[:200])
                self.assertIn(b"Host header", reply)
                self.assertEqual(len(re.findall(rb"HTTP/1\.1 \d{3} ", reply)), 1, reply)
                self.count += 1
        with socket.create_connection((HOST, self.port), timeout=CLIENT_TIMEOUT_S) as s:
            s.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            self.assertTrue(read_to_close(s).startswith(b"HTTP/1.0 200 "))
        # Chunked alone is served, and the connection goes on.
        body = json.dumps({"memory_instance_id": uuid7(), "fencing_token": 1}).encode()
        chunked = b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        last = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        with socket.create_connection((HOST, self.port), timeout=CLIENT_TIMEOUT_S) as s:
            s.sendall(head + chunked + last)
            reply = read_to_close(s)
        statuses = [int(m) for m in re.findall(rb"HTTP/1\.1 (\d{3}) ", reply)]
        self.assertEqual(len(statuses), 2, reply)
        self.assertIn(statuses[0], (404, 410), reply)
        self.assertEqual(statuses[1], 200, reply)
        self.count += 2


def _read_response(sock, timeout=CLIENT_TIMEOUT_S):
    """Reads one response (status, head, body) from a socket, bounded in time."""
    sock.settimeout(timeout)
    buf = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if b"\r\n\r\n" in buf:
            head, _, rest = buf.partition(b"\r\n\r\n")
            n = int(head_header(head, "Content-Length") or 0)
            if len(rest) >= n:
                return int(head.split(b" ")[1]), head, rest[:n]
        part = sock.recv(65536)
        if not part:
            break
        buf += part
    return None, buf, b""


if __name__ == "__main__":
    unittest.main()
