"""Fencing that reaches the data (SPEC §8), end to end with real processes: `mep server`,
`mep store`, and two daemons standing for two hosts (each its own state directory and
socket), driven through the CLI (`mep run`, `mep sync`, `mep fetch`, `mep claim`) and the
daemon's socket API.

- `zombie_sigstop_write_rejected`: host A syncs under `mep run`; A's daemon and agent are
  SIGSTOPped past the TTL; host B fetches the memory, claims it and writes nothing; after
  SIGCONT, A's write is refused — by its daemon (the lease is lost on A's own clock, so
  nothing is sent) and, with the old token, by the store (409, because B's daemon advanced
  the mark before B got its token) — and the store still serves A's last good bytes; then
  B syncs and the store serves B's bytes.
- a takeover the old daemon has not heard of yet: its sync is refused by the store (409)
  and the daemon marks the lease lost;
- the fence is advanced before the token is handed out; with the store down the attach
  is 503 store-unavailable and the lease is given back;
- re-adoption after a daemon restart advances the fence again;
- `mep run --sync-on-exit`; sync and fetch errors, each a problem and nothing changed.
"""
import json
import os
import signal
import subprocess
import time
import unittest
import uuid

from daemonfixture import EventStream, Mepd, MepServer, mepd_bin
from mephelpers import mep_bin
from storefixture import MepStore, StoreClient, new_store_token
from test_daemon import DaemonTestCase

TTL = 5


class DataPlaneCase(DaemonTestCase):
    MODE = "none"  # setUp below starts the processes

    def setUp(self):
        mep_bin()
        mepd_bin()
        import tempfile
        from daemonfixture import clean_env
        self.tmp = tempfile.mkdtemp(prefix="mep-dp-")
        self.env = clean_env(self.tmp)
        self.data = os.path.join(self.tmp, "data")
        os.makedirs(self.data)
        self.server = self.start_server()
        self.token = self.server.token("tenant-a")
        self.admin = self.server.token("tenant-a", admin=True)
        self.store_token, hashes = new_store_token(self.tmp)
        self.store = MepStore(self.tmp, os.path.join(self.tmp, "store"), ["--token-file", hashes]).start()
        self.addCleanup(self.store.stop)
        self.store_token_file = os.path.join(self.tmp, "store.token")
        self.a = self.start_host("host-a")
        self.b = self.start_host("host-b")
        self.objects = StoreClient(self.store.port, self.store_token)
        self.addCleanup(self.objects.close)

    def start_host(self, tag, store_url=None):
        d = Mepd(self.tmp, self.env, control_plane=self.server.url, token=self.token, tag=tag,
                 extra_args=["--store", store_url or self.store.url, "--store-token-file", self.store_token_file])
        self._sources.append((tag, d))
        self.addCleanup(d.stop)
        return d.start()

    def mep(self, host, *args, check=True, timeout=60):
        p = subprocess.run([mep_bin(), "--socket", host.socket_path, *args], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, env=self.env, timeout=timeout, cwd=self.data)
        if check and p.returncode != 0:
            raise AssertionError("mep %s exited %d: %s" % (" ".join(args), p.returncode, p.stderr.decode()))
        return p.returncode, p.stdout.decode(), p.stderr.decode()

    def mep_json(self, host, *args, expect=0):
        rc, out, err = self.mep(host, "--json", *args, check=False)
        self.assertEqual(rc, expect, err + out)
        return json.loads(out) if out.strip() else None

    def new_memory(self, host, name):
        path = os.path.join(self.data, name)
        self.mep(host, "init", path)
        return path

    def fence_of(self, memory_id):
        r = self.objects.fence(memory_id)
        self.assertEqual(r.status, 200, r)
        return r.json()["fencing_token"]


