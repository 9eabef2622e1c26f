"""Harness for the control-plane integration tests (SPEC §6): starts the real `mep server`
on a fresh database (a SQLite file, or a PostgreSQL database when $MEP_TEST_BACKEND is
`postgresql`: see pgfixture.py) and a free loopback port, creates bearer tokens with
`mep token create`, talks HTTP/1.1 with keep-alive, and reads the database read-only.

Standard library only. Every wait is bounded; every process started here is ended by its
PID (SIGTERM, then SIGKILL after a timeout), also when a test fails or the interpreter exits.
"""
import atexit
import calendar
import http.client
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.parse
import uuid

import pgfixture
from mephelpers import mep_bin

HOST = "127.0.0.1"
PROBLEM_BASE = "https://memoryendpoints.com/problems/"
READY_TIMEOUT_S = 30      # start-up: open and migrate the database, bind, print the ready line
STOP_TIMEOUT_S = 10       # SIGTERM → exit; the server drains for at most 5 s
COMMAND_TIMEOUT_S = 60    # `mep token …`, `mep server audit`
HTTP_TIMEOUT_S = 30       # one request/response on a socket

UUID_RE = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
HEX64_RE = re.compile(r"^[0-9a-f]{64}$")
RFC3339_MS_RE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$")


def uuid7():
    """A fresh UUIDv7 string (RFC 9562: 48-bit Unix ms, version 7, variant 10, random)."""
    ms = int(time.time() * 1000) & ((1 << 48) - 1)
    rand = int.from_bytes(os.urandom(10), "big")
    rand_a = (rand >> 62) & 0xFFF
    rand_b = rand & ((1 << 62) - 1)
    value = (ms << 80) | (0x7 << 76) | (rand_a << 64) | (0b10 << 62) | rand_b
    return str(uuid.UUID(int=value))


def unique_name(prefix="agent"):
    """A valid, single-script (Latin + ASCII digits) agent name nobody else uses."""
    return "%s-%s" % (prefix, uuid.uuid4().hex[:16])


def new_key():
    return "k-" + uuid.uuid4().hex


def parse_rfc3339_ms(text):
    """'2026-07-14T19:12:50.123Z' → Unix milliseconds (int)."""
    assert RFC3339_MS_RE.match(text), "not an RFC 3339 UTC timestamp with ms: %r" % text
    secs = calendar.timegm(time.strptime(text[:19], "%Y-%m-%dT%H:%M:%S"))
    return secs * 1000 + int(text[20:23])


# ---- processes ------------------------------------------------------------------------------

_LIVE_PIDS = set()


def _kill_leftovers():
    for pid in list(_LIVE_PIDS):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


atexit.register(_kill_leftovers)


