"""PostgreSQL for the integration tests: a throwaway cluster (scripts/pg-test-cluster.sh:
initdb in a temporary directory as an unprivileged user, loopback only) and one fresh
database per test class, queried read-only through `psql` (standard library only).

The cluster named by $MEP_TEST_PG_URL (started by scripts/test.sh) is shared; without it,
each test process starts its own and stops it at exit. Tests that restart the database
always start a private cluster (PgCluster), so they never disturb other tests.
"""
import atexit
import glob
import json
import os
import shutil
import subprocess
import tempfile
import unittest
import urllib.parse
import uuid

PSQL_TIMEOUT_S = 60
SCRIPT = os.path.join(os.environ.get("MEP_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", "..")),
                      "scripts", "pg-test-cluster.sh")


def backend():
    """'sqlite', 'postgresql' or 'spanner', from $MEP_TEST_BACKEND (ctest registers each)."""
    return os.environ.get("MEP_TEST_BACKEND", "sqlite")


def _psql(url, sql, timeout=PSQL_TIMEOUT_S):
    psql = shutil.which("psql")
    if not psql:
        raise unittest.SkipTest("psql is not installed (postgresql-client-15)")
    proc = subprocess.run([psql, "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-d", url, "-c", sql],
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError("psql failed (%d): %s\nSQL: %s" % (proc.returncode, proc.stderr.decode(), sql))
    return proc.stdout.decode("utf-8")


class PgCluster:
    """One throwaway cluster in a temporary directory: start(), stop(), start() again."""

    def __init__(self):
        if not os.path.exists(SCRIPT):
            raise unittest.SkipTest("scripts/pg-test-cluster.sh not found")
        if not glob.glob("/usr/lib/postgresql/*/bin/initdb"):
            raise unittest.SkipTest("PostgreSQL server binaries are not installed (postgresql-15)")
        self.dir = tempfile.mkdtemp(prefix="mep-pg-")
        os.chmod(self.dir, 0o755)
        self.url = None

    def start(self, env=None):
        """Starts the cluster; `env` adds to the environment its processes run in."""
        proc = subprocess.run(["bash", SCRIPT, "start", self.dir], capture_output=True, timeout=120,
                              env=dict(os.environ, **(env or {})))
        if proc.returncode != 0:
            raise AssertionError("cannot start PostgreSQL: %s" % proc.stderr.decode())
        self.url = proc.stdout.decode().strip()
        return self

    def stop(self):
        subprocess.run(["bash", SCRIPT, "stop", self.dir], capture_output=True, timeout=120)

    def destroy(self):
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def port(self):
        return urllib.parse.urlsplit(self.url).port


_SHARED = None


def shared_admin_url():
    """The maintenance URL of the shared cluster (started on first use when not given)."""
    global _SHARED
    url = os.environ.get("MEP_TEST_PG_URL")
    if url:
        return url
    if _SHARED is None:
        _SHARED = PgCluster().start()
        atexit.register(_SHARED.destroy)
    return _SHARED.url


def with_database(admin_url, name):
    parts = urllib.parse.urlsplit(admin_url)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


class PgDb:
    """A fresh database on a cluster; `url` is what `mep server --db` takes."""

    def __init__(self, admin_url=None):
        self.admin_url = admin_url or shared_admin_url()
        self.name = "mep_" + uuid.uuid4().hex[:16]
        _psql(self.admin_url, 'CREATE DATABASE "%s"' % self.name)
        self.url = with_database(self.admin_url, self.name)

    def __str__(self):
        return self.url

    def drop(self):
        try:
            _psql(self.admin_url, 'DROP DATABASE IF EXISTS "%s" WITH (FORCE)' % self.name)
        except Exception:  # the cluster may be gone already; nothing to keep
            pass

    def query(self, sql, params=()):
        """Runs `sql` with `?` placeholders; returns a list of tuples with JSON-typed values
        (bigint → int, text → str, NULL → None), like sqlite3 does."""
        text = _psql(self.url, "SELECT coalesce(json_agg(t), '[]') FROM (%s) t" % _bind(sql, params))
        rows = json.loads(text, object_pairs_hook=lambda pairs: tuple(v for _, v in pairs))
        return [tuple(r) for r in rows]

    def execute(self, sql):
        _psql(self.url, sql)

    def snapshot(self, ignore_auth_failures=True):
        """Every row of every table, sorted, as {table: [row, …]}."""
        tables = [r[0] for r in self.query(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public' "
            "AND table_type = 'BASE TABLE' ORDER BY table_name")]
        snap = {}
        for t in tables:
            rows = self.query('SELECT * FROM "%s"' % t)
            if t == "audit_events" and ignore_auth_failures:
                rows = [r for r in self.query('SELECT * FROM audit_events WHERE event_type <> ?', ("AUTH_FAILED",))]
            snap[t] = sorted(rows, key=repr)
        return snap


def _literal(v):
    if v is None:
        return "NULL"
    if isinstance(v, bool):
        return "TRUE" if v else "FALSE"
    if isinstance(v, int):
        return str(v)
    return "'" + str(v).replace("'", "''") + "'"


def _bind(sql, params):
    parts = sql.split("?")
    if len(parts) - 1 != len(params):
        raise AssertionError("%d placeholders, %d parameters: %s" % (len(parts) - 1, len(params), sql))
    out = parts[0]
    for p, rest in zip(params, parts[1:]):
        out += _literal(p) + rest
    return out
