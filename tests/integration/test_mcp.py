"""`mep mcp` (issue 53) driven by the official MCP client: the TypeScript SDK's Client over its
stdio transport (tests/mcp/driver.mjs, a test-only npm dependency), against real `mep server`,
`mep store` and two mepd processes as two hosts. Also: the official memory server
(@modelcontextprotocol/server-memory) under `mep run --wait`, and raw JSON-RPC abuse.

Every wait is bounded; every process is ended by its PID.
"""
import json
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
import unittest

from daemonfixture import Mepd, mepd_bin
from mephelpers import mep_bin, wait_for
from storefixture import MepStore, new_store_token
from test_daemon import DaemonTestCase

HERE = os.path.dirname(os.path.abspath(__file__))
MCP_DIR = os.path.join(os.path.dirname(HERE), "mcp")
DRIVER = os.path.join(MCP_DIR, "driver.mjs")
MEMORY_SERVER = os.path.join(MCP_DIR, "node_modules", "@modelcontextprotocol", "server-memory", "dist", "index.js")
OP_TIMEOUT_S = 40
READY_TIMEOUT_S = 60
REQUIRED_TOOLS = {"lease_status", "memory_read", "memory_write", "memory_append", "memory_sync", "memory_branch",
                  "memory_lineage"}


def node_or_skip():
    node = shutil.which("node")
    if not node:
        raise unittest.SkipTest("node is not installed (packaging/install-deps.sh installs nodejs and npm)")
    if not os.path.isdir(os.path.join(MCP_DIR, "node_modules", "@modelcontextprotocol", "sdk")):
        raise unittest.SkipTest("the MCP SDK is not installed: run 'npm ci' in tests/mcp (ctest's mcp_npm_ci does)")
    return node


