"""A system mepd for a shared host (SPEC §7, issue 23): `mepd --system` serves root and the
members of the group `mep` on a 0660 socket; each user sees and acts on only the leases it
attached; a file is attached, created, copied or read only with the asking user's own
rights (never the daemon's); the control plane sees no uid, user name or path.

Real processes: users and a group made for the test (useradd/groupadd, removed at the end),
the real `mep` CLI run as each of them, and mepd run as root and — the packaged set-up — as
an unprivileged user holding only CAP_SETUID and CAP_SETGID (setpriv). Needs root; skips
with the reason otherwise.
"""
import grp
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import unittest

from daemonfixture import Proc, clean_env, mepd_bin
from mephelpers import mep_bin, wait_for
from storefixture import MepStore, new_store_token

GROUP = "mep"
TIMEOUT_S = 30

# Reads GET /v1/events on argv[1]: says "ready" on stderr once the stream's headers came,
# and stops at the `released` event of the name argv[2] (or after argv[3] seconds); then
# writes all it read to stdout.
EVENTS_SCRIPT = r"""
import json, socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(b"GET /v1/events HTTP/1.1\r\nHost: localhost\r\n\r\n")
s.settimeout(0.2)
end = time.monotonic() + float(sys.argv[3])
data = b""
ready = False
while time.monotonic() < end:
    try:
        chunk = s.recv(65536)
    except socket.timeout:
        continue
    if not chunk:
        break
    data += chunk
    if not ready and b"\r\n\r\n" in data:
        ready = True
        sys.stderr.write("ready\n")
        sys.stderr.flush()
    if any('"released"' in l and sys.argv[2] in l for l in data.decode("utf-8", "replace").splitlines()):
        break
sys.stdout.write(data.decode("utf-8", "replace"))
"""

# Holds a kernel write lease on argv[1] (its owner's own file) for argv[2] seconds, with the
# lease-break signal ignored: whoever opens the file without O_NONBLOCK waits out
# /proc/sys/fs/lease-break-time.
LEASE_SCRIPT = r"""
import fcntl, os, signal, sys, time
signal.signal(signal.SIGIO, signal.SIG_IGN)
fd = os.open(sys.argv[1], os.O_WRONLY)
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
print("leased", flush=True)
time.sleep(float(sys.argv[2]))
"""

# Connects to argv[1] from a forked child that exits (and is reaped) before anything is sent,
# then attaches argv[2] under argv[3] on the inherited connection: SO_PEERCRED names a PID
# that is gone. Prints [status, body].
ORPHAN_ATTACH_SCRIPT = r"""
import http.client, json, os, socket, sys
s = socket.socket(socket.AF_UNIX)
pid = os.fork()
if pid == 0:
    s.connect(sys.argv[1])
    os._exit(0)
os.waitpid(pid, 0)
s.settimeout(20)
c = http.client.HTTPConnection("localhost")
c.sock = s
c.request("POST", "/v1/attach", body=json.dumps({"name": sys.argv[3], "path": sys.argv[2], "bind": "none"}),
          headers={"Content-Type": "application/json"})
r = c.getresponse()
print(json.dumps([r.status, json.loads(r.read() or b"{}")]))
"""

# Holds GET /v1/events streams to argv[1] (receive buffers of 1 KiB), never reading them past
# their status line. Commands on stdin, each answered with one JSON line: "open N" opens N more
# (the statuses they got, 0: none); "drain S" reads the first stream for up to S seconds
# ({"closed": whether it ended, "bytes": how many came}). Ends on EOF, or after argv[2] seconds.
STREAMS_SCRIPT = r"""
import json, signal, socket, sys, time
signal.alarm(int(sys.argv[2]))
held = []
for line in sys.stdin:
    word, n = line.split()
    if word == "drain":
        s, got, closed = held[0], 0, False
        end = time.monotonic() + float(n)
        while time.monotonic() < end:
            s.settimeout(max(0.01, end - time.monotonic()))
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                closed = True
                break
            got += len(chunk)
        print(json.dumps({"closed": closed, "bytes": got}), flush=True)
        continue
    statuses = []
    for _ in range(int(n)):
        s = socket.socket(socket.AF_UNIX)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        s.settimeout(10)
        head = b""
        try:
            s.connect(sys.argv[1])
            s.sendall(b"GET /v1/events HTTP/1.1\r\nHost: localhost\r\n\r\n")
            while b"\r\n" not in head:
                chunk = s.recv(1)
                if not chunk:
                    break
                head += chunk
        except OSError:
            pass
        words = head.split(b" ")
        statuses.append(int(words[1]) if len(words) > 2 and words[1].isdigit() else 0)
        held.append(s)
    print(json.dumps(statuses), flush=True)
"""

# As its user, in its working directory: makes argv[2] files and attaches each (ttl 5 s, bind
# none) on one connection to argv[1]; prints the statuses.
ATTACH_MANY_SCRIPT = r"""
import http.client, json, os, socket, sys
class C(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(sys.argv[1])
        self.sock.settimeout(20)
c, statuses = C("localhost"), []
for i in range(int(sys.argv[2])):
    path = os.path.abspath("r%d.uai" % i)
    with open(path, "w") as f:
        f.write("renewed memory %d\n" % i)
    c.request("POST", "/v1/attach", body=json.dumps({"name": "bob-renewed-%d" % i, "path": path, "ttl_seconds": 5,
                                                     "bind": "none"}), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    r.read()
    statuses.append(r.status)
print(json.dumps(statuses))
"""


# Opens argv[2] connections, each a POST /v1/attach of name argv[3] on file argv[4] that may wait
# 60 s; after 2 s, prints each one's status (0: still waiting) and keeps them open until stdin closes.
WAITS_SCRIPT = r"""
import json, select, socket, sys, time
body = json.dumps({"name": sys.argv[3], "path": sys.argv[4], "wait_seconds": 60}).encode()
socks = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    s.sendall(b"POST /v1/attach HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    socks.append(s)
# The attaches past the member's share are answered once mepd has handled them (each after a
# claim refused 423); the others wait their 60 s. Wait for two answers (not for a time: a
# loaded machine may take longer), then a second more, in which a third would show.
heads = {}
deadline = time.monotonic() + 30
while len(heads) < 2 and time.monotonic() < deadline:
    for s in select.select([s for s in socks if s not in heads], [], [], 0.5)[0]:
        heads[s] = s.recv(4096)
for s in select.select([s for s in socks if s not in heads], [], [], 1)[0]:
    heads[s] = s.recv(4096)
statuses = []
for s in socks:
    words = heads.get(s, b"").split(b" ")
    statuses.append(int(words[1]) if len(words) > 2 and words[1].isdigit() else 0)
print(json.dumps(statuses), flush=True)
sys.stdin.read()
"""

