"""The SDK reads the config file as the ``mep`` CLI does: the same files are refused, with
the same precedence over ``$MEP_SOCKET``, and the same ``socket`` is found in the rest —
checked against the CLI itself (``$MEP_BIN``: ``mep --json config`` and ``mep status``)."""
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

from . import SOURCE_ROOT
from .harness import mep_bin

import mep
from mep import _config

#: Config files and what the CLI makes of them (checked below against the CLI itself):
#: the socket it finds in the file (None: no socket key), or "error" (it exits 2).
CASES = [
    (b'socket = "/a.sock"\n', "/a.sock"),
    (b'socket = "/a.sock"\n[table]\nsocket = "no"\n', "error"),
    (b'socket = ""\n', ""),
    (b"socket = true\n", "true"),
    (b"socket = 1.5\n", "error"),
    (b"socket = [1]\n", "error"),
    (b"x = {a=1}\n", "error"),
    (b"a.b = 1\n", "error"),
    (b"x = 1979-05-27\n", "error"),
    (b"x = 1979-05-27 07:32:00\n", "error"),
    (b"x = 07:32:00\n", "error"),
    (b"socket = inf\n", "error"),
    (b'socket = """/m\nl.sock"""\n', "/m\nl.sock"),
    (b'socket = """\n/first-nl.sock"""\n', "/first-nl.sock"),
    (b"socket = '''\r\n/lit.sock'''\n", "/lit.sock"),
    (b'socket = """a\\\n    b"""\n', "ab"),
    (b'socket = """a\\ b"""\n', "error"),
    (b'socket = """a"""""\n', 'a""'),
    (b'socket = """a""""""\n', "error"),
    (b'socket = "/a.sock"\nsocket = "/b.sock"\n', "error"),
    (b'"socket" = "/q.sock"\n', "/q.sock"),
    (b"'socket' = '/q2.sock'\n", "/q2.sock"),
    (b"socket = 0x1F\n", "31"),
    (b"socket = 0b101\n", "5"),
    (b"socket = +1_000\n", "1000"),
    (b"socket = 1__0\n", "error"),
    (b"socket = 01\n", "error"),
    (b"socket = +0x1\n", "error"),
    (b"socket = 9223372036854775807\n", "9223372036854775807"),
    (b"socket = 9223372036854775808\n", "error"),
    (b"socket = -9223372036854775808\n", "-9223372036854775808"),
    (b'# comment \xc3\xa9\nsocket = "/\xc3\xa9.sock"\n', "/\u00e9.sock"),
    (b'# \xff is no UTF-8, in a comment\nsocket = "/c.sock"\n', "/c.sock"),
    (b'socket = "\xff"\n', "error"),
    (b'socket = "\xed\xa0\x80"\n', "error"),
    (b"\xc3\xa9 = 1\n", "error"),
    (b'\xef\xbb\xbfsocket = "/bom.sock"\n', "/bom.sock"),
    (b'socket = "/a.sock" junk\n', "error"),
    (b'socket = "\\e"\n', "error"),
    (b'socket = "a\\u00e9\\U0001F600\\t"\n', "a\u00e9\U0001F600\t"),
    (b'socket = "\\uD800"\n', "error"),
    (b'socket = "a\x01b"\n', "error"),
    (b"# \x7f\n", "error"),
    (b'socket = "/crlf.sock"\r\n', "/crlf.sock"),
    (b'socket = "/cr.sock"\r', "error"),
    (b'  socket="/ws.sock"\t# tab\n', "/ws.sock"),
    (b"socket =\n", "error"),
    (b"= 1\n", "error"),
    (b"[[arr]]\n", "error"),
    (b"[t\n", "error"),
    (b'log_level = "debug"\nsocket = "/two.sock"\nstore = 42\n', "/two.sock"),
    (b"socket = 'a\\b'\n", "a\\b"),
    (b"socket = True\n", "error"),
    (b"", None),
    (b"\n# only a comment\n", None),
]


class ConfigReaderTest(unittest.TestCase):
    """The reader alone (no processes)."""

    def test_cases(self):
        for data, expected in CASES:
            with self.subTest(data=data):
                if expected == "error":
                    with self.assertRaises(mep.ConfigError):
                        _config.parse_config(data, "c.toml")
                else:
                    self.assertEqual(_config.parse_config(data, "c.toml").get("socket"), expected)

    def test_matches_tomllib_on_valid_documents(self):
        try:
            import tomllib  # Python >= 3.11
        except ImportError:
            self.skipTest("no tomllib before Python 3.11")
        for data, expected in CASES:
            if expected == "error" or b"\xff" in data:
                continue
            with self.subTest(data=data):
                text = data.decode("utf-8").lstrip("\ufeff")
                doc = tomllib.loads(text)
                want = {k: ("true" if v is True else "false" if v is False else str(v)) for k, v in doc.items()}
                self.assertEqual(_config.parse_config(data, "c.toml"), {k: v.replace("\r\n", "\n") for k, v in want.items()})


