"""`mep canonicalize` end to end (SPEC §5, §7): output lines in human and --json mode, exit
codes, --profile, --explain, and names on stdin (`-`) including hostile input. Runs the real
binary from $MEP_BIN."""
import json
import unittest

from mephelpers import mep_bin, run

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_INVALID_NAME = 6

VALID_KEYS = ["input", "canonical_name", "skeleton", "scripts"]
ERROR_KEYS = ["input", "error"]


def canonicalize(*args, stdin=b"", timeout=60):
    """Runs `mep canonicalize ARGS...`; returns (rc, stdout bytes, stderr bytes)."""
    return run([mep_bin(), "canonicalize", *args], stdin=stdin, timeout=timeout)


def lines_of(stdout):
    """Output lines split on b"\\n" only (str.splitlines would also split on U+2028, \\v,
    \\f, … which may legitimately appear inside a name); the output must end with one."""
    if not stdout:
        return []
    assert stdout.endswith(b"\n"), "output does not end with a newline: %r" % stdout[-80:]
    return stdout[:-1].split(b"\n")


def json_lines(stdout):
    """Every output line parsed with json.loads (each must be one JSON object)."""
    out = []
    for i, line in enumerate(lines_of(stdout)):
        try:
            obj = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise AssertionError("line %d is not JSON (%s): %r" % (i, e, line[:200])) from e
        assert isinstance(obj, dict), "line %d is not an object: %r" % (i, line[:200])
        out.append(obj)
    return out


class HumanOutput(unittest.TestCase):
    def test_valid_name_line(self):
        rc, out, err = canonicalize("My Agent")
        self.assertEqual(rc, EXIT_OK, err)
        self.assertEqual(out, "myagent  skeleton=rnyagent  script=Latin\n".encode())
        self.assertEqual(err, b"")

    def test_disallowed_character_line(self):
        rc, out, err = canonicalize("agent!")
        self.assertEqual(rc, EXIT_INVALID_NAME)
        self.assertEqual(out, b"error: disallowed character U+0021 '!' at index 5\n")
        self.assertEqual(err, b"")

    def test_one_line_per_name_in_order_and_exit_6_if_any_invalid(self):
        rc, out, _ = canonicalize("My Agent", "agent!", "ΟΔΟΣ")
        self.assertEqual(rc, EXIT_INVALID_NAME)
        self.assertEqual(lines_of(out), [
            "myagent  skeleton=rnyagent  script=Latin".encode(),
            b"error: disallowed character U+0021 '!' at index 5",
            "οδος  skeleton=oẟoς  script=Greek".encode(),
        ])

    def test_all_valid_exits_0(self):
        rc, out, _ = canonicalize("alpha", "Beta 2", "ＭｙＡｇｅｎｔ")
        self.assertEqual(rc, EXIT_OK)
        self.assertEqual(len(lines_of(out)), 3)


