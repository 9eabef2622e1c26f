"""The SDK held to mepd's socket API as recorded: tests/contract/daemon_api.json holds one
request per route with the answer mepd's real request handler gave it (recorded by the C++
suite, tests/unit/daemon/daemon_api_contract_test.cpp, which fails when the handler answers
otherwise) and the event lines its keeper writes. Each answer is decoded here with the type
the SDK uses for it: every member the type has must come from the answer with its value, a
member the daemon does not send must be optional in the type, and a member the daemon sends
that the type lacks must be listed below as read elsewhere. The routes the SDK calls must be
routes the daemon serves, and each recorded route must be one the SDK calls."""
import dataclasses
import datetime
import json
import os
import re
import typing
import unittest

from . import SOURCE_ROOT  # puts the source tree on sys.path

from mep import types

CONTRACT = os.path.join(SOURCE_ROOT, "..", "..", "tests", "contract", "daemon_api.json")

# The SDK type each recorded exchange decodes to (detach answers 204: no body).
DECODES = {
    "attach": types.LeaseInfo, "lease": types.LeaseInfo, "branch": types.BranchResult,
    "init": types.MemoryIdentity, "identify": types.MemoryIdentity, "lineage": types.Lineage,
    "verify": types.VerifyResult, "sync": types.SyncResult, "fetch": types.FetchResult,
}
# Members the daemon sends that a type does not carry, and where the SDK reads them instead.
READ_ELSEWHERE = {
    ("LeaseInfo", "granted_after_ms"): "Client.attach reads it from .raw (the local deadline after a wait)",
}
# Routes the SDK calls that carry no recorded JSON exchange (see the C++ test's k_unrecorded).
UNRECORDED = {"GET /v1/events", "GET /healthz"}


def _is_optional(tp) -> bool:
    return type(None) in typing.get_args(tp)


def _plain(value):
    """An SDK value as the JSON value it came from (datetimes back to RFC 3339 with ms)."""
    if isinstance(value, datetime.datetime):
        return value.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.") + \
            "%03dZ" % (value.microsecond // 1000)
    return value


class ContractTest(unittest.TestCase):
    def setUp(self):
        if not os.path.exists(CONTRACT):
            self.skipTest("tests/contract/daemon_api.json is not beside this SDK: not a source checkout")
        with open(CONTRACT, encoding="utf-8") as f:
            self.contract = json.load(f)

    def assertDecodes(self, cls, answer):
        obj = cls.from_json(answer)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name == "raw":
                continue
            with self.subTest(type=cls.__name__, member=f.name):
                if f.name in answer:
                    self.assertEqual(_plain(getattr(obj, f.name)), answer[f.name])
                else:
                    self.assertTrue(_is_optional(hints[f.name]),
                                    "%s.%s is required but mepd does not send it" % (cls.__name__, f.name))
        names = {f.name for f in dataclasses.fields(cls)}
        for key in answer:
            with self.subTest(type=cls.__name__, sent=key):
                self.assertTrue(key in names or (cls.__name__, key) in READ_ELSEWHERE,
                                "mepd sends %r, which %s does not carry" % (key, cls.__name__))

    def test_every_recorded_answer_decodes_to_its_type(self):
        seen = set()
        for ex in self.contract["exchanges"]:
            name, answer = ex["name"], ex["response"]
            seen.add(name)
            if name == "detach":
                self.assertIsNone(answer)
                self.assertEqual(ex["status"], 204)
            elif name == "leases":
                self.assertTrue(answer["leases"])
                for lease in answer["leases"]:
                    self.assertDecodes(types.LeaseInfo, lease)
            else:
                self.assertIn(name, DECODES, "a recorded exchange this test does not decode: %s" % name)
                self.assertDecodes(DECODES[name], answer)
        self.assertEqual(seen, set(DECODES) | {"detach", "leases"})

    def test_every_recorded_event_line_decodes(self):
        kinds = set()
        for line in self.contract["events"]:
            kinds.add(line["event"])
            self.assertDecodes(types.Event, line)
        self.assertEqual(kinds, {"granted", "renewed", "degraded", "lost", "released"})

    def test_the_sdk_calls_the_routes_mepd_serves(self):
        """The routes are written once, in mep/_calls.py (the sans-I/O core); the attach of
        acquire() and the detach go out from the faces themselves. Each face (client.py,
        aio.py) must reach every recorded route, and nothing mepd does not serve."""
        recorded = {ex["route"] for ex in self.contract["exchanges"]}

        def routes(*modules):
            found = set()
            for module in modules:
                with open(os.path.join(SOURCE_ROOT, "mep", module), encoding="utf-8") as f:
                    text = f.read()
                for method, path in re.findall(r'"(GET|POST)",\s*"(/[a-z0-9/]*)', text):
                    found.add("%s %s" % (method, "/v1/leases/{name}" if path == "/v1/leases/" else path))
                if "/v1/events" in text:
                    found.add("GET /v1/events")
            return found

        core = routes("_calls.py")
        self.assertTrue(core, "no route found in mep/_calls.py")
        for face in ("client.py", "aio.py"):
            called = core | routes(face, "lease.py")
            with self.subTest(face=face):
                self.assertEqual(called - recorded - UNRECORDED, set(), "calls to routes mepd does not serve")
                self.assertEqual(recorded - called, set(), "recorded routes this face does not call")

    def test_both_faces_build_their_calls_in_the_core(self):
        """Client and AsyncClient send the same calls, built by the same functions of
        mep/_calls.py: a call added to one face only fails here."""
        import inspect
        from mep import _calls
        builders = {name for name, fn in vars(_calls).items()
                    if inspect.isfunction(fn) and not name.startswith("_")
                    and inspect.signature(fn).return_annotation in ("Call", _calls.Call)}
        self.assertTrue(builders)
        for face in ("client.py", "aio.py"):
            with open(os.path.join(SOURCE_ROOT, "mep", face), encoding="utf-8") as f:
                used = set(re.findall(r"_calls\.(\w+)\(", f.read()))
            with self.subTest(face=face):
                self.assertEqual(builders - used, set(), "calls of the core this face does not offer")


if __name__ == "__main__":
    unittest.main()
