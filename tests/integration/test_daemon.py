"""mepd end to end (SPEC §2, §3, §4 daemon session, §7, §13): a real `mepd` on a private
Unix socket, against a real `mep server` (remote mode) and with its embedded control plane.
Agents are this process (http.client over AF_UNIX), `curl --unix-socket`, and Python child
processes. Binaries come from $MEP_BIN and $MEPD_BIN.

Each test runs in its own temporary directory with its own server database and daemon
state; every process is stopped by PID at the end, and the daemon and server logs are
printed when a test fails."""
import datetime
import json
import re
import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import uuid

from daemonfixture import (DaemonClient, EventStream, MepServer, Mepd, Proc, RecordingProxy, clean_env,
                           mepd_bin, parse_time)
from mephelpers import mep_bin, read_to_close, send_all_then_read, send_expecting_continue

HERE = os.path.dirname(os.path.abspath(__file__))
PROBLEM_TYPE = "https://memoryendpoints.com/problems/"
LEASE_FIELDS = ["lease_id", "canonical_name", "display_name", "memory_instance_id", "fencing_token", "expires_at",
                "ttl_seconds", "path", "state"]
XATTR = "user.mep.memory_instance_id"

# A local agent in a child process: attaches with bind "pid", reports, then sleeps.
AGENT_SCRIPT = r"""
import json, sys, time
from daemonfixture import DaemonClient
r = DaemonClient(sys.argv[1]).attach(sys.argv[2], sys.argv[3], ttl_seconds=30, bind="pid")
print(json.dumps({"status": r.status, "body": r.json}), flush=True)
time.sleep(600)
"""

# A client running as another uid: raw HTTP over the socket; prints what happened as JSON.
OTHER_UID_SCRIPT = r"""
import json, socket, sys
out = {}
for method, target, body in (("GET", "/v1/leases", b""),
                             ("POST", "/v1/attach", json.dumps({"name": "intruder", "path": sys.argv[2],
                                                                "bind": "none"}).encode())):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect(sys.argv[1])
    except OSError as e:
        out[target] = {"connect_error": str(e)}
        continue
    req = ("%s %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
           "Content-Length: %d\r\nConnection: close\r\n\r\n" % (method, target, len(body))).encode() + body
    data, err = b"", None
    try:
        s.sendall(req)
    except OSError as e:  # the daemon may answer and close before reading the request
        err = str(e)
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError as e:
        err = err or str(e)
    s.close()
    out[target] = {"data": data.decode("latin-1"), "io_error": err}
print(json.dumps(out), flush=True)
"""


def world_executable_python():
    """A Python interpreter that any uid may run (every directory on the way searchable), or None."""
    for cand in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if not cand or not os.path.exists(cand):
            continue
        real = os.path.realpath(cand)
        d, ok = real, True
        while ok and d != "/":
            mode = os.stat(d).st_mode
            ok = bool(mode & stat.S_IXOTH)
            d = os.path.dirname(d)
        if ok:
            return cand
    return None


def raw_exchange(socket_path, request, timeout=10):
    """Sends raw bytes over a new connection (tolerating the peer closing while we send)
    and returns everything the peer wrote before closing."""
    reply = b""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(socket_path)
        try:
            s.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                reply += chunk
        except (ConnectionResetError, socket.timeout):
            pass
    return reply


def now_utc():
    return datetime.datetime.now(datetime.timezone.utc)


class DaemonTestCase(unittest.TestCase):
    """Starts the processes for one test: `mep server` + mepd (remote), or mepd alone
    (embedded, socket and state from XDG_RUNTIME_DIR / XDG_STATE_HOME)."""

    MODE = "remote"
    LOG_LEVEL = "info"

    def run(self, result=None):
        self._sources = []
        self.tmp = None
        if result is None:
            return super().run(result)
        before = len(result.failures) + len(result.errors)
        try:
            return super().run(result)
        finally:
            if len(result.failures) + len(result.errors) > before:
                for label, source in self._sources:
                    sys.stderr.write("\n----- %s log (%s) -----\n%s\n----- end of %s log -----\n"
                                     % (label, self.id(), source.log_text(), label))
            if self.tmp:
                shutil.rmtree(self.tmp, ignore_errors=True)

    def setUp(self):
        mep_bin()
        mepd_bin()
        self.tmp = tempfile.mkdtemp(prefix="mepd-it-")
        self.env = clean_env(self.tmp)
        self.data = os.path.join(self.tmp, "data")
        os.makedirs(self.data)
        self.server = None
        self.token = None
        if self.MODE == "remote":
            self.server = self.start_server()
            self.token = self.server.token("tenant-a")
            self.mepd = self.start_mepd(control_plane=self.server.url, token=self.token)
        else:
            self.mepd = self.start_mepd(use_xdg=True)
        self.client = self.mepd.client()

    # ---- process helpers ----

    def start_server(self, log_level=None):
        server = MepServer(self.tmp, self.env, log_level=log_level or self.LOG_LEVEL)
        self._sources.append(("mep server", server))
        self.addCleanup(server.stop)
        return server.start()

    def start_mepd(self, control_plane=None, token=None, use_xdg=False, tag="mepd", log_level=None):
        d = Mepd(self.tmp, self.env, control_plane=control_plane, token=token, use_xdg=use_xdg,
                 log_level=log_level or self.LOG_LEVEL, tag=tag)
        self._sources.append((tag, d))
        self.addCleanup(d.stop)
        return d.start()

    # ---- data helpers ----

    def new_file(self, name, content=None, directory=None):
        """A memory file with unique content (so fingerprints never collide by accident)."""
        path = os.path.join(directory or self.data, name)
        if content is None:
            content = ("memory of %s %s\n" % (name, uuid.uuid4().hex)).encode()
        with open(path, "wb") as f:
            f.write(content)
        return path

    def assertProblem(self, r, status, code=None):
        self.assertEqual(r.status, status, r)
        self.assertEqual(r.content_type, "application/problem+json", r)
        self.assertIsInstance(r.json, dict, r)
        self.assertEqual(r.json.get("status"), status, r)
        self.assertTrue(r.json.get("title"), r)
        self.assertTrue(r.headers.get("x-request-id"), r)
        if code is not None:
            self.assertEqual(r.json.get("code"), code, r)
            self.assertEqual(r.json.get("type"), PROBLEM_TYPE + code, r)

    def attach_ok(self, name, path, **kw):
        r = self.client.attach(name, path, **kw)
        self.assertEqual(r.status, 201, r)
        return r.json

    def server_lease(self, canonical_name, token=None):
        """GET /v1/leases/{name} on the control plane (remote mode only)."""
        return self.server.request("GET", "/v1/leases/" + canonical_name, token or self.token)

    def lease_expiry(self, canonical_name):
        """(expires_at, fencing_token) of a live lease: from the control plane in remote mode,
        else from the daemon (which only learns it from the embedded control plane)."""
        r = self.server_lease(canonical_name) if self.server else \
            self.client.request("GET", "/v1/leases/" + canonical_name)
        self.assertEqual(r.status, 200, r)
        return parse_time(r.json["expires_at"]), r.json["fencing_token"]

    def spawn_agent(self, name, path):
        """A local agent process that attaches `name` with bind "pid" and sleeps; its report
        (status and body) is in .report. Killed and reaped at cleanup."""
        env = dict(self.env, PYTHONPATH=HERE, PYTHONDONTWRITEBYTECODE="1")
        agent = subprocess.Popen([sys.executable, "-c", AGENT_SCRIPT, self.mepd.socket_path, name, path],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=self.data)

        def reap():
            if agent.poll() is None:
                agent.kill()
            agent.wait(timeout=10)
            agent.stdout.close()
            agent.stderr.close()

        self.addCleanup(reap)
        ready, _, _ = select.select([agent.stdout], [], [], 20)
        self.assertTrue(ready, "the agent did not report within 20 s")
        agent.report = json.loads(agent.stdout.readline())
        return agent

    def poll(self, pred, timeout, interval=0.05):
        """Calls pred() until it is truthy or `timeout` seconds pass; returns its last value."""
        deadline = time.monotonic() + timeout
        while True:
            v = pred()
            if v or time.monotonic() >= deadline:
                return v
            time.sleep(interval)


