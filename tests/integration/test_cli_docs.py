"""The documentation and packaging of mep (issue 6): the man pages lint clean and document
every flag the binaries' --help lists; the bash completion lists every command and flag (and
the zsh and fish ones parse); the systemd units verify; and, in a ctest test of its own
(`python -m unittest test_cli_docs.DebPackage`, slow), the .deb builds with the expected
files and lintian reports no errors.

Needs $MEP_BIN, $MEPD_BIN, $MEP_SOURCE_DIR and $MEP_BUILD_DIR (ctest sets them). Standard
library only; every command runs with a timeout."""
import gzip
import os
import re
import shutil
import subprocess
import tempfile
import unittest

from mephelpers import mep_bin

COMMAND_TIMEOUT_S = 60
CPACK_TIMEOUT_S = 600
LINTIAN_TIMEOUT_S = 240

MAN1 = ["mep", "mep-claim", "mep-run", "mep-release", "mep-init", "mep-branch", "mep-status",
        "mep-identify", "mep-lineage", "mep-sync", "mep-fetch", "mep-canonicalize", "mep-config", "mep-token",
        "mep-lease", "mep-mcp"]
MAN8 = ["mepd", "mep-server", "mep-store", "mep-migrate"]

# Each command path of `mep` (as typed) and the page that documents it.
COMMAND_PAGES = {
    (): "mep.1",
    ("claim",): "mep-claim.1", ("run",): "mep-run.1", ("release",): "mep-release.1",
    ("init",): "mep-init.1", ("branch",): "mep-branch.1", ("status",): "mep-status.1",
    ("identify",): "mep-identify.1", ("lineage",): "mep-lineage.1", ("sync",): "mep-sync.1",
    ("fetch",): "mep-fetch.1",
    ("canonicalize",): "mep-canonicalize.1", ("config",): "mep-config.1",
    ("token", "create"): "mep-token.1", ("token", "list"): "mep-token.1",
    ("token", "revoke"): "mep-token.1", ("token", "new"): "mep-token.1", ("token", "hash"): "mep-token.1",
    ("lease", "ls"): "mep-lease.1", ("lease", "show"): "mep-lease.1", ("lease", "revoke"): "mep-lease.1",
    ("lease", "history"): "mep-lease.1",
    ("mcp",): "mep-mcp.1",
    ("store",): "mep-store.8",
    ("server",): "mep-server.8", ("server", "audit"): "mep-server.8",
    ("migrate", "plan"): "mep-migrate.8", ("migrate", "run"): "mep-migrate.8",
    ("migrate", "activate"): "mep-migrate.8", ("migrate", "status"): "mep-migrate.8",
}
GROUPS = {"token": ["create", "list", "new", "hash", "revoke"], "server": ["audit"],
          "migrate": ["plan", "run", "activate", "status"], "lease": ["ls", "show", "revoke", "history"]}
EXIT_CODES = range(0, 8)
ENVIRONMENT = ["MEP_SOCKET", "MEP_CONTROL_PLANE", "MEP_TOKEN", "MEP_TOKEN_FILE", "MEP_STATE_DIR", "MEP_SERVER",
               "MEP_ANONYMOUS_HOLDER",
               "MEP_DB", "XDG_CONFIG_HOME", "XDG_STATE_HOME", "XDG_RUNTIME_DIR"]
RUN_VARIABLES = ["MEP_CANONICAL_NAME", "MEP_MEMORY_INSTANCE_ID", "MEP_FENCING_TOKEN", "MEP_LEASE_ID",
                 "MEP_LEASE_EXPIRES_AT"]

LONG_FLAG_RE = re.compile(r"(?<![\w-])(--[a-z][a-z-]*)")


def env_dir(name):
    path = os.environ.get(name)
    if not path:
        raise unittest.SkipTest("%s is not set (run through ctest)" % name)
    return path


def mepd_bin():
    return env_dir("MEPD_BIN")


