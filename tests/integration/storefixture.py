"""Harness for the data-plane tests (SPEC §8): starts the real `mep store` on a private
directory and a free loopback port with a fresh bearer token (`mep token new`, `mep token
hash`), and talks HTTP/1.1 to it.

Standard library only. Every wait is bounded; every process started here is ended by its
PID (SIGTERM, then SIGKILL after a timeout), also when a test fails.
"""
import http.client
import json
import os
import re
import signal
import subprocess
import time

from mephelpers import mep_bin
from serverfixture import _LIVE_PIDS, HOST, run_mep

READY_TIMEOUT_S = 30
STOP_TIMEOUT_S = 40     # the store lets uploads in flight finish for up to 30 s
HTTP_TIMEOUT_S = 60


def new_store_token(workdir, name="store"):
    """A fresh token in WORKDIR/NAME.token and its hash in WORKDIR/NAME.hashes; returns
    (token, hashes path)."""
    token = run_mep(["token", "new"])[1].strip()
    token_path = os.path.join(workdir, name + ".token")
    with open(token_path, "w") as f:
        f.write(token + "\n")
    hashes = run_mep(["token", "hash", token])[1]
    hashes_path = os.path.join(workdir, name + ".hashes")
    with open(hashes_path, "w") as f:
        f.write(hashes)
    return token, hashes_path


class MepStore:
    """One `mep store` process on `--listen 127.0.0.1:0`; stderr kept in a file."""

    READY_RE = re.compile(rb"^mep store listening on https?://127\.0\.0\.1:(\d+)\r?$", re.M)
    _counter = 0

    def __init__(self, workdir, data_dir, extra_args=()):
        self.workdir = workdir
        self.data_dir = data_dir
        self.extra_args = list(extra_args)
        MepStore._counter += 1
        self.log_path = os.path.join(workdir, "store-%d.stderr" % MepStore._counter)
        self.proc = None
        self.port = None

    @property
    def url(self):
        return "http://%s:%d" % (HOST, self.port)

    def start(self, timeout=READY_TIMEOUT_S, expect_ready=True):
        argv = [mep_bin(), "store", "--listen", HOST + ":0", "--dir", self.data_dir, *self.extra_args]
        with open(self.log_path, "ab") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                         start_new_session=True)
        _LIVE_PIDS.add(self.proc.pid)
        if not expect_ready:
            return self
        deadline = time.monotonic() + timeout
        offset = 0
        while True:
            data = self.stderr_bytes()
            m = None
            for m in self.READY_RE.finditer(data):
                pass
            if m and m.end() > offset:
                self.port = int(m.group(1))
                return self
            if self.proc.poll() is not None:
                _LIVE_PIDS.discard(self.proc.pid)
                raise AssertionError("mep store exited with %s before it was ready:\n%s"
                                     % (self.proc.returncode, self.stderr_text()))
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError("mep store printed no ready line within %d s:\n%s" % (timeout, self.stderr_text()))
            time.sleep(0.02)

    def stderr_bytes(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return b""

    def stderr_text(self):
        return self.stderr_bytes().decode("utf-8", "replace")

    def stop(self, timeout=STOP_TIMEOUT_S):
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
        _LIVE_PIDS.discard(self.proc.pid)
        return self.proc.returncode

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        if self.proc is not None:
            _LIVE_PIDS.discard(self.proc.pid)


class StoreReply:
    def __init__(self, status, headers, body):
        self.status = status
        self.headers = headers
        self.body = body

    def json(self):
        return json.loads(self.body)

    @property
    def code(self):
        try:
            return self.json().get("code")
        except ValueError:
            return None

    def header(self, name):
        return self.headers.get(name)

    def __repr__(self):
        return "<%d %r>" % (self.status, self.body[:300])


class StoreClient:
    """HTTP/1.1 with keep-alive to one store; reconnects after a close."""

    def __init__(self, port, token, timeout=HTTP_TIMEOUT_S):
        self.port = port
        self.token = token
        self.timeout = timeout
        self.conn = None

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def request(self, method, path, body=None, headers=None, token=True):
        h = dict(headers or {})
        if token is True and self.token:
            h["Authorization"] = "Bearer " + self.token
        elif isinstance(token, str):
            h["Authorization"] = "Bearer " + token
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
            h.setdefault("Content-Type", "application/json")
        for attempt in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(HOST, self.port, timeout=self.timeout)
            try:
                self.conn.request(method, path, body=body, headers=h)
                res = self.conn.getresponse()
                data = res.read()
                if res.getheader("Connection", "").lower() == "close":
                    self.close()
                return StoreReply(res.status, res.headers, data)
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def put(self, memory_id, data, fencing, headers=None, **kw):
        """PUT with `Fencing-Token: fencing` (none when None); kw: token= as for request()."""
        h = {"Fencing-Token": str(fencing)} if fencing is not None else {}
        h.update(headers or {})
        return self.request("PUT", "/v1/objects/" + memory_id, data, h, **kw)

    def get(self, memory_id, **kw):
        return self.request("GET", "/v1/objects/" + memory_id, **kw)

    def fence(self, memory_id, **kw):
        return self.request("GET", "/v1/fence/" + memory_id, **kw)

    def advance(self, memory_id, token, **kw):
        return self.request("POST", "/v1/fence/advance", {"memory_instance_id": memory_id, "fencing_token": token}, **kw)