class BasicCases:
    """Run against both remote and embedded mode."""

    def test_attach_and_detach(self):
        # The socket's directory is 0700 and the socket 0600 (SPEC §7); state dir 0700.
        sock_dir = os.path.dirname(self.mepd.socket_path)
        st = os.stat(sock_dir)
        self.assertEqual(stat.S_IMODE(st.st_mode), 0o700, oct(st.st_mode))
        st = os.stat(self.mepd.socket_path)
        self.assertTrue(stat.S_ISSOCK(st.st_mode))
        self.assertEqual(stat.S_IMODE(st.st_mode), 0o600, oct(st.st_mode))
        self.assertEqual(stat.S_IMODE(os.stat(self.mepd.state_dir).st_mode), 0o700)

        r = self.client.request("GET", "/healthz")
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.json["status"], "ok")

        path = self.new_file("one.uai")
        r = self.client.attach("Agent-One", path, ttl_seconds=30)
        self.assertEqual(r.status, 201, r)
        self.assertEqual(r.content_type, "application/json")
        lease = r.json
        for k in LEASE_FIELDS:
            self.assertIn(k, lease)
        self.assertEqual(lease["canonical_name"], "agent-one")
        self.assertEqual(lease["display_name"], "Agent-One")
        self.assertEqual(lease["path"], path)
        self.assertEqual(lease["state"], "held")
        self.assertEqual(lease["ttl_seconds"], 30)
        self.assertIsInstance(lease["fencing_token"], int)
        self.assertGreaterEqual(lease["fencing_token"], 1)
        uuid.UUID(lease["memory_instance_id"])
        self.assertGreater(parse_time(lease["expires_at"]), now_utc())
        # The id is kept in the file's xattr.
        self.assertEqual(os.getxattr(path, XATTR).decode(), lease["memory_instance_id"])

        listed = self.client.leases()
        self.assertEqual(list(listed), ["agent-one"])
        self.assertEqual(listed["agent-one"]["lease_id"], lease["lease_id"])
        r = self.client.request("GET", "/v1/leases/agent-one")
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.json["fencing_token"], lease["fencing_token"])
        if self.server:
            s = self.server_lease("agent-one")
            self.assertEqual(s.status, 200, s)
            self.assertEqual(s.json["lease_id"], lease["lease_id"])
            self.assertEqual(s.json["fencing_token"], lease["fencing_token"])
            self.assertEqual(s.json["memory_instance_id"], lease["memory_instance_id"])
            self.assertNotIn(path.encode(), s.body)

        events = EventStream(self.mepd.socket_path)
        self.addCleanup(events.close)
        r = self.client.detach("agent-one")
        self.assertEqual(r.status, 204, r)
        self.assertEqual(r.body, b"")
        released = events.wait_for(lambda e: e["event"] == "released", timeout=5)
        self.assertIsNotNone(released, "no released event")
        self.assertEqual(released[2]["canonical_name"], "agent-one")
        self.assertEqual(released[2]["memory_instance_id"], lease["memory_instance_id"])
        self.assertProblem(self.client.request("GET", "/v1/leases/agent-one"), 404, "lease-not-found")
        self.assertEqual(self.client.leases(), {})
        if self.server:
            self.assertProblem(self.server_lease("agent-one"), 404)
        self.assertProblem(self.client.detach("agent-one"), 404, "lease-not-found")

        # Attach again (bind defaults to "pid": this process): the same memory, a strictly
        # larger fencing token; the lease can be read under its display form too.
        again = self.attach_ok("agent-one", path, bind=None)
        self.assertEqual(again["memory_instance_id"], lease["memory_instance_id"])
        self.assertGreater(again["fencing_token"], lease["fencing_token"])
        self.assertEqual(again["bind_pid"], os.getpid())
        granted = events.wait_for(lambda e: e["event"] == "granted", timeout=5)
        self.assertIsNotNone(granted, "no granted event")
        self.assertEqual(granted[2]["fencing_token"], again["fencing_token"])
        r = self.client.request("GET", "/v1/leases/AGENT-ONE")
        self.assertEqual((r.status, r.json["lease_id"]), (200, again["lease_id"]), r)
        self.assertEqual(self.client.detach("Agent-One").status, 204)

    def test_curl_unix_socket(self):
        path = self.new_file("curl.uai")

        def curl(*args, data=None):
            argv = ["curl", "-sS", "--max-time", "20", "--unix-socket", self.mepd.socket_path,
                    "-w", "\n%{http_code} %{content_type}"]
            if data is not None:
                argv += ["-H", "Content-Type: application/json", "--data-binary", json.dumps(data)]
            p = subprocess.run(argv + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30,
                               check=False)
            self.assertEqual(p.returncode, 0, p.stderr)
            body, _, tail = p.stdout.decode().rpartition("\n")
            code, _, ctype = tail.partition(" ")
            return int(code), ctype, json.loads(body) if body else None

        # bind "none": curl exits at once, and a pid-bound lease would be released with it.
        code, ctype, lease = curl("-X", "POST", "http://localhost/v1/attach",
                                  data={"name": "curl-agent", "path": path, "bind": "none"})
        self.assertEqual(code, 201, lease)
        self.assertTrue(ctype.startswith("application/json"), ctype)
        self.assertEqual(lease["canonical_name"], "curl-agent")
        self.assertEqual(lease["state"], "held")
        self.assertIsNone(lease.get("bind_pid"))
        code, _, listed = curl("http://localhost/v1/leases")
        self.assertEqual(code, 200)
        self.assertEqual([l["canonical_name"] for l in listed["leases"]], ["curl-agent"])
        code, _, one = curl("http://localhost/v1/leases/curl-agent")
        self.assertEqual((code, one["lease_id"]), (200, lease["lease_id"]))
        code, _, ident = curl("http://localhost/v1/identify?path=" + path)
        self.assertEqual((code, ident["memory_instance_id"]), (200, lease["memory_instance_id"]))
        code, _, body = curl("-X", "POST", "http://localhost/v1/detach", data={"name": "curl-agent"})
        self.assertEqual((code, body), (204, None))
        code, ctype, problem = curl("-X", "POST", "http://localhost/v1/detach", data={"name": "curl-agent"})
        self.assertEqual(code, 404)
        self.assertTrue(ctype.startswith("application/problem+json"), ctype)
        self.assertEqual(problem["code"], "lease-not-found")

    def test_two_agents_one_name_423(self):
        first = self.attach_ok("shared-name", self.new_file("a.uai"), ttl_seconds=30)
        other = self.new_file("b.uai")
        for display in ("shared-name", "SHARED-NAME", "ｓｈａｒｅｄ-name"):
            r = self.client.attach(display, other, ttl_seconds=30)
            self.assertProblem(r, 423, "name-held")
            self.assertIn("retry-after", r.headers)
            self.assertGreaterEqual(int(r.headers["retry-after"]), 1)
        if self.server:
            # Another host (a second daemon, another tenant) on the same control plane.
            d2 = self.start_mepd(control_plane=self.server.url, token=self.server.token("tenant-b"), tag="mepd2")
            path2 = self.new_file("c.uai", directory=self.data)
            self.assertProblem(d2.client().attach("shared-name", path2, ttl_seconds=30), 423, "name-held")
            self.assertEqual(d2.client().leases(), {})
        # The holder is untouched.
        held = self.client.leases()
        self.assertEqual(list(held), ["shared-name"])
        self.assertEqual(held["shared-name"]["fencing_token"], first["fencing_token"])
        self.assertEqual(held["shared-name"]["state"], "held")

    def test_move_rename_copy_keep_identity(self):
        src = self.new_file("original.uai")
        first = self.attach_ok("mover", src)
        mid = first["memory_instance_id"]
        self.assertEqual(self.client.detach("mover").status, 204)

        # `mv` into another directory, then a rename: the identity follows the file.
        other_dir = os.path.join(self.data, "elsewhere")
        os.makedirs(other_dir)
        moved = os.path.join(other_dir, "moved.uai")
        subprocess.run(["mv", src, moved], check=True, timeout=30)
        renamed = os.path.join(other_dir, "renamed.uai")
        os.rename(moved, renamed)
        r = self.client.identify(renamed)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.json["memory_instance_id"], mid)
        again = self.attach_ok("mover", renamed)
        self.assertEqual(again["memory_instance_id"], mid)
        self.assertEqual(again["path"], renamed)
        self.assertGreater(again["fencing_token"], first["fencing_token"])

        # Without the xattr, the (device, inode) map still knows the file.
        os.removexattr(renamed, XATTR)
        r = self.client.identify(renamed)
        self.assertEqual((r.status, r.json["memory_instance_id"]), (200, mid), r)

        # A plain copy (no xattrs, new inode) is the same memory, found by fingerprint.
        copy = os.path.join(self.data, "copy.uai")
        shutil.copyfile(renamed, copy)
        with self.assertRaises(OSError):
            os.getxattr(copy, XATTR)
        r = self.client.identify(copy)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.json["memory_instance_id"], mid)
        self.assertIsNone(r.json["parent_memory_instance_id"])

        # So attaching the copy under another name while the original is held is refused.
        r = self.client.attach("copier", copy)
        self.assertProblem(r, 423, "memory-attached")
        self.assertNotIn("copier", self.client.leases())
        self.assertEqual(self.client.leases()["mover"]["fencing_token"], again["fencing_token"])

    def test_attribute_with_an_id_the_control_plane_never_saw(self):
        # A file copied with its attributes from another install (cp -a, rsync -X) names a
        # memory this control plane does not know: attaching registers that id, so the
        # file keeps its identity and is claimed, instead of failing with 404.
        from serverfixture import uuid7
        path = self.new_file("carried.uai")
        carried = uuid7()
        os.setxattr(path, XATTR, carried.encode())
        r = self.client.identify(path)
        self.assertEqual((r.status, r.json["memory_instance_id"]), (200, carried), r)
        lease = self.attach_ok("carried-over", path)
        self.assertEqual(lease["memory_instance_id"], carried)
        self.assertEqual(lease["fencing_token"], 1)
        self.assertEqual(self.client.detach("carried-over").status, 204)
        # Known now: the next attach needs no registration and continues the counter.
        self.assertEqual(self.attach_ok("carried-again", path)["fencing_token"], 2)

    def test_reused_inode_is_not_the_old_memory(self):
        # A file deleted frees its inode number; a new file may get it at once. It is a new
        # file, not the memory the daemon once saw at that number (its birth time differs).
        src = self.new_file("known.uai")
        mid = self.attach_ok("inode-owner", src)["memory_instance_id"]
        self.assertEqual(self.client.detach("inode-owner").status, 204)
        copy = os.path.join(self.data, "copy-to-delete.uai")
        shutil.copyfile(src, copy)
        self.assertEqual(self.client.identify(copy).json["memory_instance_id"], mid)  # by fingerprint
        freed = os.stat(copy).st_ino
        os.remove(copy)
        reused = None
        for i in range(64):
            candidate = self.new_file("new-%d.uai" % i)
            if os.stat(candidate).st_ino == freed:
                reused = candidate
                break
        if reused is None:
            print("\nskipping test_reused_inode_is_not_the_old_memory: the filesystem did not reuse the inode")
            self.skipTest("the filesystem did not reuse the inode number")
        self.assertProblem(self.client.identify(reused), 404, "memory-not-found")
        with self.assertRaises(OSError):
            os.getxattr(reused, XATTR)
        fresh = self.attach_ok("inode-newcomer", reused)
        self.assertNotEqual(fresh["memory_instance_id"], mid)
        self.assertEqual(fresh["fencing_token"], 1)

    def test_identify_init_branch(self):
        # A file the daemon never saw: 404; a path that does not exist: 4xx.
        unknown = self.new_file("unknown.uai")
        self.assertProblem(self.client.identify(unknown), 404, "memory-not-found")
        r = self.client.identify(os.path.join(self.data, "missing.uai"))
        self.assertTrue(400 <= r.status < 500, r)
        self.assertProblem(r, r.status)

        # init: a new, empty file with a fresh identity.
        fresh = os.path.join(self.data, "fresh.uai")
        r = self.client.request("POST", "/v1/init", {"path": fresh})
        self.assertEqual(r.status, 201, r)
        mid = r.json["memory_instance_id"]
        uuid.UUID(mid)
        self.assertEqual(r.json["path"], fresh)
        self.assertEqual(os.path.getsize(fresh), 0)
        self.assertEqual(os.getxattr(fresh, XATTR).decode(), mid)
        r = self.client.identify(fresh)
        self.assertEqual((r.status, r.json["memory_instance_id"]), (200, mid), r)
        self.assertIsNone(r.json["parent_memory_instance_id"])
        # init never overwrites.
        self.assertProblem(self.client.request("POST", "/v1/init", {"path": fresh}), 400)
        # Two inits are two memories, even though both files are empty.
        other = os.path.join(self.data, "fresh2.uai")
        r2 = self.client.request("POST", "/v1/init", {"path": other})
        self.assertEqual(r2.status, 201, r2)
        self.assertNotEqual(r2.json["memory_instance_id"], mid)

        with open(fresh, "wb") as f:
            f.write(b"some learned state " + uuid.uuid4().bytes)
        child_path = os.path.join(self.data, "child.uai")
        # branch needs a live lease on the source.
        r = self.client.request("POST", "/v1/branch", {"path": fresh, "new_path": child_path})
        self.assertProblem(r, 404, "lease-not-found")
        self.assertFalse(os.path.exists(child_path))

        lease = self.attach_ok("brancher", fresh)
        self.assertEqual(lease["memory_instance_id"], mid)
        r = self.client.request("POST", "/v1/branch", {"path": fresh, "new_path": child_path})
        self.assertEqual(r.status, 201, r)
        child = r.json["memory_instance_id"]
        self.assertNotEqual(child, mid)
        self.assertEqual(r.json["parent_memory_instance_id"], mid)
        self.assertEqual(r.json["branched_at_token"], lease["fencing_token"])
        self.assertEqual(r.json["path"], child_path)
        with open(fresh, "rb") as a, open(child_path, "rb") as b:
            self.assertEqual(a.read(), b.read())
        r = self.client.identify(child_path)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.json["memory_instance_id"], child)
        self.assertEqual(r.json["parent_memory_instance_id"], mid)
        # The source still resolves to itself (same bytes, but the branch has its own id).
        self.assertEqual(self.client.identify(fresh).json["memory_instance_id"], mid)
        # Branching onto an existing file is refused.
        r = self.client.request("POST", "/v1/branch", {"path": fresh, "new_path": other})
        self.assertTrue(400 <= r.status < 500, r)

        if self.server:
            lin = self.server.request("GET", "/v1/memories/%s/lineage" % child, self.token)
            self.assertEqual(lin.status, 200, lin)
            self.assertEqual([a["memory_instance_id"] for a in lin.json["ancestors"]], [mid])
            lin = self.server.request("GET", "/v1/memories/%s/lineage" % mid, self.token)
            self.assertEqual([c["memory_instance_id"] for c in lin.json["children"]], [child])
            mem = self.server.request("GET", "/v1/memories/" + child, self.token)
            self.assertEqual(mem.json["parent_memory_instance_id"], mid)
            self.assertEqual(mem.json["branched_at_token"], lease["fencing_token"])

        # A memory and its branch can be leased at the same time (SPEC §2.5).
        self.attach_ok("branch-child", child_path)
        self.assertEqual(sorted(self.client.leases()), ["branch-child", "brancher"])

    def test_expect_100_continue(self):
        # A client that sends `Expect: 100-continue` gets the 100 before it sends the body.
        body = json.dumps({"name": "nobody-attached"}).encode()
        head = (b"POST /v1/detach HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b"Expect: 100-continue\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(3)
            s.connect(self.mepd.socket_path)
            send_expecting_continue(s, head, body)
            reply = read_to_close(s)
        self.assertRegex(reply[:12], rb"^HTTP/1\.1 [24]\d\d")
        self.assertIn(b"x-request-id:", reply.lower())

    def run_second_mepd(self, socket_path, state_dir):
        """Runs another mepd (same control plane) to its end; returns (exit code, stderr)."""
        argv = [mepd_bin(), "--socket", socket_path, "--state-dir", state_dir]
        if self.mepd.control_plane:
            argv += ["--control-plane", self.mepd.control_plane, "--token-file", self.mepd.token_file]
        p = subprocess.run(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, timeout=20, check=False)
        return p.returncode, p.stderr.decode()

    def test_socket_path_appears_only_once_it_accepts(self):
        # A client may wait for the socket's path and connect at once. Here listen(2) waits
        # 800 ms (slow_listen.cpp, preloaded): had the path appeared at bind(2), as it did,
        # the connect below would be refused.
        shim = os.environ.get("MEP_TEST_SLOW_LISTEN", "")
        if os.environ.get("MEP_TEST_SANITIZED"):
            self.skipTest("no library is preloaded into a sanitizer build (%s)" % os.environ["MEP_TEST_SANITIZED"])
        if not os.path.exists(shim):
            self.skipTest("MEP_TEST_SLOW_LISTEN names no library (ctest builds and sets it)")
        sock_dir = os.path.join(self.tmp, "late")
        os.makedirs(sock_dir, mode=0o700)
        sock = os.path.join(sock_dir, "mepd.sock")
        argv = [mepd_bin(), "--socket", sock, "--state-dir", os.path.join(self.tmp, "late-state")]
        if self.mepd.control_plane:
            argv += ["--control-plane", self.mepd.control_plane, "--token-file", self.mepd.token_file]
        env = dict(self.env, LD_PRELOAD=shim, MEP_TEST_LISTEN_DELAY_MS="800")
        late = Proc("late mepd", argv, env, os.path.join(self.tmp, "late.log"))
        self._sources.append(("late mepd", late))
        try:
            deadline = time.monotonic() + 20
            while not os.path.exists(sock):
                self.assertTrue(late.alive(), "mepd exited before it named its socket")
                self.assertLess(time.monotonic(), deadline, "mepd did not name its socket")
                time.sleep(0.002)
            reply = raw_exchange(sock, b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            self.assertRegex(reply[:12], rb"^HTTP/1\.1 200")
            self.assertEqual(os.listdir(sock_dir), ["mepd.sock"])  # the staging name is gone
            self.assertEqual(stat.S_IMODE(os.stat(sock).st_mode), 0o600)
        finally:
            late.stop()
        self.assertFalse(os.path.exists(sock))

    def test_socket_path_too_long_is_refused(self):
        # A Unix socket's address holds 107 bytes of path: a longer one is an error at start,
        # not a socket named where no client can connect.
        sock = os.path.join(self.tmp, "s" * 120 + ".sock")
        rc, err = self.run_second_mepd(sock, os.path.join(self.tmp, "long-state"))
        self.assertEqual(rc, 1, err)
        self.assertIn("bytes long; a Unix socket's may be 107 at most", err)
        self.assertEqual(len(err.strip().splitlines()), 1, err)
        self.assertFalse(os.path.exists(sock))
        self.assertEqual([n for n in os.listdir(self.tmp) if n.startswith(".mepd-")], [])

    def test_one_daemon_per_state_directory(self):
        # A second mepd on the same state directory (here with a socket of its own) would
        # re-adopt and renew the first one's leases: it stops before it touches any.
        path = self.new_file("first.uai")
        r = self.client.attach("State-Owner", path, ttl_seconds=30)
        self.assertEqual(r.status, 201, r)
        rc, err = self.run_second_mepd(os.path.join(self.tmp, "second.sock"), self.mepd.state_dir)
        self.assertEqual(rc, 1, err)
        self.assertIn("another mepd is running with the state directory", err)
        self.assertNotIn("re-adopted", err)
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "second.sock")))
        # Nor does one on the same socket with another state directory get that far.
        rc, err = self.run_second_mepd(self.mepd.socket_path, os.path.join(self.tmp, "second-state"))
        self.assertEqual(rc, 1, err)
        self.assertIn("another mepd is already listening", err)
        # The first daemon still serves, with the lease as it was.
        lease = self.client.request("GET", "/v1/leases/state-owner")
        self.assertEqual(lease.status, 200, lease)
        self.assertEqual(lease.json["fencing_token"], r.json["fencing_token"])

    def test_sighup_keeps_serving(self):
        # The terminal mepd was started from closes, or someone asks for a reload: it serves on.
        path = self.new_file("hup.uai")
        lease = self.attach_ok("hangup", path)
        self.mepd.proc.signal(signal.SIGHUP)
        self.assertIsNotNone(self.poll(lambda: "SIGHUP" in self.mepd.log_text(), timeout=5), "no SIGHUP log line")
        self.assertEqual(self.client.request("GET", "/healthz").status, 200)
        self.assertEqual(self.client.leases()["hangup"]["fencing_token"], lease["fencing_token"])
        self.mepd.proc.signal(signal.SIGHUP)  # and again: the handler is set once more each time
        self.assertIsNotNone(self.poll(lambda: self.mepd.log_text().count("SIGHUP") >= 2, timeout=5))
        self.assertEqual(self.client.request("GET", "/healthz").status, 200)

    def test_what_is_at_the_socket_path_or_state_dir_is_never_destroyed(self):
        # mepd(8): only a socket a dead daemon left is replaced. A file, a directory or a
        # symbolic link at --socket is refused and left as it was; an existing --state-dir
        # keeps its mode (it was chmod'ed 0700), and one others may write in is refused.
        d = os.path.join(self.tmp, "precious")
        os.makedirs(d, mode=0o700)
        with open(os.path.join(d, "f.txt"), "w") as f:
            f.write("data")
        os.mkdir(os.path.join(d, "empty"))
        os.symlink("f.txt", os.path.join(d, "link"))
        for name, kind in (("f.txt", "a file"), ("empty", "a directory"), ("link", "a symbolic link")):
            rc, err = self.run_second_mepd(os.path.join(d, name), os.path.join(self.tmp, "state-" + name))
            self.assertEqual(rc, 1, err)
            self.assertIn("exists and is not a socket (it is %s)" % kind, err)
        with open(os.path.join(d, "f.txt")) as f:
            self.assertEqual(f.read(), "data")
        self.assertTrue(os.path.isdir(os.path.join(d, "empty")))
        self.assertEqual(os.readlink(os.path.join(d, "link")), "f.txt")
        # State directories.
        shared = os.path.join(self.tmp, "shared")
        os.mkdir(shared)
        os.chmod(shared, 0o1777)
        rc, err = self.run_second_mepd(os.path.join(self.tmp, "s1.sock"), shared)
        self.assertEqual(rc, 1, err)
        self.assertIn("is writable by others (mode 1777)", err)
        self.assertEqual(os.stat(shared).st_mode & 0o7777, 0o1777)
        self.assertEqual(os.listdir(shared), [])
        a_file = os.path.join(self.tmp, "notes.txt")
        with open(a_file, "w") as f:
            f.write("n")
        os.chmod(a_file, 0o644)
        rc, err = self.run_second_mepd(os.path.join(self.tmp, "s2.sock"), a_file)
        self.assertEqual(rc, 1, err)
        self.assertIn("is not a directory", err)
        self.assertEqual(os.stat(a_file).st_mode & 0o777, 0o644)
        mine = os.path.join(self.tmp, "mine")
        os.mkdir(mine)
        os.chmod(mine, 0o755)
        sock = os.path.join(self.tmp, "s3.sock")
        second = Mepd(self.tmp, self.env, tag="own-state")  # embedded: its state is all in the directory
        second.socket_path, second.state_dir = sock, mine
        self.addCleanup(second.stop)
        second.start()
        self.assertEqual(os.stat(mine).st_mode & 0o777, 0o755)  # used as it is
        self.assertTrue(os.path.exists(os.path.join(mine, "mepd.db")))
        rc, err = self.run_second_mepd(os.path.join(self.tmp, "s4.sock"), "")
        self.assertEqual(rc, 2, err)
        self.assertIn("--state-dir must not be empty", err)

    def cp_requests(self):
        text = self.client.request("GET", "/metrics").body.decode()
        return int(re.search(r"^mepd_control_plane_requests_total (\d+)$", text, re.M).group(1))

    def test_a_grant_that_comes_as_its_agent_goes_is_given_back(self):
        # An agent waiting for a name goes away (mep claim --wait interrupted) as the holder
        # lets go: the grant and the departure reach the daemon together. The lease must be
        # given back, not kept and renewed for no one. (The daemon looks for a departure
        # every 100 ms; the grant comes within a few, so it usually arrives first: 4 tries.)
        for attempt in range(4):
            name = "left-%d" % attempt
            self.attach_ok(name, self.new_file("held-%d.uai" % attempt))
            body = json.dumps({"name": name, "path": self.new_file("wanted-%d.uai" % attempt), "bind": "none",
                               "wait_seconds": 30}).encode()
            sent = self.cp_requests()
            waiter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            waiter.connect(self.mepd.socket_path)
            waiter.sendall(b"POST /v1/attach HTTP/1.1\r\nHost: mepd\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            self.assertTrue(self.poll(lambda: self.cp_requests() > sent, timeout=10), "the attach never claimed")
            waiter.close()
            self.assertEqual(self.client.detach(name).status, 204)
            # Nobody keeps it: not this daemon, and (once a claim whose answer was lost with
            # the agent is settled by the renewer) not the control plane.
            self.assertTrue(self.poll(lambda: name not in self.client.leases(), timeout=10),
                            "attempt %d: %s is kept for an agent gone" % (attempt, name))
            after = self.new_file("after-%d.uai" % attempt)
            self.assertTrue(self.poll(lambda: self.client.attach(name, after).status == 201, timeout=10, interval=0.5),
                            "attempt %d: %s stays held for an agent gone" % (attempt, name))
            self.assertEqual(self.client.detach(name).status, 204)

    def test_socket_directory_writable_by_others_is_refused(self):
        # Anyone who may write in the socket's directory could put their own socket there.
        open_dir = os.path.join(self.tmp, "open")
        os.makedirs(open_dir)
        os.chmod(open_dir, 0o777)
        rc, err = self.run_second_mepd(os.path.join(open_dir, "mepd.sock"), os.path.join(self.tmp, "other-state"))
        self.assertEqual(rc, 1, err)
        self.assertIn("is writable by others (mode 0777); make it 0700", err)
        self.assertFalse(os.path.exists(os.path.join(open_dir, "mepd.sock")))

    def test_ambiguous_framing_refused_and_closed(self):
        # As mep server: a body length two parsers could read differently gets a 400 and the
        # end of the connection, so the request hidden in the body is never served.
        smuggled = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"
        head = b"POST /v1/detach HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        for label, rest in (("identity", b"Transfer-Encoding: identity\r\nContent-Length: 0\r\n\r\n"),
                            ("chunked twice", b"Transfer-Encoding: chunked, chunked\r\n\r\n0\r\n\r\n"),
                            ("gzip", b"Transfer-Encoding: gzip\r\n\r\n")):
            with self.subTest(case=label):
                reply = raw_exchange(self.mepd.socket_path, head + rest + smuggled, timeout=5)
                self.assertTrue(reply.startswith(b"HTTP/1.1 400 "), reply[:200])
                self.assertEqual(len(re.findall(rb"HTTP/1\.1 \d{3} ", reply)), 1, reply)
        # An HTTP/1.1 request without a Host header (RFC 9112 §3.2).
        reply = raw_exchange(self.mepd.socket_path, b"GET /healthz HTTP/1.1\r\n\r\n" + smuggled, timeout=5)
        self.assertTrue(reply.startswith(b"HTTP/1.1 400 "), reply[:200])
        self.assertEqual(len(re.findall(rb"HTTP/1\.1 \d{3} ", reply)), 1, reply)

    def test_bad_input_4xx(self):
        path = self.new_file("bad.uai")
        cases = [
            ("malformed JSON", b'{"name": "x", "path": ', 400, "invalid-request"),
            ("not an object", b'["name", "path"]', 400, "invalid-request"),
            ("unknown field", {"name": "bad-agent", "path": path, "colour": "red"}, 400, "invalid-request"),
            ("missing path", {"name": "bad-agent"}, 400, "invalid-request"),
            ("missing name", {"path": path}, 400, "invalid-request"),
            ("empty body", b"", 400, "invalid-request"),
            ("name wrong type", {"name": 7, "path": path}, 400, "invalid-request"),
            ("ttl as string", {"name": "bad-agent", "path": path, "ttl_seconds": "30"}, 400, "invalid-request"),
            ("ttl fraction", {"name": "bad-agent", "path": path, "ttl_seconds": 30.5}, 400, "invalid-request"),
            ("bind value", {"name": "bad-agent", "path": path, "bind": "parent"}, 400, "invalid-request"),
            ("ttl too small", {"name": "bad-agent", "path": path, "ttl_seconds": 4}, 422, "invalid-ttl"),
            ("ttl zero", {"name": "bad-agent", "path": path, "ttl_seconds": 0}, 422, "invalid-ttl"),
            ("ttl negative", {"name": "bad-agent", "path": path, "ttl_seconds": -30}, 422, "invalid-ttl"),
            ("ttl too large", {"name": "bad-agent", "path": path, "ttl_seconds": 301}, 422, "invalid-ttl"),
            ("ttl huge", {"name": "bad-agent", "path": path, "ttl_seconds": 10 ** 30}, 400, None),
            ("mixed-script name", {"name": "pаypal", "path": path}, 422, "invalid-name"),
            ("empty name", {"name": "", "path": path}, 422, "invalid-name"),
            ("missing file", {"name": "bad-agent", "path": os.path.join(self.data, "nope.uai")}, 400, None),
            ("empty path", {"name": "bad-agent", "path": ""}, 400, "invalid-request"),
            ("NUL in the path", {"name": "bad-agent", "path": path + "\u0000tail"}, 400, "invalid-request"),
        ]
        for label, body, status, code in cases:
            with self.subTest(label):
                r = self.client.request("POST", "/v1/attach", body)
                if label == "ttl huge":
                    self.assertTrue(400 <= r.status < 500, r)
                    self.assertProblem(r, r.status)
                else:
                    self.assertProblem(r, status, code)
        # init with a NUL: the kernel would have created the file before the NUL under the
        # name after it; nothing is created.
        self.assertProblem(self.client.request("POST", "/v1/init", {"path": path + ".nul\u0000x"}), 400, "invalid-request")
        self.assertFalse(os.path.exists(path + ".nul"))
        r = self.client.request("POST", "/v1/attach", {"name": "bad-agent", "path": path, "colour": "red"})
        self.assertIn("colour", r.json.get("detail", ""))
        for label, method, target, body, status in [
            ("detach unknown field", "POST", "/v1/detach", {"name": "x", "force": True}, 400),
            ("detach malformed", "POST", "/v1/detach", b"{", 400),
            ("branch missing new_path", "POST", "/v1/branch", {"path": path}, 400),
            ("init unknown field", "POST", "/v1/init", {"path": path + ".new", "mode": 7}, 400),
            ("identify without path", "GET", "/v1/identify", None, 400),
            ("attach via GET", "GET", "/v1/attach", None, 405),
            ("leases via POST", "POST", "/v1/leases", {}, 405),
            ("unknown endpoint", "GET", "/v1/nothing-here", None, 404),
        ]:
            with self.subTest(label):
                self.assertProblem(self.client.request(method, target, body), status)
        # A 405 names the method the path accepts (RFC 9110 15.5.6).
        for method, target, allow in (("GET", "/v1/attach", "POST"), ("POST", "/v1/leases", "GET, HEAD"),
                                      ("POST", "/v1/events", "GET"), ("DELETE", "/healthz", "GET, HEAD")):
            with self.subTest(method=method, target=target):
                r = self.client.request(method, target, {} if method == "POST" else None)
                self.assertProblem(r, 405, "method-not-allowed")
                self.assertEqual(r.headers.get("allow"), allow)
        # HEAD is GET without the content (RFC 9110 9.3.2).
        got, head = self.client.request("GET", "/healthz"), self.client.request("HEAD", "/healthz")
        self.assertEqual(head.status, 200)
        self.assertEqual(head.body, b"")
        self.assertEqual(head.headers.get("content-length"), str(len(got.body)))
        self.assertFalse(os.path.exists(path + ".new"))

        # A body over the limit: 413 (the daemon may close before reading it all).
        huge = json.dumps({"name": "bad-agent", "path": path, "pad": "x" * (1 << 20)}).encode()
        reply = raw_exchange(self.mepd.socket_path,
                             b"POST /v1/attach HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(huge) + huge)
        head, _, body = reply.partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 413"), reply[:300])
        self.assertIn(b"application/problem+json", head.lower())
        self.assertIn(b"x-request-id:", head.lower())
        self.assertEqual(json.loads(body)["code"], "payload-too-large")
        # Sent whole before the client reads (as http.client does): still the 413, 100 of 100
        # times (the daemon drains what it will not read before it closes: lingering close).
        request = (b"POST /v1/attach HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n" % len(huge) + huge)
        for attempt in range(100):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(10)
                s.connect(self.mepd.socket_path)
                status, reply = send_all_then_read(s, request)
            self.assertEqual(status, b"HTTP/1.1 413 Payload Too Large", "try %d: %r" % (attempt, reply[:200]))
        # A header section over the limit.
        reply = raw_exchange(self.mepd.socket_path, b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Pad: "
                             + b"y" * (256 * 1024) + b"\r\n\r\n")
        self.assertTrue(reply == b"" or reply.startswith(b"HTTP/1.1 4"), reply[:300])
        # Garbage that is not HTTP at all.
        reply = raw_exchange(self.mepd.socket_path, b"\x00\x01 this is not HTTP\r\n\r\n")
        self.assertTrue(reply == b"" or reply.startswith(b"HTTP/1.1 400"), reply[:200])

        # Nothing was attached, and the daemon is healthy and still serving.
        self.assertEqual(self.client.leases(), {})
        self.assertEqual(self.client.request("GET", "/healthz").status, 200)
        self.assertTrue(self.mepd.proc.alive())
        self.attach_ok("bad-agent", path)

    def test_bound_agent_killed_releases_lease_at_once_not_at_expiry(self):
        path = self.new_file("agent.uai")
        agent = self.spawn_agent("killme", path)
        self.assertEqual(agent.report["status"], 201, agent.report)
        lease = self.client.leases()["killme"]
        self.assertEqual(lease["bind_pid"], agent.pid)
        if self.server:
            self.assertEqual(self.server_lease("killme").status, 200)

        agent.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        agent.wait(timeout=10)

        def released():
            if "killme" in self.client.leases():
                return False
            return self.server is None or self.server_lease("killme").status == 404

        # Released when the pid goes, not when the 30 s TTL runs out. The bound is far from
        # both (no assertion on this machine's speed); the time taken is printed.
        ok = self.poll(released, timeout=10, interval=0.02)
        elapsed = time.monotonic() - t0
        print("\nbound agent SIGKILLed: lease released after %.3f s (mode %s)" % (elapsed, self.MODE))
        self.assertTrue(ok, "the lease of a SIGKILLed agent was not released within 10 s (its TTL is 30 s)")
        if self.server:
            self.assertProblem(self.server_lease("killme"), 404)
        # The memory is free again.
        self.attach_ok("killme-again", path)

    def test_relative_path_of_a_client_gone_never_means_the_daemons_directory(self):
        # SO_PEERCRED names the process that connected. Here it connects and exits, and its
        # child (elsewhere) sends a relative path on the inherited socket: the working
        # directory of the process that connected can no longer be read. The answer is 400,
        # never a file in the daemon's own working directory.
        cwd = os.path.join(self.tmp, "client-cwd")
        os.makedirs(cwd)
        script = ("import os,socket,sys,time\n"
                  "s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
                  "parent=os.getpid()\n"
                  "if os.fork(): os._exit(0)\n"
                  "while os.getppid() == parent: time.sleep(0.01)\n"  # until the parent has exited
                  "b=b'{\"path\":\"gone-client.uai\"}'\n"
                  "s.sendall(b'POST /v1/init HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json\\r\\n'"
                  "+b'Content-Length: %d\\r\\n\\r\\n' % len(b) + b)\n"
                  "print(s.recv(65536).split(b'\\r\\n')[0].decode())\n")
        p = subprocess.run(["python3", "-c", script, self.mepd.socket_path], cwd=cwd, timeout=30,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=True)
        # (The pipe stays open until the child ends, so its answer is in stdout.)
        self.assertIn("HTTP/1.1 400", p.stdout.decode())
        for d in (self.tmp, cwd, "/"):
            self.assertFalse(os.path.exists(os.path.join(d, "gone-client.uai")), d)

    def test_other_uid_refused(self):
        if os.geteuid() != 0:
            print("\nskipping test_other_uid_refused: needs root to run a client as 'nobody'")
            self.skipTest("needs root to run a client as nobody")
        import pwd
        nobody = pwd.getpwnam("nobody")
        # Open the way to the socket, so that only the daemon's SO_PEERCRED check is left.
        d = os.path.dirname(self.mepd.socket_path)
        while True:
            os.chmod(d, 0o711)
            if d == self.tmp or d == "/":
                break
            d = os.path.dirname(d)
        os.chmod(self.mepd.socket_path, 0o666)
        path = self.new_file("victim.uai")
        os.chmod(self.data, 0o755)
        os.chmod(path, 0o644)

        def as_nobody():
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)

        python = world_executable_python()
        if python is None:
            print("\nskipping test_other_uid_refused: no Python interpreter that 'nobody' may run")
            self.skipTest("no Python interpreter that nobody may run")
        p = subprocess.run([python, "-c", OTHER_UID_SCRIPT, self.mepd.socket_path, path],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=as_nobody, cwd="/",
                           env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, timeout=60, check=False)
        self.assertEqual(p.returncode, 0, p.stderr)
        out = json.loads(p.stdout)
        print("\nclient as uid %d: %s" % (nobody.pw_uid, json.dumps(out)[:400]))
        for target, res in out.items():
            self.assertNotIn("connect_error", res, "the socket was not reachable; the test set-up is wrong")
            data = res.get("data", "")
            if data:
                head, _, body = data.partition("\r\n\r\n")
                self.assertTrue(head.startswith("HTTP/1.1 403"), data[:300])
                self.assertIn("application/problem+json", head.lower())
                self.assertIn("x-request-id:", head.lower())
                self.assertEqual(json.loads(body)["code"], "forbidden")
        # The CLI says so each time, with the auth status 7: the daemon answers and closes
        # without reading the request, and the answer is read even when sending failed.
        # A copy of mep that 'nobody' may run wherever the checkout is (a clone under a 0700
        # directory is out of its reach).
        bindir = os.path.join(self.tmp, "nobody-bin")
        os.makedirs(bindir, exist_ok=True)
        os.chmod(bindir, 0o755)
        mep_copy = os.path.join(bindir, "mep")
        shutil.copy2(mep_bin(), mep_copy)
        os.chmod(mep_copy, 0o755)
        for args in (["status"], ["claim", "victim", path]) * 5:
            p = subprocess.run([mep_copy, "--socket", self.mepd.socket_path, *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, preexec_fn=as_nobody, cwd="/",
                               env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, timeout=30, check=False)
            self.assertEqual(p.returncode, 7, (args, p.stderr))
        self.assertEqual(self.client.leases(), {})
        self.assertEqual(self.client.request("GET", "/healthz").status, 200)
        # With the socket closed to others again (0600) the kernel refuses the connect: the
        # same status 7, and a message that says whose socket it is, not "start mepd".
        os.chmod(self.mepd.socket_path, 0o600)
        p = subprocess.run([mep_copy, "--socket", self.mepd.socket_path, "status"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, preexec_fn=as_nobody, cwd="/",
                           env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, timeout=30, check=False)
        self.assertEqual(p.returncode, 7, p.stderr)
        self.assertIn(b"the socket belongs to another user", p.stderr)
        self.assertNotIn(b"start it with", p.stderr)

    def test_daemon_restart_readopts_leases(self):
        path = self.new_file("restart.uai")
        lease = self.attach_ok("restart-me", path, ttl_seconds=30, bind="none")
        # A second lease, bound to an agent that dies while the daemon is down.
        agent = self.spawn_agent("orphan", self.new_file("orphan.uai"))
        self.assertEqual(agent.report["status"], 201, agent.report)
        before = self.lease_expiry("restart-me")
        self.mepd.proc.kill9()
        agent.kill()
        agent.wait(timeout=10)
        time.sleep(1.5)  # so that a renewal after the restart visibly moves expires_at
        self.mepd.start()

        leases = self.client.leases()
        adopted = leases.get("restart-me")
        self.assertIsNotNone(adopted, "the lease was not re-adopted")
        self.assertEqual(adopted["fencing_token"], lease["fencing_token"])
        self.assertEqual(adopted["lease_id"], lease["lease_id"])
        self.assertEqual(adopted["memory_instance_id"], lease["memory_instance_id"])
        self.assertEqual(adopted["path"], path)
        self.assertEqual(adopted["state"], "held")
        self.assertIsNone(adopted["bind_pid"])
        # The dead agent's lease is released, not re-adopted.
        # (Its TTL is 30 s: gone within 10 s is released, not expired.)
        self.assertTrue(self.poll(lambda: "orphan" not in self.client.leases(), timeout=10),
                        "the lease of an agent that died while the daemon was down was kept")
        if self.server:
            self.assertTrue(self.poll(lambda: self.server_lease("orphan").status == 404, timeout=10))

        # Renewed with the stored token: the (server-side) expiry moves forward, same token.
        def moved():
            e = self.lease_expiry("restart-me")
            return e[0] > before[0] and e

        after = self.poll(moved, timeout=8, interval=0.2)
        self.assertTrue(after, "the expiry did not move forward after the restart")
        self.assertEqual(after[1], lease["fencing_token"])
        print("\nre-adopted (%s): expires_at %s -> %s" % (self.MODE, before[0].isoformat(), after[0].isoformat()))
        # Still the holder: detach releases it with the stored token.
        self.assertEqual(self.client.detach("restart-me").status, 204)
        if self.server:
            self.assertProblem(self.server_lease("restart-me"), 404)
        again = self.attach_ok("restart-me", path)
        self.assertGreater(again["fencing_token"], lease["fencing_token"])


class RemoteBasicTests(BasicCases, DaemonTestCase):
    MODE = "remote"


class EmbeddedBasicTests(BasicCases, DaemonTestCase):
    MODE = "embedded"


class RemoteDaemonTests(DaemonTestCase):
    MODE = "remote"

    def test_bad_option_values_are_usage_errors(self):
        # mepd(8): a malformed option value exits 2 with one line, before the state directory
        # is touched, as mep server does for the same URL.
        token = os.path.join(self.tmp, "usage-token")
        with open(token, "w") as f:
            f.write("mep_not_checked_before_use\n")
        cp = self.mepd.control_plane
        cases = [
            (["--control-plane", "http://example.com", "--token-file", token], "loopback"),
            (["--control-plane", "ftp://127.0.0.1:1", "--token-file", token], "must start with https:// or http://"),
            (["--control-plane", cp], "needs a token"),
            (["--control-plane", cp, "--token-file", os.path.join(self.tmp, "absent")], "cannot read the token file"),
            (["--store", "ftp://x", "--store-token-file", token], "must start with https:// or http://"),
            (["--store", "http://127.0.0.1:1"], "--store needs --store-token-file"),
        ]
        env = {k: v for k, v in self.env.items() if k != "MEP_TOKEN"}
        for i, (extra, says) in enumerate(cases):
            state = os.path.join(self.tmp, "usage-state-%d" % i)
            sock = os.path.join(self.tmp, "usage-%d.sock" % i)
            p = subprocess.run([mepd_bin(), "--socket", sock, "--state-dir", state] + extra, env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               timeout=20, check=False)
            err = p.stderr.decode()
            self.assertEqual(p.returncode, 2, (extra, err))
            self.assertIn(says, err, extra)
            self.assertEqual(len(err.strip().splitlines()), 1, err)
            self.assertFalse(os.path.exists(state), extra)
            self.assertFalse(os.path.exists(sock), extra)

    def test_paths_never_reach_control_plane(self):
        # Replace the daemon by one that reaches the server through a recording proxy.
        self.mepd.stop()
        proxy = RecordingProxy("127.0.0.1", self.server.port)
        self.addCleanup(proxy.stop)
        self.mepd = self.start_mepd(control_plane=proxy.url, token=self.token, tag="mepd-proxied",
                                    log_level="debug")
        client = self.mepd.client()
        events = EventStream(self.mepd.socket_path)
        self.addCleanup(events.close)

        tag = uuid.uuid4().hex[:12]
        markers = {
            "directory": "PATHMARK%s" % tag,
            "file name": "FILEMARK%s" % tag,
            "branch name": "BRANCHMARK%s" % tag,
            "content": "CONTENTMARK%s" % tag,
        }
        secret_dir = os.path.join(self.data, markers["directory"])
        os.makedirs(secret_dir)
        path = os.path.join(secret_dir, markers["file name"] + ".uai")
        content = (markers["content"] + " learned facts ") * 64
        with open(path, "wb") as f:
            f.write(content.encode())
        branch_path = os.path.join(secret_dir, markers["branch name"] + ".uai")

        lease = client.attach("privacy-agent", path, ttl_seconds=6).json
        self.assertEqual(lease["state"], "held", lease)
        # Let at least one renewal pass through the proxy.
        self.assertIsNotNone(events.wait_for(lambda e: e["event"] == "renewed", timeout=8), "no renewal seen")
        self.assertEqual(client.identify(path).status, 200)
        r = client.request("POST", "/v1/branch", {"path": path, "new_path": branch_path})
        self.assertEqual(r.status, 201, r)
        with open(branch_path, "ab") as f:  # the branch diverges (else a copy would be ambiguous)
            f.write((markers["branch name"] + " new thoughts").encode())
        self.assertEqual(client.attach("privacy-branch", branch_path, ttl_seconds=6).status, 201)
        self.assertEqual(client.identify(branch_path).status, 200)
        self.assertEqual(client.detach("privacy-branch").status, 204)
        self.assertEqual(client.detach("privacy-agent").status, 204)
        # And the copy case: fingerprint matching stays local too.
        copy = os.path.join(secret_dir, "copy-" + markers["file name"] + ".uai")
        shutil.copyfile(path, copy)
        self.assertEqual(client.identify(copy).json["memory_instance_id"], lease["memory_instance_id"])
        self.assertEqual(client.attach("privacy-copy", copy, ttl_seconds=6).status, 201)
        self.assertEqual(client.detach("privacy-copy").status, 204)
        self.mepd.stop()  # flushes the daemon's log

        up, down = proxy.recorded("up"), proxy.recorded("down")
        self.assertIn(b"POST /v1/leases/renew-batch", up)
        self.assertIn(b"POST /v1/memories/branch", up)
        self.assertIn(b"POST /v1/leases/release", up)
        self.assertIn(lease["memory_instance_id"].encode(), up)
        audit = subprocess.run([mep_bin(), "server", "audit", "--db", self.server.db, "--limit", "1000", "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env, timeout=60,
                               check=False)
        self.assertEqual(audit.returncode, 0, audit.stderr)
        db_bytes = self.server.stored_bytes()
        haystacks = {
            "bytes sent to the control plane": up,
            "bytes received from the control plane": down,
            "server log": self.server.log_text().encode(),
            "daemon log": self.mepd.log_text().encode(),
            "audit rows": audit.stdout,
            "server database": db_bytes,
        }
        needles = dict(markers)
        needles["path"] = path
        needles["data directory"] = self.data
        needles["content bytes"] = content[:200]
        for where, hay in haystacks.items():
            for what, needle in needles.items():
                with self.subTest(where=where, what=what):
                    self.assertNotIn(needle.encode(), hay, "%s found in the %s" % (what, where))
        print("\nproxy recorded %d bytes up, %d bytes down; no path, file name or content in them"
              % (len(up), len(down)))

    def test_partition_marks_lost_and_signals_child(self):
        events = EventStream(self.mepd.socket_path)
        self.addCleanup(events.close)
        self.assertEqual(events.headers.get("content-type"), "application/x-ndjson")
        path = self.new_file("partition.uai")
        lease = self.attach_ok("partition-me", path, ttl_seconds=6, bind="none")
        self.assertIsNotNone(events.wait_for(lambda e: e["event"] == "granted" and
                                             e["canonical_name"] == "partition-me", timeout=5))
        # One renewal first, so the session is in its steady state.
        self.assertIsNotNone(events.wait_for(lambda e: e["event"] == "renewed", timeout=6), "no renewal")

        server_proc = self.server.proc
        self.addCleanup(server_proc.signal, signal.SIGCONT)
        server_proc.signal(signal.SIGSTOP)
        t_stop = time.monotonic()
        try:
            lost = events.wait_for(lambda e: e["event"] == "lost" and e["canonical_name"] == "partition-me",
                                   timeout=12)
            self.assertIsNotNone(lost, "no lost event within 12 s of the partition")
            t_lost, wall_lost, ev = lost
            local = self.client.request("GET", "/v1/leases/partition-me")
            self.assertEqual(local.status, 200, local)
            self.assertEqual(local.json["state"], "lost")
            self.assertNotIn("fencing_token", local.json)  # a lost token is not handed out
            server_expiry = parse_time(local.json["expires_at"])  # the last expiry the server granted
            print("\npartition: lost %.2f s after SIGSTOP (reason %s); server expiry %.2f s after the event"
                  % (t_lost - t_stop, ev.get("reason"), (server_expiry - wall_lost).total_seconds()))
            self.assertLess(wall_lost, server_expiry, "lost arrived after the server-side expiry")
            self.assertLess(parse_time(ev["at"]), server_expiry)
            kinds = [e["event"] for _, _, e in events.events if e.get("canonical_name") == "partition-me"]
            print("events: %s" % kinds)
            self.assertEqual(kinds[0], "granted")
            self.assertEqual(kinds.count("lost"), 1, kinds)
            # held → degraded (renewals failing, deadline not reached) → lost (SPEC §4).
            self.assertIn("degraded", kinds[:kinds.index("lost")], kinds)
        finally:
            server_proc.signal(signal.SIGCONT)
        self.assertTrue(lease["fencing_token"] >= 1)
        # After the partition heals the daemon does not resurrect the lease.
        time.sleep(1)
        self.assertEqual(self.client.leases()["partition-me"]["state"], "lost")
        # Branching needs a live lease: a lost one is an ended lease (410), not none (404).
        r = self.client.request("POST", "/v1/branch", {"path": path, "new_path": path + ".branch"})
        self.assertProblem(r, 410, "lease-expired")
        self.assertFalse(os.path.exists(path + ".branch"))
        # A new attach replaces the lost record with a fresh grant (once the old one expired).
        def reattached():
            r = self.client.attach("partition-me", path, ttl_seconds=6, bind="none")
            return r.status == 201 and r
        r = self.poll(reattached, timeout=10, interval=0.5)
        self.assertTrue(r, "could not attach again after the old lease expired")
        self.assertGreater(r.json["fencing_token"], lease["fencing_token"])
        self.assertEqual(r.json["state"], "held")

    def test_renewals_are_batched(self):
        # Attached at once (one after another, on a loaded machine, they spread over seconds
        # and come due apart), then two renewals of each (every ttl/3 = 2 s) are waited for.
        paths = [self.new_file("batch-%02d.uai" % i) for i in range(20)]
        barrier = threading.Barrier(len(paths))
        results = [None] * len(paths)

        def agent(i):
            c = DaemonClient(self.mepd.socket_path)
            barrier.wait(timeout=30)
            results[i] = c.attach("batch-%02d" % i, paths[i], ttl_seconds=6)

        threads = [threading.Thread(target=agent, args=(i,)) for i in range(len(paths))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        self.assertEqual([r.status for r in results], [201] * len(paths), [r for r in results if r.status != 201][:3])
        t_attached = time.monotonic()
        deadline = t_attached + 60
        while self.client.metrics()["mepd_renewed_leases_total"] < 40:
            self.assertLess(time.monotonic(), deadline, self.client.metrics())
            time.sleep(0.1)
        m = self.client.metrics()
        batches = m["mepd_renew_batches_total"]
        renewed = m["mepd_renewed_leases_total"]
        print("\nrenewals after %.1f s: %d leases in %d renew-batch calls (%.1f per batch)"
              % (time.monotonic() - t_attached, renewed, batches, renewed / max(batches, 1)))
        self.assertGreaterEqual(renewed, 20, m)
        self.assertLessEqual(batches * 4, renewed, "renewals are not batched: %s" % m)
        self.assertEqual(m["mepd_leases_lost_total"], 0)
        leases = self.client.leases()
        self.assertEqual(len(leases), 20)
        self.assertTrue(all(l["state"] == "held" for l in leases.values()), leases)


    def test_a_swarm_attaching_at_once_is_claimed_in_batches(self):
        # 64 agents attach through one daemon at the same instant: their claims go to the
        # control plane together (claim-batch), each answered as if alone.
        n = 64
        paths = [self.new_file("swarm-%02d.uai" % i) for i in range(n)]
        barrier = threading.Barrier(n)
        results = [None] * n

        def agent(i):
            c = DaemonClient(self.mepd.socket_path)
            barrier.wait(timeout=30)
            results[i] = c.attach("swarm-%02d" % i, paths[i], ttl_seconds=30)

        threads = [threading.Thread(target=agent, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        self.assertEqual([r.status for r in results], [201] * n, [r for r in results if r.status != 201][:3])
        leases = self.client.leases()
        self.assertEqual(len([k for k in leases if k.startswith("swarm-")]), n)
        metrics = self.server.request("GET", "/metrics", self.token).body.decode()
        batched = [l for l in metrics.splitlines()
                   if l.startswith("mep_http_request_duration_seconds_count") and "claim-batch" in l]
        self.assertTrue(batched and all(float(l.rpartition(" ")[2]) > 0 for l in batched), metrics[-2000:])
        self.assertIn('code="200"', " ".join(batched))

class ReleaseOutcome(DaemonTestCase):
    """mep release ends the lease on this host whatever happens; when the control plane does
    not confirm it, the exit status and message say so (it printed "released" and exited 0
    when the control plane was down, the lease superseded there, or the token revoked)."""

    def mep(self, *args):
        p = subprocess.run([mep_bin(), "--socket", self.mepd.socket_path, *args], capture_output=True, text=True,
                           env=self.env, cwd=self.data, timeout=60)
        return p.returncode, p.stdout, p.stderr

    def claim(self, name):
        rc, out, err = self.mep("claim", name, self.new_file(name + ".uai"))
        self.assertEqual(rc, 0, err)

    def held_here(self):
        return [l["canonical_name"] for l in self.client.request("GET", "/v1/leases").json["leases"]]

    def test_confirmed_superseded_revoked_and_unreachable(self):
        self.claim("fine")
        self.assertEqual(self.mep("release", "fine"), (0, "released fine\n", ""))
        # Revoked by an admin and granted to another holder there: superseded (4), and the
        # other holder's lease is untouched.
        admin = self.server.token("tenant-a", admin=True)

        def supersede(name):
            memory = self.client.request("GET", "/v1/leases/" + name).json["memory_instance_id"]
            r = self.server.request("POST", "/v1/admin/leases/revoke", admin, {"canonical_name": name})
            self.assertEqual(r.status, 204, r)
            r = self.server.request("POST", "/v1/leases", self.token, {"display_name": name, "memory_instance_id": memory,
                                                                      "owner_client_id": "someone-else"},
                                    idempotency_key=str(uuid.uuid4()))
            self.assertEqual(r.status, 201, r)
            return r.json["fencing_token"]

        self.claim("superseded")
        token = supersede("superseded")
        rc, out, err = self.mep("release", "superseded")
        self.assertEqual(rc, 4, err)
        self.assertIn("did not confirm", err)
        self.assertIn("superseded", err.lower())
        self.assertNotIn("superseded", self.held_here())
        self.assertEqual(self.server_lease("superseded").json["fencing_token"], token)
        # --json: the daemon's answer, with the control plane's problem.
        self.claim("as-json")
        supersede("as-json")
        rc, out, err = self.mep("--json", "release", "as-json")
        self.assertEqual(rc, 4, err)
        self.assertEqual(json.loads(out)["control_plane"]["code"], "stale-fence")
        # The control plane down: ended here, not there (5); the name stays held there until
        # the lease expires, and the message says so.
        self.claim("unreachable")
        # mep run's release at the command's exit says so too; the command's status stands.
        go = os.path.join(self.data, "go")
        run = subprocess.Popen([mep_bin(), "--socket", self.mepd.socket_path, "run", "running",
                                self.new_file("running.uai"), "--", "sh", "-c",
                                'while [ ! -e "$1" ]; do sleep 0.05; done', "sh", go],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env, cwd=self.data)
        self.addCleanup(lambda: run.poll() is None and (run.kill(), run.wait()))
        self.assertTrue(self.poll(lambda: "running" in self.held_here(), 20))
        self.server.stop()
        rc, out, err = self.mep("release", "unreachable")
        self.assertEqual(rc, 5, err)
        self.assertIn("did not confirm", err)
        self.assertIn("until the lease expires", err)
        self.assertEqual(self.held_here(), ["running"])
        open(go, "w").close()
        out, err = run.communicate(timeout=60)
        self.assertEqual(run.returncode, 0, err)
        self.assertIn("released running on this host, but the control plane did not confirm it", err)
        self.assertEqual(self.held_here(), [])

    def test_a_revoked_daemon_token_is_said_in_the_log_and_by_release(self):
        # Renewals refused with 401 left no word in mepd's log: the leases went degraded, then
        # "lost: deadline", and an operator looked for a network problem.
        rc, out, err = self.mep("claim", "--ttl", "6", "refused", self.new_file("refused.uai"))
        self.assertEqual(rc, 0, err)
        listed = subprocess.run([mep_bin(), "token", "list", "--db", self.server.db, "--json"], capture_output=True,
                                text=True, env=self.env, timeout=60)
        self.assertEqual(listed.returncode, 0, listed.stderr)
        ids = [t["token_id"] for t in json.loads(listed.stdout)["tokens"]]
        self.assertEqual(len(ids), 1, listed.stdout)
        revoked = subprocess.run([mep_bin(), "token", "revoke", "--db", self.server.db, ids[0]], capture_output=True,
                                 text=True, env=self.env, timeout=60)
        self.assertEqual(revoked.returncode, 0, revoked.stderr)
        self.assertTrue(self.poll(lambda: "refuses this daemon's token" in self.mepd.log_text(), 15),
                        self.mepd.log_text()[-2000:])
        self.assertEqual(self.mepd.log_text().count("refuses this daemon's token"), 1)
        rc, out, err = self.mep("release", "refused")
        self.assertEqual(rc, 7, err)
        self.assertIn("did not confirm", err)


if __name__ == "__main__":
    unittest.main()