def check_output(argv, timeout=COMMAND_TIMEOUT_S, env=None, cwd=None):
    """Runs argv; returns (rc, stdout str, stderr str)."""
    p = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       timeout=timeout, env=env, cwd=cwd, check=False)
    return p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")


def help_text(argv):
    rc, out, err = check_output(argv + ["--help"])
    assert rc == 0, "%s --help exited %d: %s" % (" ".join(argv), rc, err)
    return out


def option_lines(text):
    """The lines of an --help text's Options section that start an option."""
    in_options = False
    for line in text.splitlines():
        if re.match(r"^(Options|Positionals|Subcommands):", line):
            in_options = line.startswith("Options")
        elif in_options and re.match(r"^  +-", line):
            yield line


def help_flags(text):
    """The long options an --help text lists in its Options section (not --help itself)."""
    flags = set()
    for line in option_lines(text):
        # "  --ttl INT=30    Lease TTL …": the flags come before the first double space.
        flags.update(LONG_FLAG_RE.findall(line.split("  ", 2)[1]))
    flags.discard("--help")
    return flags


def help_valued_flags(text):
    """The long options an --help text lists with a value ("--ttl INT=30", "--db TEXT")."""
    matches = (re.match(r"^  +(?:-\w,)?(--[a-z][a-z-]*) [A-Z]", line) for line in option_lines(text))
    return {m.group(1) for m in matches if m}


def help_defaults(text):
    """{flag: default} for the options an --help text shows with a default (`--ttl INT=30`)."""
    defaults = {}
    in_options = False
    for line in text.splitlines():
        if re.match(r"^(Options|Positionals|Subcommands):", line):
            in_options = line.startswith("Options")
            continue
        if not in_options or not re.match(r"^  +-", line):
            continue
        # "  --threads INT:INT in [1 - 64]=2": the default ends the part before the first
        # double space.
        m = re.match(r"^(?:-\w,)?(--[a-z][a-z-]*) .*=(\S+)$", line.split("  ", 2)[1])
        if m:
            defaults[m.group(1)] = m.group(2)
    return defaults


def definition(source, flag):
    """The paragraph of an scdoc definition list that defines `flag` (its term line, which
    names it in bold, and the indented lines below), or None."""
    lines = source.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^\*(-\w\*, \*)?--", line) and "*%s*" % flag in line:
            body = [line]
            for more in lines[i + 1:]:
                if not more.startswith("\t"):
                    break
                body.append(more)
            return " ".join(body).replace("*", "").replace("_", "")
    return None


def help_subcommands(text):
    """The names an --help text lists under Subcommands."""
    names, inside = [], False
    for line in text.splitlines():
        if line.startswith("Subcommands:"):
            inside = True
            continue
        if inside:
            m = re.match(r"^  (\S+)\s", line)
            if m:
                names.append(m.group(1))
            elif line.strip() and not line.startswith("  "):
                inside = False
    return names


def page_source(page):
    with open(os.path.join(env_dir("MEP_SOURCE_DIR"), "man", page + ".scd"), encoding="utf-8") as f:
        return f.read()


def section_of(source, title):
    """The text of `# TITLE` in an scdoc page, up to the next section."""
    m = re.search(r"^# %s\n(.*?)(?=^# |\Z)" % re.escape(title), source, re.S | re.M)
    assert m, "no section %s" % title
    return m.group(1)


def bash_complete(words, function="_mep"):
    """What the bash completion offers with the cursor on the last of `words`."""
    script = os.path.join(env_dir("MEP_SOURCE_DIR"), "completions", "mep.bash")
    array = " ".join("'%s'" % w.replace("'", "'\\''") for w in words)
    cmd = ('source "$1"; COMP_WORDS=(%s); COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); %s; '
           'printf "%%s\\n" "${COMPREPLY[@]}"' % (array, function))
    rc, out, err = check_output(["bash", "--norc", "--noprofile", "-c", cmd, "bash", script])
    assert rc == 0 and not err, "bash completion failed (%d): %s" % (rc, err)
    return [w for w in out.split("\n") if w]


