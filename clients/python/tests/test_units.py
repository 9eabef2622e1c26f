"""Tests of the SDK's pure parts (no processes): the problem → exception table, the socket
discovery order, the HTTP framing and the loss-decision state machine."""
import dataclasses
import datetime
import json
import os
import re
import tempfile
import unittest

from . import SOURCE_ROOT  # puts the source tree on sys.path

import mep
import mep.aio
from mep import _args, _config, _http
from mep._tracker import LossTracker, margin_seconds
from mep.types import Event, LeaseInfo

ALL_CODES = {
    "invalid-request": 400, "idempotency-key-missing": 400, "idempotency-key-invalid": 400,
    "unauthenticated": 401, "forbidden": 403, "not-found": 404, "memory-not-found": 404,
    "lease-not-found": 404, "method-not-allowed": 405, "memory-id-taken": 409, "stale-fence": 409,
    "idempotency-request-in-flight": 409, "lease-expired": 410, "payload-too-large": 413,
    "unsupported-media-type": 415, "invalid-name": 422, "invalid-ttl": 422, "idempotency-key-reused": 422,
    "name-held": 423, "name-confusable": 423, "memory-attached": 423, "rate-limited": 429, "internal": 500,
    "store-not-configured": 501, "transaction-conflict": 503, "unavailable": 503,
    "migration-in-progress": 503, "store-unavailable": 503, "insufficient-storage": 507,
    "control-plane-unreachable": 503,
}


class ExitStatusTest(unittest.TestCase):
    def test_python_m_mep_exits_as_the_cli_for_every_code(self):
        """``python -m mep`` gives the CLI's exit status for each problem code: checked
        against the CLI's own table in common/problem.cpp, so that the two cannot drift."""
        from mep.__main__ import EXIT_BY_CODE, exit_status
        table = os.path.join(SOURCE_ROOT, "..", "..", "common", "problem.cpp")
        if not os.path.exists(table):
            self.skipTest("the CLI's table (common/problem.cpp) is not beside this SDK: not a source checkout")
        exits = {"ok": 0, "other": 1, "usage": 2, "held": 3, "lost": 4, "unavailable": 5, "invalid_name": 6, "auth": 7}
        with open(table, encoding="utf-8") as f:
            rows = re.findall(r'CodeInfo\{Code::\w+,\s*"([a-z-]+)",\s*\d+,\s*"[^"]*",\s*ec::(\w+)\}', f.read())
        self.assertGreaterEqual(len(rows), len(ALL_CODES))
        self.assertEqual(EXIT_BY_CODE, {slug: exits[name] for slug, name in rows})
        for code, cls in mep.PROBLEM_CODES.items():
            self.assertEqual(exit_status(cls("x")), EXIT_BY_CODE[code], code)
        self.assertEqual(exit_status(mep.ConfigError("unreadable")), 2)
        self.assertEqual(exit_status(mep.MepError("no code")), 1)


