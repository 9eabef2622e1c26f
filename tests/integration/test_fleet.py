"""Operating a fleet of leases (issue 54) against a real `mep server`: who holds a lease and
since when (holder metadata, granted_at, renewals), the holder named in a refusal, the hold
limit (max_hold_seconds, --max-hold), revocation with a reason the holder learns, a name's
history from the audit table, and the metrics an operator alerts on. Runs on SQLite and
PostgreSQL (MEP_TEST_BACKEND).
"""
import http.client
import json
import os
import re
import subprocess
import tempfile
import time
import unittest
import urllib.parse

import pgfixture
from daemonfixture import MepServer as DaemonServer, Mepd, clean_env
from mephelpers import mep_bin
from storefixture import MepStore, new_store_token
from serverfixture import (ApiClient, MepServer, ServerTestCase, create_token, drop_db, new_db, new_key,
                           parse_rfc3339_ms, unique_name, uuid7)
from test_server_api import LEASE_FIELDS, owner, parse_exposition

HOLDER = {"host": "host-a", "pid": 4242, "exe": "agent.sh", "labels": {"role": "builder", "team": "blue"}}


def claim_body(name, mem, who, **extra):
    body = {"display_name": name, "memory_instance_id": mem, "owner_client_id": who}
    body.update(extra)
    return body


