"""Harness for the mepd integration tests: real `mep server` and `mepd` processes in private
temporary directories, an HTTP client over the daemon's Unix socket, an NDJSON event
reader and a recording TCP proxy. Standard library only.

Every wait is bounded; every process is stopped by its PID (SIGCONT, SIGTERM, then SIGKILL).
"""
import datetime
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import unittest

import pgfixture
from mephelpers import mep_bin

START_TIMEOUT_S = 30
STOP_GRACE_S = 5
REQUEST_TIMEOUT_S = 20


def mepd_bin():
    """The mepd binary from $MEPD_BIN (ctest sets it); skips the test when it is unset."""
    path = os.environ.get("MEPD_BIN")
    if not path:
        raise unittest.SkipTest("MEPD_BIN is not set (run through ctest)")
    return path


def clean_env(home):
    """The caller's environment without MEP_* settings, with HOME and the XDG directories
    inside `home`, so no process reads or writes the real user's files."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEP_") and not k.startswith("XDG_")}
    env["HOME"] = home
    env["XDG_CONFIG_HOME"] = os.path.join(home, "config")
    env["XDG_STATE_HOME"] = os.path.join(home, "state")
    env["XDG_RUNTIME_DIR"] = os.path.join(home, "run")
    for d in ("config", "state", "run"):
        os.makedirs(os.path.join(home, d), mode=0o700, exist_ok=True)
    return env


def parse_time(s):
    """RFC 3339 UTC timestamp → aware datetime."""
    return datetime.datetime.fromisoformat(s.replace("Z", "+00:00"))


# ---- processes ------------------------------------------------------------------------------

try:
    import ctypes
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (ImportError, OSError, AttributeError):
    _prctl = None
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid):
    """preexec_fn: the child gets SIGKILL if this test process dies (e.g. a ctest timeout),
    so no daemon or server outlives its test."""
    def fn():
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)
    return fn



class Proc:
    """One child process whose stdout and stderr go to a log file."""

    def __init__(self, label, argv, env, log_path, cwd=None):
        self.label = label
        self.argv = argv
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
                                      env=env, cwd=cwd, preexec_fn=_die_with_parent(os.getpid()))
        self.pid = self.popen.pid

    def alive(self):
        return self.popen.poll() is None

    def log_text(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def wait_for_log(self, pattern, timeout=START_TIMEOUT_S):
        """Waits until a log line matches `pattern` (regex); returns the match."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = rx.search(self.log_text())
            if m:
                return m
            if not self.alive():
                raise AssertionError("%s exited with %s before logging %r:\n%s"
                                     % (self.label, self.popen.returncode, pattern, self.log_text()))
            time.sleep(0.02)
        raise AssertionError("%s did not log %r within %ss:\n%s" % (self.label, pattern, timeout, self.log_text()))

    def signal(self, sig):
        if self.alive():
            os.kill(self.pid, sig)

    def kill9(self):
        """SIGKILL and reap."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        self.popen.wait(timeout=STOP_GRACE_S)
        self._log.close()

    def stop(self):
        """SIGCONT (in case it was stopped), SIGTERM, SIGKILL after a grace; always reaps."""
        if self.alive():
            try:
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.popen.wait(timeout=STOP_GRACE_S)
        self._log.close()


class MepServer:
    """A real `mep server` on 127.0.0.1 (free port) with its own database: a SQLite file, or
    a fresh PostgreSQL database when $MEP_TEST_BACKEND is `postgresql` (pgfixture.py; it
    lives as long as the test cluster)."""

    _started = 0

    def __init__(self, workdir, env, log_level="info", db=None):
        """`db`: another server's database URL, to serve it too (PostgreSQL); else a new one."""
        self.workdir = workdir
        self.env = env
        self.pgdb = None  # a database of the backend under test (PostgreSQL or Spanner), when not SQLite
        if db is None and pgfixture.backend() == "postgresql":
            self.pgdb = pgfixture.PgDb()
        elif db is None and pgfixture.backend() == "spanner":
            import spannerfixture
            self.pgdb = spannerfixture.SpannerDb()
        self.db = db or (self.pgdb.url if self.pgdb else "sqlite:" + os.path.join(workdir, "control.db"))
        self.log_level = log_level
        self.proc = None
        self.port = None
        self.logs = []  # every Proc this server ran (restarts keep the old logs)

    def start(self):
        MepServer._started += 1  # servers may share a workdir: each start its own log
        log = os.path.join(self.workdir, "server-%d.log" % MepServer._started)
        self.proc = Proc("mep server", [mep_bin(), "server", "--db", self.db, "--listen", "127.0.0.1:0",
                                        "--log-level", self.log_level], self.env, log, cwd=self.workdir)
        self.logs.append(self.proc)
        m = self.proc.wait_for_log(r"mep server listening on http://127\.0\.0\.1:(\d+)")
        self.port = int(m.group(1))
        return self

    @property
    def url(self):
        return "http://127.0.0.1:%d" % self.port

    def token(self, tenant, admin=False):
        """A new bearer token for `tenant` (created if new), via `mep token create`."""
        argv = [mep_bin(), "token", "create", "--db", self.db, "--tenant", tenant, "--json"]
        if admin:
            argv.append("--admin")
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env,
                           timeout=REQUEST_TIMEOUT_S, check=False)
        if p.returncode != 0:
            raise AssertionError("mep token create failed (%d): %s" % (p.returncode, p.stderr.decode()))
        return json.loads(p.stdout)["token"]

    def request(self, method, path, token, body=None, idempotency_key=None):
        """One request to the control plane; returns a Resp."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        headers = {"Authorization": "Bearer " + token}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        try:
            conn.request(method, path, body=data, headers=headers)
            return Resp.read(conn.getresponse())
        finally:
            conn.close()

    def log_text(self):
        return "".join(p.log_text() for p in self.logs)

    def stored_bytes(self):
        """Everything the database holds, as bytes (for privacy checks): the SQLite file and
        its WAL, or every row of every PostgreSQL table."""
        if self.pgdb:
            return repr(self.pgdb.snapshot(ignore_auth_failures=False)).encode()
        out = b""
        for suffix in ("", "-wal"):
            p = self.db[len("sqlite:"):] + suffix
            if os.path.exists(p):
                with open(p, "rb") as f:
                    out += f.read()
        return out

    def stop(self):
        if self.proc:
            self.proc.stop()


class Mepd:
    """A real mepd. `control_plane` None → embedded mode. With `use_xdg`, the socket and the
    state directory come from XDG_RUNTIME_DIR / XDG_STATE_HOME (the defaults); otherwise
    --socket and --state-dir are passed explicitly."""

    def __init__(self, workdir, env, control_plane=None, token=None, use_xdg=False, log_level="info", tag="mepd",
                 extra_args=()):
        self.workdir = workdir
        self.env = dict(env)
        self.extra_args = list(extra_args)
        self.control_plane = control_plane
        self.use_xdg = use_xdg
        self.log_level = log_level
        self.tag = tag
        if use_xdg:
            self.socket_path = os.path.join(env["XDG_RUNTIME_DIR"], "mep", "mepd.sock")
            self.state_dir = os.path.join(env["XDG_STATE_HOME"], "mep", "mepd")
        else:
            self.socket_path = os.path.join(workdir, tag + "-run", "mep", "mepd.sock")
            self.state_dir = os.path.join(workdir, tag + "-state")
        self.token_file = None
        if token is not None:
            self.token_file = os.path.join(workdir, tag + ".token")
            fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token + "\n")
        self.proc = None
        self.logs = []

    def start(self):
        argv = [mepd_bin(), "--log-level", self.log_level]
        if not self.use_xdg:
            argv += ["--socket", self.socket_path, "--state-dir", self.state_dir]
        if self.control_plane:
            argv += ["--control-plane", self.control_plane, "--token-file", self.token_file]
        argv += self.extra_args
        log = os.path.join(self.workdir, "%s-%d.log" % (self.tag, len(self.logs)))
        self.proc = Proc(self.tag, argv, self.env, log, cwd=self.workdir)
        self.logs.append(self.proc)
        self.proc.wait_for_log(r"mepd: info: listening on " + re.escape(self.socket_path))
        return self

    def client(self):
        return DaemonClient(self.socket_path)

    def log_text(self):
        return "".join(p.log_text() for p in self.logs)

    def stop(self):
        if self.proc:
            self.proc.stop()


# ---- HTTP over the Unix socket ----------------------------------------------------------------


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over an AF_UNIX stream socket (Host: localhost)."""

    def __init__(self, socket_path, timeout=REQUEST_TIMEOUT_S):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self.socket_path)
        except OSError:
            s.close()
            raise
        self.sock = s