class CliParityTest(unittest.TestCase):
    """Against the CLI itself."""

    def setUp(self):
        self.mep = mep_bin()
        self._tmp = tempfile.TemporaryDirectory(prefix="mep-sdk-config-")
        self.addCleanup(self._tmp.cleanup)
        self.dir = self._tmp.name
        self.env = {"HOME": os.path.join(self.dir, "home"), "XDG_RUNTIME_DIR": os.path.join(self.dir, "run"),
                    "PATH": os.environ.get("PATH", "/usr/bin:/bin")}

    def cli(self, args, env):
        return subprocess.run([self.mep] + args, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=30)

    def test_same_files_refused_and_same_socket_found(self):
        def one(i):
            data, _ = CASES[i]
            path = os.path.join(self.dir, "c%d.toml" % i)
            with open(path, "wb") as f:
                f.write(data)
            p = self.cli(["--json", "config"], dict(self.env, MEP_CONFIG=path))
            if p.returncode != 0:
                return path, ("exit %d" % p.returncode, None)
            doc = json.loads(p.stdout)["socket"]
            return path, ("exit 0", doc["value"] if doc["source"].startswith("file") else None)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(one, range(len(CASES))))
        for (data, expected), (path, cli) in zip(CASES, results):
            with self.subTest(data=data):
                self.assertEqual(cli, ("exit 2", None) if expected == "error" else ("exit 0", expected),
                                 "the CLI's verdict changed: update CASES")
                env = dict(self.env, MEP_CONFIG=path)
                if expected == "error":
                    with self.assertRaises(mep.ConfigError):
                        _config.find_socket(env)
                else:
                    sdk = _config.find_socket(env)
                    self.assertEqual(sdk[0] if sdk[1].startswith("config file") else None, expected)

    def test_mep_socket_does_not_skip_a_bad_config_file(self):
        """With $MEP_SOCKET set, a missing $MEP_CONFIG or an unparsable config file is still
        an error (exit 2) for the CLI, so for the SDK and ``python -m mep`` too."""
        bad = os.path.join(self.dir, "bad.toml")
        with open(bad, "wb") as f:
            f.write(b"socket = \n")
        default_dir = os.path.join(self.dir, "xdg", "mep")
        os.makedirs(default_dir)
        with open(os.path.join(default_dir, "config.toml"), "wb") as f:
            f.write(b"[table]\n")
        sock = os.path.join(self.dir, "nobody.sock")
        good = os.path.join(self.dir, "good.toml")
        with open(good, "wb") as f:
            f.write(b'socket = "/from/the/file.sock"\n')
        for extra, status in (({"MEP_CONFIG": "/nonexistent.toml"}, 2),
                              ({"MEP_CONFIG": bad}, 2),
                              ({"XDG_CONFIG_HOME": os.path.join(self.dir, "xdg")}, 2),
                              ({"MEP_CONFIG": good}, 5),  # $MEP_SOCKET wins over the file's socket
                              ({}, 5)):
            with self.subTest(env=extra):
                env = dict(self.env, MEP_SOCKET=sock, **extra)
                self.assertEqual(self.cli(["status"], env).returncode, status)
                py = subprocess.run([sys.executable, "-m", "mep", "status"], env=dict(env, PYTHONPATH=SOURCE_ROOT),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30)
                self.assertEqual(py.returncode, status, py.stderr)
                for args in (["--socket", sock, "status"],):  # a --socket flag does not skip it either
                    self.assertEqual(self.cli(args, env).returncode, status)
                    py = subprocess.run([sys.executable, "-m", "mep"] + args, env=dict(env, PYTHONPATH=SOURCE_ROOT),
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        timeout=30)
                    self.assertEqual(py.returncode, status, py.stderr)
                if status == 2:
                    with self.assertRaises(mep.ConfigError):
                        _config.find_socket(env)
                    with mock.patch.dict(os.environ, env, clear=True):
                        with self.assertRaises(mep.ConfigError):
                            mep.status()  # the module-level API, as a program would call it
                else:
                    self.assertEqual(_config.find_socket(env), (sock, "$MEP_SOCKET"))


if __name__ == "__main__":
    unittest.main()
