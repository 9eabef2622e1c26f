"""Process harness for the SDK's tests: real ``mep server``, ``mep store`` and ``mepd``
processes in private temporary directories (HOME and XDG_* inside them, so nothing of the
real user's is read or written), started with PR_SET_PDEATHSIG so none outlives the test
run, and stopped by PID (SIGCONT, SIGTERM, then SIGKILL). Every wait is bounded.
Standard library only.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from typing import Callable, Dict, List, Optional

from . import SOURCE_ROOT

import mep  # noqa: E402 - from the source tree (tests/__init__.py put it first on sys.path)

if not os.path.abspath(mep.__file__).startswith(os.path.join(SOURCE_ROOT, "mep")):
    raise ImportError("the tests must import mep from %s, not %s" % (SOURCE_ROOT, mep.__file__))

START_TIMEOUT_S = 30
STOP_GRACE_S = 5
REQUEST_TIMEOUT_S = 20

_skip_printed = set()


def _skip(reason: str) -> None:
    if reason not in _skip_printed:
        _skip_printed.add(reason)
        print("\nSKIP: %s" % reason, file=sys.stderr)
    raise unittest.SkipTest(reason)


def mep_bin() -> str:
    """``$MEP_BIN``, or skip the test with a printed reason."""
    p = os.environ.get("MEP_BIN")
    if not p:
        _skip("MEP_BIN is not set (point it at the mep CLI, e.g. /work/sdk-bin/mep)")
    return p  # type: ignore[return-value]


def mepd_bin() -> str:
    """``$MEPD_BIN``, or skip the test with a printed reason."""
    p = os.environ.get("MEPD_BIN")
    if not p:
        _skip("MEPD_BIN is not set (point it at the daemon, e.g. /work/sdk-bin/mepd)")
    return p  # type: ignore[return-value]


def require_binaries() -> None:
    """Skip unless both binaries are named."""
    mep_bin()
    mepd_bin()


_store_support: Optional[bool] = None


def store_supported() -> bool:
    """Whether ``mep store`` exists. ``mep store --help`` exits 0 even on a mep without
    the subcommand (it prints the top-level help), so its output is looked at too."""
    global _store_support
    if _store_support is None:
        try:
            p = subprocess.run([mep_bin(), "store", "--help"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, timeout=20, check=False)
            text = p.stdout.decode("utf-8", "replace")
            _store_support = p.returncode == 0 and "--dir" in text and "mep store" in text
        except (OSError, subprocess.TimeoutExpired):
            _store_support = False
    return _store_support


def require_store() -> None:
    """Skip unless ``mep store`` is available."""
    if not store_supported():
        _skip("'mep store' is not available in $MEP_BIN (%s): the data-plane tests need it" % os.environ.get("MEP_BIN"))


# ---- processes ------------------------------------------------------------------------------

try:
    import ctypes

    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (ImportError, OSError, AttributeError):  # pragma: no cover
    _prctl = None
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    def fn() -> None:
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)

    return fn


class Proc:
    """One child process; stdout and stderr go to a log file (stdout to a pipe with ``pipe_stdout``)."""

    def __init__(self, label: str, argv: List[str], env: Dict[str, str], log_path: str,
                 cwd: Optional[str] = None, pipe_stdout: bool = False) -> None:
        self.label = label
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE if pipe_stdout else self._log, stderr=self._log,
                                      env=env, cwd=cwd, preexec_fn=_die_with_parent(os.getpid()))
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def wait_for_log(self, pattern: str, timeout: float = START_TIMEOUT_S) -> "re.Match[str]":
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

    def readline(self, timeout: float) -> str:
        """One line of the child's stdout (``pipe_stdout``), within ``timeout`` seconds."""
        import select

        assert self.popen.stdout is not None
        deadline = time.monotonic() + timeout
        buf = b""
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.popen.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not r:
                break
            ch = os.read(self.popen.stdout.fileno(), 1)
            if not ch:
                break
            buf += ch
            if ch == b"\n":
                return buf.decode("utf-8", "replace")
        raise AssertionError("%s printed no line within %ss (got %r):\n%s" % (self.label, timeout, buf, self.log_text()))

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def stop(self) -> None:
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
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        self._log.close()

    def kill9(self) -> None:
        """SIGKILL and reap."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        self.popen.wait(timeout=STOP_GRACE_S)


def clean_env(home: str) -> Dict[str, str]:
    """The caller's environment without MEP_* and XDG_* settings, with HOME and the XDG
    directories inside ``home``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEP_") and not k.startswith("XDG_")}
    env["HOME"] = home
    env["XDG_CONFIG_HOME"] = os.path.join(home, "config")
    env["XDG_STATE_HOME"] = os.path.join(home, "state")
    env["XDG_RUNTIME_DIR"] = os.path.join(home, "run")
    for d in ("config", "state", "run"):
        os.makedirs(os.path.join(home, d), mode=0o700, exist_ok=True)
    return env


