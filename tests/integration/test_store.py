"""`mep store`, the fenced object store (SPEC §8), against the real binary:

- the rule: a token lower than the mark is refused (409 stale-fence, naming both tokens)
  and changes nothing; an equal one is accepted; a higher one raises the mark; advance;
- the API's shapes (ETag, Fencing-Token, Last-Modified, HEAD, If-Match, If-None-Match);
- bad input: each a problem, nothing changed;
- `interleaved_writers_history`: 32 clients with random tokens on one memory, checked by
  history.py (D1–D3);
- SIGKILL during a 256 MiB upload and during bursts of small writes: the previous object is
  intact, every write answered 2xx is there;
- a full disk (a small tmpfs): 507, reads keep working, nothing lost, writes resume;
- a 256 MiB object streamed in and out with the store's RSS sampled (bounded);
- --strict: the control plane's fence/verify decides, with the writer's own token.
"""
import hashlib
import http.client
import json
import os
import random
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import unittest
import uuid

from history import History
from mephelpers import read_to_close
from serverfixture import HOST, MepServer, create_token, run_mep
from storefixture import MepStore, StoreClient, new_store_token

PROBLEM_BASE = "https://memoryendpoints.com/problems/"


def uuid7():
    ms = int(time.time() * 1000)
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms << 80) | (0x7 << 76) | ((rand >> 68) & 0xFFF) << 64 | (0b10 << 62) | (rand & ((1 << 62) - 1))
    return str(uuid.UUID(int=value))


