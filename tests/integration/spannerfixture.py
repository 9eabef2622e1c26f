"""Cloud Spanner for the integration tests: the emulator this machine ships (Debian package
google-cloud-cli-spanner-emulator: gateway_main and emulator_main), started on loopback ports
and stopped by PID, and one fresh database per test class, queried through its REST API
(standard library only).

The emulator named by $MEP_TEST_SPANNER_EMULATOR (http://127.0.0.1:PORT, started by
scripts/test.sh) is shared; without it, each test process starts its own and stops it at
exit. Tests that need fault injection (-enable_fault_injection) start a private one.
Without the emulator installed, the tests that need it are skipped and say why.
"""
import atexit
import glob
import http.client
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import unittest
import urllib.parse
import uuid

PROJECT = "mep-test"
INSTANCE = "mep"
READY_TIMEOUT_S = 30
HTTP_TIMEOUT_S = 60


def emulator_dir():
    """The directory of gateway_main and emulator_main, or None when not installed."""
    for d in ("/usr/lib/google-cloud-sdk/bin/cloud_spanner_emulator",
              "/usr/share/google-cloud-sdk/bin/cloud_spanner_emulator"):
        if os.path.exists(os.path.join(d, "gateway_main")):
            return d
    found = glob.glob("/usr/lib/*/bin/cloud_spanner_emulator/gateway_main")
    return os.path.dirname(found[0]) if found else None


def require_emulator():
    if not os.environ.get("MEP_TEST_SPANNER_EMULATOR") and not emulator_dir():
        raise unittest.SkipTest("the Cloud Spanner emulator is not installed "
                                "(Debian package google-cloud-cli-spanner-emulator)")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(base, method, path, body=None, timeout=HTTP_TIMEOUT_S):
    """One REST call; returns (status, parsed JSON or None)."""
    u = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, "/v1/" + path, body=data,
                     headers={"Content-Type": "application/json"} if data else {})
        r = conn.getresponse()
        raw = r.read()
        try:
            return r.status, json.loads(raw) if raw else None
        except ValueError:
            return r.status, None
    finally:
        conn.close()


class Emulator:
    """One emulator (gateway_main + its child emulator_main) on free loopback ports."""

    def __init__(self, fault_injection=False):
        require_emulator()
        self.dir = tempfile.mkdtemp(prefix="mep-spanner-")
        d = emulator_dir()
        self.http_port, self.grpc_port = _free_port(), _free_port()
        argv = [os.path.join(d, "gateway_main"), "--hostname", "127.0.0.1", "--grpc_port", str(self.grpc_port),
                "--http_port", str(self.http_port), "--grpc_binary", os.path.join(d, "emulator_main")]
        if fault_injection:
            argv.append("-enable_fault_injection")
        self.log = open(os.path.join(self.dir, "emulator.log"), "wb")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                                     start_new_session=True)
        self.url = "http://127.0.0.1:%d" % self.http_port
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                status, _ = _call(self.url, "GET", "projects/%s/instances" % PROJECT, timeout=2)
                if status == 200:
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError("the Spanner emulator did not start: %s" % self.log_text())
            time.sleep(0.1)

    def log_text(self):
        try:
            with open(os.path.join(self.dir, "emulator.log"), "rb") as f:
                return f.read().decode("utf-8", "replace")[-4000:]
        except OSError:
            return ""

    def stop(self):
        """Stops both processes by PID: emulator_main survives a SIGTERM to the gateway."""
        children = []
        try:
            out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, timeout=10).stdout
            children = [int(p) for p in out.split()]
        except (OSError, subprocess.TimeoutExpired):
            pass
        for pid in children + [self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        for pid in children:
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.05)
        self.log.close()


_SHARED = None


def shared_emulator_url():
    """The shared emulator's REST URL (started on first use when not given)."""
    global _SHARED
    url = os.environ.get("MEP_TEST_SPANNER_EMULATOR")
    if url:
        return url
    if _SHARED is None:
        _SHARED = Emulator()
        atexit.register(_SHARED.stop)
    return _SHARED.url


def _ensure_instance(base):
    status, body = _call(base, "POST", "projects/%s/instances" % PROJECT,
                         {"instanceId": INSTANCE, "instance": {"config": "emulator-config", "displayName": INSTANCE,
                                                               "nodeCount": 1}})
    if status not in (200, 409):
        raise AssertionError("cannot create the emulator instance: %s %s" % (status, body))
    _wait_operation(base, body)


def _wait_operation(base, op, timeout=60):
    deadline = time.monotonic() + timeout
    while isinstance(op, dict) and op.get("name") and not op.get("done"):
        if time.monotonic() > deadline:
            raise AssertionError("a Spanner operation did not finish: %s" % op)
        time.sleep(0.05)
        _, op = _call(base, "GET", op["name"])
    if isinstance(op, dict) and op.get("error"):
        raise AssertionError("a Spanner operation failed: %s" % op["error"])


