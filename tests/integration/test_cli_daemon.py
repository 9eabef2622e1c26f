"""The mep CLI against a real mepd (SPEC §7, issue 6): every daemon-facing command's human and
--json output (init, claim, status, identify, branch, lineage in tree, dot and json, release,
config), the exit code of each error class (2 usage, 3 held, 5 daemon not running, 6 invalid
name), and `mep run`: the lease in the child's environment, SIGTERM forwarded, the child's
status returned, and — against a real `mep server` that is SIGSTOPped — the child's whole
process group killed when the lease is lost, with exit status 4.

The daemon runs in embedded mode with --socket and --state-dir in a temporary directory (and
HOME/XDG_* there too); mep gets --socket. Every command is bounded in time; every process
started here is ended by its PID. Binaries come from $MEP_BIN and $MEPD_BIN."""
import json
import os
import pty
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import uuid

from daemonfixture import MepServer, Mepd, clean_env
import mephelpers
from mephelpers import mep_bin

COMMAND_TIMEOUT_S = 30
WAIT_S = 15            # a file the child writes, a lease to appear or go
LOSS_TIMEOUT_S = 40    # SIGSTOP of the server → mep run has ended (ttl 6 + grace 1 + slack)

UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
RFC3339_MS = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z"
PROBLEM_BASE = "https://memoryendpoints.com/problems/"
LEASE_FIELDS = ["lease_id", "canonical_name", "display_name", "memory_instance_id", "fencing_token",
                "expires_at", "ttl_seconds", "path", "state"]

EXIT_OK, EXIT_OTHER, EXIT_USAGE, EXIT_HELD, EXIT_LOST, EXIT_UNAVAILABLE, EXIT_INVALID_NAME = 0, 1, 2, 3, 4, 5, 6


def unique(prefix="agent"):
    return "%s-%s" % (prefix, uuid.uuid4().hex[:12])


def wait_for(predicate, timeout=WAIT_S, interval=0.05):
    return mephelpers.wait_for(predicate, timeout, interval)


def read_file(path):
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def pid_gone(pid):
    """True when `pid` no longer runs (gone, or a zombie nobody reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


def kill_if_alive(pid):
    if pid and not pid_gone(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class CliTestCase(unittest.TestCase):
    """One embedded mepd per test class, in a temporary HOME; mep runs with --socket and the
    working directory in that HOME. The daemon's log is printed when a test fails."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        mep_bin()
        cls._tmp = tempfile.TemporaryDirectory(prefix="mep-cli-")
        cls.addClassCleanup(cls._tmp.cleanup)
        cls.home = cls._tmp.name
        cls.env = clean_env(cls.home)
        cls.work = os.path.join(cls.home, "work")
        os.makedirs(cls.work)
        cls.daemon = cls.start_daemon()

    @classmethod
    def start_daemon(cls):
        d = Mepd(cls.home, cls.env)
        cls.addClassCleanup(d.stop)
        return d.start()

    def setUp(self):
        self.popens = []
        self.addCleanup(self._end_popens)

    def _end_popens(self):
        for p in self.popens:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=10)

    def run(self, result=None):
        before = (len(result.failures) + len(result.errors)) if result is not None else 0
        out = super().run(result)
        if result is not None and len(result.failures) + len(result.errors) > before:
            d = getattr(type(self), "daemon", None)
            if d is not None:
                sys.stderr.write("\n---- mepd log ----\n%s\n---- end ----\n" % d.log_text()[-6000:])
        return out

    # -- running mep --

    def mep(self, *args, socket=None, timeout=COMMAND_TIMEOUT_S, env=None):
        """Runs `mep --socket S ARGS…` in the work directory; returns (rc, stdout, stderr)."""
        argv = [mep_bin(), "--socket", socket or self.daemon.socket_path, *args]
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env=env or self.env, cwd=self.work, timeout=timeout, check=False)
        return p.returncode, p.stdout.decode("utf-8"), p.stderr.decode("utf-8")

    def ok(self, *args, **kw):
        rc, out, err = self.mep(*args, **kw)
        self.assertEqual(rc, EXIT_OK, "mep %s: %s%s" % (" ".join(args), out, err))
        self.assertEqual(err, "", args)
        return out

    def ok_json(self, *args, **kw):
        """`mep --json ARGS…`: exit 0, exactly one JSON document on stdout, nothing on stderr."""
        return self.one_json(self.ok("--json", *args, **kw))

    def one_json(self, out):
        self.assertTrue(out.endswith("\n") and out.count("\n") == 1, "not one line: %r" % out)
        return json.loads(out)

    def popen_mep(self, *args, **kw):
        argv = [mep_bin(), "--socket", self.daemon.socket_path, *args]
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=self.env, cwd=self.work, start_new_session=True, **kw)
        self.popens.append(p)
        return p

    def communicate(self, p, timeout=COMMAND_TIMEOUT_S):
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out.decode("utf-8"), err.decode("utf-8")

    # -- fixtures --

    def path(self, name=None):
        return os.path.join(self.work, name or unique("mem") + ".uai")

    def new_memory(self):
        """`mep init` a fresh file; returns (path, memory id)."""
        path = self.path()
        out = self.ok("init", path)
        m = re.fullmatch(r"created (\S+)  memory=(%s)\n" % UUID, out)
        self.assertIsNotNone(m, out)
        return path, m.group(2)

    def claim(self, name, path, *extra):
        return self.ok_json("claim", name, path, *extra)

    def leases(self):
        return {l["canonical_name"]: l for l in self.ok_json("status")["leases"]}

    def assertProblem(self, out, status, code):
        doc = self.one_json(out)
        for k in ("type", "title", "status", "detail", "code"):
            self.assertIn(k, doc)
        self.assertEqual((doc["status"], doc["code"]), (status, code), doc)
        self.assertEqual(doc["type"], PROBLEM_BASE + code)
        return doc

    def assertOneLine(self, err):
        self.assertTrue(err.startswith("mep: ") and err.endswith("\n") and err.count("\n") == 1, repr(err))


