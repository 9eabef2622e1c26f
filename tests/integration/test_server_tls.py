"""mep server with --tls-cert/--tls-key: TLS 1.3 only, the whole API over it, and the
refusals (a half-given pair, an unreadable key, plain HTTP beyond loopback)."""
import json
import os
import socket
import ssl
import subprocess
import tempfile
import unittest
import uuid

from daemonfixture import Mepd, clean_env, mepd_bin
from storefixture import MepStore, StoreClient, new_store_token
from mephelpers import read_to_close, send_expecting_continue
from serverfixture import MepServer, create_token, db_url, drop_db, mep_bin, new_db, new_key, run_mep


def make_cert(directory):
    """A self-signed certificate for 127.0.0.1 (openssl req), returns (cert, key)."""
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                    "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", key, "-out", cert], check=True, capture_output=True, timeout=30)
    os.chmod(key, 0o600)
    return cert, key


def start_tls_server(cls, prefix):
    """For a test class: a temporary directory, a certificate for 127.0.0.1, a database with
    a lease token, and a mep server serving HTTPS with them, all ended with the class."""
    mep_bin()
    cls._tmp = tempfile.TemporaryDirectory(prefix=prefix)
    cls.addClassCleanup(cls._tmp.cleanup)
    cls.workdir = cls._tmp.name
    cls.cert, cls.key = make_cert(cls.workdir)
    cls.db_path = new_db(cls.workdir)
    cls.addClassCleanup(drop_db, cls.db_path)
    cls.token = create_token(cls.db_path, "tenant-tls", "lease")
    cls.server = MepServer(cls.workdir, cls.db_path, ["--tls-cert", cls.cert, "--tls-key", cls.key])
    cls.server.start()
    cls.addClassCleanup(cls.server.stop)


class TlsServer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        start_tls_server(cls, "mep-tls-")

    def context(self, maximum=None):
        ctx = ssl.create_default_context(cafile=self.cert)
        if maximum is not None:
            ctx.maximum_version = maximum
        return ctx

    def exchange(self, ctx, request, *, continue_body=None):
        """Sends `request` (bytes, with `Connection: close`) over TLS; returns (negotiated
        version, reply bytes). With `continue_body` the request expects a 100 first."""
        with socket.create_connection(("127.0.0.1", self.server.port), timeout=5) as raw:
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                if continue_body is None:
                    s.sendall(request)
                else:
                    send_expecting_continue(s, request, continue_body)
                return s.version(), read_to_close(s)

    def test_ready_line_says_https(self):
        self.assertIn("mep server listening on https://127.0.0.1:%d" % self.server.port, self.server.stderr_text())

    def test_tls13_serves_the_api(self):
        ctx = self.context()
        body = b"{}"
        req = (b"POST /v1/memories HTTP/1.1\r\nHost: mep\r\nAuthorization: Bearer " + self.token.encode() +
               b"\r\nContent-Type: application/json\r\nIdempotency-Key: " + new_key().encode() +
               b"\r\nContent-Length: 2\r\nConnection: close\r\n\r\n" + body)
        version, reply = self.exchange(ctx, req)
        self.assertEqual(version, "TLSv1.3")
        self.assertTrue(reply.startswith(b"HTTP/1.1 201 "), reply[:200])
        mem = json.loads(reply.partition(b"\r\n\r\n")[2])["memory_instance_id"]
        version, reply = self.exchange(ctx, b"GET /v1/memories/" + mem.encode() + b" HTTP/1.1\r\nHost: mep\r\n"
                                       b"Authorization: Bearer " + self.token.encode() + b"\r\nConnection: close\r\n\r\n")
        self.assertTrue(reply.startswith(b"HTTP/1.1 200 "), reply[:200])
        # A problem over TLS, HEAD, and Expect: 100-continue.
        version, reply = self.exchange(ctx, b"GET /v1/leases HTTP/1.1\r\nHost: mep\r\nConnection: close\r\n\r\n")
        self.assertTrue(reply.startswith(b"HTTP/1.1 401 "), reply[:200])
        self.assertIn(b"application/problem+json", reply.lower())
        version, reply = self.exchange(ctx, b"HEAD /healthz HTTP/1.1\r\nHost: mep\r\nConnection: close\r\n\r\n")
        self.assertTrue(reply.startswith(b"HTTP/1.1 200 "), reply[:200])
        self.assertTrue(reply.endswith(b"\r\n\r\n"), reply)
        req = (b"POST /v1/memories HTTP/1.1\r\nHost: mep\r\nAuthorization: Bearer " + self.token.encode() +
               b"\r\nContent-Type: application/json\r\nIdempotency-Key: " + new_key().encode() +
               b"\r\nExpect: 100-continue\r\nContent-Length: 2\r\nConnection: close\r\n\r\n")
        version, reply = self.exchange(ctx, req, continue_body=b"{}")
        self.assertTrue(reply.startswith(b"HTTP/1.1 201 "), reply[:200])

    def test_tls12_is_refused(self):
        with self.assertRaises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
            self.exchange(self.context(maximum=ssl.TLSVersion.TLSv1_2),
                          b"GET /healthz HTTP/1.1\r\nHost: mep\r\nConnection: close\r\n\r\n")
        self.assertTrue(self.server.running())

    def test_plain_http_on_the_tls_port_gets_no_answer(self):
        with socket.create_connection(("127.0.0.1", self.server.port), timeout=5) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: mep\r\n\r\n")
            try:
                data = read_to_close(s)
            except (ConnectionResetError, socket.timeout):
                data = b""
        self.assertNotIn(b"HTTP/1.1 200", data)
        self.assertTrue(self.server.running())
        version, reply = self.exchange(self.context(), b"GET /healthz HTTP/1.1\r\nHost: mep\r\nConnection: close\r\n\r\n")
        self.assertTrue(reply.startswith(b"HTTP/1.1 200 "), reply[:200])