def rss_kib(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def stream_put(port, token, memory_id, fencing, total, chunk=1 << 20, on_progress=None, timeout=120):
    """PUTs `total` bytes (a repeating pattern made from the memory id) with Content-Length,
    chunk by chunk, never holding the whole body; returns (status, body) or raises."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.putrequest("PUT", "/v1/objects/" + memory_id)
        conn.putheader("Authorization", "Bearer " + token)
        conn.putheader("Fencing-Token", str(fencing))
        conn.putheader("Content-Length", str(total))
        conn.endheaders()
        block = pattern_block(memory_id, fencing, chunk)
        sent = 0
        while sent < total:
            n = min(chunk, total - sent)
            conn.send(block[:n])
            sent += n
            if on_progress:
                on_progress(sent)
        res = conn.getresponse()
        return res.status, res.read()
    finally:
        conn.close()


def pattern_block(memory_id, fencing, size):
    seed = hashlib.sha256(("%s/%d" % (memory_id, fencing)).encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def pattern_sha256(memory_id, fencing, total, chunk=1 << 20):
    h = hashlib.sha256()
    block = pattern_block(memory_id, fencing, chunk)
    left = total
    while left:
        n = min(chunk, left)
        h.update(block[:n])
        left -= n
    return h.hexdigest()


class StoreCase(unittest.TestCase):
    extra_args = ()

    def setUp(self):
        self.workdir = tempfile.mkdtemp(prefix="mep-store-test-")
        self.data_dir = os.path.join(self.workdir, "data")
        self.token, self.hashes = new_store_token(self.workdir)
        self.store = MepStore(self.workdir, self.data_dir, ["--token-file", self.hashes, *self.extra_args]).start()
        self.client = StoreClient(self.store.port, self.token)

    def tearDown(self):
        self.client.close()
        self.store.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def restart(self):
        self.client.close()
        self.store.stop()
        self.store = MepStore(self.workdir, self.data_dir, ["--token-file", self.hashes, *self.extra_args]).start()
        self.client = StoreClient(self.store.port, self.token)

    def assertProblem(self, r, status, code):
        self.assertEqual(r.status, status, r)
        self.assertIn("application/problem+json", r.header("Content-Type"), r)
        p = r.json()
        self.assertEqual(p["status"], status)
        self.assertEqual(p["code"], code, r)
        self.assertEqual(p["type"], PROBLEM_BASE + code)
        self.assertTrue(p["detail"])
        return p

    def objects(self):
        """The version files (objects over 64 KiB; smaller ones live in the database). Empty
        files are the store's pool of names made durable ahead of need (pool_files): a version
        file is never empty, its object being over 64 KiB."""
        d = os.path.join(self.data_dir, "objects")
        out = []
        for n in os.listdir(d):
            try:
                if os.path.getsize(os.path.join(d, n)) > 0:
                    out.append(n)
            except FileNotFoundError:  # removed meanwhile (a replaced version)
                pass
        return sorted(out)

    def pool_files(self):
        d = os.path.join(self.data_dir, "objects")
        out = []
        for n in os.listdir(d):
            try:
                if os.path.getsize(os.path.join(d, n)) == 0:
                    out.append(n)
            except FileNotFoundError:
                pass
        return sorted(out)

    def assertFiles(self, n, timeout=5):
        """Exactly `n` version files, once the store has removed what it replaced (it does
        that after answering, off its commit path)."""
        deadline = time.monotonic() + timeout
        while len(self.objects()) != n and time.monotonic() < deadline:
            time.sleep(0.02)
        self.assertEqual(len(self.objects()), n, self.objects())

    def state(self, memory_id):
        r = self.client.fence(memory_id)
        self.assertEqual(r.status, 200, r)
        return r.json()


class FenceRule(StoreCase):
    def test_put_get_head_and_headers(self):
        m = uuid7()
        r = self.client.put(m, b"first bytes", 3)
        self.assertEqual(r.status, 200, r)
        body = r.json()
        self.assertEqual(body["memory_instance_id"], m)
        self.assertEqual(body["fencing_token"], 3)
        self.assertEqual(body["size"], 11)
        self.assertEqual(r.header("ETag"), '"%s"' % body["etag"])
        self.assertEqual(r.header("Fencing-Token"), "3")
        g = self.client.get(m)
        self.assertEqual(g.status, 200)
        self.assertEqual(g.body, b"first bytes")
        self.assertEqual(g.header("ETag"), r.header("ETag"))
        self.assertEqual(g.header("Fencing-Token"), "3")
        self.assertEqual(g.header("Content-Type"), "application/octet-stream")
        self.assertRegex(g.header("Last-Modified"), r"^[A-Z][a-z]{2}, \d{2} [A-Z][a-z]{2} \d{4} \d{2}:\d{2}:\d{2} GMT$")
        h = self.client.request("HEAD", "/v1/objects/" + m)
        self.assertEqual(h.status, 200)
        self.assertEqual(h.body, b"")
        self.assertEqual(h.header("Content-Length"), "11")
        self.assertEqual(h.header("ETag"), r.header("ETag"))
        f = self.state(m)
        self.assertEqual(f["fencing_token"], 3)
        self.assertEqual(f["object"]["etag"], body["etag"])
        # An empty object is an object.
        e = uuid7()
        self.assertEqual(self.client.put(e, b"", 1).status, 200)
        self.assertEqual(self.client.get(e).body, b"")
        # A memory the store never saw: mark 0, no object, GET 404.
        never = uuid7()
        self.assertEqual(self.state(never), {"memory_instance_id": never, "fencing_token": 0, "object": None})
        self.assertProblem(self.client.get(never), 404, "memory-not-found")

    def test_streamed_bodies_arriving_in_one_piece_are_stored_whole(self):
        # The whole request in one send: many chunks of a chunked body in one read of the
        # store (each parsed in turn, none left in the buffer), and a Content-Length body
        # followed by a second, pipelined request on the same connection.
        m, n = uuid7(), uuid7()
        rng = random.Random(7)
        data = bytes(rng.getrandbits(8) for _ in range(300_000))
        pieces = [data[i:min(i + 997, 150_000)] for i in range(0, 150_000, 997)] + [data[150_000:]]
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
        auth = ("Authorization: Bearer %s\r\n" % self.token).encode()
        req1 = (b"PUT /v1/objects/" + m.encode() + b" HTTP/1.1\r\nHost: x\r\n" + auth +
                b"Fencing-Token: 1\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked)
        req2 = (b"PUT /v1/objects/" + n.encode() + b" HTTP/1.1\r\nHost: x\r\n" + auth +
                b"Fencing-Token: 1\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        req3 = (b"GET /v1/fence/" + n.encode() + b" HTTP/1.1\r\nHost: x\r\n" + auth + b"Connection: close\r\n\r\n")
        with socket.create_connection((HOST, self.store.port), timeout=30) as s:
            s.sendall(req1 + req2 + req3)
            replies = read_to_close(s)
        self.assertEqual(replies.count(b"HTTP/1.1 200"), 3, replies[:600])
        self.assertEqual(self.client.get(m).body, data)
        self.assertEqual(self.client.get(n).body, data)

    def test_lower_token_refused_equal_accepted_higher_raises(self):
        m = uuid7()
        self.assertEqual(self.client.put(m, b"t5 a", 5).status, 200)
        self.assertEqual(self.client.put(m, b"t5 b", 5).status, 200)  # one holder writes many times
        before = self.objects()
        p = self.assertProblem(self.client.put(m, b"t4", 4), 409, "stale-fence")
        self.assertEqual(p["presented_token"], 4)
        self.assertEqual(p["current_token"], 5)
        self.assertEqual(self.client.get(m).body, b"t5 b")
        self.assertEqual(self.objects(), before)  # the refused bytes left nothing behind
        self.assertEqual(self.client.put(m, b"t9", 9).status, 200)
        self.assertProblem(self.client.put(m, b"t5 c", 5), 409, "stale-fence")
        self.assertEqual(self.client.get(m).body, b"t9")
        self.assertFiles(0)  # small objects live in the database
        # Large objects: each version a file, the replaced ones removed, the refused ones too.
        big = uuid7()
        for token, fill in ((1, b"a"), (2, b"b"), (2, b"c")):
            self.assertEqual(self.client.put(big, fill * 100000, token).status, 200)
        self.assertProblem(self.client.put(big, b"z" * 100000, 1), 409, "stale-fence")
        self.assertEqual(self.client.get(big).body, b"c" * 100000)
        self.assertFiles(1)

    def test_advance_raises_the_mark_without_a_write(self):
        m = uuid7()
        self.assertEqual(self.client.put(m, b"holder 1", 1).status, 200)
        r = self.client.advance(m, 2)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.json(), {"memory_instance_id": m, "fencing_token": 2})
        # The zombie (token 1) is refused although the new holder has written nothing.
        p = self.assertProblem(self.client.put(m, b"zombie", 1), 409, "stale-fence")
        self.assertEqual((p["presented_token"], p["current_token"]), (1, 2))
        self.assertEqual(self.client.get(m).body, b"holder 1")
        self.assertEqual(self.client.get(m).header("Fencing-Token"), "1")
        # Advancing to the same token again is fine (a retry); lower is 409.
        self.assertEqual(self.client.advance(m, 2).status, 200)
        self.assertProblem(self.client.advance(m, 1), 409, "stale-fence")
        self.assertEqual(self.state(m)["fencing_token"], 2)
        # A memory never seen can be advanced.
        n = uuid7()
        self.assertEqual(self.client.advance(n, 7).json()["fencing_token"], 7)
        self.assertProblem(self.client.put(n, b"x", 6), 409, "stale-fence")
        # The metric counts the refusals, each once: 2 PUTs refused before their body, 1
        # advance, and a PUT refused after its body was read (below).
        def rejections():
            metrics = self.client.request("GET", "/metrics").body.decode()
            line = [l for l in metrics.splitlines() if l.startswith("mep_fencing_rejections_total")]
            return float(line[0].split()[-1]) if line else 0.0
        self.assertEqual(rejections(), 3)
        self.assertProblem(self.client.put(n, b"y", 6), 409, "stale-fence")
        self.assertEqual(rejections(), 4)

    def test_if_match_and_if_none_match(self):
        m = uuid7()
        self.assertProblem(self.client.put(m, b"a", 1, {"If-Match": "*"}), 412, "precondition-failed")
        r = self.client.put(m, b"a", 1, {"If-None-Match": "*"})
        self.assertEqual(r.status, 200, r)
        etag = r.header("ETag")
        self.assertProblem(self.client.put(m, b"b", 1, {"If-None-Match": "*"}), 412, "precondition-failed")
        self.assertProblem(self.client.put(m, b"b", 1, {"If-Match": '"not-it"'}), 412, "precondition-failed")
        r2 = self.client.put(m, b"b", 1, {"If-Match": etag})
        self.assertEqual(r2.status, 200, r2)
        self.assertNotEqual(r2.header("ETag"), etag)
        self.assertEqual(self.client.put(m, b"c", 1, {"If-Match": '"x", %s' % r2.header("ETag")}).status, 200)
        self.assertEqual(self.client.get(m).body, b"c")
        self.assertProblem(self.client.put(m, b"d", 1, {"If-Match": "W/" + etag}), 400, "invalid-request")

    def test_restart_keeps_objects_and_marks(self):
        m, n = uuid7(), uuid7()
        self.client.put(m, b"kept", 4)
        self.client.advance(n, 11)
        self.restart()
        self.assertEqual(self.client.get(m).body, b"kept")
        self.assertEqual(self.state(n)["fencing_token"], 11)
        self.assertProblem(self.client.put(m, b"old", 3), 409, "stale-fence")

    def test_large_versions_use_the_pool_and_older_layouts_are_read(self):
        # The pool: empty files whose names are durable before an upload takes one, so a
        # large write needs no directory fsync; the version is then named by its etag.
        # The pool as the store offers it: made, and no longer growing (a refill creates its
        # files before the directory fsync that lets uploads take them).
        deadline = time.monotonic() + 10
        pool, stable_since = set(), time.monotonic()
        while time.monotonic() < deadline:
            now = set(self.pool_files())
            if now != pool:
                pool, stable_since = now, time.monotonic()
            elif pool and time.monotonic() - stable_since > 0.3:
                break
            time.sleep(0.02)
        self.assertTrue(pool, "the store made no pool of version files")
        m = uuid7()
        r = self.client.put(m, b"p" * 100000, 2)
        self.assertEqual(r.status, 200)
        etag = r.json()["etag"]
        self.assertIn(etag, pool, "the large version did not take a file of the pool")
        self.assertEqual(self.objects(), [etag])
        self.assertNotIn(etag, self.pool_files())
        # A SIGKILL leaves the pool behind; the next start removes it and keeps the object.
        self.client.close()
        self.store.kill()
        left = set(self.pool_files())
        self.store = MepStore(self.workdir, self.data_dir, ["--token-file", self.hashes]).start()
        self.client = StoreClient(self.store.port, self.token)
        self.assertEqual(self.client.get(m).body, b"p" * 100000)
        self.assertFalse(left & set(self.pool_files()), "the previous run's pool files were kept")
        self.assertEqual(self.objects(), [etag])
        # A directory written before the pool named version files <memory id>.<etag>: still
        # read, kept at start, and removed when replaced.
        self.restart()
        os.rename(os.path.join(self.data_dir, "objects", etag), os.path.join(self.data_dir, "objects", m + "." + etag))
        self.restart()
        self.assertEqual(self.objects(), [m + "." + etag])
        g = self.client.get(m)
        self.assertEqual((g.status, g.body, g.header("ETag")), (200, b"p" * 100000, '"%s"' % etag))
        r = self.client.put(m, b"q" * 100000, 2)
        self.assertEqual(r.status, 200)
        self.assertFiles(1)
        self.assertEqual(self.objects(), [r.json()["etag"]])
        self.assertEqual(self.client.get(m).body, b"q" * 100000)

    def test_health_and_readiness_need_no_token(self):
        for path in ("/healthz", "/readyz"):
            r = self.client.request("GET", path, token=False)
            self.assertEqual(r.status, 200, r)
            self.assertEqual(r.json(), {"status": "ok"})
            self.assertProblem(self.client.request("POST", path, b"", token=False), 405, "method-not-allowed")
        self.assertEqual(self.client.request("GET", "/metrics", token=False).status, 200)  # loopback

    def test_answers_given_before_the_body_are_counted_in_the_duration_metric(self):
        def counts():
            text = self.client.request("GET", "/metrics").body.decode()
            out = {}
            for line in text.splitlines():
                if line.startswith("mep_http_request_duration_seconds_count{"):
                    labels, value = line[len("mep_http_request_duration_seconds_count"):].rsplit(" ", 1)
                    out[labels] = float(value)
            return out
        m = uuid7()
        self.assertEqual(self.client.put(m, b"v1", 2).status, 200)
        before = counts()
        # Each is answered before its body is read, so handle() never sees it.
        self.assertProblem(self.client.put(m, b"old", 1), 409, "stale-fence")
        self.assertProblem(self.client.put(m, b"x", 3, token=False), 401, "unauthenticated")
        self.assertProblem(self.client.request("PUT", "/v1/objects/" + m, b"x", {"Fencing-Token": "x"}), 400,
                           "invalid-request")
        self.assertProblem(self.client.request("GET", "/v1/nothing", token=False), 401, "unauthenticated")
        after = counts()
        put = '{route="/v1/objects/{id}",code="%d"}'
        for labels, n in ((put % 409, 1), (put % 401, 1), (put % 400, 1), ('{route="unmatched",code="401"}', 1),
                          (put % 200, 0)):
            with self.subTest(labels=labels):
                self.assertEqual(after.get(labels, 0) - before.get(labels, 0), n)

    def test_the_token_is_checked_before_anything_else(self):
        # As on the control plane: without a valid token nothing about the endpoints is
        # learned (404, 405, 400 or 413 go to clients with one). The scheme is any case.
        m = uuid7()
        cases = [("PUT", "/v1/nothing/" + m, b"x", {"Fencing-Token": "9"}, 404, "not-found"),
                 ("DELETE", "/v1/objects/" + m, None, {}, 405, "method-not-allowed"),
                 ("GET", "/v1/objects/not-a-uuid", None, {}, 400, "invalid-request")]
        for method, path, body, headers, status, code in cases:
            with self.subTest(method=method, path=path):
                self.assertProblem(self.client.request(method, path, body, headers, token=False), 401,
                                   "unauthenticated")
                self.assertProblem(self.client.request(method, path, body, headers), status, code)
        for scheme in ("bearer", "BEARER"):
            r = self.client.put(m, b"any case", 1, headers={"Authorization": scheme + " " + self.token}, token=False)
            self.assertEqual(r.status, 200, r)


class BadInput(StoreCase):
    def test_each_bad_request_is_a_problem_and_changes_nothing(self):
        m = uuid7()
        self.client.put(m, b"good", 5)
        objects = self.objects()
        cases = [
            ("no token header", self.client.put(m, b"x", None), 400, "invalid-request"),
            ("not a number", self.client.put(m, b"x", "five"), 400, "invalid-request"),
            ("negative", self.client.put(m, b"x", "-1"), 400, "invalid-request"),
            ("fraction", self.client.put(m, b"x", "5.0"), 400, "invalid-request"),
            ("2^63", self.client.put(m, b"x", str(1 << 63)), 400, "invalid-request"),
            ("huge", self.client.put(m, b"x", "9" * 40), 400, "invalid-request"),
            ("empty", self.client.put(m, b"x", ""), 400, "invalid-request"),
            ("bad id", self.client.put("not-a-uuid", b"x", 9), 400, "invalid-request"),
            ("bad id get", self.client.get("not-a-uuid"), 400, "invalid-request"),
            ("unknown path", self.client.request("PUT", "/v1/nothing/" + m, b"x", {"Fencing-Token": "9"}), 404,
             "not-found"),
            ("advance not json", self.client.request("POST", "/v1/fence/advance", b"{nope",
                                                     {"Content-Type": "application/json"}), 400, "invalid-request"),
            ("advance no token", self.client.request("POST", "/v1/fence/advance", {"memory_instance_id": m}), 400,
             "invalid-request"),
            ("advance unknown field", self.client.request(
                "POST", "/v1/fence/advance", {"memory_instance_id": m, "fencing_token": 9, "x": 1}), 400,
             "invalid-request"),
            ("advance string token", self.client.request(
                "POST", "/v1/fence/advance", {"memory_instance_id": m, "fencing_token": "9"}), 400, "invalid-request"),
            ("advance as text", self.client.request(
                "POST", "/v1/fence/advance", json.dumps({"memory_instance_id": m, "fencing_token": 9}).encode(),
                {"Content-Type": "text/plain"}), 415, "unsupported-media-type"),
            ("no bearer", self.client.put(m, b"x", 9, token=False), 401, "unauthenticated"),
            ("wrong bearer", self.client.put(m, b"x", 9, token="mep_" + "0" * 64), 401, "unauthenticated"),
            ("wrong bearer get", self.client.get(m, token="mep_" + "0" * 64), 401, "unauthenticated"),
        ]
        for label, r, status, code in cases:
            with self.subTest(label):
                self.assertProblem(r, status, code)
        # Two Fencing-Token headers.
        with socket.create_connection((HOST, self.store.port), timeout=10) as s:
            s.sendall(b"PUT /v1/objects/%s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                      b"Fencing-Token: 9\r\nFencing-Token: 10\r\nContent-Length: 1\r\nConnection: close\r\n\r\nx"
                      % (m.encode(), self.token.encode()))
            reply = read_to_close(s)
        self.assertTrue(reply.startswith(b"HTTP/1.1 400 "), reply[:200])
        r = self.client.put(m, b"x", 9, token=False)
        self.assertIn("Bearer", r.header("WWW-Authenticate") or "")
        r = self.client.request("DELETE", "/v1/objects/" + m)
        self.assertProblem(r, 405, "method-not-allowed")
        self.assertEqual(r.header("Allow"), "PUT, GET, HEAD")
        self.assertEqual(self.client.get(m).body, b"good")
        self.assertEqual(self.state(m)["fencing_token"], 5)
        self.assertEqual(self.objects(), objects)

    def test_object_size_limit(self):
        self.store.stop()
        self.store = MepStore(self.workdir, self.data_dir,
                              ["--token-file", self.hashes, "--max-object-size", "64KiB"]).start()
        self.client = StoreClient(self.store.port, self.token)
        m = uuid7()
        self.assertEqual(self.client.put(m, b"k" * 65536, 1).status, 200)
        self.assertProblem(self.client.put(m, b"k" * 65537, 1), 413, "payload-too-large")
        # Chunked, so the limit is found while the body arrives.
        conn = http.client.HTTPConnection(HOST, self.store.port, timeout=30)
        conn.request("PUT", "/v1/objects/" + m, body=iter([b"c" * 40000, b"c" * 40000]),
                     headers={"Authorization": "Bearer " + self.token, "Fencing-Token": "1",
                              "Transfer-Encoding": "chunked"}, encode_chunked=True)
        res = conn.getresponse()
        self.assertEqual(res.status, 413)
        conn.close()
        self.assertEqual(self.client.get(m).body, b"k" * 65536)
        self.assertFiles(0)

    def test_options_refused_at_start(self):
        cases = [
            ([], "--token-file"),
            (["--strict"], "--control-plane"),
            (["--token-file", self.hashes, "--listen", "nowhere"], "--listen"),
            (["--token-file", self.hashes, "--listen", "0.0.0.0:0"], "TLS"),
            (["--token-file", os.path.join(self.workdir, "missing")], "cannot read"),
            (["--strict", "--control-plane", "http://example.com:1"], "loopback"),
        ]
        for args, needle in cases:
            with self.subTest(args=args):
                rc, out, err = run_mep(["store", "--dir", os.path.join(self.workdir, "other"), *args], check=False)
                self.assertEqual(rc, 2, err)
                self.assertIn(needle, err)
        bad = os.path.join(self.workdir, "bad.hashes")
        with open(bad, "w") as f:
            f.write("not a hash\n")
        rc, _, err = run_mep(["store", "--dir", os.path.join(self.workdir, "other"), "--token-file", bad], check=False)
        self.assertEqual(rc, 2)
        self.assertIn("mep token hash", err)

    def test_one_store_per_directory(self):
        rc, _, err = run_mep(["store", "--dir", self.data_dir, "--token-file", self.hashes, "--listen",
                              "127.0.0.1:0"], check=False)
        self.assertEqual(rc, 1)
        self.assertIn("another mep store is running", err)


class Concurrency(StoreCase):
    def test_interleaved_writers_history(self):
        # 32 clients PUT random tokens for one memory, with advances mixed in; every accepted
        # write's token is at least every token acknowledged before it, and the final bytes
        # are those of the highest accepted token (history.py, D1–D3).
        m = uuid7()
        history = History()
        stop = time.monotonic() + 4

        def worker(i):
            c = StoreClient(self.store.port, self.token)
            rng = random.Random(i)
            seq = 0
            while time.monotonic() < stop:
                token = rng.randint(1, 60)
                seq += 1
                start = history.begin()
                if rng.random() < 0.1:
                    r = c.advance(m, token)
                    history.record("advance", start, r.status, memory=m, token=token, body=r.json())
                    continue
                data = b"client %d write %d token %d" % (i, seq, token)
                r = c.put(m, data, token)
                history.record("write", start, r.status, memory=m, token=token, data=data,
                               body=r.json() if r.body else None)
            c.close()

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        g = self.client.get(m)
        final = {m: (int(g.header("Fencing-Token")), g.body)} if g.status == 200 else {}
        writes = [o for o in history.ops if o["kind"] == "write"]
        accepted = [o for o in writes if o["status"] == 200]
        refused = [o for o in writes if o["status"] == 409]
        self.assertGreater(len(accepted), 10)
        self.assertGreater(len(refused), 10)
        self.assertEqual(len(accepted) + len(refused), len(writes), {o["status"] for o in writes})
        self.assertEqual(history.check_data(final), [])
        self.assertFiles(0)

    def test_sigkill_during_bursts_of_small_writes(self):
        # 8 writers, each on its own memory with growing tokens; SIGKILL the store mid-burst.
        # After a restart every write answered 2xx is there: the object is at least as new.
        memories = [uuid7() for _ in range(8)]
        acked = {m: None for m in memories}
        sent = {m: {} for m in memories}
        lock = threading.Lock()
        go = threading.Event()

        def worker(m):
            c = StoreClient(self.store.port, self.token, timeout=10)
            token = 0
            while True:
                token += 1
                data = os.urandom(64) + b"%d" % token
                with lock:
                    sent[m][token] = data
                try:
                    r = c.put(m, data, token)
                except OSError:
                    return
                if r.status != 200:
                    return
                with lock:
                    acked[m] = token
                if token == 20:
                    go.set()

        threads = [threading.Thread(target=worker, args=(m,)) for m in memories]
        for t in threads:
            t.start()
        self.assertTrue(go.wait(30))
        time.sleep(0.3)
        self.store.kill()
        for t in threads:
            t.join(30)
        self.restart()
        for m in memories:
            g = self.client.get(m)
            self.assertEqual(g.status, 200, g)
            token = int(g.header("Fencing-Token"))
            self.assertGreaterEqual(token, acked[m], m)
            self.assertEqual(g.body, sent[m][token])
        self.assertFiles(0)  # no partial file left (these small objects live in the database)


class LargeObjects(StoreCase):
    SIZE = 256 << 20

    def test_256_mib_streamed_with_bounded_rss(self):
        m = uuid7()
        peak = [0]
        pid = self.store.proc.pid

        def sample(_sent):
            peak[0] = max(peak[0], rss_kib(pid))

        status, body = stream_put(self.store.port, self.token, m, 1, self.SIZE, on_progress=sample)
        self.assertEqual(status, 200, body[:300])
        self.assertEqual(json.loads(body)["size"], self.SIZE)
        # Download it, streamed, and compare digests.
        conn = http.client.HTTPConnection(HOST, self.store.port, timeout=120)
        conn.request("GET", "/v1/objects/" + m, headers={"Authorization": "Bearer " + self.token})
        res = conn.getresponse()
        self.assertEqual(res.status, 200)
        self.assertEqual(int(res.getheader("Content-Length")), self.SIZE)
        h = hashlib.sha256()
        while True:
            part = res.read(1 << 20)
            if not part:
                break
            h.update(part)
            peak[0] = max(peak[0], rss_kib(pid))
        conn.close()
        self.assertEqual(h.hexdigest(), pattern_sha256(m, 1, self.SIZE))
        if os.environ.get("MEP_TEST_SANITIZED"):
            # The object went through whole; the bound is what a sanitizer's shadow memory and
            # quarantine (ASan keeps freed blocks for 256 MiB) make meaningless.
            self.skipTest("the RSS bound does not hold under %s (store RSS peaked at %d KiB); the "
                          "streamed round trip was checked" % (os.environ["MEP_TEST_SANITIZED"], peak[0]))
        self.assertLess(peak[0], 64 * 1024, "store RSS peaked at %d KiB" % peak[0])

    def test_sigkill_during_a_256_mib_upload_keeps_the_previous_object(self):
        m = uuid7()
        previous = b"the previous object " * 10000  # 200 KB: a version file of its own
        self.assertEqual(self.client.put(m, previous, 1).status, 200)
        killed = threading.Event()

        def progress(sent):
            if sent >= 64 << 20 and not killed.is_set():
                self.store.kill()
                killed.set()

        try:
            stream_put(self.store.port, self.token, m, 2, self.SIZE, on_progress=progress)
        except OSError:
            pass
        self.assertTrue(killed.is_set())
        self.restart()
        g = self.client.get(m)
        self.assertEqual(g.status, 200)
        self.assertEqual(g.body, previous)
        self.assertEqual(g.header("Fencing-Token"), "1")
        self.assertFiles(1)  # the partial upload was removed at start


class FullDisk(unittest.TestCase):
    """The data directory on a 4 MiB tmpfs (root only: mount)."""

    def setUp(self):
        if os.geteuid() != 0 or not shutil.which("mount"):
            self.skipTest("needs root to mount a small tmpfs for the full-disk test")
        self.workdir = tempfile.mkdtemp(prefix="mep-store-full-")
        self.data_dir = os.path.join(self.workdir, "data")
        os.makedirs(self.data_dir)
        rc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", self.data_dir],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE).returncode
        if rc != 0:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.skipTest("mount -t tmpfs is not permitted here")
        self.token, self.hashes = new_store_token(self.workdir)
        self.store = MepStore(self.workdir, self.data_dir, ["--token-file", self.hashes]).start()
        self.client = StoreClient(self.store.port, self.token)

    def tearDown(self):
        self.client.close()
        self.store.stop()
        subprocess.run(["umount", "-l", self.data_dir])
        shutil.rmtree(self.workdir, ignore_errors=True)

    def test_full_disk_507_reads_work_nothing_lost(self):
        m = uuid7()
        good = os.urandom(1 << 20)
        self.assertEqual(self.client.put(m, good, 1).status, 200)
        # Fill the disk: an object larger than the space left.
        r = self.client.put(m, os.urandom(6 << 20), 2)
        self.assertIn(r.status, (507, 503), r)
        self.assertIn(r.code, ("insufficient-storage", "unavailable"))
        # Reads keep working and the previous object is intact; the fence did not move.
        g = self.client.get(m)
        self.assertEqual(g.status, 200)
        self.assertEqual(g.body, good)
        self.assertEqual(g.header("Fencing-Token"), "1")
        self.assertEqual(self.client.fence(m).json()["fencing_token"], 1)
        # The refused upload's bytes are gone, so writes that fit go through again.
        self.assertEqual(self.client.put(m, b"small", 2).status, 200)
        self.assertEqual(self.client.get(m).body, b"small")
        self.assertEqual(self.client.request("GET", "/healthz").status, 200)


class Strict(unittest.TestCase):
    """--strict: every write is verified with the control plane, with the writer's own
    token; tenants are kept apart by the control plane's answers."""

    def setUp(self):
        self.workdir = tempfile.mkdtemp(prefix="mep-store-strict-")
        self.db = os.path.join(self.workdir, "c.db")
        self.token_a = create_token(self.db, "tenant-a")
        self.token_b = create_token(self.db, "tenant-b")
        self.server = MepServer(self.workdir, self.db).start()
        cp = "http://%s:%d" % (HOST, self.server.port)
        self.store = MepStore(self.workdir, os.path.join(self.workdir, "data"),
                              ["--strict", "--control-plane", cp]).start()
        self.cp = self.server.client(self.token_a)
        self.a = StoreClient(self.store.port, self.token_a)
        self.b = StoreClient(self.store.port, self.token_b)

    def tearDown(self):
        for c in (self.a, self.b, self.cp):
            c.close()
        self.store.stop()
        self.server.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def claim(self, name, memory, owner="o1"):
        st, _, body, _ = self.cp.claim(name, memory, owner)
        self.assertEqual(st, 201, body)
        return body

    def test_write_needs_the_live_lease_token(self):
        memory = self.cp.new_memory()
        g1 = self.claim("strict-agent", memory)
        self.assertEqual(self.a.put(memory, b"v1", g1["fencing_token"]).status, 200)
        # Another tenant cannot read or write tenant A's memory.
        self.assertEqual(self.b.get(memory).status, 404)
        self.assertEqual(self.b.put(memory, b"intruder", g1["fencing_token"]).status, 404)
        # Released: the token no longer verifies (410), though the store's mark equals it.
        st, _, _, _ = self.cp.release("strict-agent", memory, g1["fencing_token"], "o1")
        self.assertEqual(st, 204)
        r = self.a.put(memory, b"after release", g1["fencing_token"])
        self.assertEqual(r.status, 410, r)
        self.assertEqual(r.code, "lease-expired")
        # A new grant: the old token is superseded (409 from the control plane).
        g2 = self.claim("strict-agent", memory, owner="o2")
        r = self.a.put(memory, b"zombie", g1["fencing_token"])
        self.assertEqual(r.status, 409, r)
        self.assertEqual(r.code, "stale-fence")
        # Shaped as the store's own refusal (SPEC §8), with the tokens presented and live.
        self.assertEqual((r.json()["presented_token"], r.json()["current_token"]),
                         (g1["fencing_token"], g2["fencing_token"]), r.json())
        self.assertEqual(self.a.put(memory, b"v2", g2["fencing_token"]).status, 200)
        self.assertEqual(self.a.get(memory).body, b"v2")
        # A token the control plane does not know: 401 from it.
        self.assertEqual(self.a.put(memory, b"x", g2["fencing_token"], token="mep_" + "1" * 64).status, 401)
        self.assertEqual(self.a.advance(memory, g2["fencing_token"]).status, 200)


if __name__ == "__main__":
    unittest.main()
