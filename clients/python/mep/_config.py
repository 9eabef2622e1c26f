"""Where the daemon's socket is, found the way the ``mep`` CLI finds it
(cli/daemon_client.cpp, common/config.cpp), and where the ``mep`` binary is.

The config file is read and checked exactly when, and as strictly as, the CLI reads it:
on every look-up, whatever ``$MEP_SOCKET`` says — a ``$MEP_CONFIG`` that names a missing
file, a config file that is not a regular file, that cannot be read, that is not TOML, or
whose top-level values are not all strings, integers or booleans (a table, an array, a
float, a date) is a :class:`~mep.ConfigError`, as ``mep`` exits 2 then. Only after that
does ``$MEP_SOCKET`` win over the file's ``socket`` key.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Dict, List, Mapping, Optional, Tuple

from .errors import CliNotFound, ConfigError

DEFAULT_SYSTEM_SOCKET = "/run/mep/mepd.sock"

_INT64_MIN, _INT64_MAX = -(2 ** 63), 2 ** 63 - 1


def config_file_path(env: Optional[Mapping[str, str]] = None) -> Tuple[str, bool]:
    """The config file to read and whether it was named explicitly (``$MEP_CONFIG``): an
    explicit file must exist, the default one may be absent."""
    e = os.environ if env is None else env
    explicit = e.get("MEP_CONFIG")
    if explicit:
        return explicit, True
    base = e.get("XDG_CONFIG_HOME") or os.path.join(e.get("HOME") or "/", ".config")
    return os.path.join(base, "mep", "config.toml"), False


# ---- the config file: the TOML the CLI accepts -------------------------------------------------
#
# The CLI (common/config.cpp) parses the file with toml++ and then refuses any top-level value
# that is not a string, an integer or a boolean; integers and booleans are used as their text
# ("5", "true"). So a config the CLI accepts is a flat list of `key = scalar` lines, and the
# reader below understands exactly that: bare and quoted keys, the four kinds of strings (with
# TOML 1.0's escapes), integers (decimal with _ separators, 0x, 0o, 0b; 64-bit) and booleans,
# comments, blank lines. A table header, a dotted key, an array, an inline table, a float or a
# date is the CLI's "must be a string, integer or boolean"; anything else is not TOML. Like the
# CLI, it works on bytes: non-ASCII is allowed in comments (any bytes) and in strings (valid
# UTF-8 only), nowhere else; a UTF-8 byte order mark is skipped.

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_VALUE_TOKEN = re.compile(r"[0-9A-Za-z_+.:-]+")
_DEC_INT = re.compile(r"[+-]?(?:0|[1-9](?:_?[0-9])*)\Z")
_PREFIXED_INT = re.compile(r"0x[0-9A-Fa-f](?:_?[0-9A-Fa-f])*\Z|0o[0-7](?:_?[0-7])*\Z|0b[01](?:_?[01])*\Z")
_FLOAT = re.compile(r"[+-]?(?:inf|nan|(?:0|[1-9](?:_?[0-9])*)(?:\.[0-9](?:_?[0-9])*)?(?:[eE][+-]?[0-9](?:_?[0-9])*)?)\Z")
_DATE_TIME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}(?:[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]+)?(?:[Zz]|[+-][0-9]{2}:[0-9]{2})?)?\Z"
                        r"|[0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]+)?\Z")
_ESCAPES = {"b": "\b", "t": "\t", "n": "\n", "f": "\f", "r": "\r", '"': '"', "\\": "\\"}


class _Reader:
    """One pass over the file's bytes (as latin-1 text: one character per byte)."""

    def __init__(self, data: bytes, label: str) -> None:
        if data.startswith(b"\xef\xbb\xbf"):
            data = data[3:]
        self.t = data.decode("latin-1")
        self.i = 0
        self.line = 1
        self.label = label

    # -- errors
    def error(self, what: str) -> ConfigError:
        return ConfigError("config file %s:%d: %s" % (self.label, self.line, what))

    def not_scalar(self, key: str) -> ConfigError:
        return ConfigError('config file %s: key "%s" must be a string, integer or boolean' % (self.label, key))

    # -- characters
    def at(self, k: int = 0) -> str:
        j = self.i + k
        return self.t[j] if j < len(self.t) else ""

    def skip_ws(self) -> None:
        while self.at() in (" ", "\t") and self.at() != "":
            self.i += 1

    def newline_len(self) -> int:
        """1 or 2 if a newline (LF, CRLF) starts here, else 0."""
        c = self.at()
        if c == "\n":
            return 1
        if c == "\r" and self.at(1) == "\n":
            return 2
        return 0

    def comment(self) -> None:
        """From ``#`` to the end of the line; any byte but a control character."""
        while self.i < len(self.t) and not self.newline_len():
            c = self.at()
            if (ord(c) < 0x20 and c != "\t") or c == "\x7f":
                raise self.error("control character U+%04X in a comment" % ord(c))
            self.i += 1

    def outside(self, c: str) -> ConfigError:
        if ord(c) >= 0x80:
            return self.error("a non-ASCII character outside a quoted string or a comment")
        return self.error("unexpected character %r" % c)

    # -- strings
    def string(self, quote: str, multi: bool) -> str:
        """A string whose opening delimiter was consumed; returns its value."""
        buf = bytearray()
        if multi:  # a newline right after the opening delimiter is not part of the string
            nl = self.newline_len()
            if nl:
                self.i += nl
                self.line += 1
        while True:
            if self.i >= len(self.t):
                raise self.error("unterminated string")
            c = self.at()
            if c == quote:
                if not multi:
                    self.i += 1
                    break
                run = 0
                while self.at(run) == quote:
                    run += 1
                if run >= 3:
                    if run > 5:
                        raise self.error("too many quotes at the end of a multi-line string")
                    buf += (quote * (run - 3)).encode("latin-1")
                    self.i += run
                    break
                buf += (quote * run).encode("latin-1")
                self.i += run
                continue
            nl = self.newline_len()
            if nl:
                if not multi:
                    raise self.error("unterminated string")
                buf += b"\n"
                self.i += nl
                self.line += 1
                continue
            if c == "\\" and quote == '"':
                self.escape(buf, multi)
                continue
            o = ord(c)
            if (o < 0x20 and c != "\t") or o == 0x7F:
                raise self.error("control character U+%04X in a string" % o)
            buf.append(o)
            self.i += 1
        try:
            return bytes(buf).decode("utf-8")
        except UnicodeDecodeError:
            raise self.error("invalid UTF-8 in a string") from None

    def escape(self, buf: bytearray, multi: bool) -> None:
        e = self.at(1)
        if multi and (e in (" ", "\t", "\r", "\n") and e != ""):
            # A line-ending backslash: whitespace up to the newline, then it and all
            # whitespace and newlines after it are dropped.
            j = self.i + 1
            while j < len(self.t) and self.t[j] in " \t":
                j += 1
            self.i = j
            if not self.newline_len():
                raise self.error("a backslash followed by whitespace must end the line")
            while True:
                nl = self.newline_len()
                if nl:
                    self.i += nl
                    self.line += 1
                elif self.at() in (" ", "\t") and self.at() != "":
                    self.i += 1
                else:
                    return
        if e in _ESCAPES:
            buf += _ESCAPES[e].encode("ascii")
            self.i += 2
            return
        if e in ("u", "U"):
            n = 4 if e == "u" else 8
            digits = self.t[self.i + 2 : self.i + 2 + n]
            if len(digits) != n or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise self.error("escape sequence \\%s needs %d hexadecimal digits" % (e, n))
            cp = int(digits, 16)
            if cp > 0x10FFFF or 0xD800 <= cp <= 0xDFFF:
                raise self.error("escape sequence \\%s%s is not a Unicode scalar value" % (e, digits))
            buf += chr(cp).encode("utf-8")
            self.i += 2 + n
            return
        raise self.error("unknown escape sequence '\\%s'" % (e or "EOF"))

    # -- keys and values
    def simple_key(self) -> str:
        c = self.at()
        if c == '"' or c == "'":
            self.i += 1
            return self.string(c, False)
        m = _BARE_KEY.match(self.t, self.i)
        if not m:
            raise self.outside(c) if c else self.error("expected a key")
        self.i = m.end()
        return m.group(0)

    def value(self, key: str) -> str:
        t = self.t
        for q in ('"', "'"):
            if t.startswith(q * 3, self.i):
                self.i += 3
                return self.string(q, True)
            if t.startswith(q, self.i):
                self.i += 1
                return self.string(q, False)
        c = self.at()
        if c in ("[", "{") and c != "":
            raise self.not_scalar(key)  # an array or an inline table
        m = _VALUE_TOKEN.match(t, self.i)
        if not m:
            if not c or self.newline_len() or c == "#":
                raise self.error("expected a value for %r" % key)
            raise self.outside(c)
        tok = m.group(0)
        self.i = m.end()
        if tok in ("true", "false"):
            return tok
        if _DEC_INT.match(tok) or _PREFIXED_INT.match(tok):
            v = int(tok.replace("_", ""), 0) if not _DEC_INT.match(tok) else int(tok.replace("_", ""))
            if not _INT64_MIN <= v <= _INT64_MAX:
                raise self.error("'%s' is not representable in 64 bits" % tok)
            return str(v)
        if _FLOAT.match(tok) or _DATE_TIME.match(tok):
            raise self.not_scalar(key)  # a float or a date/time
        raise self.error("%r is not a TOML value" % tok)

    def read(self) -> Dict[str, str]:
        values: Dict[str, str] = {}
        while True:
            self.skip_ws()
            if self.i >= len(self.t):
                return values
            nl = self.newline_len()
            if nl:
                self.i += nl
                self.line += 1
                continue
            c = self.at()
            if c == "#":
                self.comment()
                continue
            if c == "[":  # a table header: a top-level key whose value is a table
                self.i += 2 if self.at(1) == "[" else 1
                self.skip_ws()
                raise self.not_scalar(self.simple_key())
            key = self.simple_key()
            self.skip_ws()
            if self.at() == ".":  # a dotted key: a table
                raise self.not_scalar(key)
            if self.at() != "=":
                raise self.error("expected '=' after the key %r" % key)
            self.i += 1
            self.skip_ws()
            value = self.value(key)
            if key in values:
                raise self.error("cannot redefine the key %r" % key)
            values[key] = value
            self.skip_ws()
            if self.at() == "#":
                self.comment()
            if self.i < len(self.t) and not self.newline_len():
                c = self.at()
                raise self.error("expected a comment or a new line after the value of %r, saw %r" % (key, c))