class Fleet(ServerTestCase):
    def claim(self, c, name=None, mem=None, who=None, **extra):
        name, mem, who = name or unique_name(), mem or c.new_memory(), who or owner()
        r = c.post("/v1/leases", claim_body(name, mem, who, **extra), idem=new_key())
        return name, mem, who, r

    def admin(self):
        return self.client(self.admin_a)

    # ---- who holds it ----------------------------------------------------------------------

    def test_holder_and_times_are_shown_by_the_reads(self):
        c = self.client()
        name, mem, who, r = self.claim(c, holder=HOLDER)
        self.assertStatus(r, 201)
        granted = r.json
        got = c.get_lease(name)
        self.assertStatus(got, 200)
        self.assertEqual(set(got.json), LEASE_FIELDS)
        self.assertEqual(got.json["holder"], HOLDER)
        self.assertEqual(got.json["granted_at"], granted["server_time"])
        self.assertIsNone(got.json["renewed_at"])
        self.assertEqual(got.json["renewals"], 0)
        self.assertIsNone(got.json["hold_until"])
        for _ in range(2):
            self.assertStatus(c.renew(name, mem, granted["fencing_token"], who), 200)
        got = c.get_lease(name).json
        self.assertEqual(got["renewals"], 2)
        self.assertGreaterEqual(parse_rfc3339_ms(got["renewed_at"]), parse_rfc3339_ms(granted["server_time"]))
        listed = [l for l in c.get("/v1/leases?limit=1000").json["leases"] if l["canonical_name"] == name]
        self.assertEqual(len(listed), 1)
        self.assertEqual(listed[0]["holder"], HOLDER)
        # Without a holder: null, and the grant's answer is unchanged by any of this.
        name2, _, _, r2 = self.claim(c)
        self.assertIsNone(c.get_lease(name2).json["holder"])
        self.assertNotIn("holder", r2.json)

    def test_a_holder_out_of_bounds_is_400_naming_it_and_writes_nothing(self):
        c = self.client()
        mem = c.new_memory()
        bad = [
            ("holder", "must be an object"),
            ({"exe": "/usr/bin/agent"}, 'holder: field "exe"'),
            ({"host": "h" * 256}, 'holder: field "host"'),
            ({"host": "a\nb"}, 'holder: field "host"'),
            ({"pid": 0}, "pid"),
            ({"pid": "12"}, "pid"),
            ({"labels": {"k%d" % i: "v" for i in range(17)}}, "16 labels"),
            ({"labels": {"bad key": "v"}}, 'holder: field "labels": a key'),
            ({"labels": {"k": 5}}, 'holder: field "labels": a value'),
            ({"labels": {"k": "v" * 256}}, 'holder: field "labels": a value'),
            ({"labels": []}, "labels"),
            ({"hostname": "x"}, "hostname"),
        ]
        for holder, words in bad:
            with self.subTest(holder=holder):
                r = c.post("/v1/leases", claim_body(unique_name(), mem, owner(), holder=holder), idem=new_key())
                self.assertProblem(r, 400, "invalid-request")
                self.assertIn(words, r.json["detail"])
        for hold in (4, 366 * 86400 + 1, "60", 1.5):
            with self.subTest(max_hold=hold):
                r = c.post("/v1/leases", claim_body(unique_name(), mem, owner(), max_hold_seconds=hold),
                           idem=new_key())
                self.assertProblem(r, 400, "invalid-request")
                self.assertIn("max_hold_seconds", r.json["detail"])
        # None of them took the memory.
        _, _, _, ok = self.claim(c, mem=mem)
        self.assertStatus(ok, 201)

    def test_a_refusal_names_the_holder_to_its_tenant_only(self):
        c = self.client()
        name, mem, who, r = self.claim(c, name="Held-" + uuid7()[-12:], holder=HOLDER)
        self.assertStatus(r, 201)
        key = new_key()
        body = claim_body(name, c.new_memory(), owner())
        refused = c.post("/v1/leases", body, idem=key)
        self.assertProblem(refused, 423, "name-held")
        holder = refused.json["holder"]
        self.assertEqual(holder, {"display_name": name, "host": "host-a", "since": r.json["server_time"],
                                  "expires_at": r.json["expires_at"]})
        for secret in (r.json["lease_id"], who):
            self.assertNotIn(secret, refused.raw.decode())
        # The same for the memory, and a replay of the refusal is the same bytes.
        by_memory = c.post("/v1/leases", claim_body(unique_name(), mem, owner()), idem=new_key())
        self.assertProblem(by_memory, 423, "memory-attached")
        self.assertEqual(by_memory.json["holder"]["display_name"], name)
        again = c.post("/v1/leases", body, idem=key)
        self.assertEqual(again.raw, refused.raw)
        # Another tenant learns that it is held, not by whom.
        other = self.client(self.token_b)
        theirs = other.post("/v1/leases", claim_body(name, other.new_memory(), owner()), idem=new_key())
        self.assertProblem(theirs, 423, "name-held")
        self.assertNotIn("holder", theirs.json)
        self.assertNotIn("host-a", theirs.raw.decode())

    # ---- the hold limit ----------------------------------------------------------------------

    def test_renewals_stop_at_the_hold_limit(self):
        c = self.client()
        name, mem, who, r = self.claim(c, ttl_seconds=30, max_hold_seconds=5)
        self.assertStatus(r, 201)
        g = r.json
        # The grant itself never outlives its hold.
        self.assertEqual(parse_rfc3339_ms(g["expires_at"]) - parse_rfc3339_ms(g["server_time"]), 5000)
        self.assertEqual(c.get_lease(name).json["hold_until"], g["expires_at"])
        refused = c.renew(name, mem, g["fencing_token"], who)
        self.assertProblem(refused, 410, "lease-expired")
        self.assertEqual(refused.json["reason"], "max-hold")
        batch = c.post("/v1/leases/renew-batch", {"owner_client_id": who, "leases": [
            {"canonical_name": name, "memory_instance_id": mem, "fencing_token": g["fencing_token"],
             "ttl_seconds": 30}]})
        self.assertStatus(batch, 200)
        self.assertEqual(batch.json["results"][0]["status"], 410)
        self.assertEqual(batch.json["results"][0]["reason"], "max-hold")
        # A longer hold renews until its limit.
        name2, mem2, who2, r2 = self.claim(c, ttl_seconds=5, max_hold_seconds=3600)
        self.assertStatus(c.renew(name2, mem2, r2.json["fencing_token"], who2, ttl=5), 200)
        metrics = parse_exposition(self, c.get("/metrics", token=None).raw.decode())
        outcomes = {lab.get("outcome") for _, lab, _ in metrics["mep_renewals_total"]["samples"]}
        self.assertTrue({"renewed", "max_hold"} <= outcomes, outcomes)

    def test_the_servers_max_hold_caps_every_claim(self):
        db = new_db(self.workdir, "maxhold.db")
        self.addCleanup(drop_db, db)
        token = create_token(db, "t")
        srv = MepServer(self.workdir, db, ["--max-hold", "5"]).start()
        self.addCleanup(srv.stop)
        with ApiClient(srv.port, token) as c:
            for extra in ({}, {"max_hold_seconds": 3600}):
                name, mem, who = unique_name(), c.new_memory(), owner()
                r = c.post("/v1/leases", claim_body(name, mem, who, ttl_seconds=30, **extra), idem=new_key())
                self.assertStatus(r, 201)
                lease = c.get_lease(name).json
                self.assertEqual(parse_rfc3339_ms(lease["hold_until"]) - parse_rfc3339_ms(lease["granted_at"]), 5000)
                self.assertProblem(c.renew(name, mem, r.json["fencing_token"], who), 410, "lease-expired")

    # ---- revocation -------------------------------------------------------------------------

    def test_a_revoked_holder_learns_why_at_its_next_renewal(self):
        c = self.client()
        name, mem, who, r = self.claim(c)
        token = r.json["fencing_token"]
        self.assertProblem(c.post("/v1/admin/leases/revoke", {"canonical_name": name}), 403, "forbidden")
        a = self.admin()
        self.assertProblem(a.post("/v1/admin/leases/revoke", {"canonical_name": name, "reason": "x" * 201}), 400,
                           "invalid-request")
        self.assertProblem(a.post("/v1/admin/leases/revoke", {"canonical_name": name, "reason": "a\x01b"}), 400,
                           "invalid-request")
        self.assertStatus(a.post("/v1/admin/leases/revoke", {"canonical_name": name, "reason": "stuck on deploy"}),
                          204)
        refused = c.renew(name, mem, token, who)
        self.assertProblem(refused, 410, "lease-expired")
        self.assertEqual(refused.json["reason"], "revoked")
        self.assertIn("stuck on deploy", refused.json["detail"])
        # The next owner gets a larger token; the revoked one is then merely superseded.
        _, _, _, next_grant = self.claim(c, name=name, mem=mem)
        self.assertStatus(next_grant, 201)
        self.assertEqual(next_grant.json["fencing_token"], token + 1)
        self.assertProblem(c.renew(name, mem, token, who), 409, "stale-fence")

    # ---- history ----------------------------------------------------------------------------

    def test_a_names_history_newest_first_for_admins_of_its_tenant(self):
        c = self.client()
        name, mem, who, r = self.claim(c)
        g = r.json
        self.assertStatus(c.renew(name, mem, g["fencing_token"], who), 200)
        self.assertStatus(c.release(name, mem, g["fencing_token"], who), 204)
        time.sleep(0.3)  # audit rows are stamped at their commit: keep `since` below clear of them
        _, _, _, r2 = self.claim(c, name=name, mem=mem)
        self.assertStatus(self.admin().post("/v1/admin/leases/revoke", {"canonical_name": name}), 204)
        path = "/v1/admin/leases/%s/history" % urllib.parse.quote(name)
        self.assertProblem(c.get(path), 403, "forbidden")
        a = self.admin()
        h = a.get(path)
        self.assertStatus(h, 200)
        self.assertEqual(h.json["canonical_name"], name)
        types = [(e["event_type"], e["fencing_token"]) for e in h.json["events"]]
        self.assertEqual(types, [("LEASE_REVOKED", 2), ("LEASE_ACQUIRED", 2), ("LEASE_RELEASED", 1),
                                 ("LEASE_ACQUIRED", 1)])
        self.assertEqual(h.json["events"][2]["renewals"], 1)
        self.assertEqual(h.json["events"][0]["renewals"], 0)
        self.assertIsNone(h.json["next_cursor"])
        # A page at a time.
        first = a.get(path + "?limit=3")
        self.assertEqual(len(first.json["events"]), 3)
        rest = a.get(path + "?limit=3&cursor=" + urllib.parse.quote(first.json["next_cursor"]))
        self.assertEqual([e["event_type"] for e in rest.json["events"]], ["LEASE_ACQUIRED"])
        # Since a time; a display form of the name finds the same rows.
        second = parse_rfc3339_ms(r2.json["server_time"]) - 100
        since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second // 1000)) + ".%03dZ" % (second % 1000)
        self.assertEqual(len(a.get(path + "?since=" + since).json["events"]), 2)
        upper = a.get("/v1/admin/leases/%s/history" % urllib.parse.quote(name.upper()))
        self.assertEqual(len(upper.json["events"]), 4)
        for bad in ("?limit=0", "?since=yesterday", "?cursor=", "?colour=red", "?limit=2&limit=3"):
            self.assertProblem(a.get(path + bad), 400, "invalid-request")
        # Another tenant's admin sees nothing of it; the plaintext name is nowhere in the audit.
        other = self.client(create_token(self.db_path, "tenant-b", "admin"))
        self.assertEqual(other.get(path).json["events"], [])

    # ---- metrics ------------------------------------------------------------------------------

    def test_lease_ends_hold_times_and_leases_per_tenant_are_exported(self):
        c = self.client()
        name, mem, who, r = self.claim(c)
        self.assertStatus(c.release(name, mem, r.json["fencing_token"], who), 204)
        name, mem, who, r = self.claim(c)
        self.assertStatus(self.admin().post("/v1/admin/leases/revoke", {"canonical_name": name}), 204)
        self.claim(c)
        text = c.get("/metrics", token=None).raw.decode()
        m = parse_exposition(self, text)
        causes = {lab.get("cause") for _, lab, v in m["mep_lease_ends_total"]["samples"] if v > 0}
        self.assertTrue({"released", "revoked"} <= causes, causes)
        hold = [v for n, _, v in m["mep_lease_hold_seconds"]["samples"] if n == "mep_lease_hold_seconds_count"]
        self.assertGreaterEqual(sum(hold), 2)
        self.assertEqual(m["mep_lease_hold_seconds"]["type"], "histogram")
        tenants = {lab.get("tenant"): v for _, lab, v in m["mep_leases_active_by_tenant"]["samples"]}
        self.assertGreaterEqual(tenants.get("tenant-a", 0), 1)
        self.assertEqual([v for _, _, v in m["mep_db_ready"]["samples"]], [1])