class MepServer:
    """A real ``mep server`` on 127.0.0.1 (a free port) with its own SQLite database."""

    def __init__(self, workdir: str, env: Dict[str, str]) -> None:
        self.workdir = workdir
        self.env = env
        self.db = "sqlite:" + os.path.join(workdir, "control.db")
        self.proc: Optional[Proc] = None
        self.port = 0

    def token_file(self, tenant: str = "t", name: str = "token", scope: str = "lease") -> str:
        """``mep token create`` for ``tenant`` (``scope`` lease or admin), written to a 0600 file; its path."""
        scope_args = ["--scope", scope] if scope != "lease" else []  # the default (and all an older mep knows)
        p = subprocess.run([mep_bin(), "token", "create", "--db", self.db, "--tenant", tenant] + scope_args,
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env=self.env, timeout=REQUEST_TIMEOUT_S, check=False)
        if p.returncode != 0:
            raise AssertionError("mep token create failed (%d): %s" % (p.returncode, p.stderr.decode()))
        path = os.path.join(self.workdir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(p.stdout.strip() + b"\n")
        return path

    def start(self) -> "MepServer":
        log = os.path.join(self.workdir, "server.log")
        self.proc = Proc("mep server", [mep_bin(), "server", "--db", self.db, "--listen", "127.0.0.1:0"],
                         self.env, log, cwd=self.workdir)
        m = self.proc.wait_for_log(r"mep server listening on http://127\.0\.0\.1:(\d+)")
        self.port = int(m.group(1))
        return self

    @property
    def url(self) -> str:
        return "http://127.0.0.1:%d" % self.port

    def get_lease(self, name: str, token_file: str) -> Dict[str, object]:
        """The server's ``GET /v1/leases/{name}`` (holder, hold_until, ...) with the token in
        ``token_file``, as a dict."""
        import json
        import urllib.parse
        import urllib.request

        with open(token_file, "rb") as f:
            token = f.read().decode().strip()
        req = urllib.request.Request(self.url + "/v1/leases/" + urllib.parse.quote(name, safe=""),
                                     headers={"Authorization": "Bearer " + token})
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            return json.loads(r.read().decode("utf-8"))

    def stop(self) -> None:
        if self.proc:
            self.proc.stop()


class MepStore:
    """A real ``mep store`` on 127.0.0.1 (a free port) keeping objects under its own dir."""

    def __init__(self, workdir: str, env: Dict[str, str]) -> None:
        self.workdir = workdir
        self.env = env
        self.dir = os.path.join(workdir, "store")
        os.makedirs(self.dir, exist_ok=True)
        self.proc: Optional[Proc] = None
        self.host = "127.0.0.1"
        self.port = 0
        self.token = ""
        self.token_file = ""
        self.hash_file = ""

    def _make_token(self) -> None:
        """A bearer token for the store (``mep token new``) and the file of accepted
        hashes (``mep token hash``) the store is started with."""
        def run(args: List[str], stdin: Optional[bytes] = None) -> bytes:
            p = subprocess.run([mep_bin(), "token"] + args, input=stdin, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=self.env, timeout=REQUEST_TIMEOUT_S, check=False)
            if p.returncode != 0:
                raise AssertionError("mep token %s failed (%d): %s" % (args[0], p.returncode, p.stderr.decode()))
            return p.stdout

        token = run(["new"]).strip()
        self.token = token.decode()
        self.token_file = os.path.join(self.workdir, "store.token")
        self.hash_file = os.path.join(self.workdir, "store.hashes")
        for path, data in ((self.token_file, token + b"\n"), (self.hash_file, run(["hash"], token + b"\n"))):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)

    def start(self) -> "MepStore":
        self._make_token()
        log = os.path.join(self.workdir, "store.log")
        self.proc = Proc("mep store", [mep_bin(), "store", "--listen", "127.0.0.1:0", "--dir", self.dir,
                                       "--token-file", self.hash_file], self.env, log, cwd=self.workdir)
        m = self.proc.wait_for_log(r"mep store listening on http://([0-9.]+):(\d+)")
        self.host, self.port = m.group(1), int(m.group(2))
        return self

    @property
    def url(self) -> str:
        return "http://%s:%d" % (self.host, self.port)

    def put(self, memory_instance_id: str, data: bytes, headers: Dict[str, str]):
        """A raw ``PUT /v1/objects/{id}``; returns (status, body bytes)."""
        import http.client

        conn = http.client.HTTPConnection(self.host, self.port, timeout=REQUEST_TIMEOUT_S)
        try:
            conn.request("PUT", "/v1/objects/" + memory_instance_id, body=data,
                         headers=dict(headers, **{"Content-Type": "application/octet-stream",
                                                  "Authorization": "Bearer " + self.token}))
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def stop(self) -> None:
        if self.proc:
            self.proc.stop()