class DaemonOverTls(unittest.TestCase):
    """mepd talks to an https:// control plane whose certificate a private CA issued: it
    trusts what --ca-file (or MEP_CA_FILE, or the config's ca_file) holds; without it,
    or with another CA's, the server is not trusted and nothing is granted."""

    @classmethod
    def setUpClass(cls):
        mepd_bin()
        start_tls_server(cls, "mep-tls-daemon-")
        other = os.path.join(cls.workdir, "other")
        os.makedirs(other)
        cls.other_cert, _ = make_cert(other)
        cls.url = "https://127.0.0.1:%d" % cls.server.port

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="d-", dir=self.workdir)
        self.env = clean_env(self.tmp)

    def daemon(self, tag, extra=(), env=None, url=None):
        d = Mepd(self.tmp, env or self.env, control_plane=url or self.url, token=self.token, tag=tag,
                 extra_args=extra)
        self.addCleanup(d.stop)
        return d.start()

    def mep(self, d, *args):
        return subprocess.run([mep_bin(), "--socket", d.socket_path, *args], capture_output=True, text=True,
                              env=self.env, cwd=self.tmp, timeout=60)

    def test_a_private_ca_given_with_ca_file_is_trusted(self):
        for how, d in (("--ca-file", self.daemon("flag", ["--ca-file", self.cert])),
                       ("MEP_CA_FILE", self.daemon("env", env=dict(self.env, MEP_CA_FILE=self.cert)))):
            with self.subTest(how):
                path = os.path.join(self.tmp, d.tag + ".uai")
                p = self.mep(d, "init", path)
                self.assertEqual(p.returncode, 0, p.stderr)
                p = self.mep(d, "--json", "claim", "tls-" + d.tag, path)
                self.assertEqual(p.returncode, 0, p.stderr)
                self.assertEqual(json.loads(p.stdout)["fencing_token"], 1)
                self.assertEqual(self.mep(d, "release", "tls-" + d.tag).returncode, 0)

    def test_without_the_ca_or_with_another_or_by_another_name_the_server_is_not_trusted(self):
        # Each says why in libcurl's own words (it said "SSL peer certificate or SSH remote
        # key was not OK" for all three).
        localhost = "https://localhost:%d" % self.server.port
        for i, (how, extra, url, why) in enumerate((
                ("system CAs", [], None, "SSL certificate problem"),
                ("another CA", ["--ca-file", self.other_cert], None, "SSL certificate problem"),
                ("another name", ["--ca-file", self.cert], localhost, "localhost"))):
            with self.subTest(how):
                d = self.daemon("untrusted-%d" % i, extra, url=url)
                path = os.path.join(self.tmp, d.tag + ".uai")
                p = self.mep(d, "init", path)
                self.assertEqual(p.returncode, 5, p.stdout + p.stderr)  # unavailable: nothing made
                self.assertFalse(os.path.exists(path))
                self.assertIn(why, p.stderr)
                self.assertNotIn("SSH", p.stderr)

    def test_a_strict_store_trusts_the_ca_its_given(self):
        # mep store --strict asks the control plane about every token; it had no way to trust
        # a private CA (every request 503 "could not confirm the token").
        memory = str(uuid.uuid4())
        for how, extra, status in (("--ca-file", ["--ca-file", self.cert], 404), ("system CAs", [], 503)):
            with self.subTest(how):
                store = MepStore(self.tmp, os.path.join(self.tmp, "store-%d" % len(extra)),
                                 ["--strict", "--control-plane", self.url, *extra]).start()
                self.addCleanup(store.stop)
                client = StoreClient(store.port, self.token)
                self.addCleanup(client.close)
                r = client.fence(memory)  # the token is checked first: then there is no such fence
                self.assertEqual(r.status, status, r)
                if status == 503:
                    self.assertIn("SSL certificate problem", r.json()["detail"])

    def test_a_tls_store_is_trusted_through_the_same_ca_file(self):
        # mepd's data-plane client takes --ca-file too: the fence is advanced over TLS at the
        # grant and sync uploads over it. A bundle without the store's CA: the grant is given
        # back (503 store-unavailable, exit 5).
        store_dir = os.path.join(self.tmp, "store-cert")
        os.makedirs(store_dir)
        store_cert, store_key = make_cert(store_dir)
        both = os.path.join(self.tmp, "both.pem")
        with open(both, "w") as out:
            for pem in (self.cert, store_cert):
                with open(pem) as f:
                    out.write(f.read())
        _, hashes = new_store_token(self.tmp)
        store = MepStore(self.tmp, os.path.join(self.tmp, "tls-store"),
                         ["--token-file", hashes, "--tls-cert", store_cert, "--tls-key", store_key]).start()
        self.addCleanup(store.stop)
        store_args = ["--store", "https://127.0.0.1:%d" % store.port,
                      "--store-token-file", os.path.join(self.tmp, "store.token")]
        for i, (bundle, status) in enumerate(((both, 0), (self.cert, 5))):
            with self.subTest(bundle=os.path.basename(bundle)):
                d = self.daemon("store-%d" % i, ["--ca-file", bundle, *store_args])
                path = os.path.join(self.tmp, d.tag + ".uai")
                p = self.mep(d, "init", path)
                self.assertEqual(p.returncode, 0, p.stderr)
                p = self.mep(d, "claim", "tls-store-%d" % i, path)
                self.assertEqual(p.returncode, status, p.stdout + p.stderr)
                if status == 0:
                    with open(path, "w") as f:
                        f.write("over TLS\n")
                    p = self.mep(d, "--json", "sync", "tls-store-%d" % i)
                    self.assertEqual(p.returncode, 0, p.stderr)
                    self.assertEqual(json.loads(p.stdout)["size"], len("over TLS\n"))

    def test_a_ca_file_that_is_not_one_is_a_usage_error(self):
        not_pem = os.path.join(self.tmp, "not.pem")
        with open(not_pem, "w") as f:
            f.write("hello\n")
        for path, words in ((not_pem, "no PEM certificate"), (os.path.join(self.tmp, "missing.pem"), "cannot read")):
            with self.subTest(path):
                p = subprocess.run([mepd_bin(), "--socket", os.path.join(self.tmp, "x.sock"), "--state-dir",
                                    os.path.join(self.tmp, "x-state"), "--control-plane", self.url, "--ca-file", path],
                                   capture_output=True, text=True, env=dict(self.env, MEP_TOKEN=self.token), timeout=30)
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn("--ca-file", p.stderr)
                self.assertIn(words, p.stderr)