def parse_config(data: bytes, label: str) -> Dict[str, str]:
    """The top-level settings of a config file's bytes, each as the text the CLI uses (an
    integer or a boolean as written in decimal / ``true``, ``false``). Raises
    :class:`~mep.ConfigError` where the CLI refuses the file."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    return _Reader(data, label).read()


def socket_from_toml(text: str, path: str) -> Optional[str]:
    """The ``socket`` setting of a config document, or None (see :func:`parse_config`)."""
    return parse_config(text.encode("utf-8"), path).get("socket")


def load_config(env: Optional[Mapping[str, str]] = None) -> Tuple[Dict[str, str], Optional[str]]:
    """The settings of the config file and its path, read as the CLI reads it
    (``$MEP_CONFIG``, which must exist; else ``$XDG_CONFIG_HOME/mep/config.toml`` or
    ``~/.config/mep/config.toml``, which may be absent: then ``({}, None)``). Raises
    :class:`~mep.ConfigError` where the CLI refuses to run (it exits 2)."""
    path, explicit = config_file_path(env)
    if not os.path.exists(path):
        if explicit:
            raise ConfigError("config file %s does not exist" % path)
        return {}, None
    if not os.path.isfile(path):
        raise ConfigError("config file %s is not a regular file" % path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError("config file %s cannot be read: %s" % (path, e.strerror or e)) from None
    return parse_config(data, path), path


def find_socket(env: Optional[Mapping[str, str]] = None) -> Tuple[str, str]:
    """The daemon's socket path and where it came from, in the CLI's order:
    ``$MEP_SOCKET``; the ``socket`` key of the config file (``$MEP_CONFIG``, else
    ``$XDG_CONFIG_HOME/mep/config.toml``, else ``~/.config/mep/config.toml``);
    ``$XDG_RUNTIME_DIR/mep/mepd.sock``; ``/run/mep/mepd.sock``.

    The config file is read and checked first, whatever ``$MEP_SOCKET`` says, as the CLI
    does: :class:`~mep.ConfigError` when ``$MEP_CONFIG`` names a missing file or a config
    file cannot be read or is not one the CLI accepts (see :func:`load_config`).
    """
    e = os.environ if env is None else env
    values, path = load_config(e)
    v = e.get("MEP_SOCKET")
    if v:
        return v, "$MEP_SOCKET"
    if "socket" in values:
        return values["socket"], "config file %s" % path
    runtime = e.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "mep", "mepd.sock"), "$XDG_RUNTIME_DIR"
    return DEFAULT_SYSTEM_SOCKET, "default"


def find_mep_bin(env: Optional[Mapping[str, str]] = None) -> str:
    """The ``mep`` CLI: ``$MEP_BIN``, else ``mep`` on ``PATH``; raises :class:`~mep.CliNotFound`."""
    e = os.environ if env is None else env
    v = e.get("MEP_BIN")
    if v:
        if os.path.isfile(v) and os.access(v, os.X_OK):
            return v
        raise CliNotFound("$MEP_BIN is %s, which is not an executable file" % v)
    found = shutil.which("mep", path=e.get("PATH"))
    if not found:
        raise CliNotFound("the mep CLI is neither in $MEP_BIN nor on PATH (mep.canonicalize runs 'mep canonicalize')")
    return found


__all__: List[str] = ["config_file_path", "parse_config", "load_config", "find_socket", "find_mep_bin"]