class JsonOutput(unittest.TestCase):
    def test_valid_shape(self):
        rc, out, err = canonicalize("--json", "My Agent")
        self.assertEqual(rc, EXIT_OK, err)
        [obj] = json_lines(out)
        self.assertEqual(list(obj), VALID_KEYS)
        self.assertEqual(obj, {"input": "My Agent", "canonical_name": "myagent",
                               "skeleton": "rnyagent", "scripts": ["Latin"]})

    def test_invalid_shape(self):
        rc, out, _ = canonicalize("--json", "agent!")
        self.assertEqual(rc, EXIT_INVALID_NAME)
        [obj] = json_lines(out)
        self.assertEqual(list(obj), ERROR_KEYS)
        self.assertEqual(list(obj["error"]), ["reason", "codepoint", "index"])
        self.assertEqual(obj, {"input": "agent!", "error": {
            "reason": "disallowed-character", "codepoint": "U+0021", "index": 5}})

    def test_global_json_flag_before_the_command(self):
        rc, out, _ = run([mep_bin(), "--json", "canonicalize", "My Agent"])
        self.assertEqual(rc, EXIT_OK)
        self.assertEqual(json_lines(out)[0]["canonical_name"], "myagent")

    def test_spec_examples(self):
        # SPEC §5's table; `None` leaves the member unchecked.
        cases = [
            ("My Agent", "myagent", None),
            ("ＭｙＡｇｅｎｔ", "myagent", None),
            ("\u2126", "\u03c9", None),
            ("ΟΔΟΣ", "οδο\u03c2", None),
            ("e\u0301", "\u00e9", None),
            ("\ufb01le", None, {"reason": "disallowed-character", "codepoint": "U+FB01",
                                "index": 0}),
            ("agent!", None, {"reason": "disallowed-character", "codepoint": "U+0021",
                              "index": 5}),
            ("bot\U0001F600", None, {"reason": "disallowed-character", "codepoint": "U+1F600",
                                     "index": 3}),
            ("agent\u200d", None, {"reason": "context-rule", "codepoint": "U+200D", "index": 5}),
            ("my\u0430gent", None, {"reason": "mixed-script"}),
            ("раура", "раура", None),
            ("Straße", "straße", None),
            ("STRASSE", "strasse", None),
            ("", None, {"reason": "empty"}),
            ("   ", None, {"reason": "empty"}),
            ("a" * 65, None, {"reason": "too-long"}),
        ]
        rc, out, _ = canonicalize("--json", *[c[0] for c in cases])
        self.assertEqual(rc, EXIT_INVALID_NAME)
        objs = json_lines(out)
        self.assertEqual(len(objs), len(cases))
        for (name, canonical, error), obj in zip(cases, objs):
            with self.subTest(name=name):
                self.assertEqual(obj["input"], name)
                if canonical is not None:
                    self.assertEqual(list(obj), VALID_KEYS)
                    self.assertEqual(obj["canonical_name"], canonical)
                else:
                    self.assertEqual(list(obj), ERROR_KEYS)
                    self.assertEqual(obj["error"], error)

    def test_hebrew_after_latin_is_rejected(self):
        rc, out, _ = canonicalize("--json", "abcאבג")
        self.assertEqual(rc, EXIT_INVALID_NAME)
        self.assertIn(json_lines(out)[0]["error"]["reason"], ("mixed-script", "bidi-rule"))

    def test_confusables_share_a_skeleton(self):
        rc, out, _ = canonicalize("--json", "раура", "paypa", "agent_1", "agent_l")
        self.assertEqual(rc, EXIT_OK)
        cyr, lat, one, ell = json_lines(out)
        self.assertEqual(cyr["scripts"], ["Cyrillic"])
        self.assertEqual(cyr["skeleton"], lat["skeleton"])
        self.assertNotEqual(cyr["canonical_name"], lat["canonical_name"])
        self.assertEqual(one["skeleton"], ell["skeleton"])
        self.assertNotEqual(one["canonical_name"], ell["canonical_name"])


class UsageErrors(unittest.TestCase):
    def assert_usage(self, *args):
        rc, out, err = canonicalize(*args)
        self.assertEqual(rc, EXIT_USAGE, (args, out, err))
        self.assertEqual(out, b"")
        self.assertNotEqual(err, b"")

    def test_no_names(self):
        self.assert_usage()

    def test_no_names_json(self):
        self.assert_usage("--json")

    def test_unknown_flag(self):
        self.assert_usage("--frobnicate", "agent")

    def test_bad_profile(self):
        self.assert_usage("--profile", "bogus", "agent")

    def test_profile_without_value(self):
        self.assert_usage("agent", "--profile")


class Profiles(unittest.TestCase):
    def test_usernamecasemapped_keeps_punctuation(self):
        rc, out, err = canonicalize("--profile", "usernamecasemapped", "agent!")
        self.assertEqual(rc, EXIT_OK, err)
        self.assertEqual(out, b"agent!\n")

    def test_usernamecasemapped_rejects_space(self):
        rc, out, _ = canonicalize("--profile", "usernamecasemapped", "--json", "My Agent")
        self.assertEqual(rc, EXIT_INVALID_NAME)
        [obj] = json_lines(out)
        self.assertEqual(obj["input"], "My Agent")
        self.assertEqual(obj["error"], {"reason": "disallowed-character", "codepoint": "U+0020",
                                        "index": 2})

    def test_usernamecasemapped_json_valid(self):
        rc, out, _ = canonicalize("--profile", "usernamecasemapped", "--json", "ＡＢＣ", "Ω")
        self.assertEqual(rc, EXIT_OK)
        objs = json_lines(out)
        self.assertEqual([o["canonical_name"] for o in objs], ["abc", "\u03c9"])

    def test_agent_profile_is_the_default(self):
        _, default, _ = canonicalize("--json", "agent!", "My Agent")
        _, agent, _ = canonicalize("--json", "--profile", "agent", "agent!", "My Agent")
        self.assertEqual(default, agent)