if __name__ == "__main__":
    unittest.main()


# ---- the daemons and the `mep lease` commands ----------------------------------------------------

COMMAND_TIMEOUT_S = 60


class FleetCli(unittest.TestCase):
    """One `mep server`, two daemons as two hosts (one of them --anonymous-holder), and an
    operator with an admin token, as the issue's "done means" describes."""

    @classmethod
    def setUpClass(cls):
        cls._tmp = tempfile.TemporaryDirectory(prefix="mep-fleet-")
        cls.addClassCleanup(cls._tmp.cleanup)
        cls.dir = cls._tmp.name
        cls.env = clean_env(cls.dir)
        cls.server = DaemonServer(cls.dir, cls.env).start()
        cls.addClassCleanup(cls.server.stop)
        lease_token = cls.server.token("fleet")
        cls.admin_file = os.path.join(cls.dir, "admin.token")
        with open(cls.admin_file, "w") as f:
            f.write(cls.server.token("fleet", admin=True) + "\n")
        cls.host_a = Mepd(cls.dir, cls.env, cls.server.url, lease_token, tag="host-a").start()
        cls.addClassCleanup(cls.host_a.stop)
        cls.host_b = Mepd(cls.dir, cls.env, cls.server.url, lease_token, tag="host-b",
                          extra_args=["--anonymous-holder"]).start()
        cls.addClassCleanup(cls.host_b.stop)
        cls.hostname = os.uname().nodename

    def setUp(self):
        self.popens = []

    def tearDown(self):
        for p in self.popens:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=30)

    def mep(self, *args, host=None, timeout=COMMAND_TIMEOUT_S):
        argv = [mep_bin()] + (["--socket", host.socket_path] if host else []) + list(args)
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, env=self.env, timeout=timeout,
                           cwd=self.dir)
        return p.returncode, p.stdout.decode(), p.stderr.decode()

    def lease_cmd(self, *args):
        return self.mep("lease", *args, "--server", self.server.url, "--token-file", self.admin_file)

    def memory(self, host):
        path = os.path.join(self.dir, "m-%s.uai" % uuid7()[-12:])
        rc, _, err = self.mep("init", path, host=host)
        self.assertEqual(rc, 0, err)
        return path

    def run_agent(self, host, name, path, *extra):
        p = subprocess.Popen([mep_bin(), "--socket", host.socket_path, "run", *extra, name, path, "--",
                              "sleep", "120"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=self.env, cwd=self.dir)
        self.popens.append(p)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            rc, out, _ = self.lease_cmd("ls", "--json")
            if rc == 0 and any(l["canonical_name"] == name for l in json.loads(out)["leases"]):
                return p
            if p.poll() is not None:
                self.fail("mep run ended: %r" % (p.communicate(timeout=10),))
            time.sleep(0.1)
        self.fail("%s was never held" % name)

    def test_an_operator_lists_revokes_and_reads_the_history(self):
        name_a, name_b = "builder-" + uuid7()[-8:], "tester-" + uuid7()[-8:]
        path_a = self.memory(self.host_a)
        agent = self.run_agent(self.host_a, name_a, path_a, "--label", "role=builder", "--label", "team=blue")
        self.run_agent(self.host_b, name_b, self.memory(self.host_b), "--label", "role=tester")
        # Every lease of the tenant, across both daemons, with its host where one is told.
        rc, out, err = self.lease_cmd("ls", "--json")
        self.assertEqual(rc, 0, err)
        leases = {l["canonical_name"]: l for l in json.loads(out)["leases"]}
        self.assertEqual(leases[name_a]["holder"]["host"], self.hostname)
        self.assertEqual(leases[name_a]["holder"]["exe"], "sleep")  # mep run's command, not mep
        self.assertIsInstance(leases[name_a]["holder"]["pid"], int)
        self.assertEqual(leases[name_a]["holder"]["labels"], {"role": "builder", "team": "blue"})
        self.assertIsNone(leases[name_b]["holder"])  # --anonymous-holder told nothing
        rc, out, _ = self.lease_cmd("ls")
        self.assertEqual(rc, 0)
        self.assertTrue(out.startswith("NAME "), out)
        row = [l for l in out.splitlines() if l.startswith(name_a + " ")]
        self.assertEqual(len(row), 1, out)
        self.assertIn(self.hostname, row[0])
        # Filters.
        for flt, want in ((["--label", "role=builder"], {name_a}), (["--label", "team"], {name_a}),
                          (["--host", self.hostname], {name_a}), (["--name", "tester-*"], {name_b}),
                          (["--expiring-within", "3600"], {name_a, name_b}), (["--host", "elsewhere"], set())):
            rc, out, err = self.lease_cmd("ls", "--json", *flt)
            self.assertEqual(rc, 0, err)
            got = {l["canonical_name"] for l in json.loads(out)["leases"]} & {name_a, name_b}
            self.assertEqual(got, want, flt)
        # One lease in full.
        rc, out, err = self.lease_cmd("show", name_a)
        self.assertEqual(rc, 0, err)
        self.assertRegex(out, r"labels +role=builder,team=blue")
        self.assertRegex(out, r"token +1 \(the memory's fence mark: 1\)")
        rc, out, _ = self.lease_cmd("show", name_a, "--json")
        self.assertEqual(json.loads(out)["lease"]["canonical_name"], name_a)
        self.assertIn("ancestors", json.loads(out)["lineage"])
        # A claim of the name from the other host says who holds it.
        rc, _, err = self.mep("claim", name_a, self.memory(self.host_b), host=self.host_b)
        self.assertEqual(rc, 3, err)
        self.assertRegex(err, r"^mep: Name held: held by %s on %s since \d\d:\d\d, expires in \d+ s\n$"
                         % (name_a, re.escape(self.hostname)))
        rc, out, _ = self.mep("--json", "claim", name_a, self.memory(self.host_b), host=self.host_b)
        self.assertEqual(json.loads(out)["holder"]["display_name"], name_a)
        # Revoked: the holder's mep run stops (lost, 4), saying why.
        rc, out, err = self.lease_cmd("revoke", name_a, "--reason", "stuck on deploy")
        self.assertEqual(rc, 0, err)
        _, agent_err = agent.communicate(timeout=60)
        self.assertEqual(agent.returncode, 4, agent_err)
        self.assertIn(b"lost (revoked)", agent_err)
        # The name goes to another owner, with a larger token.
        rc, out, err = self.mep("--json", "claim", name_a, path_a, host=self.host_b)
        self.assertEqual(rc, 0, err)
        self.assertEqual(json.loads(out)["fencing_token"], 2)
        # Its history.
        rc, out, err = self.lease_cmd("history", name_a, "--json")
        self.assertEqual(rc, 0, err)
        kinds = [e["event_type"] for e in json.loads(out)["events"]]
        self.assertEqual(kinds[0], "LEASE_ACQUIRED")
        self.assertIn("LEASE_REVOKED", kinds)
        self.assertEqual(kinds[-1], "LEASE_ACQUIRED")
        rc, out, _ = self.lease_cmd("history", name_a, "--since", "1h")
        self.assertEqual(rc, 0)
        self.assertIn("LEASE_REVOKED", out)
        # Revoking what is not held: 1 with one line; a lease token is not an admin's: 7.
        rc, _, err = self.lease_cmd("revoke", "nobody-" + uuid7()[-8:])
        self.assertEqual(rc, 1, err)
        self.assertEqual(len(err.strip().splitlines()), 1, err)

    def test_usage_and_auth_errors_are_one_line_with_their_exit_codes(self):
        lease_file = os.path.join(self.dir, "lease.token")
        with open(lease_file, "w") as f:
            f.write(self.server.token("fleet") + "\n")
        # Listing is for any token of the tenant (its daemons see holders in refusals too);
        # revoking and the history are for admins.
        rc, _, err = self.mep("lease", "ls", "--server", self.server.url, "--token-file", lease_file)
        self.assertEqual(rc, 0, err)
        cases = [
            (["lease", "revoke", "x", "--server", self.server.url, "--token-file", lease_file], 7),
            (["lease", "history", "x", "--server", self.server.url, "--token-file", lease_file], 7),
            (["lease", "ls", "--server", self.server.url, "--token-file", "/nonexistent"], 2),
            (["lease", "ls", "--server", "http://example.com:1", "--token-file", self.admin_file], 2),
            (["lease", "ls", "--server", "http://127.0.0.1:1", "--token-file", self.admin_file], 5),
            (["lease", "history", "x", "--since", "yesterday", "--server", self.server.url, "--token-file",
              self.admin_file], 2),
            (["lease"], 2),
        ]
        for argv, code in cases:
            with self.subTest(argv=argv):
                rc, out, err = self.mep(*argv)
                self.assertEqual(rc, code, err)
                self.assertTrue(err.startswith("mep: "), err)

    def test_max_hold_ends_a_run_that_holds_too_long(self):
        name = "capped-" + uuid7()[-8:]
        p = subprocess.Popen([mep_bin(), "--socket", self.host_a.socket_path, "run", "--ttl", "5", "--max-hold", "6",
                              name, self.memory(self.host_a), "--", "sleep", "120"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env)
        self.popens.append(p)
        _, err = p.communicate(timeout=60)
        self.assertEqual(p.returncode, 4, err)
        self.assertIn(b"lost (max-hold)", err)
        # Its renewal was refused, its lease not ended: the daemon releases it once it sees
        # mep run gone (its log says so), and the name leaves the fleet's list. (Not timed:
        # waiting for the expiry instead would free the name as well, a few seconds later,
        # but the daemon's line would be missing.)
        def listed():
            rc, out, _ = self.lease_cmd("ls", "--json")
            self.assertEqual(rc, 0)
            return name in [l["canonical_name"] for l in json.loads(out)["leases"]]
        deadline = time.monotonic() + 30
        while listed():
            self.assertLess(time.monotonic(), deadline, "the lease is still listed")
            time.sleep(0.05)
        deadline = time.monotonic() + 30
        while "agent process exited; released %s" % name not in self.host_a.log_text():
            self.assertLess(time.monotonic(), deadline, self.host_a.log_text()[-2000:])
            time.sleep(0.05)


class Dashboards(unittest.TestCase):
    """The Grafana dashboard and the alert rules (packaging/) use only metrics that a running
    mep server and mep store really export, so neither shows an empty panel or an alert
    that can never fire for a name that does not exist."""

    def test_every_query_names_an_exported_metric(self):
        src = os.environ.get("MEP_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
        tmp = tempfile.TemporaryDirectory(prefix="mep-dash-")
        self.addCleanup(tmp.cleanup)
        env = clean_env(tmp.name)
        server = DaemonServer(tmp.name, env).start()
        self.addCleanup(server.stop)
        token = server.token("dash")
        _, hashes = new_store_token(tmp.name)
        store = MepStore(tmp.name, os.path.join(tmp.name, "data"), ["--token-file", hashes]).start()
        self.addCleanup(store.stop)
        exported = {"up"}
        for port in (server.port, store.port):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
            conn.close()
            for line in text.splitlines():
                m = re.match(r"# TYPE (\S+) (\S+)", line)
                if not m:
                    continue
                exported.add(m.group(1))
                if m.group(2) == "histogram":
                    exported.update(m.group(1) + s for s in ("_bucket", "_sum", "_count"))
        self.assertIn("mep_lease_hold_seconds_bucket", exported)
        self.assertIn("mep_store_bytes_written_total", exported)
        exprs = []
        with open(os.path.join(src, "packaging", "grafana", "mep.json"), encoding="utf-8") as f:
            dash = json.load(f)

        def walk(node):
            if isinstance(node, dict):
                if isinstance(node.get("expr"), str):
                    exprs.append(("dashboard", node["expr"]))
                if isinstance(node.get("query"), str) and "mep_" in node["query"]:
                    exprs.append(("dashboard variable", node["query"]))
                for v in node.values():
                    walk(v)
            elif isinstance(node, list):
                for v in node:
                    walk(v)
        walk(dash)
        with open(os.path.join(src, "packaging", "prometheus", "mep-rules.yml"), encoding="utf-8") as f:
            lines = f.read().splitlines()
        for i, line in enumerate(lines):  # `expr: TEXT`, or a block scalar (`expr: |-`) below it
            m = re.match(r"^(\s+)expr: (.*)$", line)
            if not m:
                continue
            if m.group(2).strip() not in ("|", "|-", ">", ">-"):
                exprs.append(("rules", m.group(2)))
                continue
            block = []
            for more in lines[i + 1:]:
                if more.strip() and len(more) - len(more.lstrip()) <= len(m.group(1)):
                    break
                block.append(more.strip())
            exprs.append(("rules", " ".join(block)))
        self.assertGreater(len([e for e in exprs if e[0] == "dashboard"]), 20)
        self.assertGreater(len([e for e in exprs if e[0] == "rules"]), 8)
        for where, expr in exprs:
            names = set(re.findall(r"\b(mep_[a-z0-9_]+|up)\b", expr))
            self.assertTrue(names, "%s: %s names no metric" % (where, expr))
            self.assertLessEqual(names, exported, "%s: %s" % (where, expr))