class ProblemTableTest(unittest.TestCase):
    def test_statuses_and_titles_are_the_cli_table(self):
        """Every code's status and title are those of common/problem.cpp (they had drifted:
        nine titles differed), and every code there that mepd can answer has a class."""
        table = os.path.join(SOURCE_ROOT, "..", "..", "common", "problem.cpp")
        if not os.path.exists(table):
            self.skipTest("the CLI's table (common/problem.cpp) is not beside this SDK: not a source checkout")
        with open(table, encoding="utf-8") as f:
            rows = re.findall(r'CodeInfo\{Code::\w+,\s*"([a-z-]+)",\s*(\d+),\s*"([^"]*)"', f.read())
        self.assertGreaterEqual(len(rows), len(ALL_CODES))
        # The data plane's own answer to a conditional write (If-Match): mepd sends none.
        data_plane_only = {"precondition-failed"}
        self.assertEqual(set(mep.PROBLEM_CODES), {slug for slug, _, _ in rows} - data_plane_only)
        for slug, status, title in rows:
            if slug in data_plane_only:
                continue
            cls = mep.PROBLEM_CODES[slug]
            self.assertEqual((cls.STATUS, cls.TITLE), (int(status), title), slug)

    def test_every_code_has_its_own_class(self):
        self.assertEqual(set(mep.PROBLEM_CODES), set(ALL_CODES))
        classes = set()
        for code, status in ALL_CODES.items():
            cls = mep.PROBLEM_CODES[code]
            self.assertTrue(issubclass(cls, mep.MepError))
            self.assertEqual(cls.STATUS, status, code)
            self.assertIs(getattr(mep, cls.__name__), cls, "mep.%s is exported" % cls.__name__)
            classes.add(cls)
        self.assertEqual(len(classes), len(ALL_CODES))

    def test_grouping_bases(self):
        for cls in (mep.NameHeld, mep.NameConfusable, mep.MemoryAttached):
            self.assertTrue(issubclass(cls, mep.Held))
        for cls in (mep.StaleFence, mep.LeaseExpired, mep.LeaseLost):
            self.assertTrue(issubclass(cls, mep.LeaseGone))
        for cls in (mep.Unavailable, mep.StoreUnavailable, mep.TransactionConflict, mep.MigrationInProgress):
            self.assertTrue(issubclass(cls, mep.TemporarilyUnavailable))
        self.assertTrue(issubclass(mep.DaemonNotRunning, mep.Unavailable))
        # It was "unavailable" before it had a code of its own: catching Unavailable still does.
        self.assertTrue(issubclass(mep.ControlPlaneUnreachable, mep.Unavailable))
        self.assertTrue(issubclass(mep.LeaseNotFound, mep.NotFound))

    def test_problem_fields_and_extensions(self):
        body = json.dumps({"type": "https://memoryendpoints.com/problems/invalid-name", "title": "Invalid agent name",
                           "status": 422, "detail": "invalid agent name: disallowed character U+0021",
                           "instance": "rid-1", "code": "invalid-name", "reason": "disallowed-character",
                           "codepoint": "U+0021", "index": 5, "other": [1]}).encode()
        e = mep.error_for_problem(422, body, {"retry-after": "3"})
        self.assertIsInstance(e, mep.InvalidName)
        self.assertEqual((e.code, e.status, e.title, e.instance), ("invalid-name", 422, "Invalid agent name", "rid-1"))
        self.assertEqual((e.reason, e.codepoint, e.index, e.retry_after), ("disallowed-character", "U+0021", 5, 3.0))
        self.assertEqual(e.extensions["other"], [1])
        self.assertEqual(e.other, [1])  # any extension reads as an attribute
        self.assertEqual(str(e), "Invalid agent name: disallowed character U+0021")
        self.assertEqual(e.to_problem()["codepoint"], "U+0021")
        with self.assertRaises(AttributeError):
            e.no_such_extension  # noqa: B018

    def test_held_errors_carry_the_holder(self):
        view = {"display_name": "builder-7", "host": "host-a", "since": "2026-12-06T14:02:07.123Z",
                "expires_at": "2026-12-06T14:03:07.5Z"}
        for code, cls in (("name-held", mep.NameHeld), ("name-confusable", mep.NameConfusable),
                          ("memory-attached", mep.MemoryAttached)):
            e = mep.error_for_problem(423, json.dumps({"code": code, "status": 423, "holder": view}).encode())
            self.assertIsInstance(e, cls)
            h = e.holder
            self.assertIsInstance(h, mep.Holder)
            self.assertIs(mep.Holder, mep.types.Holder)
            utc = datetime.timezone.utc
            self.assertEqual(h, mep.Holder("builder-7", "host-a", datetime.datetime(2026, 12, 6, 14, 2, 7, 123000, utc),
                                           datetime.datetime(2026, 12, 6, 14, 3, 7, 500000, utc)))
            self.assertEqual(h.raw, view)
            with self.assertRaises(dataclasses.FrozenInstanceError):
                h.host = "x"  # type: ignore[misc]
        # No host (a daemon that tells nothing of its holders), no holder (another tenant's
        # lease, an older daemon), or one that cannot be read: None, never an exception.
        no_host = {k: v for k, v in view.items() if k != "host"}
        e = mep.error_for_problem(423, json.dumps({"code": "name-held", "holder": no_host}).encode())
        self.assertEqual((e.holder.display_name, e.holder.host), ("builder-7", None))
        self.assertIsNone(mep.error_for_problem(423, b'{"code":"name-held"}').holder)
        for bad in ("x", {"display_name": "a"}, dict(view, since="yesterday"), dict(view, display_name=7)):
            self.assertIsNone(mep.error_for_problem(423, json.dumps({"code": "name-held", "holder": bad}).encode()).holder)

    def test_unknown_code_and_non_problem_bodies(self):
        e = mep.error_for_problem(418, b'{"code":"teapot","status":418,"detail":"short"}')
        self.assertIs(type(e), mep.MepError)
        self.assertEqual(e.code, "teapot")
        e = mep.error_for_problem(503, b"<html>bad gateway</html>")
        self.assertIsInstance(e, mep.Unavailable)
        self.assertEqual(e.status, 503)


class SocketDiscoveryTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.home = self.tmp.name

    def test_order(self):
        env = {"HOME": self.home}
        self.assertEqual(_config.find_socket(env)[0], "/run/mep/mepd.sock")
        env["XDG_RUNTIME_DIR"] = "/xdg/run"
        self.assertEqual(_config.find_socket(env)[0], "/xdg/run/mep/mepd.sock")
        cfg = os.path.join(self.home, ".config", "mep")
        os.makedirs(cfg)
        with open(os.path.join(cfg, "config.toml"), "w") as f:
            f.write('# comment\nsocket = "/from/config.sock"  # trailing\nlog_level = "info"\n')
        self.assertEqual(_config.find_socket(env), ("/from/config.sock", "config file " + os.path.join(cfg, "config.toml")))
        env["XDG_CONFIG_HOME"] = os.path.join(self.home, "elsewhere")
        self.assertEqual(_config.find_socket(env)[0], "/xdg/run/mep/mepd.sock")
        other = os.path.join(self.home, "other.toml")
        with open(other, "w") as f:
            f.write("socket = '/literal.sock'\n")
        env["MEP_CONFIG"] = other
        self.assertEqual(_config.find_socket(env)[0], "/literal.sock")
        env["MEP_SOCKET"] = "/env.sock"
        self.assertEqual(_config.find_socket(env), ("/env.sock", "$MEP_SOCKET"))

    def test_missing_explicit_config_and_bad_config(self):
        with self.assertRaises(mep.ConfigError):
            _config.find_socket({"HOME": self.home, "MEP_CONFIG": os.path.join(self.home, "nope.toml")})
        bad = os.path.join(self.home, "bad.toml")
        for text in ("socket = 1.5\n", "socket = \n", "[table]\n", "socket = 'x'\nsocket = 'y'\n"):
            with open(bad, "w") as f:
                f.write(text)
            with self.assertRaises(mep.ConfigError):
                _config.find_socket({"HOME": self.home, "MEP_CONFIG": bad})
        with self.assertRaises(mep.ConfigError):  # not a regular file
            _config.find_socket({"HOME": self.home, "MEP_CONFIG": self.home})

    def test_the_config_file_is_checked_even_with_mep_socket(self):
        # As the CLI: $MEP_SOCKET wins over the file's socket, but a config file that is
        # missing ($MEP_CONFIG) or cannot be parsed is an error all the same (mep exits 2).
        env = {"HOME": self.home, "MEP_SOCKET": "/env.sock"}
        with self.assertRaises(mep.ConfigError):
            _config.find_socket(dict(env, MEP_CONFIG="/nonexistent.toml"))
        bad = os.path.join(self.home, "bad.toml")
        with open(bad, "w") as f:
            f.write("socket = \n")
        with self.assertRaises(mep.ConfigError):
            _config.find_socket(dict(env, MEP_CONFIG=bad))
        cfg = os.path.join(self.home, ".config", "mep")
        os.makedirs(cfg)
        with open(os.path.join(cfg, "config.toml"), "w") as f:
            f.write("[table]\n")
        with self.assertRaises(mep.ConfigError):
            _config.find_socket(env)  # the default file, when it exists, must be valid too
        with open(os.path.join(cfg, "config.toml"), "w") as f:
            f.write("socket = '/file.sock'\n")
        self.assertEqual(_config.find_socket(env), ("/env.sock", "$MEP_SOCKET"))

    def test_values_as_the_cli_reads_them(self):
        text = '# c\nsocket = "/a \\"b\\".sock" # x\nother = 1\n'
        self.assertEqual(_config.socket_from_toml(text, "f"), '/a "b".sock')
        self.assertEqual(_config.socket_from_toml("socket = '/lit'\n", "f"), "/lit")
        self.assertIsNone(_config.socket_from_toml("x = 1\n", "f"))
        # An integer or a boolean is taken as its text, as the CLI does.
        self.assertEqual(_config.socket_from_toml("socket = 5\n", "f"), "5")
        self.assertEqual(_config.parse_config(b"a = true\nb = 0x10\n", "f"), {"a": "true", "b": "16"})