class Commands(CliTestCase):
    """Human lines and --json documents of the daemon-facing commands."""

    def test_init(self):
        path = self.path()
        out = self.ok("init", path)
        self.assertRegex(out, r"^created %s  memory=%s\n$" % (re.escape(path), UUID))
        self.assertEqual(os.path.getsize(path), 0)
        doc = self.ok_json("init", self.path("json.uai"))
        self.assertEqual(set(doc), {"memory_instance_id", "path"})
        self.assertRegex(doc["memory_instance_id"], "^%s$" % UUID)
        self.assertEqual(doc["path"], self.path("json.uai"))
        # Two fresh files are two identities; a relative path is taken from the cwd.
        self.assertNotEqual(self.new_memory()[1], self.new_memory()[1])
        out = self.ok("init", "relative.uai")
        self.assertIn(" %s  " % self.path("relative.uai"), " " + out)
        # The new file's mode follows the caller's umask (the daemon creates it).
        for mask, mode in ((0o077, 0o600), (0o022, 0o644), (0o027, 0o640)):
            target = self.path()
            p = subprocess.run([mep_bin(), "--socket", self.daemon.socket_path, "init", target], env=self.env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=COMMAND_TIMEOUT_S,
                               preexec_fn=lambda m=mask: os.umask(m), check=False)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertEqual(os.stat(target).st_mode & 0o777, mode, "umask %o" % mask)

    def test_claim_status_release(self):
        path, mem = self.new_memory()
        name = unique("Agent")
        out = self.ok("claim", name, path, "--ttl", "20")
        m = re.fullmatch(r"claimed (\S+)  memory=(%s)  token=(\d+)  expires in (\d+) s\n" % UUID, out)
        self.assertIsNotNone(m, out)
        self.assertEqual(m.group(1), name.lower())
        self.assertEqual(m.group(2), mem)
        self.assertLessEqual(int(m.group(4)), 20)

        table = self.ok("status").splitlines()
        self.assertRegex(table[0], r"^NAME +MEMORY +TOKEN +EXPIRES IN +STATE +PATH$")
        rows = [r for r in table[1:] if r.startswith(name.lower() + " ")]
        self.assertEqual(len(rows), 1, table)
        self.assertRegex(rows[0], r"^%s +%s +%s +\d+ s +held +%s$" % (name.lower(), mem, m.group(3), re.escape(path)))

        lease = self.leases()[name.lower()]
        for k in LEASE_FIELDS:
            self.assertIn(k, lease)
        self.assertEqual((lease["display_name"], lease["memory_instance_id"], lease["path"], lease["state"],
                          lease["ttl_seconds"], lease["fencing_token"]), (name, mem, path, "held", 20, int(m.group(3))))
        self.assertRegex(lease["expires_at"], "^%s$" % RFC3339_MS)

        self.assertEqual(self.ok("release", name), "released %s\n" % name)
        self.assertNotIn(name.lower(), self.leases())

    def test_status_columns_line_up_for_any_script(self):
        # Padding counts terminal columns, not bytes: ß and ω take one, a Han character two.
        import unicodedata

        def columns(text):
            return sum(0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1
                       for ch in text)
        suffix = str(uuid.uuid4().int % 10**8)
        names = ["straße" + suffix, "ωμέγα" + suffix, "中文名字" + suffix]
        for n in names:
            path, _ = self.new_memory()
            self.ok("claim", n, path)
        table = self.ok("status").splitlines()
        header = columns(table[0][:table[0].index("MEMORY")])
        for n in names:
            row = [r for r in table if r.startswith(n + " ")]
            self.assertEqual(len(row), 1, table)
            self.assertEqual(columns(re.split(UUID, row[0])[0]), header, row[0])
            self.ok("release", n)

    def test_claim_and_release_json(self):
        path, mem = self.new_memory()
        name = unique()
        doc = self.claim(name, path)
        for k in LEASE_FIELDS:
            self.assertIn(k, doc)
        self.assertEqual((doc["canonical_name"], doc["memory_instance_id"], doc["path"], doc["state"],
                          doc["ttl_seconds"]), (name, mem, path, "held", 30))
        self.assertIsInstance(doc["fencing_token"], int)
        self.assertRegex(doc["lease_id"], "^%s$" % UUID)
        self.assertEqual(self.ok_json("release", name), {})
        # Claimed again after the release: a larger token (the counter lives on the memory).
        again = self.claim(name, path)
        self.assertGreater(again["fencing_token"], doc["fencing_token"])
        self.ok("release", name)

    def test_status_empty(self):
        # A daemon of its own, so no other test's lease shows up.
        home = tempfile.mkdtemp(prefix="mep-cli-empty-")
        self.addCleanup(shutil.rmtree, home, True)
        d = Mepd(home, clean_env(home), tag="empty")
        self.addCleanup(d.stop)
        d.start()
        self.assertEqual(self.ok("status", socket=d.socket_path), "no leases\n")
        self.assertEqual(self.ok_json("status", socket=d.socket_path), {"leases": []})

    def test_identify(self):
        path, mem = self.new_memory()
        self.assertEqual(self.ok("identify", path), "%s  memory=%s  parent=-\n" % (path, mem))
        doc = self.ok_json("identify", path)
        self.assertEqual((doc["memory_instance_id"], doc["path"], doc["parent_memory_instance_id"]), (mem, path, None))

    def test_branch_and_lineage(self):
        root, root_id = self.new_memory()
        name = unique()
        token = self.claim(name, root)["fencing_token"]
        child = self.path()
        out = self.ok("branch", root, child)
        m = re.fullmatch(r"branched (\S+)  memory=(%s)  parent=(%s)  at token (\d+)\n" % (UUID, UUID), out)
        self.assertIsNotNone(m, out)
        self.assertEqual((m.group(1), m.group(3), int(m.group(4))), (child, root_id, token))
        child_id = m.group(2)
        second = self.path()
        doc = self.ok_json("branch", root, second)
        self.assertEqual(set(doc), {"memory_instance_id", "parent_memory_instance_id", "branched_at_token", "path"})
        self.assertEqual((doc["parent_memory_instance_id"], doc["branched_at_token"], doc["path"]),
                         (root_id, token, second))
        second_id = doc["memory_instance_id"]
        self.ok("release", name)

        # The branch's identity and parent; a grandchild, to get three generations.
        self.assertEqual(self.ok("identify", child), "%s  memory=%s  parent=%s\n" % (child, child_id, root_id))
        gname = unique()
        gtoken = self.claim(gname, child)["fencing_token"]
        grandchild_id = self.ok_json("branch", child, self.path())["memory_instance_id"]
        self.ok("release", gname)

        # tree, not on a terminal: ASCII. Root first, this memory marked, its children below.
        tree = self.ok("lineage", child)
        self.assertEqual(tree, "%s\n\\- %s  (branched at token %d)  <- this memory\n"
                               "   \\- %s  (branched at token %d)\n" % (root_id, child_id, token, grandchild_id, gtoken))
        tree = self.ok("lineage", "--format", "tree", root)
        self.assertEqual(tree.splitlines(), ["%s  <- this memory" % root_id,
                                             "+- %s  (branched at token %d)" % (child_id, token),
                                             "\\- %s  (branched at token %d)" % (second_id, token)])
        # By id as well as by path.
        self.assertEqual(self.ok("lineage", child_id), self.ok("lineage", child))

        # json (--format json and --json are the same document).
        doc = self.one_json(self.ok("lineage", "--format", "json", child))
        self.assertEqual(doc, self.ok_json("lineage", child))
        self.assertEqual(doc["memory"]["memory_instance_id"], child_id)
        self.assertEqual(doc["memory"]["parent_memory_instance_id"], root_id)
        self.assertEqual(doc["memory"]["branched_at_token"], token)
        self.assertEqual([a["memory_instance_id"] for a in doc["ancestors"]], [root_id])
        self.assertEqual([(c["memory_instance_id"], c["branched_at_token"]) for c in doc["children"]],
                         [(grandchild_id, gtoken)])

        # dot: a digraph with both edges, which Graphviz renders.
        dot = self.ok("lineage", "--format", "dot", child)
        self.assertTrue(dot.startswith("digraph lineage {\n") and dot.endswith("}\n"), dot)
        self.assertIn('"%s" -> "%s" [label="token %d"];' % (root_id, child_id, token), dot)
        self.assertIn('"%s" -> "%s" [label="token %d"];' % (child_id, grandchild_id, gtoken), dot)
        if shutil.which("dot") is None:
            self.skipTest("graphviz is not installed")
        p = subprocess.run(["dot", "-Tsvg"], input=dot.encode(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           timeout=COMMAND_TIMEOUT_S, check=False)
        self.assertEqual((p.returncode, p.stderr), (0, b""))
        self.assertIn(b"<svg", p.stdout)
        self.assertIn(child_id.replace("-", "&#45;").encode(), p.stdout)  # SVG escapes the hyphens

    def test_lineage_tree_on_a_terminal_draws_boxes(self):
        root, root_id = self.new_memory()
        name = unique()
        token = self.claim(name, root)["fencing_token"]
        child_id = self.ok_json("branch", root, self.path())["memory_instance_id"]
        self.ok("release", name)
        master, slave = pty.openpty()
        try:
            p = subprocess.Popen([mep_bin(), "--socket", self.daemon.socket_path, "lineage", root],
                                 stdin=subprocess.DEVNULL, stdout=slave, stderr=subprocess.PIPE, env=self.env,
                                 cwd=self.work)
            self.popens.append(p)
            os.close(slave)
            slave = None
            data = b""
            deadline = time.monotonic() + COMMAND_TIMEOUT_S
            while time.monotonic() < deadline:
                ready, _, _ = select.select([master], [], [], 0.2)
                if ready:
                    try:
                        chunk = os.read(master, 65536)
                    except OSError:  # EIO: the last writer closed the terminal
                        break
                    if not chunk:
                        break
                    data += chunk
                elif p.poll() is not None:
                    break
            self.assertEqual(p.wait(timeout=COMMAND_TIMEOUT_S), 0, p.stderr.read())
            p.stderr.close()
        finally:
            os.close(master)
            if slave is not None:
                os.close(slave)
        text = data.decode("utf-8").replace("\r\n", "\n")
        self.assertEqual(text, "%s  ◀ this memory\n└─ %s  (branched at token %d)\n" % (root_id, child_id, token))

    def test_config(self):
        out = self.ok("config")
        rows = {}
        for line in out.splitlines():
            m = re.fullmatch(r"(\w+) +(.+?) +\((.+)\)", line)
            self.assertIsNotNone(m, line)
            rows[m.group(1)] = (m.group(2), m.group(3))
        self.assertEqual(list(rows), ["socket", "control_plane", "token_file", "store", "store_token_file", "ca_file",
                                      "anonymous_holder", "server", "state_dir", "db"])
        self.assertEqual(rows["anonymous_holder"], ("false", "default"))
        self.assertEqual(rows["socket"], (self.daemon.socket_path, "flag --socket"))
        self.assertEqual(rows["control_plane"], ("(none: embedded)", "default"))
        self.assertEqual(rows["token_file"], ("(none)", "default"))
        self.assertEqual(rows["store"], ("(none)", "default"))
        self.assertEqual(rows["db"], ("sqlite:%s/state/mep/control.db" % self.home, "default"))

        # The environment beats the file, the file beats the default; --json says the same.
        cfg = os.path.join(self.home, "custom.toml")
        with open(cfg, "w") as f:
            f.write('state_dir = "/srv/mep"\ncontrol_plane = "https://file.example"\n')
        env = dict(self.env, MEP_CONTROL_PLANE="https://env.example", MEP_TOKEN_FILE="/etc/mep/token")
        doc = self.ok_json("--config", cfg, "config", env=env)
        self.assertEqual(doc["control_plane"], {"value": "https://env.example", "source": "env MEP_CONTROL_PLANE"})
        self.assertEqual(doc["token_file"], {"value": "/etc/mep/token", "source": "env MEP_TOKEN_FILE"})
        self.assertEqual(doc["state_dir"], {"value": "/srv/mep", "source": "file " + cfg})
        self.assertEqual(doc["socket"], {"value": self.daemon.socket_path, "source": "flag --socket"})
        self.assertEqual(doc["db"]["source"], "default")

    def test_config_state_dir_default_follows_mepd(self):
        # mepd run by root without XDG_STATE_HOME keeps its state in /var/lib/mep.
        env = {k: v for k, v in self.env.items() if k != "XDG_STATE_HOME"}
        doc = self.ok_json("config", env=env)
        expected = "/var/lib/mep" if os.geteuid() == 0 else os.path.join(self.home, ".local/state/mep/mepd")
        self.assertEqual(doc["state_dir"], {"value": expected, "source": "default"})

    def test_db_from_the_config_file_is_used(self):
        # `mep config` reports the file's db; mep token, mep server audit and mep migrate use it.
        db = os.path.join(self.home, "from-file.db")
        cfg = os.path.join(self.home, "db.toml")
        with open(cfg, "w") as f:
            f.write('db = "sqlite:%s"\n' % db)
        self.assertEqual(self.ok_json("--config", cfg, "config")["db"],
                         {"value": "sqlite:" + db, "source": "file " + cfg})
        token = self.ok("--config", cfg, "token", "create", "--tenant", "from-file").strip()
        self.assertTrue(token and os.path.exists(db))
        tokens = self.ok_json("--config", cfg, "token", "list")["tokens"]
        self.assertEqual([t["tenant"] for t in tokens], ["from-file"])
        self.assertIn("events", self.ok_json("--config", cfg, "server", "audit"))
        # MEP_DB still beats the file.
        other = os.path.join(self.home, "from-env.db")
        self.ok("--config", cfg, "token", "create", "--tenant", "env", env=dict(self.env, MEP_DB="sqlite:" + other))
        self.assertTrue(os.path.exists(other))

    def test_config_errors_exit_2(self):
        rc, out, err = self.mep("config", "--config", os.path.join(self.home, "missing.toml"))
        self.assertEqual((rc, out), (EXIT_USAGE, ""))
        self.assertOneLine(err)
        bad = os.path.join(self.home, "bad.toml")
        with open(bad, "w") as f:
            f.write("socket = \n")
        rc, out, err = self.mep("--json", "config", "--config", bad)
        self.assertEqual((rc, err), (EXIT_USAGE, ""))
        self.assertIn("bad.toml:1", self.assertProblem(out, 400, "invalid-request")["detail"])
        # Every command that reads the config file says so, rather than going on without it:
        # a file given with --config, a directory given as one, and a broken default file.
        path, _ = self.new_memory()
        for config in (bad, self.home):
            for args in (["status"], ["claim", unique(), path], ["release", "nobody"],
                         ["run", unique(), path, "--", "true"], ["token", "list"]):
                with self.subTest(config=config, args=args):
                    rc, out, err = self.mep("--config", config, *args)
                    self.assertEqual((rc, out), (EXIT_USAGE, ""), err)
                    self.assertOneLine(err)
                    self.assertIn("config file " + config, err)
        default = os.path.join(self.home, "xdg-config", "mep")
        os.makedirs(default)
        with open(os.path.join(default, "config.toml"), "w") as f:
            f.write("socket = \n")
        env = dict(self.env, XDG_CONFIG_HOME=os.path.dirname(default))
        rc, out, err = self.mep("status", env=env)
        self.assertEqual((rc, out), (EXIT_USAGE, ""), err)
        self.assertIn("config.toml:1", err)


class Paths(CliTestCase):
    def test_dotdot_after_a_symbolic_link_is_the_kernels(self):
        # L -> A/B: L/.. is A for the kernel (cat L/../t.uai reads A/t.uai), not the work
        # directory as a textual clean-up would have it. mep must act on the file the
        # kernel opens, for an existing file and for one it creates.
        os.makedirs(os.path.join(self.work, "A", "B"))
        os.symlink(os.path.join("A", "B"), os.path.join(self.work, "L"))
        inside = self.ok_json("init", os.path.join("A", "t.uai"))["memory_instance_id"]
        self.ok_json("init", "t.uai")  # the decoy the textual reading would pick
        name = unique()
        lease = self.claim(name, os.path.join("L", "..", "t.uai"))
        self.assertEqual(lease["memory_instance_id"], inside)
        self.assertEqual(os.path.realpath(lease["path"]), os.path.join(os.path.realpath(self.work), "A", "t.uai"))
        self.ok("init", os.path.join("L", "..", "c.uai"))
        self.assertTrue(os.path.exists(os.path.join(self.work, "A", "c.uai")))
        self.assertFalse(os.path.exists(os.path.join(self.work, "c.uai")))
        # A directory that does not exist: one line, usage.
        rc, out, err = self.mep("init", os.path.join("nowhere", "..", "x.uai"))
        self.assertEqual(rc, 2, err)
        self.assertOneLine(err)

    def test_a_path_that_is_not_utf8_is_a_usage_error(self):
        # JSON carries text: such a path would reach mepd as another name (U+FFFD in place
        # of the byte), and mep would create or lease that other file.
        for cmd in (("init",), ("claim", unique()), ("identify",)):
            with self.subTest(cmd=cmd[0]):
                rc, out, err = self.mep(*cmd, "new\udce9.uai")  # the byte 0xE9, as Python passes it
                self.assertEqual(rc, 2, err)
                self.assertOneLine(err)
                self.assertIn("not valid UTF-8", err)
        self.assertEqual([n for n in os.listdir(self.work) if n.startswith("new")], [])


    def test_a_path_longer_than_the_system_takes_says_so(self):
        # It said "no such regular file: create it with 'mep init PATH'", which cannot work.
        long = os.path.join(self.work, *(["d" * 200] * 21), "x.uai")  # > 4096 bytes
        for cmd in (("claim", unique()), ("identify",)):
            with self.subTest(cmd=cmd[0]):
                rc, out, err = self.mep(*cmd, long)
                self.assertEqual(rc, 2, err)
                self.assertOneLine(err)
                self.assertIn("bytes long; paths may have 4095 at most", err)


class ErrorClasses(CliTestCase):
    """Each error class: its exit code, one line on stderr, or a problem document with --json."""

    def test_held_name_exit_3(self):
        a, _ = self.new_memory()
        b, _ = self.new_memory()
        name = unique()
        self.claim(name, a)
        rc, out, err = self.mep("claim", name.upper(), b)
        self.assertEqual((rc, out), (EXIT_HELD, ""))
        self.assertOneLine(err)
        self.assertIn("Name held", err)
        rc, out, err = self.mep("--json", "claim", name, b)
        self.assertEqual((rc, err), (EXIT_HELD, ""))
        self.assertProblem(out, 423, "name-held")
        # The memory under another name, and a confusable of the name (agent_1 / agent_l).
        rc, out, _ = self.mep("--json", "claim", unique(), a)
        self.assertEqual(rc, EXIT_HELD)
        self.assertProblem(out, 423, "memory-attached")
        base = "c" + uuid.uuid4().hex[:8]
        self.claim(base + "_1", b)
        c, _ = self.new_memory()
        rc, out, _ = self.mep("--json", "claim", base + "_l", c)
        self.assertEqual(rc, EXIT_HELD)
        self.assertProblem(out, 423, "name-confusable")

    def test_invalid_name_exit_6(self):
        path, _ = self.new_memory()
        rc, out, err = self.mep("claim", "agent!", path)
        self.assertEqual((rc, out), (EXIT_INVALID_NAME, ""))
        self.assertEqual(err, "mep: Invalid agent name: disallowed character U+0021 '!' at index 5\n")
        rc, out, err = self.mep("--json", "claim", "myаgent", path)  # Cyrillic а
        self.assertEqual((rc, err), (EXIT_INVALID_NAME, ""))
        self.assertEqual(self.assertProblem(out, 422, "invalid-name")["reason"], "mixed-script")
        rc, _, _ = self.mep("run", "bad name!", path, "--", "true")
        self.assertEqual(rc, EXIT_INVALID_NAME)

    def test_usage_exit_2(self):
        path, _ = self.new_memory()
        for args in (["claim", "only-a-name"], ["frobnicate"], ["--frobnicate", "status"], ["status", "extra"],
                     ["lineage", "--format", "svg", path], ["run", "--on-loss", "sometimes", "x", path, "--", "true"],
                     ["run", "x", path], ["claim", "--ttl", "soon", "x", path], []):
            rc, out, err = self.mep(*args)
            self.assertEqual((rc, out), (EXIT_USAGE, ""), args)
            self.assertTrue(err.startswith("mep: "), (args, err))
        # A command mep does not know is named as such (CLI11 alone said "A subcommand is
        # required", as if none had been given).
        for word in ("frobnicate", "help", "clam"):
            rc, out, err = self.mep(word)
            self.assertEqual((rc, out), (EXIT_USAGE, ""), word)
            self.assertIn("mep: unknown command '%s'" % word, err)
        # Bad values the daemon rejects are usage errors too.
        rc, out, err = self.mep("claim", "--ttl", "1", unique(), path)
        self.assertEqual((rc, out), (EXIT_USAGE, ""))
        self.assertOneLine(err)
        rc, out, err = self.mep("--json", "claim", "--ttl", "301", unique(), path)
        self.assertEqual((rc, err), (EXIT_USAGE, ""))
        self.assertProblem(out, 422, "invalid-ttl")
        rc, out, err = self.mep("claim", unique(), self.path("does-not-exist.uai"))
        self.assertEqual((rc, out), (EXIT_USAGE, ""))
        self.assertIn("mep init", err)
        rc, out, err = self.mep("init", path)
        self.assertEqual((rc, out), (EXIT_USAGE, ""))
        self.assertIn("already exists", err)

    def test_not_found_exit_1(self):
        rc, out, err = self.mep("release", unique())
        self.assertEqual((rc, out), (EXIT_OTHER, ""))
        self.assertOneLine(err)
        rc, out, err = self.mep("--json", "release", unique())
        self.assertEqual((rc, err), (EXIT_OTHER, ""))
        self.assertProblem(out, 404, "lease-not-found")
        path, _ = self.new_memory()
        rc, out, _ = self.mep("--json", "branch", path, self.path())  # no lease on the source
        self.assertEqual(rc, EXIT_OTHER)
        self.assertProblem(out, 404, "lease-not-found")

    def test_daemon_not_running_exit_5_with_a_hint(self):
        gone = os.path.join(self.home, "no-daemon", "mepd.sock")
        path, _ = self.new_memory()
        for args in (["status"], ["claim", "x", path], ["init", self.path()], ["identify", path],
                     ["lineage", path], ["release", "x"], ["branch", path, self.path()],
                     ["run", "x", path, "--", "touch", self.path("never-run")]):
            rc, out, err = self.mep(*args, socket=gone)
            self.assertEqual((rc, out), (EXIT_UNAVAILABLE, ""), args)
            self.assertOneLine(err)
            self.assertIn(gone, err)
            self.assertIn("mepd", err)
            self.assertIn("systemctl --user start mepd.socket", err)
        self.assertFalse(os.path.exists(self.path("never-run")))
        rc, out, err = self.mep("--json", "status", socket=gone)
        self.assertEqual((rc, err), (EXIT_UNAVAILABLE, ""))
        self.assertIn("mepd", self.assertProblem(out, 503, "unavailable")["detail"])


class Run(CliTestCase):
    """`mep run` against the embedded daemon."""

    def test_passes_the_lease_and_returns_the_status(self):
        path, mem = self.new_memory()
        name = unique("Runner")
        envfile = self.path("env.txt")
        rc, out, err = self.mep("run", name, path, "--", "sh", "-c", 'env > "$1"; echo out; exit 7', "sh", envfile,
                                env=dict(self.env, CLI_TEST_VARIABLE="kept"))
        self.assertEqual((rc, out, err), (7, "out\n", ""))
        seen = dict(line.split("=", 1) for line in read_file(envfile).splitlines() if "=" in line)
        self.assertEqual(seen["MEP_CANONICAL_NAME"], name.lower())
        self.assertEqual(seen["MEP_MEMORY_INSTANCE_ID"], mem)
        self.assertRegex(seen["MEP_FENCING_TOKEN"], r"^[1-9]\d*$")
        self.assertRegex(seen["MEP_LEASE_ID"], "^%s$" % UUID)
        self.assertRegex(seen["MEP_LEASE_EXPIRES_AT"], "^%s$" % RFC3339_MS)
        # The user's environment is kept; the lease is released when the command ends.
        self.assertEqual(seen["CLI_TEST_VARIABLE"], "kept")
        self.assertNotIn(name.lower(), self.leases())
        # A second run gets a larger token.
        rc, out, _ = self.mep("run", name, path, "--", "sh", "-c", 'echo "$MEP_FENCING_TOKEN"')
        self.assertEqual(rc, 0)
        self.assertGreater(int(out), int(seen["MEP_FENCING_TOKEN"]))

    def test_child_killed_by_a_signal_is_128_plus_n(self):
        path, _ = self.new_memory()
        rc, _, _ = self.mep("run", unique(), path, "--", "sh", "-c", "kill -KILL $$")
        self.assertEqual(rc, 128 + signal.SIGKILL)
        rc, _, _ = self.mep("run", unique(), path, "--", "true")
        self.assertEqual(rc, 0)

    def test_command_not_found_is_127(self):
        path, _ = self.new_memory()
        rc, out, err = self.mep("run", unique(), path, "--", "/nonexistent/mep-test-command")
        self.assertEqual((rc, out), (127, ""))
        self.assertIn("cannot run /nonexistent/mep-test-command", err)

    def test_the_command_keeps_its_own_arguments(self):
        # Like flock(1): mep reads its options up to the command, the command gets the rest,
        # with or without `--` (and a `--` of the command's own is kept).
        path, _ = self.new_memory()
        show = 'printf "%s|" "$@"'
        for args, expected in ((["--ttl", "7", unique(), path, "sh", "-c", show, "sh", "--ttl", "5", "-v"],
                                "--ttl|5|-v|"),
                               ([unique(), path, "--", "sh", "-c", show, "sh", "-c", "--json"], "-c|--json|"),
                               ([unique(), path, "sh", "-c", show, "sh", "a", "--", "b"], "a|--|b|")):
            with self.subTest(args=args):
                rc, out, err = self.mep("run", *args)
                self.assertEqual((rc, out, err), (0, expected, ""))
        rc, out, err = self.mep("run", unique(), path)
        self.assertEqual((rc, out), (EXIT_USAGE, ""))
        self.assertIn("a command to run", err)
        rc, out, err = self.mep("run", "--grace", "-1", unique(), path, "true")
        self.assertEqual((rc, out), (EXIT_USAGE, ""), err)
        self.assertIn("--grace: must be a number of seconds, 0 or more (got -1)", err)

    def test_command_not_runnable_is_126(self):
        path, _ = self.new_memory()
        script = self.path(unique("noexec"))
        with open(script, "w") as f:
            f.write("#!/bin/sh\necho ran\n")
        os.chmod(script, 0o644)
        rc, out, err = self.mep("run", unique(), path, "--", script)
        self.assertEqual((rc, out), (126, ""))
        self.assertIn("cannot run", err)

    def test_sigterm_is_forwarded_to_the_child(self):
        path, _ = self.new_memory()
        name = unique()
        ready, seen = self.path("ready"), self.path("seen")
        script = ('trap \'echo TERM > "$2"; exit 143\' TERM; echo $$ > "$1"; '
                  'while :; do sleep 0.1; done')
        p = self.popen_mep("run", name, path, "--", "sh", "-c", script, "sh", ready, seen)
        child = wait_for(lambda: (read_file(ready) or "").strip())
        self.assertTrue(child, "the child never started")
        self.assertIn(name, self.leases())
        os.kill(p.pid, signal.SIGTERM)
        rc, out, err = self.communicate(p)
        self.assertEqual(rc, 143, err)
        self.assertEqual(read_file(seen), "TERM\n")
        self.assertTrue(pid_gone(int(child)))
        self.assertIsNotNone(wait_for(lambda: name not in self.leases()), "the lease was not released")

    def test_what_the_command_left_behind_ends_before_the_release(self):
        # A background process of the command would run on unfenced: it gets SIGKILL when
        # the command exits, before the lease is released; with --on-loss ignore it is left.
        for on_loss, survives in (("term", False), ("ignore", True)):
            with self.subTest(on_loss=on_loss):
                path, _ = self.new_memory()
                pidfile = self.path(unique("bg"))
                rc, _, err = self.mep("run", "--on-loss", on_loss, unique(), path, "--", "sh", "-c",
                                      'sleep 60 >/dev/null 2>&1 & echo $! > "$1"; exit 5', "sh", pidfile)
                self.assertEqual(rc, 5, err)
                bg = int(read_file(pidfile))
                try:
                    if survives:
                        self.assertFalse(pid_gone(bg))
                    else:
                        self.assertTrue(wait_for(lambda: pid_gone(bg)), "the background process runs on")
                finally:
                    kill_if_alive(bg)

    def run_sleeper(self):
        """Starts `mep run NAME PATH -- sleep 60` (the shell exec's sleep); returns (name,
        the mep process, the command's pid as a string) once the command runs."""
        path, _ = self.new_memory()
        name = unique()
        ready = self.path(unique("ready"))
        p = self.popen_mep("run", name, path, "--", "sh", "-c", 'echo $$ > "$1"; exec sleep 60', "sh", ready)
        child = wait_for(lambda: (read_file(ready) or "").strip())
        self.assertTrue(child, "the child never started")
        return name, p, child

    def test_other_signals_are_forwarded(self):
        # SIGUSR1 (like SIGQUIT, SIGUSR2 and SIGALRM) would end mep run and leave the command
        # running: it goes to the command's group.
        name, p, child = self.run_sleeper()
        os.kill(p.pid, signal.SIGUSR1)
        rc, _, err = self.communicate(p)
        self.assertEqual(rc, 128 + signal.SIGUSR1, err)
        self.assertTrue(pid_gone(int(child)))
        self.assertIsNotNone(wait_for(lambda: name not in self.leases()), "the lease was not released")

    def test_command_dies_with_mep_run(self):
        # mep run killed outright: the daemon releases the lease, and the command gets SIGKILL.
        name, p, child = self.run_sleeper()
        try:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=COMMAND_TIMEOUT_S)
            self.assertTrue(wait_for(lambda: pid_gone(int(child))), "the command outlived mep run")
            self.assertIsNotNone(wait_for(lambda: name not in self.leases()), "the lease was not released")
        finally:
            kill_if_alive(int(child))

    def test_what_the_command_started_dies_with_mep_run(self):
        # Guards: only the command itself died with mep run (PR_SET_PDEATHSIG); what it had
        # started in the background ran on, writing with the token, after the daemon released
        # the lease and another host was granted the name. The group's guard kills it all.
        path, _ = self.new_memory()
        name = unique()
        pidfile = self.path(unique("bg"))
        p = self.popen_mep("run", name, path, "--", "sh", "-c",
                           'sleep 60 >/dev/null 2>&1 & echo $! > "$1"; exec sleep 60', "sh", pidfile)
        bg = wait_for(lambda: (read_file(pidfile) or "").strip())
        self.assertTrue(bg, "the command never started")
        bg = int(bg)
        group = os.getpgid(bg)
        self.assertNotEqual(group, os.getpgid(p.pid), "the command runs in a group of its own")

        def members():
            """The live processes of the command's group (zombies not reaped yet are gone)."""
            found = []
            for d in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open("/proc/%s/stat" % d) as f:
                        state, _, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
                except OSError:
                    continue
                if int(pgrp) == group and state != "Z":
                    found.append(int(d))
            return found

        try:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=COMMAND_TIMEOUT_S)
            self.assertTrue(wait_for(lambda: pid_gone(bg)), "the command's background process outlived mep run")
            # Nothing of the run is left in the group (the guard that killed it neither).
            self.assertTrue(wait_for(lambda: not members()), members())
            self.assertIsNotNone(wait_for(lambda: name not in self.leases()), "the lease was not released")
        finally:
            kill_if_alive(bg)

    def run_on_terminal(self, script, *run_args, stdin_from_terminal=True):
        """Starts `mep run RUN_ARGS NAME PATH -- sh -c SCRIPT` as the session leader of a new
        pseudo terminal, as a shell would in the foreground (standard input /dev/null unless
        `stdin_from_terminal`); returns (process, master fd)."""
        path, _ = self.new_memory()
        master, slave = pty.openpty()
        self.addCleanup(os.close, master)

        def controlling_terminal():
            import fcntl
            import termios
            fcntl.ioctl(1, termios.TIOCSCTTY, 0)

        try:
            p = subprocess.Popen([mep_bin(), "--socket", self.daemon.socket_path, "run", *run_args, unique(), path,
                                  "--", "sh", "-c", script],
                                 stdin=slave if stdin_from_terminal else subprocess.DEVNULL, stdout=slave,
                                 stderr=slave, env=self.env, cwd=self.work, start_new_session=True,
                                 preexec_fn=controlling_terminal)
        finally:
            os.close(slave)
        self.popens.append(p)
        return p, master

    def read_until(self, master, text, seen=b""):
        deadline = time.monotonic() + WAIT_S
        while text not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    seen += os.read(master, 4096)
                except OSError:  # EIO: the terminal's last writer closed it
                    break
        self.assertIn(text, seen)
        return seen

    def test_interactive_command_reads_the_terminal(self):
        # The command's group is the terminal's foreground group while it runs: it reads
        # what is typed (a background group would be stopped by SIGTTIN for ever).
        p, master = self.run_on_terminal('read x; echo "got:$x"')
        os.write(master, b"hello\n")
        self.read_until(master, b"got:hello")
        self.assertEqual(p.wait(timeout=COMMAND_TIMEOUT_S), 0)

    def stop_and_resume(self, stopped_for, *run_args):
        """A command reading two lines on a terminal: ^Z after the first, SIGCONT to mep run
        (as the shell's fg sends) `stopped_for` seconds later, then the second; returns what
        the terminal showed, once the command exited 0."""
        p, master = self.run_on_terminal('read x; echo "one:$x"; read y; echo "two:$y"', *run_args)
        os.write(master, b"a\n")
        seen = self.read_until(master, b"one:a")
        os.write(master, b"\x1a")

        def stopped():
            with open("/proc/%d/stat" % p.pid) as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "T"
        self.assertTrue(wait_for(stopped), "mep run did not stop with its command")
        time.sleep(stopped_for)
        os.killpg(p.pid, signal.SIGCONT)
        os.write(master, b"b\n")
        seen = self.read_until(master, b"two:b", seen)
        self.assertEqual(p.wait(timeout=COMMAND_TIMEOUT_S), 0, seen)
        return seen

    def test_ctrl_z_stops_mep_run_with_the_command(self):
        # ^Z stops the command and mep run with it (the shell sees its job stopped); SIGCONT
        # to mep run, as the shell's fg sends, gives the terminal back to the command.
        self.stop_and_resume(0)

    def test_a_stop_longer_than_the_ttl_is_no_loss(self):
        # Guards: after ^Z for longer than the TTL, mep run judged its deadline before it had
        # heard the renewals mepd made meanwhile, and killed the command as "lost".
        self.assertNotIn(b"lost", self.stop_and_resume(7, "--ttl", "5"))  # mepd renews all along

    def test_the_terminal_on_standard_output_is_handed_over_too(self):
        # Guards: only a terminal on standard input was handed to the command; with input from
        # a pipe or /dev/null, the command stayed in the background and stopped (SIGTTIN) when
        # it read /dev/tty.
        p, master = self.run_on_terminal('read x </dev/tty; echo "tty:$x"', stdin_from_terminal=False)
        os.write(master, b"hi\n")
        self.read_until(master, b"tty:hi")
        self.assertEqual(p.wait(timeout=COMMAND_TIMEOUT_S), 0)

    def test_signals_ignored_by_the_caller_stay_ignored(self):
        # Guards: `nohup mep run ...` was defeated: mep run forwarded SIGHUP, and the command
        # had it reset to the default, so a hang-up ended the command nohup was to protect.
        path, _ = self.new_memory()
        ready = self.path(unique("ready"))

        def ignore_hup():
            signal.signal(signal.SIGHUP, signal.SIG_IGN)

        p = self.popen_mep("run", unique(), path, "--", "sh", "-c",
                           'grep SigIgn /proc/$$/status > "$1"; exec sleep 60', "sh", ready,
                           preexec_fn=ignore_hup)
        line = wait_for(lambda: (read_file(ready) or "").strip())
        self.assertTrue(line, "the command never started")
        self.assertTrue(int(line.split()[1], 16) & (1 << (signal.SIGHUP - 1)), line)
        os.kill(p.pid, signal.SIGHUP)
        time.sleep(0.5)
        self.assertIsNone(p.poll(), "SIGHUP ended mep run")
        os.kill(p.pid, signal.SIGTERM)
        rc, _, err = self.communicate(p)
        self.assertEqual(rc, 128 + signal.SIGTERM, err)

    def test_closed_standard_streams_are_dev_null(self):
        # Guards: with standard input, output and error closed, the next descriptors opened
        # became them: mep run's messages went into the socket of the group's guard, which
        # read them as "stand down".
        path, _ = self.new_memory()
        ready = self.path(unique("ready"))
        p = subprocess.Popen(["sh", "-c", 'exec "$0" --socket "$1" run "$2" "$3" -- sh -c "echo \\$PPID > $4; '
                              'exec sleep 60" <&- >&- 2>&-', mep_bin(), self.daemon.socket_path, unique(), path, ready],
                             env=self.env, cwd=self.work, start_new_session=True)
        self.popens.append(p)
        self.assertTrue(wait_for(lambda: (read_file(ready) or "").strip()), "the command never started")
        for fd in (0, 1, 2):
            self.assertEqual(os.readlink("/proc/%d/fd/%d" % (p.pid, fd)), "/dev/null", fd)
        os.kill(p.pid, signal.SIGTERM)
        self.assertEqual(p.wait(timeout=COMMAND_TIMEOUT_S), 128 + signal.SIGTERM)

    def test_ctrl_z_of_mep_run_inside_mep_run_under_an_interactive_shell(self):
        # Guards: the inner mep run stopped itself with SIGSTOP, on which the outer one does not
        # act: ^Z left the terminal to a stopped job, with no prompt, and ^C did nothing.
        a, _ = self.new_memory()
        b, _ = self.new_memory()
        outer, inner = unique(), unique()
        pid, fd = pty.fork()
        if pid == 0:
            try:
                os.chdir(self.work)
                os.execvpe("bash", ["bash", "--norc", "--noprofile", "-i"], dict(self.env, PS1="PROMPT> ", TERM="dumb"))
            finally:
                os._exit(127)
        self.addCleanup(os.close, fd)

        def end_session():  # bash leads the pty's session: whatever it started goes too
            for d in filter(str.isdigit, os.listdir("/proc")):
                try:
                    if os.getsid(int(d)) == pid:
                        os.kill(int(d), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            os.waitpid(pid, 0)
        self.addCleanup(end_session)
        out = bytearray()

        def until(pred, timeout=WAIT_S):
            deadline = time.monotonic() + timeout
            while not pred() and time.monotonic() < deadline:
                if select.select([fd], [], [], 0.1)[0]:
                    try:
                        out.extend(os.read(fd, 4096))
                    except OSError:
                        break
            return pred()

        mep = "%s --socket %s" % (mep_bin(), self.daemon.socket_path)
        self.assertTrue(until(lambda: out.endswith(b"PROMPT> ")), bytes(out))
        os.write(fd, ("%s run %s %s -- %s run %s %s -- sh -c 'while :; do echo tick; sleep 0.2; done'\n"
                      % (mep, outer, a, mep, inner, b)).encode())
        self.assertTrue(until(lambda: out.count(b"tick\r\n") >= 2), bytes(out[-300:]))
        os.write(fd, b"\x1a")
        self.assertTrue(until(lambda: b"Stopped" in out and out.endswith(b"PROMPT> ")), bytes(out[-300:]))
        mark = len(out)
        os.write(fd, b"fg\n")
        self.assertTrue(until(lambda: out[mark:].count(b"tick\r\n") >= 2), bytes(out[-300:]))
        mark = len(out)
        os.write(fd, b"\x03")
        self.assertTrue(until(lambda: out[mark:].endswith(b"PROMPT> ")), bytes(out[-300:]))
        self.assertIsNotNone(wait_for(lambda: outer not in self.leases() and inner not in self.leases()))

    def test_held_name_does_not_start_the_command(self):
        a, _ = self.new_memory()
        b, _ = self.new_memory()
        name = unique()
        self.claim(name, a)
        marker = self.path("started")
        rc, out, err = self.mep("run", name, b, "--", "touch", marker)
        self.assertEqual((rc, out), (EXIT_HELD, ""))
        self.assertOneLine(err)
        self.assertFalse(os.path.exists(marker))
        rc, out, err = self.mep("--json", "run", name, b, "--", "touch", marker)
        self.assertEqual((rc, err), (EXIT_HELD, ""))
        self.assertProblem(out, 423, "name-held")
        self.assertFalse(os.path.exists(marker))


class RunWithADaemonThatDoesNotAnswer(CliTestCase):
    def test_the_commands_status_is_not_held_back_by_the_release(self):
        # The command stops mepd and exits: mep run's release gets no answer. The lease is
        # bound to mep run's pid, so mep run exits with the command's status after a short
        # wait (it waited 60 s), and mepd, once it runs again, releases the lease itself.
        path, _ = self.new_memory()
        name = unique()
        pid = self.daemon.proc.pid
        self.addCleanup(lambda: os.kill(pid, signal.SIGCONT))
        p = self.popen_mep("run", name, path, "--", "sh", "-c", "kill -STOP %d; exit 3" % pid)
        rc, out, err = self.communicate(p, timeout=30)
        self.assertEqual(rc, 3, err)
        os.kill(pid, signal.SIGCONT)
        self.assertTrue(wait_for(lambda: name not in self.leases(), timeout=10), self.leases().get(name))


class RunAcrossDaemonRestart(CliTestCase):
    """mep run goes on through a restart of mepd: the daemon re-adopts the lease, and mep run
    opens the event stream again, so renewals keep moving its local deadline."""

    def test_command_outlives_a_daemon_restart(self):
        path, _ = self.new_memory()
        name = unique()
        ready = self.path(unique("ready"))
        # TTL 15: renewals every 5 s, local deadline 12 s after the last one heard of. The
        # command ends by itself 20 s after the restart, well past that deadline.
        p = self.popen_mep("run", "--ttl", "15", name, path, "--", "sh", "-c",
                           'echo $$ > "$1"; sleep 20; exit 3', "sh", ready)
        self.assertTrue(wait_for(lambda: (read_file(ready) or "").strip()), "the child never started")
        token = self.leases()[name]["fencing_token"]
        self.daemon.proc.kill9()
        self.daemon.start()
        rc, out, err = self.communicate(p, timeout=60)
        self.assertEqual(rc, 3, err)
        self.assertNotIn("lost", err)
        self.assertNotIn(name, self.leases())  # released when the command ended
        self.assertGreaterEqual(token, 1)


class RunLeaseLoss(CliTestCase):
    """mepd against a real `mep server`; the server is SIGSTOPped while `mep run --ttl 6` holds a
    lease, so renewals hang and the local deadline passes: the lease is lost, the child's whole
    process group (a grandchild too) gets SIGTERM, then SIGKILL, and mep run exits 4."""

    @classmethod
    def start_daemon(cls):
        server = MepServer(cls.home, cls.env)
        cls.addClassCleanup(server.stop)
        cls.server = server.start()
        d = Mepd(cls.home, cls.env, control_plane=server.url, token=server.token("tenant-cli"))
        cls.addClassCleanup(d.stop)
        return d.start()

    def test_loss_kills_the_process_group_and_exits_4(self):
        path, _ = self.new_memory()
        name = unique()
        child_pid, gc_pid, signals = self.path("child.pid"), self.path("gc.pid"), self.path("signals")
        # The child notes SIGTERM and carries on; its background grandchild ignores SIGTERM.
        # Only SIGKILL to the whole group ends both.
        script = ('trap \'echo TERM >> "$3"\' TERM; '
                  '(trap "" TERM; exec sleep 1000) & echo $! > "$2"; echo $$ > "$1"; '
                  'while :; do sleep 0.2; done')
        p = self.popen_mep("run", "--ttl", "6", "--grace", "1", name, path, "--",
                           "sh", "-c", script, "sh", child_pid, gc_pid, signals)
        pids = wait_for(lambda: (read_file(child_pid) or "").strip() and (read_file(gc_pid) or "").strip()
                        and (int(read_file(child_pid)), int(read_file(gc_pid))))
        self.assertTrue(pids, "the child never started")
        self.addCleanup(kill_if_alive, pids[0])
        self.addCleanup(kill_if_alive, pids[1])
        self.assertNotEqual(os.getpgid(pids[0]), os.getpgid(p.pid), "the child runs in a process group of its own")
        self.assertEqual(os.getpgid(pids[1]), os.getpgid(pids[0]), "the grandchild is in the child's group")
        # Survive at least one renewal (ttl/3 = 2 s) before the partition.
        time.sleep(3)
        self.assertIsNone(p.poll(), "mep run ended early: %r" % (p.stderr.read() if p.poll() is not None else ""))

        os.kill(self.server.proc.pid, signal.SIGSTOP)
        self.addCleanup(self.server.proc.signal, signal.SIGCONT)
        stopped = time.monotonic()
        rc, out, err = self.communicate(p, timeout=LOSS_TIMEOUT_S)
        elapsed = time.monotonic() - stopped
        self.assertEqual(rc, EXIT_LOST, err)
        self.assertRegex(err, r"(?m)^mep: lease on %s lost \(" % re.escape(name))
        # ttl 6: lost at most ~5 s after the last renewal was sent, then 1 s of grace.
        self.assertLess(elapsed, 6 + 1 + 8, err)
        self.assertEqual(read_file(signals), "TERM\n", "SIGTERM first, then SIGKILL")
        self.assertTrue(wait_for(lambda: pid_gone(pids[0]), timeout=5), "the child survived")
        self.assertTrue(wait_for(lambda: pid_gone(pids[1]), timeout=5), "the grandchild survived")
        # mepd decides on its own deadline, which by design comes up to about a second after
        # mep run's (mep run keeps twice the daemon's margin): checked at once, after the
        # one-second grace, the two raced. mepd must say lost soon after.
        def daemon_says_lost():
            status = self.leases().get(name)
            return status is None or status["state"] == "lost"
        self.assertTrue(wait_for(daemon_says_lost, timeout=5), self.leases().get(name))


if __name__ == "__main__":
    unittest.main()


class AnswersOfAnotherVersion(unittest.TestCase):
    """mep reads mepd's answers with the daemon API's decoders (common/daemon_api): an answer
    whose members are not what it reads (another version of mepd, a bug) is one line on
    stderr and exit 1, never a table of blanks printed as if it had succeeded; --json still
    prints the answer as it came."""

    ANSWER = {"leases": [{"lease_id": "l1", "canonical_name": 7, "display_name": "x",
                          "memory_instance_id": "m", "expires_at": "2026-01-01T00:00:00.000Z",
                          "ttl_seconds": 30, "path": "/p", "state": "held", "bind_pid": None}]}

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="mep-cli-odd-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.socket_path = os.path.join(self.dir, "mepd.sock")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(self.socket_path)
        srv.listen(8)
        srv.settimeout(0.2)
        self.stop = threading.Event()
        body = json.dumps(self.ANSWER).encode()

        def serve():
            while not self.stop.is_set():
                try:
                    conn, _ = srv.accept()
                except OSError:
                    continue
                with conn:
                    conn.settimeout(5)
                    data = b""
                    while b"\r\n\r\n" not in data:
                        part = conn.recv(65536)
                        if not part:
                            break
                        data += part
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            srv.close()

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        self.addCleanup(t.join, 5)
        self.addCleanup(self.stop.set)

    def mep(self, *args):
        p = subprocess.run([mep_bin(), "--socket", self.socket_path, *args], stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env(self.dir), cwd=self.dir,
                           timeout=COMMAND_TIMEOUT_S, check=False)
        return p.returncode, p.stdout.decode("utf-8"), p.stderr.decode("utf-8")

    def test_an_answer_it_cannot_read_is_one_line_and_exit_1(self):
        rc, out, err = self.mep("status")
        self.assertEqual((rc, out), (EXIT_OTHER, ""))
        self.assertEqual(err.count("\n"), 1, err)
        self.assertIn("GET /v1/leases", err)
        self.assertIn("canonical_name", err)
        rc, out, err = self.mep("--json", "status")
        self.assertEqual((rc, err), (EXIT_OK, ""))
        self.assertEqual(json.loads(out), self.ANSWER)