class TlsRefusals(unittest.TestCase):
    """Configurations the server refuses at start, each with one line and exit 2 or 1."""

    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory(prefix="mep-tls-")
        self.addCleanup(self._tmp.cleanup)
        self.dir = self._tmp.name
        self.db = os.path.join(self.dir, "c.db")

    def server(self, *args):
        return run_mep(["server", "--db", db_url(self.db), "--listen", "127.0.0.1:0", *args], check=False)

    def test_cert_without_key(self):
        cert, _ = make_cert(self.dir)
        rc, _, err = self.server("--tls-cert", cert)
        self.assertEqual(rc, 2, err)
        self.assertIn("--tls-cert and --tls-key go together", err)

    def test_unreadable_key(self):
        cert, _ = make_cert(self.dir)
        rc, _, err = self.server("--tls-cert", cert, "--tls-key", os.path.join(self.dir, "missing.pem"))
        self.assertNotEqual(rc, 0, err)
        self.assertEqual(len(err.strip().splitlines()), 1, err)
        self.assertNotIn("listening", err)

    def test_plain_http_beyond_loopback_is_refused(self):
        rc, _, err = run_mep(["server", "--db", db_url(self.db), "--listen", "0.0.0.0:0"], check=False)
        self.assertEqual(rc, 2, err)
        self.assertIn("--insecure-plaintext", err)


if __name__ == "__main__":
    unittest.main()