class Resp:
    """A read response: status, lower-cased headers, body bytes, parsed JSON (or None)."""

    def __init__(self, status, headers, body):
        self.status = status
        self.headers = headers
        self.body = body
        try:
            self.json = json.loads(body) if body else None
        except ValueError:
            self.json = None

    @classmethod
    def read(cls, r):
        body = r.read()
        return cls(r.status, {k.lower(): v for k, v in r.getheaders()}, body)

    @property
    def content_type(self):
        return self.headers.get("content-type", "").split(";")[0].strip()

    def __repr__(self):
        return "<%d %s %r>" % (self.status, self.content_type, self.body[:500])


class DaemonClient:
    """A local agent speaking HTTP/1.1 + JSON to mepd (one connection per request)."""

    def __init__(self, socket_path):
        self.socket_path = socket_path

    def request(self, method, path, body=None, headers=None, timeout=REQUEST_TIMEOUT_S):
        conn = UnixHTTPConnection(self.socket_path, timeout=timeout)
        hdrs = dict(headers or {})
        data = None
        if isinstance(body, (bytes, bytearray)):
            data = bytes(body)
        elif body is not None:
            data = json.dumps(body).encode()
        if data is not None:
            hdrs.setdefault("Content-Type", "application/json")
        try:
            conn.request(method, path, body=data, headers=hdrs)
            return Resp.read(conn.getresponse())
        finally:
            conn.close()

    def attach(self, name, path, ttl_seconds=None, bind="none"):
        body = {"name": name, "path": str(path)}
        if ttl_seconds is not None:
            body["ttl_seconds"] = ttl_seconds
        if bind is not None:
            body["bind"] = bind
        return self.request("POST", "/v1/attach", body)

    def detach(self, name):
        return self.request("POST", "/v1/detach", {"name": name})

    def leases(self):
        r = self.request("GET", "/v1/leases")
        if r.status != 200:
            raise AssertionError("GET /v1/leases: %r" % r)
        return {l["canonical_name"]: l for l in r.json["leases"]}

    def identify(self, path):
        from urllib.parse import quote
        return self.request("GET", "/v1/identify?path=" + quote(str(path), safe=""))

    def metrics(self):
        """GET /metrics → {sample name (with labels): float}."""
        r = self.request("GET", "/metrics")
        if r.status != 200:
            raise AssertionError("GET /metrics: %r" % r)
        out = {}
        for line in r.body.decode().splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
        return out