class Mepd:
    """A real mepd with a private socket and state directory; embedded control plane
    unless ``control_plane`` (URL) and ``token_file`` are given; ``store`` (URL) enables
    sync and fetch."""

    def __init__(self, workdir: str, env: Dict[str, str], tag: str = "mepd", control_plane: Optional[str] = None,
                 token_file: Optional[str] = None, store: Optional[str] = None,
                 store_token_file: Optional[str] = None, extra_args: Optional[List[str]] = None) -> None:
        self.workdir = workdir
        self.extra_args = list(extra_args or [])
        self.env = dict(env)
        self.tag = tag
        self.control_plane = control_plane
        self.token_file = token_file
        self.store = store
        self.store_token_file = store_token_file
        self.socket_path = os.path.join(workdir, tag + "-run", "mepd.sock")
        self.state_dir = os.path.join(workdir, tag + "-state")
        self.proc: Optional[Proc] = None
        self.starts = 0

    def start(self) -> "Mepd":
        argv = [mepd_bin(), "--socket", self.socket_path, "--state-dir", self.state_dir]
        if self.control_plane:
            argv += ["--control-plane", self.control_plane, "--token-file", self.token_file or ""]
        if self.store:
            argv += ["--store", self.store]
        if self.store_token_file:
            argv += ["--store-token-file", self.store_token_file]
        argv += self.extra_args
        log = os.path.join(self.workdir, "%s-%d.log" % (self.tag, self.starts))
        self.starts += 1
        self.proc = Proc(self.tag, argv, self.env, log, cwd=self.workdir)
        self.proc.wait_for_log(r"listening on " + re.escape(self.socket_path))
        # Ready when the socket answers GET /healthz.
        deadline = time.monotonic() + START_TIMEOUT_S
        c = self.client()
        while True:
            try:
                c.health()
                return self
            except mep.MepError:
                if time.monotonic() > deadline:
                    raise AssertionError("%s did not answer /healthz:\n%s" % (self.tag, self.proc.log_text()))
                time.sleep(0.05)

    def client(self, timeout: float = REQUEST_TIMEOUT_S) -> mep.Client:
        return mep.Client(self.socket_path, timeout=timeout)

    def log_text(self) -> str:
        return self.proc.log_text() if self.proc else ""

    def stop(self) -> None:
        if self.proc:
            self.proc.stop()


def wait_until(pred: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``pred`` until it is true (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


class DaemonTestCase(unittest.TestCase):
    """A test with a private temp dir and environment; processes it starts are stopped at cleanup."""

    def setUp(self) -> None:
        require_binaries()
        if os.environ.get("MEP_TEST_KEEP"):  # keep the processes' logs for a post-mortem
            self.dir = tempfile.mkdtemp(prefix="mep-sdk-test-")
            print("\nkeeping %s" % self.dir, file=sys.stderr)
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="mep-sdk-test-")
            self.addCleanup(self._tmp.cleanup)
            self.dir = self._tmp.name
        self.env = clean_env(os.path.join(self.dir, "home"))
        self.work = os.path.join(self.dir, "work")
        os.makedirs(self.work)

    def start_mepd(self, **kw) -> Mepd:
        d = Mepd(self.dir, self.env, **kw)
        self.addCleanup(d.stop)
        return d.start()

    def start_server(self) -> MepServer:
        s = MepServer(self.dir, self.env)
        self.addCleanup(s.stop)
        return s.start()

    def start_store(self) -> MepStore:
        s = MepStore(self.dir, self.env)
        self.addCleanup(s.stop)
        return s.start()

    def start_remote(self, tag: str = "mepd", server: Optional[MepServer] = None,
                     store: Optional[MepStore] = None, extra_args: Optional[List[str]] = None):
        """A ``mep server`` (new unless given) and a mepd using it (and ``store``); (server, mepd).
        The mepd's token file is ``mepd.token_file``."""
        server = server or self.start_server()
        tok = server.token_file(name=tag + ".token")
        return server, self.start_mepd(tag=tag, control_plane=server.url, token_file=tok,
                                       store=store.url if store else None,
                                       store_token_file=store.token_file if store else None,
                                       extra_args=extra_args)

    def new_memory(self, client: mep.Client, name: str = "memory.uai") -> str:
        path = os.path.join(self.work, name)
        client.init(path)
        return path

    def start_child(self, code: str, env_extra: Optional[Dict[str, str]] = None) -> Proc:
        """A Python child running ``code`` with the source tree first on sys.path."""
        env = dict(self.env)
        env["PYTHONPATH"] = SOURCE_ROOT
        env.update(env_extra or {})
        p = Proc("child", [sys.executable, "-c", code], env, os.path.join(self.dir, "child.log"),
                 cwd=self.work, pipe_stdout=True)
        self.addCleanup(p.stop)
        return p