class ManPages(unittest.TestCase):
    """The pages built into $MEP_BUILD_DIR/man: present, lint-clean, and in step with --help."""

    def built_page(self, page):
        section = page.rsplit(".", 1)[1]
        path = os.path.join(env_dir("MEP_BUILD_DIR"), "man", "man" + section, page)
        if not os.path.exists(path) and shutil.which("scdoc") is None:
            self.skipTest("scdoc is not installed, so the pages are not built")
        self.assertTrue(os.path.exists(path), "%s was not built (build the `man` target)" % path)
        return path

    def all_pages(self):
        return [p + ".1" for p in MAN1] + [p + ".8" for p in MAN8]

    def test_every_page_is_built_and_compressed(self):
        for page in self.all_pages():
            path = self.built_page(page)
            with gzip.open(path + ".gz", "rb") as f, open(path, "rb") as plain:
                self.assertEqual(f.read(), plain.read(), page)
            with open(path + ".gz", "rb") as f:
                header = f.read(10)
            # gzip -n: no original name (FLG.FNAME) and no time stamp, for reproducible packages.
            self.assertEqual(header[3] & 0x08, 0, page)
            self.assertEqual(header[4:8], b"\0\0\0\0", page)

    def test_mandoc_lint_has_no_warnings(self):
        if shutil.which("mandoc") is None:
            self.skipTest("mandoc is not installed")
        for page in self.all_pages():
            rc, out, err = check_output(["mandoc", "-Tlint", "-W", "warning", self.built_page(page)])
            self.assertEqual((rc, out + err), (0, ""), page)

    def test_man_renders_without_warnings(self):
        if shutil.which("man") is None:
            self.skipTest("man is not installed")
        env = dict(os.environ, MANWIDTH="80", MAN_KEEP_FORMATTING="0")
        for page in self.all_pages():
            rc, out, err = check_output(["man", "--warnings=w", "-l", self.built_page(page)], env=env)
            self.assertEqual(rc, 0, page)
            self.assertEqual(err, "", page)
            self.assertIn("NAME", re.sub(".\b", "", out), page)  # without overstrike bold

    def test_every_command_has_a_page_and_is_listed_in_mep_1(self):
        commands = help_subcommands(help_text([mep_bin()]))
        self.assertGreaterEqual(len(commands), 13, commands)
        overview = section_of(page_source("mep.1"), "COMMANDS")
        for name in commands:
            self.assertIn("*%s*" % name, overview, name)
            self.assertTrue(any(path[:1] == (name,) for path in COMMAND_PAGES), "no page for mep " + name)
        for group, subs in GROUPS.items():
            self.assertEqual(help_subcommands(help_text([mep_bin(), group])), subs, group)

    def test_every_flag_of_every_command_is_documented(self):
        for path, page in COMMAND_PAGES.items():
            flags = help_flags(help_text([mep_bin(), *path]))
            self.assertTrue(flags or path in (("release",), ("init",), ("branch",), ("status",),
                                              ("identify",), ("config",), ("sync",), ("fetch",), ("token", "new"),
                                              ("token", "hash")), path)
            source = page_source(page)
            for flag in flags:
                self.assertTrue("*%s*" % flag in source, "mep %s %s is not in %s" % (" ".join(path), flag, page))

    def test_every_default_is_documented(self):
        checked = 0
        for path, page in COMMAND_PAGES.items():
            source = page_source(page)
            for flag, default in help_defaults(help_text([mep_bin(), *path])).items():
                text = definition(source, flag)
                self.assertIsNotNone(text, "no definition of %s in %s" % (flag, page))
                self.assertIn(default, text, "mep %s %s defaults to %s" % (" ".join(path), flag, default))
                checked += 1
        for flag, default in help_defaults(help_text([mepd_bin()])).items():
            self.assertIn(default, definition(page_source("mepd.8"), flag), flag)
            checked += 1
        self.assertGreaterEqual(checked, 12)

    def test_every_mepd_flag_is_documented(self):
        flags = help_flags(help_text([mepd_bin()]))
        self.assertGreaterEqual(flags, {"--socket", "--state-dir", "--control-plane", "--token-file", "--config",
                                        "--log-level", "--version"})
        source = page_source("mepd.8")
        for flag in flags:
            self.assertIn("*%s*" % flag, section_of(source, "OPTIONS"), flag)

    def test_exit_codes_environment_and_files_in_mep_1(self):
        source = page_source("mep.1")
        exits = section_of(source, "EXIT STATUS")
        for code in EXIT_CODES:
            self.assertRegex(exits, r"(?m)^\*%d\*$" % code)
        env = section_of(source, "ENVIRONMENT")
        for name in ENVIRONMENT + RUN_VARIABLES:
            self.assertIn(name, env)
        files = section_of(source, "FILES")
        for path in ("~/.config/mep/config.toml", "$XDG_RUNTIME_DIR/mep/mepd.sock", "/run/mep/mepd.sock"):
            self.assertIn(path, files)

    def test_mep_run_page_lists_the_child_environment_and_exit_4(self):
        source = page_source("mep-run.1")
        for name in RUN_VARIABLES:
            self.assertIn("*%s*" % name, section_of(source, "ENVIRONMENT"))
        self.assertRegex(section_of(source, "EXIT STATUS"), r"(?m)^\*4\*$")

    def test_help_footers(self):
        # The exit codes are listed; `mep run` points at `mep --help`, which exists; the footer
        # of `mep server` does not leak into `mep server audit`.
        self.assertIn("Exit status: 0 ok, 1 other error, 2 usage, 3 held/locked, 4 lost/stale/expired",
                      help_text([mep_bin()]))
        self.assertIn("else as 'mep --help'", help_text([mep_bin(), "run"]))
        self.assertIn("listening on", help_text([mep_bin(), "server"]))
        self.assertNotIn("listening on", help_text([mep_bin(), "server", "audit"]))

    def test_migrate_page_matches_the_binary(self):
        # mep-migrate(8) documents the built command; if the command ever goes away the page
        # has to say so.
        rc, out, _ = check_output([mep_bin(), "migrate", "--help"])
        built = rc == 0 and "plan" in help_subcommands(out)
        self.assertEqual("not built yet" in page_source("mep-migrate.8"), not built)