def run(argv, **kw):
    return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=TIMEOUT_S, check=False, **kw)


class Users:
    """Users and the group `mep` made for one test class, removed afterwards."""

    def __init__(self):
        self.made_group = False
        self.users = []

    def group(self):
        try:
            return grp.getgrnam(GROUP).gr_gid
        except KeyError:
            p = run(["groupadd", "--system", GROUP])
            if p.returncode != 0:
                raise unittest.SkipTest("cannot create the group mep: %s" % p.stderr.decode().strip())
            self.made_group = True
            return grp.getgrnam(GROUP).gr_gid

    def add(self, name, in_group):
        argv = ["useradd", "--no-create-home", "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin",
                "--user-group"]
        if in_group:
            argv += ["--groups", GROUP]
        p = run(argv + [name])
        if p.returncode != 0:
            raise AssertionError("useradd %s failed: %s" % (name, p.stderr.decode()))
        self.users.append(name)
        return pwd.getpwnam(name)

    def remove(self):
        for u in self.users:
            run(["userdel", u])
        if self.made_group:
            run(["groupdel", GROUP])


@unittest.skipUnless(shutil.which("useradd") and shutil.which("setpriv"), "needs useradd and setpriv (passwd, util-linux)")
class SystemDaemon(unittest.TestCase):
    """mepd --system run as root."""

    DAEMON_USER = False  # run mepd as an unprivileged user with CAP_SETUID/CAP_SETGID instead

    @classmethod
    def setUpClass(cls):
        if os.geteuid() != 0:
            print("\nskipping the system mepd tests: they create users and run commands as them (needs root)")
            raise unittest.SkipTest("needs root to create users")
        cls.accounts = Users()
        try:
            cls.gid_mep = cls.accounts.group()
            tag = "%x" % (os.getpid() & 0xfffff)
            cls.alice = cls.accounts.add("mepa" + tag, True)
            cls.bob = cls.accounts.add("mepb" + tag, True)
            cls.carol = cls.accounts.add("mepc" + tag, False)  # not in the group
            cls.daemon_user = cls.accounts.add("mepd" + tag, True) if cls.DAEMON_USER else None
        except BaseException:
            cls.accounts.remove()
            raise

    @classmethod
    def tearDownClass(cls):
        cls.accounts.remove()

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="mep-system-")
        os.chmod(self.tmp, 0o755)
        # Copies of the binaries every user may run (the checkout may sit under a 0700 home).
        self.bin = os.path.join(self.tmp, "bin")
        os.makedirs(self.bin)
        os.chmod(self.bin, 0o755)
        for src, name in ((mep_bin(), "mep"), (mepd_bin(), "mepd")):
            shutil.copy2(src, os.path.join(self.bin, name))
            os.chmod(os.path.join(self.bin, name), 0o755)
        self.mep = os.path.join(self.bin, "mep")
        self.socket = os.path.join(self.tmp, "run", "mepd.sock")
        self.state = os.path.join(self.tmp, "state")
        home = os.path.join(self.tmp, "daemon-home")
        self.env = clean_env(home)
        # A data plane, so that sync and fetch are there to be abused.
        _, hashes = new_store_token(self.tmp)
        self.store = MepStore(self.tmp, os.path.join(self.tmp, "store-data"), ["--token-file", hashes]).start()
        self.addCleanup(self.store.stop)
        store_token = os.path.join(self.tmp, "store.token")
        os.chmod(store_token, 0o600)
        if self.daemon_user:
            os.chown(store_token, self.daemon_user.pw_uid, self.daemon_user.pw_gid)
        argv = [os.path.join(self.bin, "mepd"), "--system", "--socket", self.socket, "--state-dir", self.state,
                "--store", "http://127.0.0.1:%d" % self.store.port, "--store-token-file", store_token]
        if self.daemon_user:
            # The packaged unit's set-up: the daemon's own user, with two capabilities only;
            # /run/mep as tmpfiles.d makes it (0750, the daemon's user, the group mep).
            os.makedirs(self.state, mode=0o700)
            u = self.daemon_user
            os.makedirs(os.path.dirname(self.socket), mode=0o750)
            os.chown(os.path.dirname(self.socket), u.pw_uid, self.gid_mep)
            os.chmod(os.path.dirname(self.socket), 0o750)
            for d in (self.state, home, *[os.path.join(home, x) for x in os.listdir(home)]):
                os.chown(d, u.pw_uid, u.pw_gid)
            os.chmod(home, 0o700)
            argv = ["setpriv", "--reuid", str(u.pw_uid), "--regid", str(u.pw_gid), "--init-groups",
                    "--inh-caps=+setuid,+setgid", "--ambient-caps=+setuid,+setgid", "--bounding-set=-all,+setuid,+setgid",
                    *argv]
            self.env["HOME"] = home
        self.mepd = Proc("mepd", argv, self.env, os.path.join(self.tmp, "mepd.log"), cwd="/")
        self.mepd.wait_for_log(r"listening on .* for the group mep \(system mode\)")
        self.homes = {}
        for user in (self.alice, self.bob, self.carol):
            d = os.path.join(self.tmp, user.pw_name)
            os.makedirs(d)
            os.chown(d, user.pw_uid, user.pw_gid)
            os.chmod(d, 0o700)
            self.homes[user.pw_name] = d

    def tearDown(self):
        self.mepd.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # ---- helpers ----

    def as_user(self, user, args, cwd=None, umask=0o077):
        groups = [g.gr_gid for g in grp.getgrall() if user.pw_name in g.gr_mem]

        def drop():
            os.setgroups(groups)
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            os.umask(umask)

        env = {"PATH": "/usr/bin:/bin", "HOME": self.homes.get(user.pw_name, "/")}
        return run(args, preexec_fn=drop, cwd=cwd or self.homes.get(user.pw_name, "/"), env=env)

    def mep_as(self, user, *args, cwd=None, umask=0o077):
        return self.as_user(user, [self.mep, "--socket", self.socket, *args], cwd=cwd, umask=umask)

    def mep_root(self, *args):
        return run([self.mep, "--socket", self.socket, *args], env={"PATH": "/usr/bin:/bin", "HOME": self.tmp})

    def names(self, p):
        self.assertEqual(p.returncode, 0, p.stderr.decode())
        return sorted(lease["canonical_name"] for lease in json.loads(p.stdout)["leases"])

    def ok(self, p):
        self.assertEqual(p.returncode, 0, "exit %d: %s" % (p.returncode, p.stderr.decode()))
        return p

    def refused(self, p, code, words):
        self.assertEqual(p.returncode, code, "exit %d, wanted %d: %s%s" % (p.returncode, code, p.stdout.decode(),
                                                                          p.stderr.decode()))
        self.assertIn(words, p.stderr.decode())
        self.assertEqual(len(p.stderr.decode().strip().splitlines()), 1, p.stderr.decode())

    # ---- the tests ----

    def test_socket_is_the_groups_and_others_are_refused(self):
        st = os.stat(self.socket)
        self.assertEqual(st.st_mode & 0o7777, 0o660)
        self.assertEqual(st.st_gid, self.gid_mep)
        dst = os.stat(os.path.dirname(self.socket))
        self.assertEqual(dst.st_mode & 0o7777, 0o750)
        self.assertEqual(dst.st_gid, self.gid_mep)
        # Not in the group: the socket is out of reach (and, were it reachable, SO_PEERCRED
        # refuses the uid: 403, exit 7).
        p = self.mep_as(self.carol, "status")
        self.assertNotEqual(p.returncode, 0)
        os.chmod(os.path.dirname(self.socket), 0o755)
        os.chmod(self.socket, 0o666)
        p = self.mep_as(self.carol, "status")
        self.refused(p, 7, "not allowed")
        self.assertIn("refused a client with uid %d" % self.carol.pw_uid, self.mepd.log_text())
        self.ok(self.mep_as(self.alice, "status"))

    def test_each_user_sees_and_acts_on_only_its_own_leases(self):
        a, b = self.alice, self.bob
        ahome, bhome = self.homes[a.pw_name], self.homes[b.pw_name]
        # mep init creates the file as the user (owner, umask), where the user may.
        self.ok(self.mep_as(a, "init", "a.uai", umask=0o027))
        st = os.stat(os.path.join(ahome, "a.uai"))
        self.assertEqual((st.st_uid, st.st_gid), (a.pw_uid, a.pw_gid))
        self.assertEqual(st.st_mode & 0o777, 0o640)
        self.ok(self.mep_as(a, "claim", "alice-agent", "a.uai"))
        self.ok(self.mep_as(b, "init", "b.uai"))
        self.ok(self.mep_as(b, "claim", "bob-agent", "b.uai"))
        self.assertEqual(self.names(self.mep_as(a, "status", "--json")), ["alice-agent"])
        self.assertEqual(self.names(self.mep_as(b, "status", "--json")), ["bob-agent"])
        self.assertEqual(self.names(self.mep_root("status", "--json")), ["alice-agent", "bob-agent"])
        # Another user's lease is 404 to bob: release, sync, verify; alice keeps it.
        self.refused(self.mep_as(b, "release", "alice-agent"), 1, "no lease")
        self.assertEqual(self.names(self.mep_as(a, "status", "--json")), ["alice-agent"])
        # The socket API directly: GET one lease, verify, sync, detach.
        for method, path, body in (("GET", "/v1/leases/alice-agent", None), ("POST", "/v1/verify", {"name": "alice-agent"}),
                                   ("POST", "/v1/sync", {"name": "alice-agent"}),
                                   ("POST", "/v1/detach", {"name": "alice-agent"})):
            status, answer = self.api_as(b, method, path, body)
            self.assertEqual((status, answer.get("code")), (404, "lease-not-found"), path)
        self.assertEqual(self.names(self.mep_root("status", "--json")), ["alice-agent", "bob-agent"])
        # Root acts on all: it may release bob's lease.
        self.ok(self.mep_root("release", "bob-agent"))
        self.assertEqual(self.names(self.mep_as(b, "status", "--json")), [])
        self.ok(self.mep_as(a, "release", "alice-agent"))

    def test_a_file_is_used_only_with_the_users_own_rights(self):
        a, b = self.alice, self.bob
        ahome, bhome = self.homes[a.pw_name], self.homes[b.pw_name]
        self.ok(self.mep_as(a, "init", "private.uai"))  # 0600 in a 0700 directory
        os.chmod(ahome, 0o711)                           # bob may pass through, not list
        self.ok(self.mep_as(a, "init", "readable.uai", umask=0o022))  # 0644: bob may read, not write
        self.ok(self.mep_as(a, "claim", "alice-read", "readable.uai"))
        private, readable = os.path.join(ahome, "private.uai"), os.path.join(ahome, "readable.uai")
        # The daemon (root, or CAP_SETUID) could open both; bob may attach neither.
        self.refused(self.mep_as(b, "claim", "bob-private", private), 7, "cannot open this file for writing")
        self.refused(self.mep_as(b, "claim", "bob-readable", readable), 7, "cannot open this file for writing")
        # Nor through a symlink of his own, nor a system file.
        os.symlink(private, os.path.join(bhome, "link.uai"))
        self.refused(self.mep_as(b, "claim", "bob-link", "link.uai"), 7, "cannot open this file for writing")
        self.refused(self.mep_as(b, "claim", "bob-shadow", "/etc/shadow"), 7, "cannot open this file for writing")
        # init and branch create only where bob may; nothing is left behind.
        self.refused(self.mep_as(b, "init", os.path.join(ahome, "planted.uai")), 7, "Permission denied")
        self.refused(self.mep_as(b, "init", os.path.join(self.tmp, "planted.uai")), 7, "Permission denied")
        self.assertFalse(os.path.exists(os.path.join(ahome, "planted.uai")))
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "planted.uai")))
        # Branching alice's memory is not bob's to do: it is known here as hers.
        self.refused(self.mep_as(b, "branch", readable, "copy.uai"), 7, "belongs to another user")
        self.assertFalse(os.path.exists(os.path.join(bhome, "copy.uai")))
        # Alice branches her own: the copy is hers.
        self.ok(self.mep_as(a, "branch", "readable.uai", "child.uai"))
        self.assertEqual(os.stat(os.path.join(ahome, "child.uai")).st_uid, a.pw_uid)
        # Nothing bob asked for got an identity: the private file has the one alice's init gave.
        self.assertEqual(self.names(self.mep_as(b, "status", "--json")), [])
        self.assertEqual(self.names(self.mep_root("status", "--json")), ["alice-read"])
        # The control plane's database holds no user name, uid or path of theirs.
        stored = b""
        for name in os.listdir(self.state):
            if name.startswith("control.db"):
                with open(os.path.join(self.state, name), "rb") as f:
                    stored += f.read()
        self.assertTrue(stored, "no control-plane database under the state directory")
        for secret in (a.pw_name, b.pw_name, ahome, bhome, "readable.uai", "private.uai"):
            self.assertNotIn(secret.encode(), stored, secret)

    def test_events_show_each_user_only_its_own(self):
        a, b = self.alice, self.bob
        self.ok(self.mep_as(a, "init", "a.uai"))
        self.ok(self.mep_as(b, "init", "b.uai"))
        reader = subprocess.Popen(
            ["python3", "-c", EVENTS_SCRIPT, self.socket, "bob-own-name", "30"], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=lambda: (os.setgroups([self.gid_mep]), os.setgid(b.pw_gid), os.setuid(b.pw_uid)),
            env={"PATH": "/usr/bin:/bin"}, cwd="/")
        try:
            # Subscribed before the first claim (an event, not a guess at how long it takes);
            # the reader stops at bob's last event, which comes after all of alice's.
            self.assertEqual(reader.stderr.readline(), b"ready\n")
            self.ok(self.mep_as(a, "claim", "alice-secret-name", "a.uai"))
            self.ok(self.mep_as(b, "claim", "bob-own-name", "b.uai"))
            self.ok(self.mep_as(a, "release", "alice-secret-name"))
            self.ok(self.mep_as(b, "release", "bob-own-name"))
            out, err = reader.communicate(timeout=TIMEOUT_S)
        finally:
            if reader.poll() is None:
                reader.kill()
                reader.wait()
        text = out.decode()
        self.assertIn("200", text.splitlines()[0] if text else "", err.decode())
        self.assertIn("bob-own-name", text)
        self.assertNotIn("alice-secret-name", text)
        self.assertNotIn(self.homes[a.pw_name], text)


    # ---- what an audit from outside found (each a way around the isolation before) ----

    def api_as(self, user, method, path, body=None):
        """One request to the socket as `user`: (status, parsed body)."""
        script = ("import http.client,json,socket,sys\n"
                  "class C(http.client.HTTPConnection):\n"
                  "  def connect(self):\n"
                  "    self.sock=socket.socket(socket.AF_UNIX); self.sock.connect(sys.argv[1]); self.sock.settimeout(20)\n"
                  "c=C('localhost'); b=sys.argv[4] or None\n"
                  "c.request(sys.argv[2],sys.argv[3],body=b,headers={'Content-Type':'application/json'} if b else {})\n"
                  "r=c.getresponse(); print(json.dumps([r.status, json.loads(r.read() or b'{}')]))\n")
        p = self.as_user(user, ["python3", "-c", script, self.socket, method, path, json.dumps(body) if body else ""])
        self.ok(p)
        return tuple(json.loads(p.stdout))

    def memory_of(self, user, name):
        for lease in json.loads(self.ok(self.mep_as(user, "status", "--json")).stdout)["leases"]:
            if lease["canonical_name"] == name:
                return lease["memory_instance_id"]
        self.fail("%s holds no lease %s" % (user.pw_name, name))

    def test_no_identity_leaks_to_another_user(self):
        a, b = self.alice, self.bob
        ahome, bhome = self.homes[a.pw_name], self.homes[b.pw_name]
        os.chmod(ahome, 0o711)
        self.ok(self.mep_as(a, "init", "secret.uai"))  # 0600: bob may stat it, not read it
        with open(os.path.join(ahome, "secret.uai"), "a") as f:
            f.write("ALICE-TOP-SECRET\n")
        self.ok(self.mep_as(a, "claim", "alice-secret", "secret.uai"))
        self.ok(self.mep_as(a, "sync", "alice-secret"))
        mid = self.memory_of(a, "alice-secret")
        # identify and lineage by path: no id for a file bob cannot read (the inode map is
        # alice's, not his).
        for path in ("/v1/identify?path=" + os.path.join(ahome, "secret.uai"),
                     "/v1/lineage?path=" + os.path.join(ahome, "secret.uai")):
            status, body = self.api_as(b, "GET", path)
            self.assertNotEqual(status, 200, (path, body))
            self.assertNotIn(mid, json.dumps(body))
        # The daemon's own descriptors: /proc/self/fd/N is a magic link, refused.
        for n in range(0, 48):
            status, body = self.api_as(b, "GET", "/v1/identify?path=/proc/self/fd/%d" % n)
            self.assertNotEqual(status, 200, (n, body))
        # A memory known here as alice's is not fetched for bob, nor claimed through an
        # xattr copied onto his own file.
        status, body = self.api_as(b, "POST", "/v1/fetch", {"memory_instance_id": mid,
                                                             "path": os.path.join(bhome, "stolen.uai")})
        self.assertEqual((status, body.get("code")), (403, "forbidden"), body)
        self.assertFalse(os.path.exists(os.path.join(bhome, "stolen.uai")))
        forged = os.path.join(bhome, "forged.uai")
        self.ok(self.as_user(b, ["python3", "-c", "import os,sys; open(sys.argv[1],'w').write('BOB\\n'); "
                                                  "os.setxattr(sys.argv[1],'user.mep.memory_instance_id',sys.argv[2].encode())",
                                 forged, mid]))
        self.refused(self.mep_as(b, "claim", "bob-forged", forged), 7, "belongs to another user")
        # Alice's own fetch still works, and her bytes are hers.
        self.ok(self.mep_as(a, "fetch", mid, "copy.uai"))
        with open(os.path.join(ahome, "copy.uai")) as f:
            self.assertIn("ALICE-TOP-SECRET", f.read())

    def test_one_user_cannot_plant_an_identity_on_anothers_file(self):
        a, b = self.alice, self.bob
        ahome, bhome = self.homes[a.pw_name], self.homes[b.pw_name]
        os.chmod(ahome, 0o711)
        diary = os.path.join(ahome, "diary.uai")
        self.as_user(a, ["sh", "-c", "printf 'ALICE-DIARY\\n' > diary.uai"], umask=0o022)
        self.ok(self.mep_as(b, "init", "b1.uai"))
        self.ok(self.mep_as(b, "claim", "bob-poison", "b1.uai"))
        bob_mid = self.memory_of(b, "bob-poison")
        os.unlink(os.path.join(bhome, "b1.uai"))
        os.symlink(diary, os.path.join(bhome, "b1.uai"))
        self.ok(self.mep_as(b, "release", "bob-poison"))  # the release records the file it finds
        self.ok(self.mep_as(a, "claim", "my-diary", "diary.uai"))
        self.assertNotEqual(self.memory_of(a, "my-diary"), bob_mid, "alice's file got bob's memory identity")

    def test_a_fifo_or_a_proc_link_does_not_stall_or_open_the_way(self):
        a, b = self.alice, self.bob
        ahome, bhome = self.homes[a.pw_name], self.homes[b.pw_name]
        self.ok(self.mep_as(b, "init", "b.uai"))
        self.ok(self.mep_as(b, "claim", "bob-fifo", "b.uai"))
        os.unlink(os.path.join(bhome, "b.uai"))
        self.as_user(b, ["mkfifo", "b.uai"])
        started = time.monotonic()
        for _ in range(20):  # more than the daemon's 16 workers
            p = self.mep_as(b, "sync", "bob-fifo")
            self.assertNotEqual(p.returncode, 0)
        self.assertLess(time.monotonic() - started, TIMEOUT_S)
        self.ok(self.mep_as(a, "status"))  # the daemon still serves
        # Alice's working directory, below a 0700 directory: /proc/PID/cwd is a magic link that
        # would take the daemon past the 0700 directory; bob's sync through it is refused.
        proj = os.path.join(ahome, "h700", "proj")
        os.makedirs(proj)
        for d in (os.path.join(ahome, "h700"), proj):
            os.chown(d, a.pw_uid, a.pw_gid)
        os.chmod(os.path.join(ahome, "h700"), 0o700)
        os.chmod(proj, 0o755)
        os.chmod(ahome, 0o711)
        with open(os.path.join(proj, "notes.uai"), "w") as f:
            f.write("ALICE-NOTES\n")
        os.chmod(os.path.join(proj, "notes.uai"), 0o644)
        sleeper = subprocess.Popen(["sleep", "60"], cwd=proj, preexec_fn=lambda: (os.setgid(a.pw_gid), os.setuid(a.pw_uid)))
        try:
            self.ok(self.mep_as(b, "init", "car.uai"))
            self.ok(self.mep_as(b, "claim", "bob-car", "car.uai"))
            os.unlink(os.path.join(bhome, "car.uai"))
            os.symlink("/proc/%d/cwd/notes.uai" % sleeper.pid, os.path.join(bhome, "car.uai"))
            p = self.mep_as(b, "sync", "bob-car")
            self.assertNotEqual(p.returncode, 0, p.stdout)
            self.refused(self.mep_as(b, "claim", "bob-car2", os.path.join(bhome, "car.uai")), 7,
                         "cannot open this file for writing")
        finally:
            sleeper.kill()
            sleeper.wait()

    # ---- what a second audit found (each a way to stall, fool or outgrow the daemon before) ----

    def popen_as(self, user, args, umask=0o077, groups=None, stdin=subprocess.DEVNULL):
        """`args` started as `user` (its groups, or only `groups`) and not waited for: the
        caller ends it by its PID (finish, or kill and wait)."""
        groups = groups if groups is not None else [g.gr_gid for g in grp.getgrall() if user.pw_name in g.gr_mem]

        def drop():
            os.setgroups(groups)
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            os.umask(umask)

        return subprocess.Popen(args, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=drop, cwd=self.homes.get(user.pw_name, "/"),
                                env={"PATH": "/usr/bin:/bin", "HOME": self.homes.get(user.pw_name, "/")})

    @staticmethod
    def finish(proc, deadline):
        """(returncode, stdout, stderr) of `proc` if it ends before `deadline` (monotonic),
        else (None, ...) after killing it."""
        try:
            out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            return proc.returncode, out, err
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate(timeout=TIMEOUT_S)
            return None, out, err

    def stop_all(self, procs):
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=TIMEOUT_S)

    def test_a_leased_file_does_not_stall_branch(self):
        # Guards: the copy of a branch opens its source without O_NONBLOCK, so a user's kernel
        # write lease on his own file (SIGIO ignored) held each branch, and a daemon worker, in
        # open() for the lease-break time (45 s).
        a, b = self.alice, self.bob
        self.ok(self.mep_as(b, "init", "b.uai"))
        self.ok(self.mep_as(b, "claim", "bob-leased", "b.uai"))
        holder = self.popen_as(b, ["python3", "-c", LEASE_SCRIPT, os.path.join(self.homes[b.pw_name], "b.uai"), "60"])
        branches = []
        try:
            line = holder.stdout.readline()
            self.assertEqual(line.strip(), b"leased", holder.stderr.read1(4096) if not line else line)
            started = time.monotonic()
            branches = [self.popen_as(b, [self.mep, "--socket", self.socket, "branch", "b.uai", "br%d.uai" % i])
                        for i in range(20)]  # more than the daemon's 16 workers
            time.sleep(1)
            status = self.popen_as(a, [self.mep, "--socket", self.socket, "status"])
            branches.append(status)
            # (The stall this guards against lasts the lease-break time, 45 s.)
            rc, _, err = self.finish(status, started + 30)
            self.assertIsNotNone(rc, "alice's status got no answer within 30 s while bob's file was leased")
            self.assertEqual(rc, 0, err.decode())
            for i, proc in enumerate(branches[:-1]):
                rc, _, err = self.finish(proc, started + 30)
                self.assertIsNotNone(rc, "branch %d got no answer within 30 s of a leased source" % i)
        finally:
            self.stop_all([holder, *branches])

    def test_branch_follows_the_users_umask(self):
        # Guards: the copy of a branch took the source's mode as it was (0666 here), not the
        # source's mode less the asking user's umask, as cp(1) and init do.
        b = self.bob
        bhome = self.homes[b.pw_name]
        self.ok(self.mep_as(b, "init", "b.uai"))
        self.ok(self.mep_as(b, "claim", "bob-umask", "b.uai"))
        os.chmod(os.path.join(bhome, "b.uai"), 0o666)
        self.ok(self.mep_as(b, "branch", "b.uai", "br.uai", umask=0o077))
        st = os.stat(os.path.join(bhome, "br.uai"))
        self.assertEqual((st.st_uid, st.st_gid), (b.pw_uid, b.pw_gid))
        self.assertEqual(st.st_mode & 0o777, 0o600)

    def test_anothers_failed_attach_keeps_a_lost_lease(self):
        # Guards: bob's attach under the name of alice's lost lease, refused for a missing file,
        # wiped alice's record of the loss (her GET of the lease became 404).
        a, b = self.alice, self.bob
        self.ok(self.mep_as(a, "init", "a.uai"))
        self.ok(self.mep_as(a, "claim", "alice-l", "a.uai", "--ttl", "5"))
        self.mepd.signal(signal.SIGSTOP)
        try:
            time.sleep(6)  # past the lease's local deadline
        finally:
            self.mepd.signal(signal.SIGCONT)

        def lost():
            leases = json.loads(self.ok(self.mep_as(a, "status", "--json")).stdout)["leases"]
            return any(lease["canonical_name"] == "alice-l" and lease.get("state") == "lost" for lease in leases)

        self.assertTrue(wait_for(lost, timeout=TIMEOUT_S, interval=0.5), "alice-l was not reported lost")
        before = self.api_as(a, "GET", "/v1/leases/alice-l")
        status, body = self.api_as(b, "POST", "/v1/attach", {"name": "alice-l", "path": "/nonexistent/x.uai"})
        self.assertEqual(status, 400, body)
        after = self.api_as(a, "GET", "/v1/leases/alice-l")
        self.assertEqual(after[0], before[0], (before, after))
        self.assertEqual((after[1].get("lease_id"), after[1].get("state")),
                         (before[1].get("lease_id"), before[1].get("state")), (before, after))
        self.assertTrue(lost(), "alice's status no longer shows alice-l lost")

    def test_dot_dot_after_a_proc_magic_link_is_refused(self):
        # Guards: /proc/PID/cwd/../F was resolved in the daemon's own process, past the
        # directories that guard F (mepd(8): magic links are refused, also behind `..`).
        a, b = self.alice, self.bob
        ahome = self.homes[a.pw_name]
        hidden = os.path.join(ahome, "hidden")
        proj = os.path.join(hidden, "proj")
        os.makedirs(proj)
        for d, mode in ((hidden, 0o711), (proj, 0o755)):
            os.chown(d, a.pw_uid, a.pw_gid)
            os.chmod(d, mode)
        os.chmod(ahome, 0o711)  # bob may pass through ahome and hidden, not list them
        for d in (hidden, proj):
            path = os.path.join(d, "world.uai")
            with open(path, "w") as f:
                f.write("ALICE-WORLD\n")
            os.chown(path, a.pw_uid, a.pw_gid)
            os.chmod(path, 0o666)
        sleeper = subprocess.Popen(["sleep", "60"], cwd=proj,
                                   preexec_fn=lambda: (os.setgid(a.pw_gid), os.setuid(a.pw_uid)))
        try:
            p = self.mep_as(b, "claim", "n1", "/proc/%d/cwd/world.uai" % sleeper.pid)
            self.assertNotEqual(p.returncode, 0, p.stdout.decode())
            p = self.mep_as(b, "claim", "n2", "/proc/%d/cwd/../world.uai" % sleeper.pid)
            self.assertNotEqual(p.returncode, 0, p.stdout.decode())
            self.assertEqual(self.names(self.mep_as(b, "status", "--json")), [])
        finally:
            sleeper.kill()
            sleeper.wait()

    def test_roots_sync_of_a_users_lease_reads_as_that_user(self):
        # Guards: root's `mep sync` of bob's lease read bob's file with root's rights, so a
        # symlink of bob's to a root-only file got its bytes uploaded, for bob to fetch.
        b = self.bob
        bhome = self.homes[b.pw_name]
        secret = os.path.join(self.tmp, "root-only.uai")
        with open(secret, "w") as f:
            f.write("ROOT-ONLY-SECRET\n")
        os.chmod(secret, 0o600)
        self.ok(self.mep_as(b, "init", "c.uai"))
        self.ok(self.mep_as(b, "claim", "bob-c", "c.uai"))
        mid = self.memory_of(b, "bob-c")
        os.unlink(os.path.join(bhome, "c.uai"))
        os.symlink(secret, os.path.join(bhome, "c.uai"))
        self.refused(self.mep_as(b, "sync", "bob-c"), 7, "cannot read the memory file")  # bob may not read it
        p = self.mep_root("sync", "bob-c")
        self.assertNotEqual(p.returncode, 0, "root's sync uploaded what bob may not read: %s" % p.stdout.decode())
        p = self.mep_as(b, "fetch", mid, "out.uai")
        if p.returncode == 0:
            with open(os.path.join(bhome, "out.uai"), "rb") as f:
                self.assertNotIn(b"ROOT-ONLY-SECRET", f.read())

    def test_a_dropped_group_is_not_regained_through_the_daemon(self):
        # Guards: with the connecting process gone (a forked child connected and exited), the
        # daemon took the user's full group list from /etc/group instead of the groups that
        # process had (SO_PEERGROUPS), so a process that had dropped a group used it again.
        a = self.alice
        group = "mepg%x" % (os.getpid() & 0xfffff)
        p = run(["groupadd", "--users", a.pw_name, group])
        self.assertEqual(p.returncode, 0, p.stderr.decode())
        self.addCleanup(run, ["groupdel", group])
        gid = grp.getgrnam(group).gr_gid
        path = os.path.join(self.tmp, "group-only.uai")
        with open(path, "w") as f:
            f.write("GROUP-ONLY\n")
        os.chown(path, 0, gid)
        os.chmod(path, 0o660)
        # Alice's process keeps only the group mep, then asks through an orphaned connection.
        proc = self.popen_as(a, ["python3", "-c", ORPHAN_ATTACH_SCRIPT, self.socket, path, "alice-group"],
                             groups=[self.gid_mep])
        rc, out, err = self.finish(proc, time.monotonic() + TIMEOUT_S)
        self.assertEqual(rc, 0, err.decode())
        status, body = json.loads(out)
        self.assertIn(status, (400, 403), body)
        self.assertEqual(self.names(self.mep_as(a, "status", "--json")), [])
        # With the group (her full list, as she logs in) she may attach it: the refusal was the group's.
        self.ok(self.mep_as(a, "claim", "alice-group", path))

    def start_small_daemon(self, limit):
        """A second system mepd (root's) that may open `limit` descriptors; stopped by the caller."""
        sock = os.path.join(self.tmp, "run2", "mepd.sock")
        mepd = Proc("mepd2", ["prlimit", "--nofile=%d:%d" % (limit, limit), "--", os.path.join(self.bin, "mepd"),
                              "--system", "--socket", sock, "--state-dir", os.path.join(self.tmp, "state2")],
                    self.env, os.path.join(self.tmp, "mepd2.log"), cwd="/")
        try:
            mepd.wait_for_log(r"listening on .* for the group mep \(system mode\)")
        except BaseException:
            mepd.stop()
            raise
        return mepd, sock

    def open_streams(self, streams, n):
        """Has the STREAMS_SCRIPT process `streams` open `n` more event streams; their statuses."""
        streams.stdin.write(b"open %d\n" % n)
        streams.stdin.flush()
        line = streams.stdout.readline()
        self.assertTrue(line, streams.stderr.read().decode() if streams.poll() is not None else "")
        return json.loads(line)

    def test_running_out_of_descriptors_is_no_refusal(self):
        # Guards: a daemon out of file descriptors (getpwuid_r, getgrouplist: EMFILE) answered a
        # member of the group mep 403 "peer is not allowed" (exit 7), not a temporary failure.
        # Root's streams take the descriptors: a member may not hold more than a quarter.
        if self.daemon_user:
            self.skipTest("its second daemon runs as root in either set-up: run once")
        limit = 120
        mepd, sock = self.start_small_daemon(limit)
        streams = None
        try:
            def fds():
                return len(os.listdir("/proc/%d/fd" % mepd.pid))

            # Root's streams take all the daemon's descriptors but one, which alice's connection
            # takes; opened a half of what is left at a time, not to overshoot.
            streams = subprocess.Popen(["python3", "-c", STREAMS_SCRIPT, sock, "150"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            deadline = time.monotonic() + TIMEOUT_S
            while fds() < limit - 1 and time.monotonic() < deadline:
                self.open_streams(streams, max(1, (limit - 1 - fds()) // 2))
                time.sleep(0.1)
            self.assertGreaterEqual(fds(), limit - 1)
            # An answer, or the CLI's own "no answer from the daemon" after 60 s (exit 5).
            status = self.popen_as(self.alice, [self.mep, "--socket", sock, "status"])
            rc, out, err = self.finish(status, time.monotonic() + 75)
            self.assertIsNotNone(rc, "alice's status got no answer within 75 s")
            self.assertIn(rc, (0, 5), "exit %s: %s" % (rc, err.decode()))
        finally:
            if streams is not None:
                self.stop_all([streams])
            mepd.stop()

    def test_one_member_cannot_take_the_daemons_descriptors(self):
        # Guards: a member's idle connections and event streams took every descriptor of the
        # daemon, and the other members then waited or got 503. Each member now holds a quarter
        # of them at most (1024 at most); its next connection is refused with 429.
        if self.daemon_user:
            self.skipTest("its second daemon runs as root in either set-up: run once")
        a, b = self.alice, self.bob
        limit = 120
        mepd, sock = self.start_small_daemon(limit)
        streams = None
        try:
            base = len(os.listdir("/proc/%d/fd" % mepd.pid))
            streams = self.popen_as(b, ["python3", "-c", STREAMS_SCRIPT, sock, "150"], stdin=subprocess.PIPE)
            statuses = self.open_streams(streams, limit)
            self.assertEqual(statuses.count(200), limit // 4, statuses)
            # Past the limit: 429, or, while 16 refusals are still being answered, closed at once
            # (no status): refusals must not hold the descriptors the limit keeps free.
            self.assertTrue(set(statuses[limit // 4:]) <= {429, 0}, statuses)
            self.assertGreaterEqual(statuses.count(429), 16, statuses)
            self.assertLessEqual(len(os.listdir("/proc/%d/fd" % mepd.pid)), base + limit // 4 + 16)
            # Alice is served at once, and so is root.
            rc, out, err = self.finish(self.popen_as(a, [self.mep, "--socket", sock, "status"]),
                                       time.monotonic() + TIMEOUT_S)
            self.assertEqual(rc, 0, "exit %s: %s" % (rc, err.decode()))
            rc, out, err = self.finish(subprocess.Popen([self.mep, "--socket", sock, "status"],
                                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE),
                                       time.monotonic() + TIMEOUT_S)
            self.assertEqual(rc, 0, err.decode())
            # Bob's own CLI is told why, with the exit code for "try again" (5), once the refusals
            # in flight have been answered (closed after at most 5 s of lingering).
            deadline = time.monotonic() + TIMEOUT_S
            while True:
                rc, out, err = self.finish(self.popen_as(b, [self.mep, "--socket", sock, "status"]),
                                           time.monotonic() + TIMEOUT_S)
                if b"connections" in err or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            self.assertEqual(rc, 5, "exit %s: %s" % (rc, err.decode()))
            self.assertIn("connections", err.decode())
            # His connections are given back when they close.
            self.stop_all([streams])
            streams = None
            deadline = time.monotonic() + TIMEOUT_S
            while True:
                rc, out, err = self.finish(self.popen_as(b, [self.mep, "--socket", sock, "status"]),
                                           time.monotonic() + TIMEOUT_S)
                if rc == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            self.assertEqual(rc, 0, err.decode())
            with open(os.path.join(self.tmp, "mepd2.log")) as f:
                self.assertEqual(f.read().count("as many as one user may"), 1)
        finally:
            if streams is not None:
                self.stop_all([streams])
            mepd.stop()

    def test_one_member_cannot_take_the_threads_of_waiting_attaches(self):
        # Guards: a member's attaches waiting for a held name took the daemon's 1024 threads
        # for waiting, and the others' waiting attaches then took the worker pool that every
        # request needs. A member may have half its connections waiting (here 15 of 30).
        if self.daemon_user:
            self.skipTest("its second daemon runs as root in either set-up: run once")
        a, b = self.alice, self.bob
        mepd, sock = self.start_small_daemon(120)
        waits = []
        try:
            def cli(user, *args):
                return self.finish(self.popen_as(user, [self.mep, "--socket", sock, *args]),
                                   time.monotonic() + TIMEOUT_S)

            for user, prefix in ((a, "wa"), (b, "wb")):
                for n in (1, 2):
                    rc, _, err = cli(user, "init", "%s%d.uai" % (prefix, n))
                    self.assertEqual(rc, 0, err.decode())
            self.assertEqual(cli(b, "claim", "bob-busy", "wb1.uai")[0], 0)
            self.assertEqual(cli(a, "claim", "alice-busy", "wa1.uai")[0], 0)
            path = os.path.join(self.homes[b.pw_name], "wb2.uai")
            waits.append(self.popen_as(b, ["python3", "-c", WAITS_SCRIPT, sock, "17", "bob-busy", path],
                                       stdin=subprocess.PIPE))
            line = waits[0].stdout.readline()
            self.assertTrue(line, waits[0].stderr.read().decode() if waits[0].poll() is not None else "")
            statuses = json.loads(line)
            self.assertEqual(sorted(statuses), [0] * 15 + [429, 429], statuses)
            # Alice's waiting attach still waits (and ends held: exit 3), not refused (exit 5);
            # so does root's.
            t0 = time.monotonic()
            rc, _, err = cli(a, "claim", "--wait", "2", "alice-busy", "wa2.uai")
            self.assertEqual(rc, 3, err.decode())
            self.assertGreaterEqual(time.monotonic() - t0, 1.5)
            mine = os.path.join(self.tmp, "wr.uai")
            for args in (["init", mine], ["claim", "--wait", "1", "bob-busy", mine]):
                rc, _, err = self.finish(subprocess.Popen([self.mep, "--socket", sock, *args], stdout=subprocess.PIPE,
                                                          stderr=subprocess.PIPE), time.monotonic() + TIMEOUT_S)
            self.assertEqual(rc, 3, err.decode())
            # Bob's next one is refused and told why, with the exit code for "try again" (5).
            rc, _, err = cli(b, "claim", "--wait", "2", "bob-busy", "wb2.uai")
            self.assertEqual(rc, 5, err.decode())
            self.assertIn("attaches waiting", err.decode())
            # Once his waiting agents are gone, he may wait again.
            self.stop_all(waits)
            waits = []
            deadline = time.monotonic() + TIMEOUT_S
            while True:
                rc, _, err = cli(b, "claim", "--wait", "1", "bob-busy", "wb2.uai")
                if rc != 5 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            self.assertEqual(rc, 3, err.decode())
        finally:
            self.stop_all(waits)
            mepd.stop()

    def rss_kib(self, pid):
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        self.fail("no VmRSS for %d" % pid)

    def test_unread_event_streams_do_not_grow_the_daemon(self):
        # Guards: the events for a stream nobody reads were queued without limit, so a member's
        # unread streams grew the daemon's memory until it ran out (now a slow reader's stream
        # is closed once its queue is full).
        if self.daemon_user:
            self.skipTest("the event queues are the same whatever the daemon's user: run once")
        b = self.bob
        leases, nstreams, watch_s = 200, 50, 30  # ~80 MB of queued events in 30 s before
        rc, out, err = self.finish(self.popen_as(b, ["python3", "-c", ATTACH_MANY_SCRIPT, self.socket, str(leases)]),
                                   time.monotonic() + 3 * TIMEOUT_S)
        self.assertEqual(rc, 0, err.decode())
        self.assertEqual(set(json.loads(out)), {201})
        streams = self.popen_as(b, ["python3", "-c", STREAMS_SCRIPT, self.socket, "120"], stdin=subprocess.PIPE)
        try:
            streams.stdin.write(b"open %d\n" % nstreams)
            streams.stdin.flush()
            line = streams.stdout.readline()
            self.assertTrue(line, streams.stderr.read().decode() if not line else "")
            self.assertEqual(set(json.loads(line)), {200}, "bob's streams were not all served: %s" % line)
            before = self.rss_kib(self.mepd.pid)
            t0 = time.monotonic()
            peak = before
            while time.monotonic() - t0 < watch_s:
                time.sleep(1)
                peak = max(peak, self.rss_kib(self.mepd.pid))
            streams.stdin.write(b"drain 20\n")
            streams.stdin.flush()
            line = streams.stdout.readline()
            self.assertLess(peak - before, 40 * 1024, "the daemon grew by %d KiB in %d s" % (peak - before, watch_s))
            self.assertTrue(line, streams.stderr.read().decode() if streams.poll() is not None else "")
            drained = json.loads(line)
            self.assertTrue(drained["closed"], "an unread stream was still open after %d s (%d bytes read)"
                            % (watch_s, drained["bytes"]))
        finally:
            self.stop_all([streams])


    def test_health_and_metrics_tell_a_member_only_what_is_its_own(self):
        # /healthz gave every member the host's lease count and the path of the daemon's
        # state directory (the embedded control plane's database); /metrics every user's counts.
        a, b = self.alice, self.bob
        for i in range(3):
            self.ok(self.mep_as(a, "init", "a%d.uai" % i))
            self.ok(self.mep_as(a, "claim", "alice-h%d" % i, "a%d.uai" % i))
        self.ok(self.mep_as(b, "init", "b.uai"))
        self.ok(self.mep_as(b, "claim", "bob-h", "b.uai"))
        script = ("import http.client, socket, sys, json\n"
                  "class C(http.client.HTTPConnection):\n"
                  "    def connect(self):\n"
                  "        self.sock = socket.socket(socket.AF_UNIX); self.sock.connect(sys.argv[1])\n"
                  "c = C('localhost'); c.request('GET', sys.argv[2]); r = c.getresponse()\n"
                  "print(json.dumps([r.status, r.read().decode()]))\n")
        def get(user, path):
            p = self.as_user(user, ["python3", "-c", script, self.socket, path]) if user else \
                run(["python3", "-c", script, self.socket, path])
            self.assertEqual(p.returncode, 0, p.stderr.decode())
            return json.loads(p.stdout)
        status, body = get(b, "/healthz")
        self.assertEqual(status, 200, body)
        health = json.loads(body)
        self.assertEqual(health["leases"], 1, health)
        self.assertNotIn(self.state, body)
        self.assertEqual(get(b, "/metrics")[0], 403)
        status, body = get(None, "/healthz")
        self.assertEqual(json.loads(body)["leases"], 4, body)
        status, body = get(None, "/metrics")
        self.assertEqual(status, 200, body)
        self.assertIn('mepd_leases{state="held"} 4', body)

    def test_a_root_daemon_keeps_only_the_two_capabilities_it_needs(self):
        # Started as root it had them all: CAP_SYS_RESOURCE let a user's fetch fill the
        # blocks reserved for root, CAP_SYS_PTRACE let a path through another user's
        # /proc/PID/cwd/.. resolve. Only the threads that serve no one (the embedded control
        # plane's, started before) may hold more.
        want = (1 << 6) | (1 << 7)  # CAP_SETGID, CAP_SETUID
        tasks = os.listdir("/proc/%d/task" % self.mepd.pid)
        serving = 0
        for tid in tasks:
            try:
                with open("/proc/%d/task/%s/status" % (self.mepd.pid, tid)) as f:
                    caps = {k: int(v, 16) for k, v in
                            (l.split(":\t") for l in f.read().splitlines() if l.startswith(("CapEff", "CapPrm")))}
            except FileNotFoundError:
                continue
            if caps["CapEff"] == want and caps["CapPrm"] == want:
                serving += 1
        # The main thread and the 64 workers at least.
        self.assertGreaterEqual(serving, 65, "threads with CAP_SETUID and CAP_SETGID only: %d of %d" % (serving, len(tasks)))
        with open("/proc/%d/status" % self.mepd.pid) as f:
            eff = [l for l in f.read().splitlines() if l.startswith("CapEff")][0]
        self.assertEqual(int(eff.split()[1], 16), want, eff)


class SystemDaemonAsItsOwnUser(SystemDaemon):
    """The packaged set-up: mepd as an unprivileged user with CAP_SETUID and CAP_SETGID only
    (no CAP_DAC_OVERRIDE): it reaches users' files only by taking their rights."""

    DAEMON_USER = True

    def test_without_the_capabilities_it_refuses_to_start(self):
        u = self.carol
        p = run(["setpriv", "--reuid", str(u.pw_uid), "--regid", str(u.pw_gid), "--clear-groups",
                 os.path.join(self.bin, "mepd"), "--system", "--socket", os.path.join(self.tmp, "x", "s.sock"),
                 "--state-dir", os.path.join(self.tmp, "x-state")], env={"PATH": "/usr/bin:/bin", "HOME": "/"}, cwd="/")
        self.assertEqual(p.returncode, 1, p.stderr.decode())
        self.assertIn("CAP_SETUID", p.stderr.decode())
        self.assertEqual(len(p.stderr.decode().strip().splitlines()), 1, p.stderr.decode())


if __name__ == "__main__":
    unittest.main()