class EventStream:
    """GET /v1/events read by a thread; events are kept with their arrival times."""

    def __init__(self, socket_path):
        self.events = []  # (monotonic, wall datetime, dict)
        self._cond = threading.Condition()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(REQUEST_TIMEOUT_S)
        self.sock.connect(socket_path)
        self.sock.sendall(b"GET /v1/events HTTP/1.1\r\nHost: localhost\r\nAccept: application/x-ndjson\r\n\r\n")
        self._file = self.sock.makefile("rb")
        status = self._file.readline()
        if not status.startswith(b"HTTP/1.1 200"):
            raise AssertionError("GET /v1/events: %r" % status)
        self.headers = {}
        while True:
            line = self._file.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            k, _, v = line.decode().partition(":")
            self.headers[k.strip().lower()] = v.strip()
        self.sock.settimeout(None)  # the reader blocks; close() unblocks it
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        try:
            for line in self._file:
                line = line.strip()
                if not line:
                    continue
                ev = json.loads(line)
                with self._cond:
                    self.events.append((time.monotonic(), datetime.datetime.now(datetime.timezone.utc), ev))
                    self._cond.notify_all()
        except (OSError, ValueError):
            pass

    def wait_for(self, pred, timeout):
        """The first (monotonic, wall, event) matching pred, or None after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for item in self.events:
                    if pred(item[2]):
                        return item
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._thread.join(timeout=5)


# ---- a recording TCP proxy ----------------------------------------------------------------------


class Hold:
    """Requests to the upstream whose first chunk `match`es: each is held at the proxy until
    let_go(), then sent on, or answered by the proxy itself with the raw HTTP bytes
    `answer` (the upstream never sees it)."""

    def __init__(self, match, answer=None):
        self.match = match
        self.answer = answer
        self._arrived = threading.Semaphore(0)
        self._go = threading.Semaphore(0)

    def arrival(self, timeout):
        """True once one more held request has arrived (within `timeout` seconds)."""
        return self._arrived.acquire(timeout=timeout)

    def let_go(self):
        self._go.release()


class RecordingProxy:
    """127.0.0.1:PORT → upstream, recording every byte in both directions. refuse(True)
    cuts every connection and closes new ones at once (an unreachable upstream) until
    refuse(False). hold(Hold(...)) stops matching requests (see Hold)."""

    def __init__(self, upstream_host, upstream_port):
        self.upstream = (upstream_host, upstream_port)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self._lock = threading.Lock()
        self._chunks = {"up": [], "down": []}
        self._socks = []
        self._stopped = False
        self._refusing = False
        self._holds = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def url(self):
        return "http://127.0.0.1:%d" % self.port

    def _accept(self):
        while not self._stopped:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self._refusing:
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks += [client, server]
            for src, dst, key in ((client, server, "up"), (server, client, "down")):
                t = threading.Thread(target=self._pump, args=(src, dst, key), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src, dst, key):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                hold = None
                if key == "up":
                    with self._lock:
                        hold = next((h for h in self._holds if h.match(data)), None)
                if hold:
                    hold._arrived.release()
                    hold._go.acquire(timeout=30)
                    if hold.answer:
                        src.sendall(hold.answer)
                        continue
                with self._lock:
                    self._chunks[key].append(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def recorded(self, direction):
        """All bytes seen in one direction ("up": to the server, "down": from it)."""
        with self._lock:
            return b"".join(self._chunks[direction])

    def hold(self, h):
        with self._lock:
            self._holds.append(h)
        return h

    def unhold(self, h):
        with self._lock:
            if h in self._holds:
                self._holds.remove(h)
        for _ in range(64):
            h.let_go()  # whatever it still holds goes on

    def count(self, match):
        """How many chunks sent upstream so far `match` (held ones once let go)."""
        with self._lock:
            return sum(1 for c in self._chunks["up"] if match(c))

    def refuse(self, on):
        self._refusing = on
        if on:
            self._cut()

    def _cut(self):
        with self._lock:
            socks, self._socks = list(self._socks), []
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def stop(self):
        self._stopped = True
        try:
            self.listener.close()
        except OSError:
            pass
        self._cut()
        for t in self._threads:
            t.join(timeout=2)