def valued_flag_cases():
    """(command path, an option it takes with a value, its other flags) for every such option."""
    cases = []
    for path in COMMAND_PAGES:
        if not path:
            continue
        text = help_text([mep_bin(), *path])
        flags = help_flags(text)
        cases += [(path, valued, flags - {valued}) for valued in sorted(help_valued_flags(text))]
    assert cases, "no command takes an option with a value?"
    return cases


class Completions(unittest.TestCase):
    """completions/: bash driven through its function; zsh and fish at least parse."""

    def test_bash_lists_the_commands(self):
        commands = help_subcommands(help_text([mep_bin()]))
        self.assertEqual(sorted(bash_complete(["mep", ""])), sorted(commands))
        self.assertEqual(bash_complete(["mep", "cla"]), ["claim"])

    def test_bash_lists_mep_run_flags(self):
        offered = bash_complete(["mep", "run", "--"])
        for flag in ("--ttl", "--on-loss", "--grace", "--json", "--socket"):
            self.assertIn(flag, offered)
        self.assertEqual(len(offered), len(set(offered)), offered)

    def test_bash_lists_every_flag_of_every_command(self):
        for path in COMMAND_PAGES:
            if not path:
                continue
            flags = help_flags(help_text([mep_bin(), *path]))
            offered = set(bash_complete(["mep", *path, "--"]))
            self.assertLessEqual(flags, offered, "mep %s" % " ".join(path))

    def test_bash_lists_subcommands(self):
        for group, subs in GROUPS.items():
            self.assertEqual(sorted(bash_complete(["mep", group, ""])), sorted(subs), group)

    def test_bash_completes_option_values(self):
        self.assertEqual(bash_complete(["mep", "run", "--on-loss", ""]), ["term", "kill", "ignore"])
        self.assertEqual(bash_complete(["mep", "lineage", "--format", "d"]), ["dot"])
        self.assertEqual(bash_complete(["mep", "lineage", "--format", "=", "j"]), ["json"])
        self.assertEqual(bash_complete(["mep", "--json", "run", "--on-loss=k"]), ["kill"])

    def test_bash_after_the_double_dash_completes_a_command(self):
        self.assertIn("bash", bash_complete(["mep", "run", "agent", "a.uai", "--", "bas"]))
        # Options and their values before the command do not count as positionals.
        self.assertEqual(bash_complete(["mep", "--socket", "/x", "run", "--ttl", "9", "agent", "a.uai", ""]), ["--"])

    def test_bash_mepd(self):
        flags = help_flags(help_text([mepd_bin()]))
        self.assertLessEqual(flags, set(bash_complete(["mepd", "--"], "_mepd")))
        self.assertEqual(bash_complete(["mepd", "--log-level", "w"], "_mepd"), ["warn"])

    def test_zsh_parses(self):
        if shutil.which("zsh") is None:
            self.skipTest("zsh is not installed")
        for name in ("_mep", "_mepd"):
            rc, _, err = check_output(["zsh", "-n", os.path.join(env_dir("MEP_SOURCE_DIR"), "completions", name)])
            self.assertEqual((rc, err), (0, ""), name)

    def test_fish_parses_and_lists_commands(self):
        if shutil.which("fish") is None:
            self.skipTest("fish is not installed")
        src = os.path.join(env_dir("MEP_SOURCE_DIR"), "completions")
        rc, out, err = check_output(["fish", "--no-config", "-c",
                                     "source %s/mep.fish; complete -C 'mep '" % src])
        self.assertEqual(rc, 0, err)
        offered = {line.split("\t")[0] for line in out.splitlines()}
        self.assertLessEqual(set(help_subcommands(help_text([mep_bin()]))), offered)
        rc, _, err = check_output(["fish", "--no-config", "-n", os.path.join(src, "mepd.fish")])
        self.assertEqual((rc, err), (0, ""))

    def test_bash_skips_every_option_value(self):
        for path, valued, others in valued_flag_cases():
            offered = set(bash_complete(["mep", *path, valued, "7", "--"]))
            self.assertLessEqual(others, offered, "mep %s %s 7 --" % (" ".join(path), valued))

    def test_fish_skips_every_option_value(self):
        # An option's value is not a command word: after "mep server --writer-nice 5" the
        # server's flags are still offered.
        if shutil.which("fish") is None:
            self.skipTest("fish is not installed")
        src = os.path.join(env_dir("MEP_SOURCE_DIR"), "completions", "mep.fish")
        cases = valued_flag_cases()
        script = "source %s; " % src + "; ".join(
            "echo '== %d'; complete -C 'mep %s %s 7 --'" % (i, " ".join(path), valued)
            for i, (path, valued, _) in enumerate(cases))
        rc, out, err = check_output(["fish", "--no-config", "-c", script])
        self.assertEqual(rc, 0, err)
        offered = {}
        for line in out.splitlines():
            if line.startswith("== "):
                current = offered.setdefault(int(line[3:]), set())
            else:
                current.add(line.split("\t")[0])
        for i, (path, valued, others) in enumerate(cases):
            self.assertLessEqual(others, offered.get(i, set()), "mep %s %s 7 --" % (" ".join(path), valued))


