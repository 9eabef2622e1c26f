"""mep server --writer-nice: the SQLite store's commit thread (mep-writer) asks for that
nice value, best effort; no other thread changes; a process that may not go below 0
keeps serving at its own priority; out-of-range values are refused at start."""
import os
import pwd
import resource
import shutil
import subprocess
import tempfile
import unittest

from serverfixture import MepServer, create_token, mep_bin, run_mep


def thread_nices(pid):
    """{tid: (name, nice)} for every thread of process `pid` (getpriority on a thread id
    gives that thread's nice value)."""
    out = {}
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/comm" % (pid, tid)) as f:
                out[int(tid)] = (f.read().strip(), os.getpriority(os.PRIO_PROCESS, int(tid)))
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile
    return out


def may_lower_nice_to(value):
    """Whether this process (and a server it starts) may set a nice value as low as
    `value`: with CAP_SYS_NICE (capability 23), or down to 20 - RLIMIT_NICE."""
    with open("/proc/self/status") as f:
        caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    if caps & (1 << 23):
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or 20 - soft <= value


class WriterNice(unittest.TestCase):
    def setUp(self):
        if os.environ.get("MEP_TEST_BACKEND", "sqlite") != "sqlite":
            self.skipTest("--writer-nice applies to the SQLite store only")
        mep_bin()
        self._tmp = tempfile.TemporaryDirectory(prefix="mep-nice-")
        self.addCleanup(self._tmp.cleanup)
        self.dir = self._tmp.name
        self.db = os.path.join(self.dir, "c.db")
        self.token = create_token(self.db, "tenant-nice")

    def start(self, *args, wrap=None):
        server = MepServer(self.dir, self.db, ["--log-level", "debug", *args], wrap=wrap)
        server.start()
        self.addCleanup(server.stop)
        # The writer sets its priority as it starts; the server is ready only after the
        # store is open, and a request through the writer makes sure it has run.
        with server.client(self.token) as c:
            self.assertEqual(c.register().status, 201)
        return server

    def check(self, server, writer_expected):
        nices = thread_nices(server.pid)
        process_nice = os.getpriority(os.PRIO_PROCESS, server.pid)  # the main thread's
        writers = [n for (name, n) in nices.values() if name == "mep-writer"]
        self.assertEqual(writers, [writer_expected], nices)
        others = [n for (name, n) in nices.values() if name != "mep-writer"]
        self.assertTrue(others, nices)
        self.assertEqual(set(others), {process_nice}, "only the writer changes: %r" % nices)

    def test_default_is_minus_10_when_the_process_may(self):
        server = self.start()
        if may_lower_nice_to(-10):
            self.check(server, -10)
            self.assertIn("the commit thread runs at nice -10", server.stderr_text())
        else:
            self.check(server, os.getpriority(os.PRIO_PROCESS, server.pid))
            self.assertIn("the commit thread keeps its priority", server.stderr_text())

    def test_zero_leaves_the_thread_alone(self):
        server = self.start("--writer-nice", "0")
        self.check(server, os.getpriority(os.PRIO_PROCESS, server.pid))
        self.assertNotIn("commit thread", server.stderr_text())

    def test_a_higher_value_is_always_allowed(self):
        server = self.start("--writer-nice", "7")
        self.check(server, 7)

    def test_unprivileged_server_keeps_its_priority_and_serves(self):
        """As a user without CAP_SYS_NICE (setpriv to nobody, no capabilities, RLIMIT_NICE
        0), the default -10 is refused by the kernel; the server logs it and serves."""
        if os.geteuid() != 0:
            self.skipTest("needs root to start the server as another user")
        setpriv, prlimit = shutil.which("setpriv"), shutil.which("prlimit")
        if not setpriv or not prlimit:
            self.skipTest("setpriv and prlimit (util-linux) are needed")
        nobody = pwd.getpwnam("nobody")

        def as_nobody(argv):
            # No capabilities, and RLIMIT_NICE 0: nice may only go up.
            return [setpriv, "--reuid=%d" % nobody.pw_uid, "--regid=%d" % nobody.pw_gid,
                    "--clear-groups", "--inh-caps=-all", "--bounding-set=-all",
                    prlimit, "--nice=0", "--", *argv]

        probe = subprocess.run(as_nobody([mep_bin(), "--version"]), capture_output=True, timeout=30)
        if probe.returncode != 0:
            self.skipTest("nobody cannot run %s: %s" % (mep_bin(), probe.stderr.decode(errors="replace")))
        for root, dirs, files in os.walk(self.dir):
            for name in [root] + [os.path.join(root, f) for f in files]:
                os.chown(name, nobody.pw_uid, nobody.pw_gid)
        server = self.start(wrap=as_nobody)
        self.check(server, os.getpriority(os.PRIO_PROCESS, server.pid))
        self.assertIn("the commit thread keeps its priority: nice -10", server.stderr_text())

    def test_out_of_range_is_refused(self):
        for value in ("-21", "20", "x"):
            rc, _, err = run_mep(["server", "--db", "sqlite:" + self.db, "--listen", "127.0.0.1:0",
                                  "--writer-nice", value], check=False)
            self.assertEqual(rc, 2, err)
            self.assertIn("--writer-nice", err)
            self.assertNotIn("listening", err)


if __name__ == "__main__":
    unittest.main()