class Agent:
    """One MCP client (the SDK's) and the server it started, driven one command at a time."""

    def __init__(self, test, label, command, args, env, cwd, expect_ready=True):
        self.label = label
        self.log_path = os.path.join(test.tmp, "agent-%s.log" % label)
        self._log = open(self.log_path, "ab")
        spec = {"command": command, "args": args, "env": env, "cwd": cwd, "label": label}
        self.proc = subprocess.Popen([node_or_skip(), DRIVER, json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, cwd=MCP_DIR)
        test.addCleanup(self.end)
        test._sources.append(("agent " + label, self))
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.next_id = 0
        self.ready = None
        self.server_pid = None
        if expect_ready:
            self.wait_ready()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def wait_ready(self, timeout=READY_TIMEOUT_S):
        msg = self.lines.get(timeout=timeout)
        if msg is None or not msg.get("ready"):
            raise AssertionError("%s did not connect: %r\n%s" % (self.label, msg, self.log_text()))
        self.ready = msg
        self.server_pid = msg["pid"]
        return msg

    def op(self, op, timeout=OP_TIMEOUT_S, **kw):
        self.next_id += 1
        kw.update(id=self.next_id, op=op)
        self.proc.stdin.write((json.dumps(kw) + "\n").encode())
        self.proc.stdin.flush()
        while True:
            msg = self.lines.get(timeout=timeout)
            if msg is None:
                raise AssertionError("%s's driver ended\n%s" % (self.label, self.log_text()))
            if msg.get("id") == self.next_id:
                return msg

    def ok(self, op, **kw):
        msg = self.op(op, **kw)
        if "error" in msg:
            raise AssertionError("%s %s failed: %r\n%s" % (self.label, op, msg["error"], self.log_text()))
        return msg["ok"]

    def call(self, name, **arguments):
        """A tool's result (content, structuredContent, isError), validated by the SDK."""
        return self.ok("callTool", name=name, arguments=arguments)

    def notifications(self):
        return self.ok("notifications")

    def wait_notification(self, pred, timeout=30):
        seen = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen += self.notifications()["notifications"]
            if any(pred(n) for n in seen):
                return seen
            time.sleep(0.1)
        raise AssertionError("%s: no such notification among %r" % (self.label, seen))

    def close(self):
        """What a client does at the end of a session: closes the server's stdin."""
        self.ok("close")
        self.proc.wait(timeout=30)

    def log_text(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def end(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.server_pid:
            try:
                os.kill(self.server_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()


def text_of(result):
    return result["content"][0]["text"]


class McpCase(DaemonTestCase):
    """One `mep server`, one `mep store`, hosts a and b (each a mepd with the store)."""
    MODE = "none"

    def setUp(self):
        mep_bin()
        mepd_bin()
        node_or_skip()
        import tempfile
        from daemonfixture import clean_env
        self.tmp = tempfile.mkdtemp(prefix="mep-mcp-")
        self.env = clean_env(self.tmp)
        self.data = os.path.join(self.tmp, "data")
        os.makedirs(self.data)
        self.server = self.start_server()
        self.token = self.server.token("tenant-a")
        self.admin_file = os.path.join(self.tmp, "admin.token")
        with open(self.admin_file, "w") as f:
            f.write(self.server.token("tenant-a", admin=True) + "\n")
        self.store_token, hashes = new_store_token(self.tmp)
        self.store = MepStore(self.tmp, os.path.join(self.tmp, "store"), ["--token-file", hashes]).start()
        self.addCleanup(self.store.stop)
        self.store_token_file = os.path.join(self.tmp, "store.token")
        self.a = self.start_host("host-a")
        self.b = self.start_host("host-b")

    def start_host(self, tag):
        d = Mepd(self.tmp, self.env, control_plane=self.server.url, token=self.token, tag=tag,
                 extra_args=["--store", self.store.url, "--store-token-file", self.store_token_file])
        self._sources.append((tag, d))
        self.addCleanup(d.stop)
        return d.start()

    def mep(self, host, *args, timeout=60):
        argv = [mep_bin()] + (["--socket", host.socket_path] if host else []) + list(args)
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, env=self.env, timeout=timeout,
                           cwd=self.data)
        return p.returncode, p.stdout.decode(), p.stderr.decode()

    def agent(self, host, name, path, *extra, label=None, expect_ready=True):
        """An MCP client configured the way the README says: command mep, args mcp --name …"""
        env = dict(self.env, MEP_SOCKET=host.socket_path)
        return Agent(self, label or name, mep_bin(), ["mcp", "--name", name, "--memory", path, *extra], env,
                     self.data, expect_ready=expect_ready)

    def held_names(self, host):
        rc, out, err = self.mep(host, "--json", "status")
        self.assertEqual(rc, 0, err)
        return {l["canonical_name"]: l for l in json.loads(out)["leases"]}

    def read_file(self, path):
        with open(path, "rb") as f:
            return f.read()


class Tools(McpCase):
    def test_tools_are_listed_with_valid_schemas(self):
        agent = self.agent(self.a, "schema-agent", os.path.join(self.data, "schema.uai"))
        caps = agent.ready["capabilities"]
        self.assertTrue(caps["resources"]["subscribe"], caps)
        self.assertIn("logging", caps)
        tools = {t["name"]: t for t in agent.ok("listTools")["tools"]}
        self.assertLessEqual(REQUIRED_TOOLS, set(tools))
        for t in tools.values():
            for key in ("inputSchema", "outputSchema"):
                schema = t[key]
                self.assertEqual(schema["type"], "object", (t["name"], key))
                self.assertNotIn("$id", schema)
                for prop, s in schema.get("properties", {}).items():
                    self.assertIn("type", s, (t["name"], key, prop))
                for r in schema.get("required", []):
                    self.assertIn(r, schema["properties"], (t["name"], key))
            self.assertTrue(t["description"])
        self.assertTrue(tools["memory_read"]["annotations"]["readOnlyHint"])
        self.assertFalse(tools["memory_write"]["annotations"]["readOnlyHint"])

    def test_write_and_read_round_trip_atomically_under_the_lease(self):
        path = os.path.join(self.data, "round.uai")
        agent = self.agent(self.a, "round-trip", path)
        agent.ok("listTools")  # the SDK checks every structured result against its schema from here on
        st = agent.call("lease_status")["structuredContent"]
        self.assertEqual(st["state"], "held", st)
        self.assertTrue(st["writable"])
        self.assertIsInstance(st["fencing_token"], int)
        self.assertNotIn("path", st)
        # Bound to the server's pid: the lease lives as long as the session.
        lease = self.held_names(self.a)["round-trip"]
        self.assertEqual(lease["bind_pid"], agent.server_pid)
        text = "notes for later \u00e9\U0001F600\n"
        w = agent.call("memory_write", text=text)
        self.assertNotIn("isError", w)
        self.assertEqual(w["structuredContent"]["bytes_written"], len(text.encode()))
        self.assertTrue(w["structuredContent"]["verified"])
        self.assertEqual(self.read_file(path), text.encode())
        agent.call("memory_append", text="more\n")
        r = agent.call("memory_read")["structuredContent"]
        self.assertEqual(r["text"], text + "more\n")
        self.assertEqual(r["size"], len((text + "more\n").encode()))
        self.assertNotIn("next_offset", r)
        # Slices: the offset and length of a large memory; the end cut on a character boundary.
        part = agent.call("memory_read", offset=0, length=17)["structuredContent"]
        self.assertTrue(text.encode().startswith(part["text"].encode()))
        self.assertLessEqual(len(part["text"].encode()), 17)
        rest = agent.call("memory_read", offset=part["next_offset"])["structuredContent"]
        self.assertEqual(part["text"] + rest["text"], text + "more\n")
        # The file keeps its identity (mep identify) across the renames of atomic writes.
        rc, out, err = self.mep(self.a, "--json", "identify", path)
        self.assertEqual(rc, 0, err)
        self.assertEqual(json.loads(out)["memory_instance_id"], st["memory_instance_id"])
        # Bad arguments are tool errors for the model, not protocol errors.
        bad = agent.call("memory_write", txt="x")
        self.assertTrue(bad["isError"])
        self.assertIn("text", text_of(bad))
        self.assertTrue(agent.call("memory_read", offset=10 ** 9)["isError"])
        unknown = agent.op("callTool", name="no_such_tool", arguments={})
        self.assertEqual(unknown["error"]["code"], -32602, unknown)
        self.assertEqual(self.read_file(path), (text + "more\n").encode())
        # The end of the session releases the lease.
        agent.close()
        self.assertTrue(wait_for(lambda: "round-trip" not in self.held_names(self.a), timeout=10))

    def test_the_memory_is_a_resource_with_updates(self):
        path = os.path.join(self.data, "res.uai")
        agent = self.agent(self.a, "res-agent", path)
        agent.call("memory_write", text="v1")
        resources = agent.ok("listResources")["resources"]
        self.assertEqual(len(resources), 1, resources)
        uri = resources[0]["uri"]
        st = agent.call("lease_status")["structuredContent"]
        self.assertEqual(uri, "mep://memory/" + st["memory_instance_id"])
        self.assertEqual(agent.ok("readResource", uri=uri)["contents"][0]["text"], "v1")
        self.assertEqual(agent.op("readResource", uri="mep://memory/other")["error"]["code"], -32002)
        agent.ok("subscribe", uri=uri)
        agent.notifications()
        agent.call("memory_write", text="v2")
        agent.wait_notification(lambda n: n["method"] == "notifications/resources/updated" and n["params"]["uri"] == uri)
        # A change made by someone else (here, by hand) is noticed too.
        with open(path, "ab") as f:
            f.write(b" by hand")
        agent.wait_notification(lambda n: n["method"] == "notifications/resources/updated")
        self.assertEqual(agent.ok("readResource", uri=uri)["contents"][0]["text"], "v2 by hand")
        agent.ok("unsubscribe", uri=uri)


class HeldElsewhere(McpCase):
    def test_a_second_server_reads_waits_and_is_told_when_granted(self):
        path = os.path.join(self.data, "shared.uai")
        first = self.agent(self.a, "first-agent", path)
        first.call("memory_write", text="from the first agent\n")
        memory_id = first.call("memory_sync")["structuredContent"]["memory_instance_id"]
        # The second agent, on host b, on the same memory (fetched there from the store).
        copy = os.path.join(self.data, "shared-on-b.uai")
        rc, _, err = self.mep(self.b, "fetch", memory_id, copy)
        self.assertEqual(rc, 0, err)
        second = self.agent(self.b, "second-agent", copy)
        second.ok("listTools")
        st = second.call("lease_status")["structuredContent"]
        self.assertEqual(st["state"], "waiting", st)
        self.assertEqual(st["memory_instance_id"], memory_id)
        self.assertFalse(st["writable"])
        self.assertEqual(st["holder"]["display_name"], "first-agent", st)
        self.assertIn("since", st["holder"])
        self.assertNotIn("fencing_token", st)
        self.assertNotIn("lease_id", st)
        self.assertNotIn("fencing_token", st["holder"])
        self.assertEqual(second.call("memory_read")["structuredContent"]["text"], "from the first agent\n")
        refused = second.call("memory_write", text="clobber")
        self.assertTrue(refused["isError"])
        self.assertIn("first-agent", text_of(refused))
        self.assertTrue(second.call("memory_append", text="clobber")["isError"])
        self.assertTrue(second.call("memory_sync")["isError"])
        self.assertEqual(self.read_file(copy), b"from the first agent\n")
        # The first session ends: the second is granted the lease and says so.
        second.notifications()
        first.close()
        second.wait_notification(lambda n: n["method"] == "notifications/message" and "granted" in str(n["params"]))
        st = second.call("lease_status")["structuredContent"]
        self.assertEqual(st["state"], "held", st)
        w = second.call("memory_append", text="from the second agent\n")
        self.assertNotIn("isError", w, w)
        self.assertEqual(self.read_file(copy), b"from the first agent\nfrom the second agent\n")

    def test_kill_9_of_the_holder_hands_the_memory_to_the_waiting_one(self):
        path = os.path.join(self.data, "killed.uai")
        first = self.agent(self.a, "doomed-agent", path)
        first.call("memory_write", text="before the crash")
        second = self.agent(self.a, "heir-agent", path)
        self.assertEqual(second.call("lease_status")["structuredContent"]["state"], "waiting")
        os.kill(first.server_pid, signal.SIGKILL)
        second.wait_notification(lambda n: n["method"] == "notifications/message" and "granted" in str(n["params"]),
                                 timeout=30)
        w = second.call("memory_write", text="after the crash")
        self.assertNotIn("isError", w, w)
        self.assertEqual(self.read_file(path), b"after the crash")

    def test_if_held_fail_exits_3(self):
        path = os.path.join(self.data, "busy.uai")
        self.agent(self.a, "busy-agent", path)
        p = subprocess.run([mep_bin(), "--socket", self.a.socket_path, "mcp", "--name", "other-agent", "--memory",
                            path, "--if-held", "fail"], stdin=subprocess.PIPE, capture_output=True, env=self.env,
                           timeout=60)
        self.assertEqual(p.returncode, 3, p.stderr)
        self.assertEqual(p.stdout, b"")  # nothing but MCP messages on stdout, and none here
        err = p.stderr.decode().strip()
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertIn("busy-agent", err)

    def test_an_agent_that_must_not_wait_branches(self):
        path = os.path.join(self.data, "trunk.uai")
        first = self.agent(self.a, "trunk-agent", path)
        first.call("memory_write", text="trunk")
        second = self.agent(self.a, "branch-agent", path)
        self.assertEqual(second.call("lease_status")["structuredContent"]["state"], "waiting")
        trunk_id = first.call("lease_status")["structuredContent"]["memory_instance_id"]
        new_path = os.path.join(self.data, "branch.uai")
        b = second.call("memory_branch", path=new_path)
        self.assertNotIn("isError", b, b)
        self.assertEqual(b["structuredContent"]["parent_memory_instance_id"], trunk_id)
        self.assertEqual(b["structuredContent"]["state"], "held", second.call("lease_status"))
        self.assertTrue(b["structuredContent"]["writable"])
        self.assertNotIn("isError", second.call("memory_append", text=" and branch"))
        self.assertEqual(self.read_file(new_path), b"trunk and branch")
        self.assertEqual(self.read_file(path), b"trunk")
        lineage = second.call("memory_lineage")["structuredContent"]
        self.assertEqual([a["memory_instance_id"] for a in lineage["ancestors"]], [trunk_id])
        # The wait for the trunk was given up: its holder ends, and nobody takes it.
        first.close()
        time.sleep(1.5)
        self.assertFalse([l for l in self.held_names(self.a).values() if l["memory_instance_id"] == trunk_id])


class FailClosed(McpCase):
    def test_a_revoked_lease_fails_the_next_write(self):
        path = os.path.join(self.data, "revoked.uai")
        agent = self.agent(self.a, "revoked-agent", path, "--ttl", "60")
        agent.call("memory_write", text="kept")
        rc, _, err = self.mep(None, "lease", "revoke", "revoked-agent", "--reason", "rogue agent", "--server",
                              self.server.url, "--token-file", self.admin_file)
        self.assertEqual(rc, 0, err)
        # The next renewal is 20 s away: the write itself asks the control plane.
        refused = agent.call("memory_write", text="late write")
        self.assertTrue(refused["isError"], refused)
        self.assertIn("not live", text_of(refused))
        self.assertEqual(self.read_file(path), b"kept")
        st = agent.call("lease_status")["structuredContent"]
        self.assertEqual(st["state"], "lost", st)
        self.assertTrue(agent.call("memory_append", text="x")["isError"])
        self.assertEqual(self.read_file(path), b"kept")

    def test_an_expired_lease_fails_the_next_write(self):
        path = os.path.join(self.data, "expired.uai")
        agent = self.agent(self.a, "expiring-agent", path, "--ttl", "5")
        agent.call("memory_write", text="kept")
        # The daemon stops renewing (stopped), the local deadline passes.
        self.a.proc.signal(signal.SIGSTOP)
        try:
            time.sleep(6)
            refused = agent.call("memory_write", text="too late")
        finally:
            self.a.proc.signal(signal.SIGCONT)
        self.assertTrue(refused["isError"], refused)
        self.assertIn("lost", text_of(refused))
        self.assertEqual(self.read_file(path), b"kept")

    def test_a_sync_after_a_takeover_is_refused_by_the_store(self):
        path = os.path.join(self.data, "synced.uai")
        agent = self.agent(self.a, "sync-agent", path, "--ttl", "60")
        agent.call("memory_write", text="first version")
        synced = agent.call("memory_sync")
        self.assertNotIn("isError", synced, synced)
        memory_id = synced["structuredContent"]["memory_instance_id"]
        token = synced["structuredContent"]["fencing_token"]
        # Another host takes the memory over (the lease revoked, the memory fetched and claimed
        # there: the store's mark moves past this agent's token) before host a hears of it.
        rc, _, err = self.mep(None, "lease", "revoke", "sync-agent", "--server", self.server.url, "--token-file",
                              self.admin_file)
        self.assertEqual(rc, 0, err)
        other = os.path.join(self.data, "taken-over.uai")
        rc, _, err = self.mep(self.b, "fetch", memory_id, other)
        self.assertEqual(rc, 0, err)
        rc, out, err = self.mep(self.b, "--json", "claim", "sync-agent", other)
        self.assertEqual(rc, 0, err)
        self.assertGreater(json.loads(out)["fencing_token"], token)
        refused = agent.call("memory_sync")
        self.assertTrue(refused["isError"], refused)
        self.assertIn("stale-fence", text_of(refused))


class Protocol(McpCase):
    """Raw JSON-RPC on the server's stdin, without the SDK (which never sends such things)."""

    def test_malformed_unknown_and_oversized_messages_get_errors_and_the_server_lives(self):
        path = os.path.join(self.data, "raw.uai")
        p = subprocess.Popen([mep_bin(), "--socket", self.a.socket_path, "mcp", "--name", "raw-agent", "--memory",
                              path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             env=self.env)
        self.addCleanup(lambda: p.poll() is None and p.kill())
        answers = queue.Queue()
        threading.Thread(target=lambda: [answers.put(json.loads(l)) for l in p.stdout], daemon=True).start()

        def send(raw):
            p.stdin.write(raw if isinstance(raw, bytes) else raw.encode())
            p.stdin.write(b"\n")
            p.stdin.flush()
            return answers.get(timeout=OP_TIMEOUT_S)

        self.assertEqual(send('{"jsonrpc":"2.0","id":1,"method":"tools/list"}')["error"]["code"], -32600)
        init = send('{"jsonrpc":"2.0","id":2,"method":"initialize","params":{"protocolVersion":"2024-11-05",'
                    '"capabilities":{},"clientInfo":{"name":"raw","version":"0"}}}')
        self.assertEqual(init["result"]["protocolVersion"], "2024-11-05")
        p.stdin.write(b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n')
        garbage = send("this is not json")
        self.assertEqual(garbage["error"]["code"], -32700)
        self.assertNotIn("id", garbage)
        self.assertEqual(send(b'{"jsonrpc":"2.0","id":3,"method":"ping","params":{"x":"\xff"}}')["error"]["code"],
                         -32700)
        self.assertEqual(send("[]")["error"]["code"], -32600)
        unknown = send('{"jsonrpc":"2.0","id":"u","method":"no/such/method"}')
        self.assertEqual((unknown["id"], unknown["error"]["code"]), ("u", -32601))
        bad_call = send('{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":7}}')
        self.assertEqual(bad_call["error"]["code"], -32602)
        # 17 MiB in one message, its id last as the SDK writes it.
        big = ('{"jsonrpc":"2.0","method":"tools/call","params":{"name":"memory_write","arguments":{"text":"'
               + "x" * (17 << 20) + '"}},"id":5}')
        over = send(big)
        self.assertEqual((over.get("id"), over["error"]["code"]), (5, -32600))
        self.assertFalse(os.path.getsize(path))  # nothing of it was written
        # Still serving.
        self.assertEqual(send('{"jsonrpc":"2.0","id":6,"method":"ping"}'), {"jsonrpc": "2.0", "id": 6, "result": {}})
        ok = send('{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"memory_write",'
                  '"arguments":{"text":"fine"}}}')
        self.assertNotIn("isError", ok["result"], ok)
        p.stdin.close()
        self.assertEqual(p.wait(timeout=30), 0)
        self.assertEqual(self.read_file(path), b"fine")

    def test_a_full_disk_refuses_the_write_and_keeps_the_memory(self):
        if os.geteuid() != 0:
            self.skipTest("needs root to mount a small tmpfs")
        small = os.path.join(self.tmp, "small")
        os.makedirs(small)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", small]).returncode != 0:
            self.skipTest("mount -t tmpfs is not permitted here")
        self.addCleanup(lambda: subprocess.run(["umount", "-l", small]))
        path = os.path.join(small, "full.uai")
        agent = self.agent(self.a, "full-agent", path)
        agent.call("memory_write", text="small and safe")
        fd = os.open(os.path.join(small, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError:
            pass
        finally:
            os.close(fd)
        refused = agent.call("memory_write", text="y" * 100000)
        self.assertTrue(refused["isError"], refused)
        self.assertIn("disk is full", text_of(refused))
        self.assertEqual(self.read_file(path), b"small and safe")
        self.assertEqual(sorted(os.listdir(small)), ["filler", "full.uai"])
        os.unlink(os.path.join(small, "filler"))
        self.assertNotIn("isError", agent.call("memory_write", text="y" * 100000))


class ExistingServersUnderALease(McpCase):
    """The official memory server keeps its own file: under `mep run --wait` a second agent
    waits instead of clobbering it, and a killed agent's lease frees the file."""

    def memory_agent(self, name, path, label):
        env = dict(self.env, MEMORY_FILE_PATH=path)
        return Agent(self, label, mep_bin(),
                     ["--socket", self.a.socket_path, "run", "--wait", "120", name, path, "--",
                      shutil.which("node"), MEMORY_SERVER], env, self.data, expect_ready=False)

    def entities(self, path):
        with open(path) as f:
            return [json.loads(l) for l in f.read().splitlines() if l.strip()]

    def test_two_agents_on_the_official_memory_server_lose_no_write(self):
        path = os.path.join(self.data, "graph.jsonl")
        rc, _, err = self.mep(self.a, "init", path)
        self.assertEqual(rc, 0, err)
        first = self.memory_agent("graph-keeper", path, "first")
        first.wait_ready()
        second = self.memory_agent("graph-keeper", path, "second")
        # The second agent's server has not started: its mep run waits for the lease, and the
        # client's initialize waits with it.
        with self.assertRaises(queue.Empty):
            second.lines.get(timeout=2)
        for i in range(20):
            r = first.call("create_entities", entities=[{"name": "a%d" % i, "entityType": "t", "observations": []}])
            self.assertNotIn("isError", r, r)
        # The first agent is killed outright (its mep run): the lease frees the file.
        os.kill(first.server_pid, signal.SIGKILL)
        second.wait_ready(timeout=60)
        for i in range(20):
            r = second.call("create_entities", entities=[{"name": "b%d" % i, "entityType": "t", "observations": []}])
            self.assertNotIn("isError", r, r)
        second.close()
        names = {e["name"] for e in self.entities(path) if e["type"] == "entity"}
        self.assertEqual(len(names), 40, sorted(names))


if __name__ == "__main__":
    unittest.main()