class PathArgumentTest(unittest.TestCase):
    def test_a_relative_path_is_made_absolute_but_not_normalized(self):
        # ".." after a symbolic link is the link target's parent for the kernel: the path
        # goes to mepd as given (after the working directory), which resolves it so.
        self.assertEqual(_args.path(os.path.join("L", "..", "t.uai")),
                         os.path.join(os.getcwd(), "L", "..", "t.uai"))
        self.assertEqual(_args.path("/a/L/../t.uai"), "/a/L/../t.uai")


class ArgumentsTest(unittest.TestCase):
    """Wrong arguments are a TypeError or ValueError naming the argument, raised before any
    I/O (the client's socket does not exist: anything sent would be DaemonNotRunning)."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.c = mep.Client(os.path.join(self.tmp.name, "no.sock"), mep_bin=os.path.join(self.tmp.name, "no-mep"))
        self.ac = mep.aio.AsyncClient(os.path.join(self.tmp.name, "no.sock"), mep_bin=os.path.join(self.tmp.name, "no-mep"))
        self.path = os.path.join(self.tmp.name, "m.uai")

    def check(self, exc, arg, fn, *args, **kw):
        with self.assertRaises(exc) as cm:
            fn(*args, **kw)
        self.assertIn(arg, str(cm.exception))
        return cm.exception

    def acheck(self, exc, arg, coro_fn, *args, **kw):
        import asyncio

        async def run():
            return await coro_fn(*args, **kw)

        self.check(exc, arg, lambda: asyncio.run(run()))

    def test_names(self):
        c = self.c
        e = self.check(ValueError, "name", c.acquire, "a\udc80", self.path)
        self.assertIn("U+DC80", str(e))
        self.check(TypeError, "name", c.acquire, None, self.path)
        self.check(TypeError, "name", c.acquire, b"agent", self.path)
        self.check(ValueError, "name", c.lease, "a\udc80", self.path)
        self.check(ValueError, "name", c.attach, "a\ud800b", self.path)
        self.check(ValueError, "name", c.get_lease, "a\udc80")
        self.check(TypeError, "name", c.detach, 7)
        self.check(TypeError, "lease_id", c.detach, "agent", 7)
        self.check(TypeError, "name", c.verify, None)
        self.check(ValueError, "name", c.sync, "a\udc80")
        self.check(TypeError, "name", c.canonicalize, None)
        self.check(TypeError, "name", mep.canonicalize, None)
        self.check(ValueError, "name", c.canonicalize, "a\udc80")
        self.acheck(ValueError, "name", self.ac.acquire, "a\udc80", self.path)
        self.acheck(TypeError, "name", self.ac.canonicalize, None)
        self.check(ValueError, "name", self.ac.lease, "a\udc80", self.path)

    def test_paths(self):
        c = self.c
        e = self.check(TypeError, "path", c.init, b"/tmp/m.uai")
        self.assertIn("bytes", str(e))
        self.check(ValueError, "path", c.init, "/tmp/a\udc80.uai")
        self.check(ValueError, "path", c.init, "/tmp/a\x00.uai")
        self.check(ValueError, "path", c.init, "")
        self.check(TypeError, "path", c.init, None)
        self.check(TypeError, "path", c.acquire, "agent", b"/tmp/m.uai")
        self.check(ValueError, "path", c.identify, "/tmp/a\udc80")
        self.check(TypeError, "new_path", c.branch, self.path, b"/tmp/n.uai")
        self.check(TypeError, "path_or_id", c.lineage, None)
        self.check(TypeError, "memory_instance_id", c.fetch, None, self.path)
        self.check(TypeError, "path", c.fetch, "01a23331-0cc3-7298-afd1-580522a5ec00", b"/tmp/x.uai")
        self.acheck(TypeError, "path", self.ac.init, b"/tmp/m.uai")
        self.acheck(ValueError, "path", self.ac.identify, "/tmp/a\udc80")

    def test_numbers(self):
        c = self.c
        e = self.check(TypeError, "wait", c.acquire, "agent", self.path, wait="x")
        self.assertIn("str", str(e))
        for bad in (-1, float("nan"), float("inf"), 2 ** 31):
            self.check(ValueError, "wait", c.acquire, "agent", self.path, wait=bad)
        self.check(TypeError, "wait", c.lease, "agent", self.path, wait=True)
        self.check(TypeError, "ttl", c.acquire, "agent", self.path, ttl="30")
        self.check(ValueError, "ttl", c.acquire, "agent", self.path, ttl=30.5)
        self.check(ValueError, "ttl", c.attach, "agent", self.path, ttl=float("nan"))
        self.check(ValueError, "bind", c.acquire, "agent", self.path, bind="thread")
        self.check(TypeError, "timeout", c.sync, "agent", timeout="1")
        self.check(ValueError, "timeout", c.fetch, "01a23331-0cc3-7298-afd1-580522a5ec00", self.path, timeout=-1)
        self.acheck(TypeError, "wait", self.ac.acquire, "agent", self.path, wait="x")
        # Good arguments get as far as the (missing) daemon.
        with self.assertRaises(mep.DaemonNotRunning):
            c.acquire("agent", self.path, ttl=30.0, wait=1.5)


    def test_labels_and_max_hold(self):
        c, ac, path = self.c, self.ac, self.path
        seventeen = {"k%d" % i: "v" for i in range(17)}
        bad_labels = [
            (ValueError, "at most 16 labels", seventeen),
            (ValueError, "'a b' must be 1-63 characters", {"a b": "x"}),
            (ValueError, "1-63 characters", {"": "x"}),
            (ValueError, "1-63 characters", {"k" * 64: "x"}),
            (ValueError, "1-63 characters", {"caf\u00e9": "x"}),
            (TypeError, "labels['n'] must be a str, not int", {"n": 1}),
            (TypeError, "labels['n'] must be a str, not NoneType", {"n": None}),
            (TypeError, "a key must be a str, not int", {1: "x"}),
            (ValueError, "labels['long'] must be at most 255 bytes of UTF-8, not 256", {"long": "x" * 256}),
            (ValueError, "not 256", {"long": "\u00e9" * 128}),  # 128 characters, 256 bytes
            (ValueError, "control character U+0007 at index 1", {"bell": "a\x07"}),
            (ValueError, "control character U+0085", {"nel": "\x85"}),
            (ValueError, "U+DC80", {"s": "a\udc80"}),
            (TypeError, "labels must be a mapping", [("a", "b")]),
            (TypeError, "labels must be a mapping", "a=b"),
        ]
        bad_holds = [(ValueError, "max_hold must be between 5 and 31622400", 4),
                     (ValueError, "between 5 and", 31622401),
                     (ValueError, "between 5 and", -10),
                     (TypeError, "max_hold must be a whole number of seconds or None, not str", "10"),
                     (TypeError, "not bool", True),
                     (ValueError, "whole number", 10.5),
                     (ValueError, "whole number", float("nan"))]
        calls = [c.acquire, c.lease, c.attach, mep.acquire, mep.lease]
        for exc, text, value in bad_labels:
            for fn in calls:
                self.check(exc, text, fn, "agent", path, labels=value)
            self.check(exc, text, ac.lease, "agent", path, labels=value)
            self.check(exc, text, mep.aio.lease, "agent", path, labels=value)
            self.acheck(exc, text, ac.acquire, "agent", path, labels=value)
            self.acheck(exc, text, ac.attach, "agent", path, labels=value)
            self.acheck(exc, text, mep.aio.acquire, "agent", path, labels=value)
        for exc, text, value in bad_holds:
            for fn in calls:
                self.check(exc, text, fn, "agent", path, max_hold=value)
            self.check(exc, text, ac.lease, "agent", path, max_hold=value)
            self.check(exc, text, mep.aio.lease, "agent", path, max_hold=value)
            self.acheck(exc, text, ac.acquire, "agent", path, max_hold=value)
            self.acheck(exc, text, ac.attach, "agent", path, max_hold=value)
            self.acheck(exc, text, mep.aio.acquire, "agent", path, max_hold=value)
        # The edges are good arguments, and get as far as the (missing) daemon.
        edge = {("k%02d" % i) + "-._" + "K" * 57: "\u00e9" * 127 + "x" for i in range(16)}
        self.assertEqual({len(k) for k in edge}, {63})
        self.assertEqual({len(v.encode()) for v in edge.values()}, {255})
        for hold in (5, 31622400, 60.0):
            with self.assertRaises(mep.DaemonNotRunning):
                c.acquire("agent", path, labels=edge, max_hold=hold)
        with self.assertRaises(mep.DaemonNotRunning):
            with c.lease("agent", path, labels={}, max_hold=None):
                pass

    def test_attach_body(self):
        from mep.client import _attach_body

        labels = {"team": "infra", "job": "ci-42"}
        body = _attach_body("agent", "/m.uai", 30, None, "pid", labels, 600)
        self.assertEqual(body, {"name": "agent", "path": "/m.uai", "bind": "pid", "ttl_seconds": 30,
                                "labels": labels, "max_hold_seconds": 600})
        self.assertIsNot(body["labels"], labels, "a copy: the caller's mapping is not kept")
        self.assertEqual(type(_attach_body("a", "/m", None, None, "none", {"x": "y"}, 10.0)["max_hold_seconds"]), int)
        # None and empty labels, and no max_hold, are not sent (a mepd that predates them takes the attach).
        for empty in (None, {}):
            self.assertEqual(_attach_body("agent", "/m.uai", None, None, "none", empty, None),
                             {"name": "agent", "path": "/m.uai", "bind": "none"})
        # A LeaseContext keeps the labels as they were checked.
        labels = {"a": "1"}
        ctx = self.c.lease("agent", self.path, labels=labels)
        labels["a b"] = "changed after"
        self.assertEqual(ctx._labels, {"a": "1"})


class FramingTest(unittest.TestCase):
    def parse(self, chunks):
        p = _http.ResponseParser()
        for c in chunks:
            p.feed(c)
            if p.done:
                break
        if not p.done:
            p.finish()
        return p.response()

    def test_content_length_split_anywhere(self):
        raw = b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{\"a\":1}"
        for i in range(1, len(raw)):
            r = self.parse([raw[:i], raw[i:]])
            self.assertEqual((r.status, r.json()), (201, {"a": 1}))

    def test_chunked_interim_and_until_close(self):
        r = self.parse([b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                        b"3\r\n{\"a\r\n4\r\n\":2}\r\n0\r\n\r\n"])
        self.assertEqual(r.json(), {"a": 2})
        r = self.parse([b"HTTP/1.1 200 OK\r\n\r\nuntil", b" close"])
        self.assertEqual(r.body, b"until close")
        r = self.parse([b"HTTP/1.1 204 No Content\r\nServer: mepd\r\n\r\n"])
        self.assertEqual((r.status, r.body), (204, b""))

    def test_cut_short_and_not_http(self):
        with self.assertRaises(mep.ProtocolError):
            self.parse([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"])
        with self.assertRaises(mep.ProtocolError):
            self.parse([b"SSH-2.0-OpenSSH\r\n\r\n"])
        with self.assertRaises(mep.Unavailable):
            self.parse([])

    def test_request_bytes(self):
        req = _http.build_request("POST", "/v1/attach", {"name": "Zoë"})
        head, _, body = req.partition(b"\r\n\r\n")
        self.assertIn(b"Content-Length: %d" % len(body), head)
        self.assertEqual(json.loads(body), {"name": "Zoë"})


def _info(token=3, ttl=10, lease_id="L1"):
    return LeaseInfo(lease_id=lease_id, canonical_name="agent", display_name="Agent", memory_instance_id="M",
                     fencing_token=token, expires_at=None, ttl_seconds=ttl, path="/m.uai", state="held", bind_pid=1)


def _ev(kind, name="agent", token=None, reason=None, lease_id=None):
    return Event(event=kind, canonical_name=name, memory_instance_id="M", state="", at=None,
                 fencing_token=token, expires_at=datetime.datetime(2030, 1, 1, tzinfo=datetime.timezone.utc)
                 if token else None, reason=reason, lease_id=lease_id)


class LossTrackerTest(unittest.TestCase):
    def test_margin(self):
        self.assertEqual(margin_seconds(5), 1.0)
        self.assertEqual(margin_seconds(30), 3.0)

    def test_local_deadline_from_send_time_and_renewals(self):
        t = LossTracker(10)
        t.attached(_info(ttl=10), sent_at=100.0)
        self.assertEqual(t.deadline, 100.0 + 10 - 1)
        t.event(_ev("granted", token=3), 100.1)
        t.tick(108.9)
        self.assertFalse(t.lost)
        t.event(_ev("renewed", token=3), 103.0)
        self.assertEqual(t.deadline, 103.0 + 10 - 2)
        t.tick(110.9)
        self.assertFalse(t.lost)
        t.tick(111.0)
        self.assertEqual(t.lost_reason, "local-deadline")
        self.assertTrue(t.at_risk)

    def test_events_before_attach_are_replayed_and_predecessors_ignored(self):
        t = LossTracker(10)
        t.event(_ev("released"), 1.0)          # an earlier holder of the name
        t.event(_ev("other", name="x"), 1.0)
        t.event(_ev("granted", token=3), 1.1)  # ours
        t.event(_ev("degraded", token=3, reason="unreachable"), 1.2)
        t.attached(_info(), 1.0)
        self.assertFalse(t.lost)
        self.assertEqual(t.at_risk_reason, "degraded (unreachable)")
        t.event(_ev("renewed", token=3), 2.0)
        self.assertFalse(t.at_risk)
        t.event(_ev("lost", reason="stale-fence"), 2.5)
        self.assertEqual(t.lost_reason, "stale-fence")

    def test_released_by_someone_else_is_lost_but_own_release_is_not(self):
        t = LossTracker(10)
        t.attached(_info(), 0.0)
        t.event(_ev("granted", token=3), 0.1)
        t.event(_ev("released"), 0.2)
        self.assertEqual(t.lost_reason, "released")
        t = LossTracker(10)
        t.attached(_info(), 0.0)
        t.event(_ev("granted", token=3), 0.1)
        t.closing = True
        t.event(_ev("released"), 0.2)
        t.tick(1000.0)
        self.assertFalse(t.lost)

    def test_stream_down_and_recheck(self):
        t = LossTracker(10)
        t.attached(_info(), 0.0)
        t.stream_down()
        self.assertEqual(t.at_risk_reason, "daemon-unreachable")
        t.event(_ev("renewed", token=3), 1.0)  # heard before the re-check: still at risk
        self.assertTrue(t.at_risk)
        t.recheck(_info())
        self.assertFalse(t.at_risk)
        self.assertFalse(t.lost)
        t.stream_down()
        t.recheck(_info(lease_id="L2", token=4))
        self.assertEqual(t.lost_reason, "superseded")
        t = LossTracker(10)
        t.attached(_info(), 0.0)
        t.stream_down()
        t.recheck(None)
        self.assertEqual(t.lost_reason, "not-held")

    def test_events_that_name_the_lease(self):
        t = LossTracker(10)
        t.event(_ev("released", lease_id="L0"), 1.0)   # the previous holder's, by id
        t.event(_ev("degraded", token=3, lease_id="L1"), 1.1)  # ours, even before its granted
        t.attached(_info(lease_id="L1"), 1.0)
        self.assertFalse(t.lost)
        self.assertTrue(t.at_risk)
        t.event(_ev("lost", reason="deadline", lease_id="L0"), 2.0)
        self.assertFalse(t.lost, "another lease's loss")
        t.event(_ev("released", lease_id="L1"), 2.1)
        self.assertEqual(t.lost_reason, "released")

    def test_loss_is_final(self):
        t = LossTracker(10)
        t.attached(_info(), 0.0)
        self.assertTrue(t.lose("stale-fence"))
        self.assertFalse(t.lose("other"))
        t.event(_ev("granted", token=3), 0.1)
        t.recheck(_info())
        self.assertEqual(t.lost_reason, "stale-fence")


if __name__ == "__main__":
    unittest.main()


class LeaseAnswerTest(unittest.TestCase):
    """How both faces' lease objects judge mepd's answers about a held lease (mep._calls):
    by the problem's code, never by its status."""

    @staticmethod
    def answer(status, doc):
        return _http.Response(status, {"content-type": "application/problem+json"}, json.dumps(doc).encode())

    def test_a_gone_code_is_a_loss_and_nothing_else_is(self):
        from mep import _calls
        for code in ("stale-fence", "lease-expired", "lease-not-found"):
            self.assertEqual(_calls.lost_by(self.answer(ALL_CODES[code], {"code": code})), code)
        # A route an older mepd lacks (404 not-found), a busy or unreachable side: not a loss.
        for code in ("not-found", "rate-limited", "unavailable", "control-plane-unreachable", "internal"):
            self.assertIsNone(_calls.lost_by(self.answer(ALL_CODES[code], {"code": code})), code)
        self.assertIsNone(_calls.lost_by(self.answer(200, {})))

    def test_a_recheck_reads_the_lease_none_or_ask_again(self):
        from mep import _calls
        lease = {"lease_id": "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a60", "canonical_name": "a", "display_name": "a",
                 "memory_instance_id": "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b", "fencing_token": 3,
                 "expires_at": "2026-01-01T00:00:30.000Z", "ttl_seconds": 30, "path": "", "state": "held",
                 "bind_pid": None}
        answered, info = _calls.read_recheck(self.answer(200, lease))
        self.assertTrue(answered)
        self.assertEqual(info.fencing_token, 3)
        self.assertEqual(_calls.read_recheck(self.answer(404, {"code": "lease-not-found"})), (True, None))
        self.assertEqual(_calls.read_recheck(self.answer(404, {"code": "not-found"})), (False, None))
        self.assertEqual(_calls.read_recheck(self.answer(503, {"code": "unavailable"})), (False, None))
        self.assertEqual(_calls.read_recheck(self.answer(200, {"lease_id": 7})), (False, None))