def run_mep(args, timeout=COMMAND_TIMEOUT_S, check=True):
    """Runs `mep ARGS…` to completion (bounded); returns (rc, stdout str, stderr str)."""
    proc = subprocess.Popen([mep_bin(), *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _LIVE_PIDS.add(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)
        raise AssertionError("mep %s did not finish within %d s" % (" ".join(args), timeout))
    finally:
        _LIVE_PIDS.discard(proc.pid)
    out_s, err_s = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    if check and proc.returncode != 0:
        raise AssertionError("mep %s exited %d: %s" % (" ".join(args), proc.returncode, err_s))
    return proc.returncode, out_s, err_s


def new_db(workdir, filename="c.db"):
    """A fresh database for the backend under test: a SQLite path in `workdir`, a new
    PostgreSQL database (pgfixture.PgDb), or a new database on the Spanner emulator
    (spannerfixture.SpannerDb); drop() the last two when done."""
    if pgfixture.backend() == "postgresql":
        return pgfixture.PgDb()
    if pgfixture.backend() == "spanner":
        import spannerfixture
        return spannerfixture.SpannerDb()
    return os.path.join(workdir, filename)


def db_url(db):
    """What `--db` takes for a database from new_db()."""
    return "sqlite:" + db if isinstance(db, str) else db.url


def drop_db(db):
    if not isinstance(db, str):
        db.drop()


def create_token(db_path, tenant, scope="lease"):
    """`mep token create` → the bearer token (creates the database and tenant if needed)."""
    _, out, _ = run_mep(["token", "create", "--db", db_url(db_path), "--tenant", tenant,
                         "--scope", scope])
    token = out.strip()
    assert token and "\n" not in token, "unexpected token output %r" % out
    return token


def token_id_of(db_path, tenant):
    """The ids of a tenant's tokens, oldest first, via `mep token list --json`."""
    _, out, _ = run_mep(["token", "list", "--db", db_url(db_path), "--tenant", tenant, "--json"])
    return [t["token_id"] for t in json.loads(out)["tokens"]]


def revoke_token(db_path, token_id):
    run_mep(["token", "revoke", "--db", db_url(db_path), token_id])


class MepServer:
    """One `mep server` process on `--listen 127.0.0.1:0`. stderr is kept in a file."""

    READY_RE = re.compile(rb"^mep server listening on https?://127\.0\.0\.1:(\d+)\r?$", re.M)
    _counter = 0

    def __init__(self, workdir, db_path, extra_args=(), wrap=None):
        self.workdir = workdir
        self.db_path = db_path
        self.extra_args = list(extra_args)
        self.wrap = wrap  # argv -> argv: a command the server runs under (which must exec it)
        MepServer._counter += 1
        self.log_path = os.path.join(workdir, "server-%d.stderr" % MepServer._counter)
        self.out_path = os.path.join(workdir, "server-%d.stdout" % MepServer._counter)
        self.proc = None
        self.port = None
        self.returncode = None

    @property
    def pid(self):
        return self.proc.pid

    def start(self, timeout=READY_TIMEOUT_S):
        argv = [mep_bin(), "server", "--db", db_url(self.db_path), "--listen", HOST + ":0",
                *self.extra_args, *os.environ.get("MEP_TEST_SERVER_ARGS", "").split()]
        if self.wrap:
            argv = self.wrap(argv)
        with open(self.log_path, "wb") as err, open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                         start_new_session=True)
        _LIVE_PIDS.add(self.proc.pid)
        deadline = time.monotonic() + timeout
        while True:
            m = self.READY_RE.search(self.stderr_bytes())
            if m:
                self.port = int(m.group(1))
                return self
            if self.proc.poll() is not None:
                self._forget()
                raise AssertionError("mep server exited with %s before it was ready:\n%s"
                                     % (self.proc.returncode, self.stderr_text()))
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError("mep server printed no ready line within %d s:\n%s"
                                     % (timeout, self.stderr_text()))
            time.sleep(0.02)

    def stderr_bytes(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return b""

    def stderr_text(self):
        return self.stderr_bytes().decode("utf-8", "replace")

    def running(self):
        return self.proc is not None and self.proc.poll() is None

    def _forget(self):
        _LIVE_PIDS.discard(self.proc.pid)
        self.returncode = self.proc.returncode

    def stop(self, timeout=STOP_TIMEOUT_S):
        """SIGTERM by PID, wait (bounded), then SIGKILL. Returns the exit status (negative
        for a signal, as subprocess reports it); idempotent."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._forget()
        return self.returncode

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        if self.proc is not None:
            self._forget()

    def client(self, token=None):
        return ApiClient(self.port, token)


# ---- HTTP -----------------------------------------------------------------------------------

class Response:
    """status, headers (http.client.HTTPMessage: case-insensitive get/get_all), json (parsed
    body or None), raw (bytes)."""

    def __init__(self, status, headers, body, raw):
        self.status = status
        self.headers = headers
        self.json = body
        self.raw = raw

    def __iter__(self):  # (status, headers, json, raw)
        return iter((self.status, self.headers, self.json, self.raw))

    def header(self, name):
        return self.headers.get(name)

    @property
    def code(self):
        return self.json.get("code") if isinstance(self.json, dict) else None

    def __repr__(self):
        return "<Response %d %s>" % (self.status, self.raw[:600])


_USE_DEFAULT = object()


class Client:
    """One keep-alive HTTP/1.1 connection to the server (reconnects when it was closed)."""

    def __init__(self, port, token=None, timeout=HTTP_TIMEOUT_S):
        self.port = port
        self.token = token
        self.timeout = timeout
        self.conn = None

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def request(self, method, path, body=None, *, token=_USE_DEFAULT, idem=None, headers=None,
                content_type="application/json", retry=True):
        """Sends one request. `body`: dict/list (JSON-encoded), bytes or str (sent as is) or
        None. `headers`: dict or list of (name, value) pairs (repeats allowed). Returns a
        Response. A connection the server closed while idle is reopened once."""
        if isinstance(body, (dict, list)):
            data = json.dumps(body, ensure_ascii=False).encode("utf-8")
        elif isinstance(body, str):
            data = body.encode("utf-8")
        else:
            data = body
        pairs = []
        tok = self.token if token is _USE_DEFAULT else token
        if tok is not None:
            pairs.append(("Authorization", "Bearer " + tok))
        if idem is not None:
            pairs.append(("Idempotency-Key", idem))
        if data is not None and content_type is not None:
            pairs.append(("Content-Type", content_type))
        if headers:
            pairs.extend(headers.items() if isinstance(headers, dict) else headers)
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(HOST, self.port, timeout=self.timeout)
            try:
                self.conn.putrequest(method, path, skip_accept_encoding=True)
                for k, v in pairs:
                    self.conn.putheader(k, v)
                if data is not None:
                    self.conn.putheader("Content-Length", str(len(data)))
                self.conn.endheaders(data)
                resp = self.conn.getresponse()
                raw = resp.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError,
                    http.client.CannotSendRequest, http.client.ResponseNotReady):
                self.close()
                if attempt == 0 and retry:
                    continue
                raise
            if resp.will_close:
                self.close()
            ctype = (resp.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            parsed = None
            if raw and ctype in ("application/json", "application/problem+json"):
                try:
                    parsed = json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, ValueError):
                    parsed = None
            return Response(resp.status, resp.headers, parsed, raw)
        raise AssertionError("unreachable")

    def get(self, path, **kw):
        return self.request("GET", path, **kw)

    def post(self, path, body=None, **kw):
        return self.request("POST", path, body, **kw)


class ApiClient(Client):
    """The control-plane calls of SPEC §6 with sensible defaults."""

    def register(self, memory_id=None, key=None, **kw):
        body = {} if memory_id is None else {"memory_instance_id": memory_id}
        return self.post("/v1/memories", body, idem=key or new_key(), **kw)

    def new_memory(self):
        r = self.register()
        assert r.status == 201, r
        return r.json["memory_instance_id"]

    def claim(self, name, memory_id, owner, ttl=None, key=None, **kw):
        body = {"display_name": name, "memory_instance_id": memory_id, "owner_client_id": owner}
        if ttl is not None:
            body["ttl_seconds"] = ttl
        return self.post("/v1/leases", body, idem=key or new_key(), **kw)

    def renew(self, name, memory_id, token, owner, ttl=None, **kw):
        body = {"canonical_name": name, "memory_instance_id": memory_id, "fencing_token": token,
                "owner_client_id": owner}
        if ttl is not None:
            body["ttl_seconds"] = ttl
        return self.post("/v1/leases/renew", body, **kw)

    def release(self, name, memory_id, token, owner, **kw):
        body = {"canonical_name": name, "memory_instance_id": memory_id, "fencing_token": token,
                "owner_client_id": owner}
        return self.post("/v1/leases/release", body, **kw)

    def branch(self, parent, token, memory_id=None, key=None, **kw):
        body = {"parent_memory_instance_id": parent, "parent_fencing_token": token}
        if memory_id is not None:
            body["memory_instance_id"] = memory_id
        return self.post("/v1/memories/branch", body, idem=key or new_key(), **kw)

    def verify(self, memory_id, token, **kw):
        return self.post("/v1/fence/verify", {"memory_instance_id": memory_id, "fencing_token": token}, **kw)

    def get_lease(self, name, **kw):
        return self.get("/v1/leases/" + urllib.parse.quote(name, safe=""), **kw)


def raw_exchange(port, data, timeout=10.0, send_all=True, chunk=65536):
    """Sends raw bytes on a fresh socket and reads until the server closes it or a whole
    response (headers + Content-Length body) arrived, within `timeout` seconds in total.
    Returns (status or None, head bytes, body bytes, closed_by_server). Sending errors (the
    server may close early, e.g. after a 413) are ignored: the response is what counts."""
    deadline = time.monotonic() + timeout
    s = socket.create_connection((HOST, port), timeout=timeout)
    buf = b""
    closed = False
    try:
        s.settimeout(0.05)
        view = memoryview(data)
        sent = 0
        # Interleave sending and receiving so a server that answers early (413) is heard.
        while True:
            if sent < len(view) and send_all:
                try:
                    sent += s.send(view[sent:sent + chunk])
                except (socket.timeout, BlockingIOError):
                    pass  # the send buffer is full: read, then try again
                except (BrokenPipeError, ConnectionResetError):
                    send_all = False  # the server stopped reading; its answer is what counts
            try:
                part = s.recv(65536)
                if not part:
                    closed = True
                    break
                buf += part
            except socket.timeout:
                pass
            except ConnectionResetError:
                closed = True
                break
            status, head, body = _split_response(buf)
            if status is not None and body is not None:
                break
            if time.monotonic() > deadline:
                break
    finally:
        s.close()
    status, head, body = _split_response(buf)
    if status is None and buf.startswith(b"HTTP/"):
        try:
            status = int(buf.split(b" ", 2)[1])
        except (IndexError, ValueError):
            status = None
    return status, head, body if body is not None else buf.partition(b"\r\n\r\n")[2], closed


def _split_response(buf):
    """(status, head, body) when `buf` holds a complete response, else (status?, head?, None)."""
    if b"\r\n\r\n" not in buf:
        return None, None, None
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    try:
        status = int(lines[0].split(b" ", 2)[1])
    except (IndexError, ValueError):
        return None, head, None
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    if len(rest) < length:
        return status, head, None
    return status, head, rest[:length]


def head_header(head, name):
    """A header value from raw response head bytes (first match), or None."""
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == name.lower().encode():
            return v.strip().decode("latin-1")
    return None


# ---- the database, read-only ----------------------------------------------------------------

def db_connect_ro(db_path):
    uri = "file:" + urllib.parse.quote(os.path.abspath(db_path)) + "?mode=ro"
    conn = sqlite3.connect(uri, uri=True, timeout=10)
    conn.execute("PRAGMA busy_timeout = 10000")
    return conn


def db_query(db_path, sql, params=()):
    if not isinstance(db_path, str):
        return db_path.query(sql, params)
    conn = db_connect_ro(db_path)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def db_execute(db_path, sql):
    """Runs one writing statement (no parameters) behind the server's back: SQLite in its
    own transaction (waiting up to 10 s for the server's writer), or psql."""
    if not isinstance(db_path, str):
        db_path.execute(sql)
        return
    conn = sqlite3.connect(db_path, timeout=10)
    try:
        with conn:
            conn.execute(sql)
    finally:
        conn.close()


def db_snapshot(db_path, ignore_auth_failures=True):
    """Every row of every table, sorted, as {table: [row, …]} (one read transaction).
    AUTH_FAILED audit rows are left out when asked: a rejected token may be audited. The
    lease clock's checkpoint (a settings row the sweeper rewrites every second) is left
    out: it is the server's own bookkeeping, not something a request changed."""
    if not isinstance(db_path, str):
        return db_path.snapshot(ignore_auth_failures)
    conn = db_connect_ro(db_path)
    try:
        conn.execute("BEGIN")
        tables = [r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name")]
        snap = {}
        for t in tables:
            rows = conn.execute('SELECT * FROM "%s"' % t.replace('"', '""')).fetchall()
            if t == "audit_events" and ignore_auth_failures:
                cols = [d[0] for d in conn.execute('SELECT * FROM audit_events LIMIT 0').description]
                i = cols.index("event_type")
                rows = [r for r in rows if r[i] != "AUTH_FAILED"]
            if t == "settings":
                rows = [r for r in rows if r[0] != "lease_clock_checkpoint"]
            snap[t] = sorted(rows, key=repr)
        conn.execute("COMMIT")
        return snap
    finally:
        conn.close()


# ---- test case base -------------------------------------------------------------------------

class ServerTestCase(unittest.TestCase):
    """Starts one server per test class on a fresh database in a temporary directory, with
    tokens for tenant A (lease and admin scope) and tenant B (lease). Prints the server's
    stderr when a test fails; stops the server and removes the directory afterwards."""

    server_args = ()

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        mep_bin()
        cls._tmp = tempfile.TemporaryDirectory(prefix="mep-it-")
        cls.addClassCleanup(cls._tmp.cleanup)
        cls.workdir = cls._tmp.name
        cls.db_path = new_db(cls.workdir)
        cls.addClassCleanup(drop_db, cls.db_path)
        cls.token_a = create_token(cls.db_path, "tenant-a", "lease")
        cls.admin_a = create_token(cls.db_path, "tenant-a", "admin")
        cls.token_b = create_token(cls.db_path, "tenant-b", "lease")
        cls.server = MepServer(cls.workdir, cls.db_path, cls.server_args)
        cls.server.start()
        cls.addClassCleanup(cls.server.stop)
        cls.port = cls.server.port

    def setUp(self):
        self._clients = []

    def tearDown(self):
        for c in self._clients:
            c.close()

    def client(self, token=_USE_DEFAULT):
        c = ApiClient(self.port, self.token_a if token is _USE_DEFAULT else token)
        self._clients.append(c)
        return c

    def run(self, result=None):
        before = (len(result.failures) + len(result.errors)) if result is not None else 0
        out = super().run(result)
        if result is not None and len(result.failures) + len(result.errors) > before:
            srv = getattr(type(self), "server", None)
            if srv is not None:
                text = srv.stderr_text()
                sys.stderr.write("\n---- mep server stderr (%s, last 8000 chars) ----\n%s\n---- end ----\n"
                                 % (srv.log_path, text[-8000:]))
        return out

    # -- assertions --

    def assertProblem(self, resp, status, code=None, replay=False):
        """An RFC 9457 problem with the shape of SPEC §6: type, title, status, detail,
        instance == X-Request-Id (not for replays, whose body is the original's), code."""
        msg = repr(resp)
        self.assertEqual(resp.status, status, msg)
        ctype = (resp.header("Content-Type") or "").split(";")[0].strip()
        self.assertEqual(ctype, "application/problem+json", msg)
        body = resp.json
        self.assertIsInstance(body, dict, msg)
        for k in ("type", "title", "status", "detail", "instance", "code"):
            self.assertIn(k, body, msg)
        self.assertEqual(body["status"], status, msg)
        self.assertEqual(body["type"], PROBLEM_BASE + body["code"], msg)
        self.assertIsInstance(body["title"], str, msg)
        self.assertTrue(body["title"], msg)
        self.assertIsInstance(body["detail"], str, msg)
        if code is not None:
            self.assertEqual(body["code"], code, msg)
        rid = resp.header("X-Request-Id")
        self.assertTrue(rid, msg)
        if not replay:
            self.assertEqual(body["instance"], rid, msg)
        return body

    def assertRetryAfter(self, resp, max_s=None):
        ra = resp.header("Retry-After")
        self.assertIsNotNone(ra, "no Retry-After: %r" % resp)
        self.assertRegex(ra, r"^\d+$")
        self.assertGreaterEqual(int(ra), 1)
        if max_s is not None:
            self.assertLessEqual(int(ra), max_s)
        return int(ra)

    def assertStatus(self, resp, status):
        self.assertEqual(resp.status, status, repr(resp))
