"""Where the daemon's socket is, found the way the ``mep`` CLI finds it
(cli/daemon_client.cpp, common/config.cpp), and where the ``mep`` binary is."""
from __future__ import annotations

import os
import re
import shutil
import sys
from typing import Any, Mapping, Optional, Tuple

from .errors import CliNotFound, ConfigError

DEFAULT_SYSTEM_SOCKET = "/run/mep/mepd.sock"


def config_file_path(env: Optional[Mapping[str, str]] = None) -> Tuple[str, bool]:
    """The config file to read and whether it was named explicitly (``$MEP_CONFIG``): an
    explicit file must exist, the default one may be absent."""
    e = os.environ if env is None else env
    explicit = e.get("MEP_CONFIG")
    if explicit:
        return explicit, True
    base = e.get("XDG_CONFIG_HOME") or os.path.join(e.get("HOME") or "/", ".config")
    return os.path.join(base, "mep", "config.toml"), False


_KEY_LINE = re.compile(r"""^\s*socket\s*=\s*(?P<value>"(?:[^"\\]|\\.)*"|'[^']*')\s*(?:#.*)?$""")
_ANY_SOCKET_KEY = re.compile(r"^\s*socket\s*=")


def socket_from_toml(text: str, path: str, use_tomllib: bool = True) -> Optional[str]:
    """The top-level ``socket`` string of a TOML document, or None. Uses :mod:`tomllib`
    where Python has it (3.11+) and ``use_tomllib``, else a small reader that understands
    the top-level ``key = "string"`` lines the CLI's config uses. Raises
    :class:`~mep.ConfigError` for a document that cannot be read or a non-string socket."""
    if use_tomllib and sys.version_info >= (3, 11):
        import importlib

        tomllib: Any = importlib.import_module("tomllib")
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError("config file %s: %s" % (path, e)) from None
        value = doc.get("socket")
        if value is None:
            return None
        if not isinstance(value, str):
            raise ConfigError('config file %s: key "socket" must be a string' % path)
        return value
    import json

    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("["):
            break  # a table: top-level keys come first in TOML
        m = _KEY_LINE.match(line)
        if not m:
            if _ANY_SOCKET_KEY.match(line):
                raise ConfigError('config file %s:%d: key "socket" must be a string' % (path, number))
            continue
        raw = m.group("value")
        if raw.startswith("'"):
            return raw[1:-1]
        try:
            return str(json.loads(raw))
        except ValueError:
            raise ConfigError("config file %s:%d: cannot read the socket string %s" % (path, number, raw)) from None
    return None


def _read_socket_key(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError("cannot read the config file %s: %s" % (path, e.strerror or e)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError("config file %s is not UTF-8" % path) from None
    return socket_from_toml(text, path)


def find_socket(env: Optional[Mapping[str, str]] = None) -> Tuple[str, str]:
    """The daemon's socket path and where it came from, in the CLI's order:
    ``$MEP_SOCKET``; the ``socket`` key of the config file (``$MEP_CONFIG``, else
    ``$XDG_CONFIG_HOME/mep/config.toml``, else ``~/.config/mep/config.toml``);
    ``$XDG_RUNTIME_DIR/mep/mepd.sock``; ``/run/mep/mepd.sock``.

    Raises :class:`~mep.ConfigError` when an explicit config file is missing or a config
    file cannot be parsed (as the CLI refuses to run then).
    """
    e = os.environ if env is None else env
    v = e.get("MEP_SOCKET")
    if v:
        return v, "$MEP_SOCKET"
    path, explicit = config_file_path(e)
    if os.path.exists(path):
        if not os.path.isfile(path):
            raise ConfigError("config file %s is not a regular file" % path)
        s = _read_socket_key(path)
        if s:
            return s, "config file " + path
    elif explicit:
        raise ConfigError("config file %s does not exist" % path)
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