class Zombie(DataPlaneCase):
    def test_zombie_sigstop_write_rejected(self):
        path_a = self.new_memory(self.a, "agent.uai")
        memory = self.mep_json(self.a, "identify", path_a)["memory_instance_id"]
        marker = os.path.join(self.tmp, "a-synced")
        go_on = os.path.join(self.tmp, "a-go-on")
        # Agent A: writes its memory and syncs it under the lease, then, when told, writes
        # again and syncs again (its daemon decides whether that still goes out).
        script = ('echo "A first bytes" > "$2"; mep --socket "$1" sync zombie-agent && touch "$3"; '
                  'while [ ! -e "$4" ]; do sleep 0.05; done; '
                  'echo "A late bytes" > "$2"; mep --socket "$1" --json sync zombie-agent > "$5"; echo $? > "$5.rc"; '
                  'sleep 30')
        late = os.path.join(self.tmp, "a-late.json")
        env = dict(self.env, PATH=os.path.dirname(mep_bin()) + ":" + self.env.get("PATH", "/usr/bin:/bin"))
        run = subprocess.Popen([mep_bin(), "--socket", self.a.socket_path, "run", "--ttl", str(TTL),
                                "--on-loss", "ignore", "zombie-agent", path_a, "--", "sh", "-c", script, "sh",
                                self.a.socket_path, path_a, marker, go_on, late],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.addCleanup(lambda: run.poll() is None and os.killpg(run.pid, signal.SIGKILL))
        deadline = time.monotonic() + 30
        while not os.path.exists(marker):
            self.assertLess(time.monotonic(), deadline, "agent A never synced")
            self.assertIsNone(run.poll(), run.stderr.read().decode() if run.poll() is not None else "")
            time.sleep(0.05)
        got = self.objects.get(memory)
        self.assertEqual(got.body, b"A first bytes\n")
        old_token = int(got.header("Fencing-Token"))
        self.assertEqual(self.fence_of(memory), old_token)

        # Host A freezes (its daemon and its agent) past the lease's TTL.
        os.killpg(run.pid, signal.SIGSTOP)
        self.a.proc.signal(signal.SIGSTOP)
        try:
            time.sleep(TTL + 1.5)
            # Host B: fetches the memory (its identity comes along), claims it, writes nothing.
            path_b = os.path.join(self.data, "agent-on-b.uai")
            fetched = self.mep_json(self.b, "fetch", memory, path_b)
            self.assertEqual(fetched["memory_instance_id"], memory)
            with open(path_b, "rb") as f:
                self.assertEqual(f.read(), b"A first bytes\n")
            self.assertEqual(self.mep_json(self.b, "identify", path_b)["memory_instance_id"], memory)
            claimed = self.mep_json(self.b, "claim", "--ttl", "30", "zombie-agent", path_b)
            self.assertGreater(claimed["fencing_token"], old_token)
            # B's daemon advanced the mark before it handed out the token.
            self.assertEqual(self.fence_of(memory), claimed["fencing_token"])
        finally:
            self.a.proc.signal(signal.SIGCONT)
            os.killpg(run.pid, signal.SIGCONT)

        # A's late write: its daemon knows the lease is over (its own monotonic deadline
        # passed) and refuses before any byte is sent...
        with open(go_on, "w"):
            pass
        deadline = time.monotonic() + 30
        # The shell creates the file before it writes the status into it: wait for the line.
        while not (os.path.exists(late + ".rc") and open(late + ".rc").read().endswith("\n")):
            self.assertLess(time.monotonic(), deadline, "agent A's late sync never finished")
            time.sleep(0.05)
        with open(late) as f:
            problem = json.load(f)
        with open(late + ".rc") as f:
            self.assertEqual(f.read().strip(), "4")
        self.assertIn(problem["code"], ("lease-expired", "stale-fence"), problem)
        # ...and a zombie that kept the old token and writes on its own is refused by the store.
        raw = self.objects.put(memory, b"zombie bytes", old_token)
        self.assertEqual(raw.status, 409, raw)
        self.assertEqual(raw.json()["code"], "stale-fence")
        self.assertEqual((raw.json()["presented_token"], raw.json()["current_token"]),
                         (old_token, claimed["fencing_token"]))
        # The store still serves A's last good bytes.
        got = self.objects.get(memory)
        self.assertEqual(got.body, b"A first bytes\n")
        self.assertEqual(int(got.header("Fencing-Token")), old_token)
        # B syncs: B's bytes.
        with open(path_b, "wb") as f:
            f.write(b"B's bytes\n")
        synced = self.mep_json(self.b, "sync", "zombie-agent")
        self.assertEqual(synced["fencing_token"], claimed["fencing_token"])
        got = self.objects.get(memory)
        self.assertEqual(got.body, b"B's bytes\n")
        self.assertEqual(int(got.header("Fencing-Token")), claimed["fencing_token"])
        os.killpg(run.pid, signal.SIGKILL)
        run.wait(10)

    def test_takeover_the_old_daemon_has_not_heard_of_is_refused_by_the_store(self):
        path_a = self.new_memory(self.a, "t.uai")
        lease_a = self.mep_json(self.a, "claim", "--ttl", "300", "takeover-agent", path_a)
        memory = lease_a["memory_instance_id"]
        with open(path_a, "wb") as f:
            f.write(b"A's bytes")
        self.mep_json(self.a, "sync", "takeover-agent")
        # An admin revokes A's lease; B fetches and claims: B's token is in the store now,
        # while A's daemon (next renewal in ~100 s) still takes its lease for live.
        r = self.server.request("POST", "/v1/admin/leases/revoke", self.admin, {"canonical_name": "takeover-agent"})
        self.assertEqual(r.status, 204, r)
        path_b = os.path.join(self.data, "t-on-b.uai")
        self.mep_json(self.b, "fetch", memory, path_b)
        lease_b = self.mep_json(self.b, "claim", "takeover-agent", path_b)
        self.assertEqual(self.fence_of(memory), lease_b["fencing_token"])
        self.assertEqual(self.mep_json(self.a, "status")["leases"][0]["state"], "held")
        with open(path_a, "wb") as f:
            f.write(b"A's stale bytes")
        problem = self.mep_json(self.a, "sync", "takeover-agent", expect=4)
        self.assertEqual(problem["code"], "stale-fence")
        self.assertEqual(problem["current_token"], lease_b["fencing_token"])
        # A's daemon now knows: the lease is lost, and a second sync is refused locally.
        lease = self.mep_json(self.a, "status")["leases"][0]
        self.assertEqual((lease["state"], lease.get("lost_reason")), ("lost", "stale-fence"))
        self.assertEqual(self.mep_json(self.a, "sync", "takeover-agent", expect=4)["code"], "lease-expired")
        self.assertEqual(self.objects.get(memory).body, b"A's bytes")


class Fence(DataPlaneCase):
    def test_fence_advanced_before_the_token_is_handed_out(self):
        events = EventStream(self.a.socket_path)
        self.addCleanup(events.close)
        path = self.new_memory(self.a, "f.uai")
        lease = self.mep_json(self.a, "claim", "fence-agent", path)
        # By the time the claim is answered, the store's mark is the new token.
        self.assertEqual(self.fence_of(lease["memory_instance_id"]), lease["fencing_token"])
        self.assertTrue(events.wait_for(lambda e: e["event"] == "granted" and e["canonical_name"] == "fence-agent", 10))

    def test_store_down_attach_is_503_and_the_lease_given_back(self):
        path = self.new_memory(self.a, "down.uai")
        memory = self.mep_json(self.a, "identify", path)["memory_instance_id"]
        self.store.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            problem = self.mep_json(self.a, "claim", "down-agent", path, expect=5)
            self.assertLess(time.monotonic() - started, 20)
        finally:
            self.store.proc.send_signal(signal.SIGCONT)
        self.assertEqual(problem["code"], "store-unavailable")
        self.assertEqual(self.mep_json(self.a, "status")["leases"], [])
        # The lease was given back: with the store back, the next claim is granted at once
        # (not 423), with a higher token, and fenced.
        again = self.mep_json(self.a, "claim", "down-agent", path)
        self.assertEqual(self.fence_of(memory), again["fencing_token"])
        self.assertGreaterEqual(again["fencing_token"], 2)

    def test_readoption_after_a_daemon_restart_advances_the_fence_again(self):
        path = self.new_memory(self.a, "re.uai")
        lease = self.mep_json(self.a, "claim", "--ttl", "60", "readopt-agent", path)
        memory = lease["memory_instance_id"]
        # A new, empty store (its marks lost): the restarted daemon fences its lease again.
        self.store.stop()
        store_token, hashes = new_store_token(self.tmp, "store2")
        fresh = MepStore(self.tmp, os.path.join(self.tmp, "store-fresh"), ["--token-file", hashes]).start()
        self.addCleanup(fresh.stop)
        with open(self.store_token_file, "w") as f:
            f.write(store_token + "\n")
        self.a.stop()
        self.a.extra_args = ["--store", fresh.url, "--store-token-file", self.store_token_file]
        self.a.start()
        objects = StoreClient(fresh.port, store_token)
        self.addCleanup(objects.close)
        deadline = time.monotonic() + 15
        while objects.fence(memory).json()["fencing_token"] != lease["fencing_token"]:
            self.assertLess(time.monotonic(), deadline, "the re-adopted lease was not fenced")
            time.sleep(0.1)
        with open(path, "wb") as f:
            f.write(b"after restart")
        self.assertEqual(self.mep_json(self.a, "sync", "readopt-agent")["fencing_token"], lease["fencing_token"])
        self.assertEqual(objects.get(memory).body, b"after restart")


class SyncAndFetch(DataPlaneCase):
    def test_run_sync_on_exit(self):
        path = self.new_memory(self.a, "exit.uai")
        memory = self.mep_json(self.a, "identify", path)["memory_instance_id"]
        rc, _, err = self.mep(self.a, "run", "--sync-on-exit", "exit-agent", path, "--", "sh", "-c",
                              'echo "work done" > "$1"', "sh", path, check=False)
        self.assertEqual(rc, 0, err)
        self.assertEqual(self.objects.get(memory).body, b"work done\n")
        self.assertEqual(self.mep_json(self.a, "status")["leases"], [])  # released after the sync
        # A failed command keeps its status (and still syncs what it left).
        rc, _, _ = self.mep(self.a, "run", "--sync-on-exit", "exit-agent", path, "--", "sh", "-c",
                            'echo "half done" > "$1"; exit 7', "sh", path, check=False)
        self.assertEqual(rc, 7)
        self.assertEqual(self.objects.get(memory).body, b"half done\n")

    def test_errors_are_problems_and_change_nothing(self):
        path = self.new_memory(self.a, "err.uai")
        lease = self.mep_json(self.a, "claim", "err-agent", path)
        memory = lease["memory_instance_id"]
        with open(path, "wb") as f:
            f.write(b"good")
        self.mep_json(self.a, "sync", "err-agent")
        client = self.a.client()
        cases = [
            ("sync without a lease", ("POST", "/v1/sync", {"name": "nobody-holds-this"}), 404, "lease-not-found"),
            ("sync of a bad name", ("POST", "/v1/sync", {"name": "bad!"}), 404, "lease-not-found"),
            ("sync without a name", ("POST", "/v1/sync", {}), 400, "invalid-request"),
            ("sync with an unknown field", ("POST", "/v1/sync", {"name": "err-agent", "x": 1}), 400, "invalid-request"),
            ("fetch of an unknown id", ("POST", "/v1/fetch", {"memory_instance_id": str(uuid.uuid4()),
                                                              "path": os.path.join(self.data, "nope.uai")}), 404,
             "memory-not-found"),
            ("fetch to an existing path", ("POST", "/v1/fetch", {"memory_instance_id": memory, "path": path}), 400,
             "invalid-request"),
            ("fetch of a bad id", ("POST", "/v1/fetch", {"memory_instance_id": "x", "path": "y.uai"}), 400,
             "invalid-request"),
            ("verify without a lease", ("POST", "/v1/verify", {"name": "nobody-holds-this"}), 404, "lease-not-found"),
        ]
        for label, (method, target, body), status, code in cases:
            with self.subTest(label):
                r = client.request(method, target, body)
                self.assertEqual(r.status, status, r)
                self.assertEqual(r.json["code"], code, r)
        self.assertFalse(os.path.exists(os.path.join(self.data, "nope.uai")))
        self.assertEqual([f for f in os.listdir(self.data) if "mep-fetch" in f], [])
        self.assertEqual(self.objects.get(memory).body, b"good")
        verified = client.request("POST", "/v1/verify", {"name": "err-agent"})
        self.assertEqual(verified.status, 200, verified)
        self.assertEqual(verified.json["fencing_token"], lease["fencing_token"])
        # After a release: 404 here too; the store keeps the last bytes.
        self.mep(self.a, "release", "err-agent")
        self.assertEqual(self.mep_json(self.a, "sync", "err-agent", expect=1)["code"], "lease-not-found")
        self.assertEqual(self.objects.get(memory).body, b"good")

    def test_verify_and_sync_of_a_lease_by_its_id_refuse_a_later_lease_under_the_name(self):
        # verify and sync took only a name: an agent whose lease was released and the name
        # claimed by another on another memory (its first token is 1 too) was told its
        # lease was verified, and uploaded the other agent's file. With lease_id, only
        # that lease is used (as detach does).
        one, two = self.new_memory(self.a, "one.uai"), self.new_memory(self.a, "two.uai")
        first = self.mep_json(self.a, "claim", "race-agent", one)
        self.mep(self.a, "release", "race-agent")
        second = self.mep_json(self.a, "claim", "race-agent", two)
        self.assertEqual(first["fencing_token"], second["fencing_token"])
        self.assertNotEqual(first["lease_id"], second["lease_id"])
        with open(two, "wb") as f:
            f.write(b"the other agent's")
        client = self.a.client()
        for target in ("/v1/verify", "/v1/sync"):
            with self.subTest(target):
                r = client.request("POST", target, {"name": "race-agent", "lease_id": first["lease_id"]})
                self.assertEqual(r.status, 404, r)
                self.assertEqual(r.json["code"], "lease-not-found", r)
        self.assertEqual(self.objects.get(second["memory_instance_id"]).status, 404, "a refused sync uploaded")
        for target in ("/v1/verify", "/v1/sync"):
            with self.subTest(target):
                r = client.request("POST", target, {"name": "race-agent", "lease_id": second["lease_id"]})
                self.assertEqual(r.status, 200, r)
                self.assertEqual(r.json["memory_instance_id"], second["memory_instance_id"], r)
        self.assertEqual(self.objects.get(second["memory_instance_id"]).body, b"the other agent's")

    def test_a_file_written_while_it_is_sent(self):
        # An upload sends exactly the size the file had when it began: bytes appended
        # meanwhile must not follow, or the store reads them as the start of another request
        # and answers it on the connection the next store call reuses. The sync says the
        # object may be torn (503, exit 5); the next one, on a quiet file, stores it whole.
        path = self.new_memory(self.a, "grow.uai")
        self.mep_json(self.a, "claim", "grower", path)
        with open(path, "wb") as f:
            f.write(os.urandom(1024) * (48 * 1024))  # 48 MiB: more than the sockets' buffers hold

        def sent_so_far():
            # How far mepd has read the file (its descriptor's offset), or 0.
            fds = "/proc/%d/fd" % self.a.proc.pid
            for fd in os.listdir(fds):
                try:
                    if os.readlink(os.path.join(fds, fd)) == path:
                        with open("/proc/%d/fdinfo/%s" % (self.a.proc.pid, fd)) as info:
                            return int(info.readline().split()[1])
                except OSError:
                    continue
            return 0

        self.store.proc.send_signal(signal.SIGSTOP)  # the upload blocks once the buffers are full
        try:
            sync = subprocess.Popen([mep_bin(), "--socket", self.a.socket_path, "--json", "sync", "grower"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env)
            self.addCleanup(lambda: sync.poll() is None and sync.kill())
            deadline = time.monotonic() + 30
            while sent_so_far() == 0:
                self.assertLess(time.monotonic(), deadline, "mepd never started sending the file")
                time.sleep(0.05)
            with open(path, "ab") as f:
                f.write(b"appended while it was sent\n" * 4096)
        finally:
            self.store.proc.send_signal(signal.SIGCONT)
        out, err = sync.communicate(timeout=60)
        self.assertEqual(sync.returncode, 5, err)
        problem = json.loads(out)
        self.assertEqual(problem["code"], "unavailable", problem)
        self.assertIn("changed while it was being sent", problem["detail"])
        # The store's connection is whole: a claim (its fence advanced) and a sync go through.
        other = self.new_memory(self.a, "after.uai")
        self.mep_json(self.a, "claim", "after-grow", other)
        stored = self.mep_json(self.a, "sync", "grower")
        with open(path, "rb") as f:
            whole = f.read()
        self.assertEqual(stored["size"], len(whole))
        self.assertEqual(self.objects.get(stored["memory_instance_id"]).body, whole)

    def test_sync_and_fetch_need_a_data_plane(self):
        plain = Mepd(self.tmp, self.env, control_plane=self.server.url, token=self.token, tag="no-store")
        self.addCleanup(plain.stop)
        plain.start()
        path = os.path.join(self.data, "plain.uai")
        self.mep(plain, "init", path)
        self.mep(plain, "claim", "plain-agent", path)
        self.assertEqual(self.mep_json(plain, "sync", "plain-agent", expect=1)["code"], "store-not-configured")
        problem = self.mep_json(plain, "fetch", str(uuid.uuid4()), os.path.join(self.data, "x.uai"), expect=1)
        self.assertEqual(problem["code"], "store-not-configured")


if __name__ == "__main__":
    unittest.main()