class SystemdUnits(unittest.TestCase):
    """packaging/: the units as installed (ExecStart filled in) pass systemd-analyze verify;
    the sysusers and tmpfiles snippets apply to a scratch root."""

    def installed_units(self, mode, bindir):
        src = os.path.join(env_dir("MEP_SOURCE_DIR"), "packaging", "systemd", mode)
        out = tempfile.mkdtemp(prefix="mep-units-")
        self.addCleanup(shutil.rmtree, out, True)
        names = sorted(os.listdir(src))
        for name in names:
            with open(os.path.join(src, name)) as f:
                text = f.read().replace("@MEP_BINDIR@", bindir)
            with open(os.path.join(out, name), "w") as f:
                f.write(text)
        return out, names

    def verify(self, mode, extra_env=None):
        if shutil.which("systemd-analyze") is None:
            self.skipTest("systemd-analyze is not installed")
        bindir = tempfile.mkdtemp(prefix="mep-bin-")
        self.addCleanup(shutil.rmtree, bindir, True)
        os.symlink(mep_bin(), os.path.join(bindir, "mep"))
        os.symlink(mepd_bin(), os.path.join(bindir, "mepd"))
        out, names = self.installed_units(mode, bindir)
        self.assertIn("mepd.service", names)
        self.assertIn("mepd.socket", names)
        argv = ["systemd-analyze"] + (["--user"] if mode == "user" else []) + ["verify", "--man=no"]
        env = dict(os.environ, **(extra_env or {}))
        rc, stdout, err = check_output(argv + ["./" + n for n in names], env=env, cwd=out)
        if "Failed to initialize manager" in err or "System has not been booted" in err:
            self.skipTest("systemd-analyze cannot run here: " + err.strip())
        self.assertEqual((rc, stdout + err), (0, ""), mode)
        return out

    def test_system_units_verify(self):
        out = self.verify("system")
        with open(os.path.join(out, "mepd.socket")) as f:
            socket_unit = f.read()
        for line in ("ListenStream=/run/mep/mepd.sock", "SocketGroup=mep", "SocketMode=0660", "DirectoryMode=0750"):
            self.assertIn(line + "\n", socket_unit)
        with open(os.path.join(out, "mep-server.service")) as f:
            server_unit = f.read()
        for line in ("ProtectSystem=strict", "StateDirectory=mep", "NoNewPrivileges=yes", "PrivateTmp=yes",
                     "ProtectHome=yes", "SystemCallFilter=@system-service", "User=mep"):
            self.assertIn(line + "\n", server_unit)
        self.assertRegex(server_unit, r"(?m)^RestrictAddressFamilies=")

    def test_user_units_verify(self):
        runtime = tempfile.mkdtemp(prefix="mep-xdg-")
        self.addCleanup(shutil.rmtree, runtime, True)
        out = self.verify("user", {"XDG_RUNTIME_DIR": runtime})
        with open(os.path.join(out, "mepd.socket")) as f:
            socket_unit = f.read()
        for line in ("ListenStream=%t/mep/mepd.sock", "SocketMode=0600", "DirectoryMode=0700"):
            self.assertIn(line + "\n", socket_unit)

    def test_sysusers_and_tmpfiles_apply(self):
        for tool in ("systemd-sysusers", "systemd-tmpfiles"):
            if shutil.which(tool) is None:
                self.skipTest(tool + " is not installed")
        if os.geteuid() != 0:
            self.skipTest("needs root to chown in the scratch root")
        root = tempfile.mkdtemp(prefix="mep-root-")
        self.addCleanup(shutil.rmtree, root, True)
        src = os.path.join(env_dir("MEP_SOURCE_DIR"), "packaging")
        for kind in ("sysusers.d", "tmpfiles.d"):
            os.makedirs(os.path.join(root, "usr", "lib", kind))
            shutil.copy(os.path.join(src, kind, "mep.conf"), os.path.join(root, "usr", "lib", kind))
        os.makedirs(os.path.join(root, "etc"))
        rc, _, err = check_output(["systemd-sysusers", "--root=" + root, "mep.conf"])
        self.assertEqual(rc, 0, err)
        with open(os.path.join(root, "etc", "passwd")) as f:
            self.assertRegex(f.read(), r"(?m)^mep:x:\d+:\d+:[^:]*:/var/lib/mep:")
        rc, _, err = check_output(["systemd-tmpfiles", "--root=" + root, "--create", "mep.conf"])
        self.assertEqual(rc, 0, err)
        self.assertEqual(os.stat(os.path.join(root, "run", "mep")).st_mode & 0o7777, 0o750)
        self.assertEqual(os.stat(os.path.join(root, "var", "lib", "mep")).st_mode & 0o7777, 0o700)