def _typed(value, typ):
    """A value of a result as Python: INT64 (a string in JSON) → int, NULL → None."""
    if value is None:
        return None
    code = typ.get("code")
    if code == "INT64":
        return int(value)
    if code == "ARRAY":
        return [_typed(v, typ.get("arrayElementType", {})) for v in value]
    return value


def _param(v):
    if v is None:
        return None, {"code": "STRING"}
    if isinstance(v, bool):
        return v, {"code": "BOOL"}
    if isinstance(v, int):
        return str(v), {"code": "INT64"}
    return str(v), {"code": "STRING"}


class SpannerDb:
    """A fresh database on an emulator; `url` is what `mep server --db` takes."""

    def __init__(self, emulator_url=None):
        self.base = emulator_url or shared_emulator_url()
        _ensure_instance(self.base)
        self.name = "d" + uuid.uuid4().hex[:20]
        self.path = "projects/%s/instances/%s/databases/%s" % (PROJECT, INSTANCE, self.name)
        status, body = _call(self.base, "POST", "projects/%s/instances/%s/databases" % (PROJECT, INSTANCE),
                             {"createStatement": "CREATE DATABASE `%s`" % self.name})
        if status != 200:
            raise AssertionError("cannot create a database on the emulator: %s %s" % (status, body))
        _wait_operation(self.base, body)
        self.url = "spanner:%s?endpoint=%s" % (self.path, self.base)

    def __str__(self):
        return self.url

    def drop(self):
        try:
            _call(self.base, "DELETE", self.path)
        except OSError:
            pass

    def _session(self):
        status, body = _call(self.base, "POST", self.path + "/sessions", {})
        if status != 200:
            raise AssertionError("cannot open a session: %s %s" % (status, body))
        return body["name"]

    def query(self, sql, params=()):
        """Runs `sql` with `?` placeholders in a strong read-only transaction; a list of tuples
        (INT64 → int, NULL → None), like sqlite3 does."""
        parts = sql.split("?")
        if len(parts) - 1 != len(params):
            raise AssertionError("%d placeholders, %d parameters: %s" % (len(parts) - 1, len(params), sql))
        text, values, types = parts[0], {}, {}
        for i, (p, rest) in enumerate(zip(params, parts[1:])):
            values["p%d" % i], types["p%d" % i] = _param(p)
            text += "@p%d" % i + rest
        session = self._session()
        try:
            body = {"sql": text, "transaction": {"singleUse": {"readOnly": {"strong": True}}}}
            if values:
                body["params"], body["paramTypes"] = values, types
            status, res = _call(self.base, "POST", session + ":executeSql", body)
            if status != 200:
                raise AssertionError("query failed (%s): %s\nSQL: %s" % (status, res, text))
        finally:
            _call(self.base, "DELETE", session)  # a single-use read leaves no transaction open
        fields = res.get("metadata", {}).get("rowType", {}).get("fields", [])
        return [tuple(_typed(v, f.get("type", {})) for v, f in zip(row, fields)) for row in res.get("rows", [])]

    def execute(self, sql):
        """Runs one DML statement behind the servers' backs, in a transaction of its own."""
        session = self._session()
        try:
            status, res = _call(self.base, "POST", session + ":executeSql",
                                {"sql": sql, "seqno": "1", "transaction": {"begin": {"readWrite": {}}}})
            if status != 200:
                raise AssertionError("statement failed (%s): %s\nSQL: %s" % (status, res, sql))
            tx = res["metadata"]["transaction"]["id"]
            status, res = _call(self.base, "POST", session + ":commit", {"transactionId": tx})
            if status != 200:
                raise AssertionError("commit failed (%s): %s" % (status, res))
        finally:
            _call(self.base, "DELETE", session)

    def tables(self):
        status, body = _call(self.base, "GET", self.path + "/ddl")
        if status != 200:
            raise AssertionError("cannot read the schema: %s %s" % (status, body))
        names = []
        for st in body.get("statements", []):
            if st.startswith("CREATE TABLE "):
                names.append(st[len("CREATE TABLE "):].split()[0].strip("`("))
        return sorted(names)

    def snapshot(self, ignore_auth_failures=True):
        """Every row of every table, sorted, as {table: [row, …]}."""
        snap = {}
        for t in self.tables():
            sql = "SELECT * FROM %s" % t
            if t == "audit_events" and ignore_auth_failures:
                sql += " WHERE event_type <> 'AUTH_FAILED'"
            if t in ("waiters", "lease_frees"):
                continue  # bookkeeping of waiting claims, stamped with commit times
            snap[t] = sorted(self.query(sql), key=repr)
        return snap