class Explain(unittest.TestCase):
    def test_human_steps_then_result(self):
        rc, out, _ = canonicalize("--explain", "My Agent")
        self.assertEqual(rc, EXIT_OK)
        lines = lines_of(out)
        steps = [line for line in lines if line.startswith(b"  ")]
        self.assertGreaterEqual(len(steps), 3)
        self.assertEqual(lines[-1], "myagent  skeleton=rnyagent  script=Latin".encode())
        self.assertIn(b"  input: My Agent", lines)
        self.assertTrue(any(line.endswith(b": MyAgent") for line in steps), steps)
        self.assertTrue(any(line.endswith(b": rnyagent") for line in steps), steps)

    def test_json_steps(self):
        rc, out, _ = canonicalize("--explain", "--json", "ＭｙＡｇｅｎｔ")
        self.assertEqual(rc, EXIT_OK)
        [obj] = json_lines(out)
        self.assertEqual(list(obj)[:4], VALID_KEYS)
        self.assertEqual(obj["canonical_name"], "myagent")
        steps = obj["steps"]
        self.assertTrue(all(list(s) == ["step", "value"] for s in steps), steps)
        values = [s["value"] for s in steps]
        self.assertEqual(values[0], "ＭｙＡｇｅｎｔ")
        self.assertIn("myagent", values)
        self.assertEqual(values[-1], "rnyagent")

    def test_explain_invalid_name_ends_with_the_error(self):
        rc, out, _ = canonicalize("--explain", "My Agent!")
        self.assertEqual(rc, EXIT_INVALID_NAME)
        lines = lines_of(out)
        self.assertEqual(lines[-1], b"error: disallowed character U+0021 '!' at index 8")
        self.assertIn(b"  input: My Agent!", lines)

    def test_explain_json_invalid(self):
        rc, out, _ = canonicalize("--explain", "--json", "agent!")
        self.assertEqual(rc, EXIT_INVALID_NAME)
        [obj] = json_lines(out)
        self.assertEqual(obj["error"]["codepoint"], "U+0021")
        self.assertEqual(obj["steps"][0], {"step": "input", "value": "agent!"})


