"""mep server with --tls-cert/--tls-key: TLS 1.3 only, the whole API over it, and the
refusals (a half-given pair, an unreadable key, plain HTTP beyond loopback)."""
import json
import os
import socket
import ssl
import subprocess
import tempfile
import unittest

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


class TlsServer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        mep_bin()
        cls._tmp = tempfile.TemporaryDirectory(prefix="mep-tls-")
        cls.addClassCleanup(cls._tmp.cleanup)
        cls.workdir = cls._tmp.name
        cls.cert, cls.key = make_cert(cls.workdir)
        cls.db_path = new_db(cls.workdir)
        cls.addClassCleanup(drop_db, cls.db_path)
        cls.token = create_token(cls.db_path, "tenant-tls", "lease")
        cls.server = MepServer(cls.workdir, cls.db_path, ["--tls-cert", cls.cert, "--tls-key", cls.key])
        cls.server.start()
        cls.addClassCleanup(cls.server.stop)

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