class DebPackage(unittest.TestCase):
    """`cpack -G DEB` in the build directory (into a temporary directory), then dpkg-deb -c
    and lintian. Slow: its own ctest test, run as test_cli_docs.DebPackage."""

    EXPECTED = (
        ["./usr/bin/mep", "./usr/bin/mepd",
         "./usr/lib/systemd/system/mepd.service", "./usr/lib/systemd/system/mepd.socket",
         "./usr/lib/systemd/system/mep-server.service",
         "./usr/lib/systemd/user/mepd.service", "./usr/lib/systemd/user/mepd.socket",
         "./usr/lib/sysusers.d/mep.conf", "./usr/lib/tmpfiles.d/mep.conf",
         "./usr/share/doc/mep/copyright", "./usr/share/doc/mep/changelog.Debian.gz",
         "./usr/share/bash-completion/completions/mep", "./usr/share/bash-completion/completions/mepd",
         "./usr/share/zsh/vendor-completions/_mep", "./usr/share/zsh/vendor-completions/_mepd",
         "./usr/share/fish/vendor_completions.d/mep.fish", "./usr/share/fish/vendor_completions.d/mepd.fish"]
        + ["./usr/share/man/man1/%s.1.gz" % p for p in MAN1]
        + ["./usr/share/man/man8/%s.8.gz" % p for p in MAN8])

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        for tool in ("cpack", "dpkg-deb", "dpkg-shlibdeps"):
            if shutil.which(tool) is None:
                raise unittest.SkipTest(tool + " is not installed")
        cls.build_dir = env_dir("MEP_BUILD_DIR")
        cls.tmp = tempfile.mkdtemp(prefix="mep-deb-")
        cls.addClassCleanup(shutil.rmtree, cls.tmp, True)
        rc, out, err = check_output(["cpack", "-G", "DEB", "-B", cls.tmp, "--config",
                                     os.path.join(cls.build_dir, "CPackConfig.cmake")],
                                    timeout=CPACK_TIMEOUT_S, cwd=cls.build_dir)
        if rc != 0:
            raise AssertionError("cpack failed (%d):\n%s\n%s" % (rc, out[-4000:], err[-4000:]))
        debs = [f for f in os.listdir(cls.tmp) if f.endswith(".deb")]
        assert len(debs) == 1, debs
        cls.deb = os.path.join(cls.tmp, debs[0])

    def field(self, name):
        rc, out, err = check_output(["dpkg-deb", "--field", self.deb, name])
        self.assertEqual(rc, 0, err)
        return out.strip()

    def test_file_name_and_control_fields(self):
        self.assertRegex(os.path.basename(self.deb), r"^mep_\d+\.\d+\.\d+-1_[a-z0-9]+\.deb$")
        self.assertEqual(self.field("Package"), "mep")
        self.assertEqual(self.field("Maintainer"), "mep developers <dev@memoryendpoints.com>")
        self.assertEqual(self.field("Section"), "admin")
        depends = self.field("Depends")
        for lib in ("libc6", "libstdc++6", "libsqlite3-0", "libssl3", "libcurl4", "libicu"):
            self.assertIn(lib, depends)  # dpkg-shlibdeps ran

    def test_dpkg_deb_lists_the_expected_files(self):
        rc, out, err = check_output(["dpkg-deb", "-c", self.deb])
        self.assertEqual(rc, 0, err)
        listed = {line.split()[-1] for line in out.splitlines() if line.strip()}
        missing = [p for p in self.EXPECTED if p not in listed]
        self.assertEqual(missing, [])
        for line in out.splitlines():
            mode, owner = line.split()[:2]
            self.assertEqual(owner, "root/root", line)
            self.assertIn(mode, ("drwxr-xr-x", "-rw-r--r--", "-rwxr-xr-x"), line)

    def test_units_name_the_installed_binaries_and_binaries_are_stripped(self):
        with tempfile.TemporaryDirectory(prefix="mep-deb-x-") as root:
            rc, _, err = check_output(["dpkg-deb", "-x", self.deb, root])
            self.assertEqual(rc, 0, err)
            with open(os.path.join(root, "usr/lib/systemd/system/mepd.service")) as f:
                self.assertRegex(f.read(), r"(?m)^ExecStart=/usr/bin/mepd ")
            with open(os.path.join(root, "usr/lib/systemd/system/mep-server.service")) as f:
                self.assertRegex(f.read(), r"(?m)^ExecStart=/usr/bin/mep server ")
            with open(os.path.join(root, "usr/lib/systemd/user/mepd.service")) as f:
                self.assertRegex(f.read(), r"(?m)^ExecStart=/usr/bin/mepd$")
            if shutil.which("readelf"):
                for binary in ("mep", "mepd"):
                    rc, out, _ = check_output(["readelf", "-S", os.path.join(root, "usr/bin", binary)])
                    self.assertEqual(rc, 0)
                    self.assertNotIn(".debug_info", out, binary)
                    self.assertNotIn(".symtab", out, binary)
            with gzip.open(os.path.join(root, "usr/share/doc/mep/changelog.Debian.gz"), "rt") as f:
                self.assertRegex(f.readline(), r"^mep \(\d+\.\d+\.\d+-1\) unstable; urgency=medium$")

    def test_maintainer_scripts(self):
        with tempfile.TemporaryDirectory(prefix="mep-deb-c-") as ctl:
            rc, _, err = check_output(["dpkg-deb", "-e", self.deb, ctl])
            self.assertEqual(rc, 0, err)
            for script in ("postinst", "prerm", "postrm"):
                path = os.path.join(ctl, script)
                self.assertTrue(os.access(path, os.X_OK), script)
                rc, _, err = check_output(["sh", "-n", path])
                self.assertEqual(rc, 0, err)
            with open(os.path.join(ctl, "postinst")) as f:
                text = f.read()
            self.assertIn("systemd-sysusers", text)
            self.assertIn("systemd-tmpfiles", text)

    def test_lintian_reports_no_errors(self):
        if shutil.which("lintian") is None:
            self.skipTest("lintian is not installed")
        rc, out, err = check_output(["lintian", "--no-tag-display-limit", self.deb], timeout=LINTIAN_TIMEOUT_S)
        tags = [line for line in out.splitlines() if re.match(r"^[EWIPX]: ", line)]
        errors = [t for t in tags if t.startswith("E: ")]
        self.assertEqual(errors, [], "\n".join(tags))
        # lintian exits 1 when it reports errors (or fails); 0 with warnings only.
        self.assertEqual(rc, 0, out + err)
        if tags:
            print("\nlintian: %s" % "\n         ".join(tags))


def load_tests(loader, standard_tests, pattern):
    """`python -m unittest test_cli_docs.py` runs everything but the slow package build, which
    has its own ctest test (`python -m unittest test_cli_docs.DebPackage`)."""
    suite = unittest.TestSuite()
    for case in (ManPages, Completions, SystemdUnits):
        suite.addTests(loader.loadTestsFromTestCase(case))
    return suite


if __name__ == "__main__":
    unittest.main()