class Stdin(unittest.TestCase):
    def test_many_names_in_order(self):
        names = []
        for i in range(10_000):
            if i % 10 == 3:
                names.append("bad name %d!" % i)      # invalid: '!'
            elif i % 10 == 7:
                names.append("Ωμέγα %d" % i)          # Greek with a space
            else:
                names.append("Agent-%d" % i)
        stdin = "".join(n + "\n" for n in names).encode()
        rc, out, err = canonicalize("--json", "-", stdin=stdin)
        self.assertEqual(rc, EXIT_INVALID_NAME, err[:500])
        objs = json_lines(out)
        self.assertEqual(len(objs), len(names))
        for i, (name, obj) in enumerate(zip(names, objs)):
            self.assertEqual(obj["input"], name, i)
            if i % 10 == 3:
                self.assertEqual(obj["error"], {"reason": "disallowed-character",
                                                "codepoint": "U+0021", "index": len(name) - 1})
            elif i % 10 == 7:
                self.assertEqual(obj["canonical_name"], "ωμέγα%d" % i)
            else:
                self.assertEqual(obj["canonical_name"], "agent-%d" % i)

    def test_many_names_human_one_line_each(self):
        names = ["agent%d" % i for i in range(10_000)]
        rc, out, _ = canonicalize("-", stdin="\n".join(names).encode())
        self.assertEqual(rc, EXIT_OK)
        lines = lines_of(out)
        self.assertEqual(len(lines), len(names))
        self.assertEqual(lines[9_999], b"agent9999  skeleton=agent9999  script=Latin")

    def test_empty_stdin_has_no_lines(self):
        rc, out, _ = canonicalize("--json", "-", stdin=b"")
        self.assertEqual(rc, EXIT_OK)
        self.assertEqual(out, b"")

    def test_arguments_and_stdin_keep_their_order(self):
        rc, out, _ = canonicalize("--json", "first", "-", "last", stdin=b"two\nthree\n")
        self.assertEqual(rc, EXIT_OK)
        self.assertEqual([o["input"] for o in json_lines(out)],
                         ["first", "two", "three", "last"])

    # Hostile lines: each gets exactly one result line, with the right reason.
    BIG = b"z" * (10 * 1024 * 1024)
    HOSTILE = [
        # (bytes of the line, expected "input", expected canonical_name or error object)
        (b"good", "good", "good"),
        (b"ab\xffcd", "ab\ufffdcd", {"reason": "invalid-utf8", "index": 2}),
        (b"\xc0\xafx", "\ufffd\ufffdx", {"reason": "invalid-utf8", "index": 0}),
        (b"x\x00y", "x\x00y", {"reason": "disallowed-character", "codepoint": "U+0000",
                               "index": 1}),
        (b"\x00", "\x00", {"reason": "disallowed-character", "codepoint": "U+0000",
                           "index": 0}),
        (BIG, "z" * len(BIG), {"reason": "too-long"}),
        (b"", "", {"reason": "empty"}),
        (b"crlf\r", "crlf", "crlf"),
        (b"\r", "", {"reason": "empty"}),
        (b"tab\there", "tab\there", {"reason": "disallowed-character", "codepoint": "U+0009",
                                     "index": 3}),
        (b"v\x0bf\x0c", "v\x0bf\x0c", {"reason": "disallowed-character",
                                       "codepoint": "U+000B", "index": 1}),
        ("a\u2028b".encode(), "a\u2028b", {"reason": "disallowed-character",
                                           "codepoint": "U+2028", "index": 1}),
        ("a\u0085b".encode(), "a\u0085b", {"reason": "disallowed-character",
                                           "codepoint": "U+0085", "index": 1}),
        (b"last", "last", "last"),  # the final line, sent without "\n"
    ]

    def hostile_stdin(self):
        return b"\n".join(line for line, _, _ in self.HOSTILE)

    def test_hostile_lines_json(self):
        rc, out, err = canonicalize("--json", "-", stdin=self.hostile_stdin())
        self.assertEqual(rc, EXIT_INVALID_NAME, err[:500])
        objs = json_lines(out)
        self.assertEqual(len(objs), len(self.HOSTILE))
        for (line, inp, expected), obj in zip(self.HOSTILE, objs):
            with self.subTest(line=line[:40]):
                self.assertEqual(obj["input"], inp)
                if isinstance(expected, str):
                    self.assertEqual(obj["canonical_name"], expected)
                else:
                    self.assertEqual(obj["error"], expected)

    def test_hostile_lines_human(self):
        rc, out, _ = canonicalize("-", stdin=self.hostile_stdin())
        self.assertEqual(rc, EXIT_INVALID_NAME)
        lines = lines_of(out)
        self.assertEqual(len(lines), len(self.HOSTILE))
        for (line, _, expected), got in zip(self.HOSTILE, lines):
            with self.subTest(line=line[:40]):
                if isinstance(expected, str):
                    self.assertTrue(got.startswith(expected.encode() + b"  skeleton="), got)
                else:
                    self.assertTrue(got.startswith(b"error: "), got[:200])
        self.assertEqual(lines[1], b"error: invalid UTF-8 at byte 2")
        self.assertEqual(lines[3], b"error: disallowed character U+0000 at index 1")
        self.assertTrue(lines[5].startswith(b"error: name too long"), lines[5][:200])
        self.assertEqual(lines[6], b"error: empty name")

    def test_each_hostile_line_alone(self):
        # Alone, and as the last line without a newline: one result line, never a hang.
        for line, inp, expected in self.HOSTILE:
            for stdin in (line + b"\n", line):
                with self.subTest(line=line[:40], newline=stdin.endswith(b"\n")):
                    rc, out, _ = canonicalize("--json", "-", stdin=stdin)
                    if stdin == b"":
                        self.assertEqual((rc, out), (EXIT_OK, b""))  # no line at all
                        continue
                    [obj] = json_lines(out)
                    self.assertEqual(obj["input"], inp)
                    valid = isinstance(expected, str)
                    self.assertEqual(rc, EXIT_OK if valid else EXIT_INVALID_NAME)

    def test_crlf_everywhere(self):
        rc, out, _ = canonicalize("--json", "-", stdin=b"One\r\nTwo Words\r\nthree\r\n")
        self.assertEqual(rc, EXIT_OK)
        self.assertEqual([o["canonical_name"] for o in json_lines(out)],
                         ["one", "twowords", "three"])

    def test_crlf_split_across_read_blocks(self):
        # The CLI reads stdin in 1 MiB blocks: put the "\r" last in one and the "\n" first
        # in the next, and a multi-byte character across the following boundary.
        first = b"x" * (2**20 - 1)
        second = b"y" * (2 * 2**20 - 1 - len(first + b"\r\nafter\n")) + "é".encode()
        stdin = first + b"\r\n" + b"after\n" + second + b"\n"
        rc, out, _ = canonicalize("--json", "-", stdin=stdin)
        self.assertEqual(rc, EXIT_INVALID_NAME)
        objs = json_lines(out)
        self.assertEqual([o["input"] for o in objs],
                         [first.decode(), "after", second.decode()])
        self.assertEqual(objs[0]["error"], {"reason": "too-long"})
        self.assertEqual(objs[1]["canonical_name"], "after")

    def test_invalid_utf8_argument(self):
        rc, out, _ = run([mep_bin(), "canonicalize", "--json", b"a\xfe"])
        self.assertEqual(rc, EXIT_INVALID_NAME)
        [obj] = json_lines(out)
        self.assertEqual(obj, {"input": "a\ufffd", "error": {"reason": "invalid-utf8",
                                                             "index": 1}})


if __name__ == "__main__":
    unittest.main()
