"""Checks of the arguments of the public API, so that a wrong argument is a
:class:`TypeError` or :class:`ValueError` naming it, raised before anything is sent —
not an exception from deep inside the JSON encoder or the HTTP framing."""
from __future__ import annotations

import math
import numbers
import os
import re
from typing import Any, Dict, Mapping, Optional

#: The largest ``wait`` the daemon takes (seconds; its ``wait_seconds`` is a 32-bit count).
MAX_WAIT_S = 2147483647
#: ``max_hold`` bounds (seconds): the shortest TTL, and 366 days.
MIN_HOLD_S = 5
MAX_HOLD_S = 366 * 24 * 3600
#: Label bounds: how many, a key's characters, a value's UTF-8 bytes.
MAX_LABELS = 16
MAX_LABEL_KEY = 63
MAX_LABEL_VALUE_BYTES = 255

_LABEL_KEY_RE = re.compile(r"[A-Za-z0-9_.\-]{1,%d}" % MAX_LABEL_KEY)


def _type_name(value: Any) -> str:
    return type(value).__name__


def _utf8(text: str, arg: str, what: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError("%s %s: it has the lone surrogate U+%04X at index %d, which cannot be sent as UTF-8"
                         % (arg, what, ord(text[e.start]), e.start)) from None
    return text


def text(value: Any, arg: str) -> str:
    """A ``str`` that can be sent as UTF-8 (names, ids)."""
    if not isinstance(value, str):
        raise TypeError("%s must be a str, not %s" % (arg, _type_name(value)))
    return _utf8(value, arg, "is not valid Unicode text")


def path(value: Any, arg: str = "path") -> str:
    """A file path (``str`` or ``os.PathLike[str]``) as an absolute ``str``."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError("%s must be a str or an os.PathLike of str, not %s: mepd takes UTF-8 paths "
                        "(decode it with os.fsdecode())" % (arg, _type_name(value)))
    try:
        p = os.fspath(value)
    except TypeError:
        raise TypeError("%s must be a str or an os.PathLike of str, not %s" % (arg, _type_name(value))) from None
    if not isinstance(p, str):
        raise TypeError("%s must be a str or an os.PathLike of str, not a path of %s" % (arg, _type_name(p)))
    if not p:
        raise ValueError("%s must not be empty" % arg)
    if "\x00" in p:
        raise ValueError("%s contains a NUL character (at index %d)" % (arg, p.index("\x00")))
    _utf8(p, arg, "is not valid UTF-8 (a file name with undecodable bytes?)")
    # Absolute but not normalized (os.path.abspath would be): ".." after a symbolic link is
    # for mepd to resolve as the kernel does, not text to drop.
    return p if os.path.isabs(p) else os.path.join(os.getcwd(), p)


def path_text(value: Any, arg: str) -> str:
    """A path or id as given (not made absolute), checked like :func:`path`."""
    path(value, arg)
    return os.fspath(value)


def _real(value: Any, arg: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError("%s must be %s, not %s" % (arg, what, _type_name(value)))
    try:
        return float(value)
    except (OverflowError, ValueError):
        raise ValueError("%s must be %s, not %r" % (arg, what, value)) from None


def wait(value: Any, arg: str = "wait") -> Optional[float]:
    """None, or seconds in 0..MAX_WAIT_S."""
    if value is None:
        return None
    v = _real(value, arg, "a number of seconds or None")
    if not (0 <= v <= MAX_WAIT_S):  # also NaN
        raise ValueError("%s must be between 0 and %d seconds, not %r" % (arg, MAX_WAIT_S, value))
    return int(v) if v.is_integer() else v


def ttl(value: Any, arg: str = "ttl") -> Optional[int]:
    """None (the daemon's default), or a whole number of seconds (the daemon checks 5..300)."""
    if value is None:
        return None
    v = _real(value, arg, "a whole number of seconds or None")
    if not math.isfinite(v) or not v.is_integer():
        raise ValueError("%s must be a whole number of seconds, not %r" % (arg, value))
    return int(v)


def timeout(value: Any, arg: str = "timeout") -> Optional[float]:
    """None (no limit), or seconds > 0 (``math.inf`` is no limit too)."""
    if value is None:
        return None
    v = _real(value, arg, "a number of seconds or None")
    if not v > 0:  # also NaN
        raise ValueError("%s must be more than 0 seconds (or None: no limit), not %r" % (arg, value))
    return None if math.isinf(v) else v


def bind(value: Any) -> str:
    """``"pid"`` or ``"none"``."""
    if value not in ("pid", "none") or not isinstance(value, str):
        raise ValueError('bind must be "pid" or "none", not %r' % (value,))
    return value


def max_hold(value: Any, arg: str = "max_hold") -> Optional[int]:
    """None (no limit), or a whole number of seconds in MIN_HOLD_S..MAX_HOLD_S."""
    if value is None:
        return None
    v = _real(value, arg, "a whole number of seconds or None")
    if not math.isfinite(v) or not v.is_integer():
        raise ValueError("%s must be a whole number of seconds, not %r" % (arg, value))
    if not (MIN_HOLD_S <= v <= MAX_HOLD_S):
        raise ValueError("%s must be between %d and %d seconds (366 days), not %r"
                         % (arg, MIN_HOLD_S, MAX_HOLD_S, value))
    return int(v)


def _control(text: str) -> int:
    """The index of the first control character (C0, DEL, C1) of ``text``, or -1."""
    for i, ch in enumerate(text):
        c = ord(ch)
        if c < 0x20 or 0x7F <= c < 0xA0:
            return i
    return -1


def labels(value: Any, arg: str = "labels") -> Optional[Dict[str, str]]:
    """None, or a mapping of at most MAX_LABELS ``str`` keys of 1-63 characters of
    ``A-Z a-z 0-9 _ . -`` to ``str`` values of at most 255 bytes of printable UTF-8 (no
    control characters), as the daemon takes them; returned as a plain dict."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Mapping):
        raise TypeError("%s must be a mapping of str to str (or None), not %s" % (arg, _type_name(value)))
    if len(value) > MAX_LABELS:
        raise ValueError("%s holds at most %d labels, not %d" % (arg, MAX_LABELS, len(value)))
    out: Dict[str, str] = {}
    for k, v in value.items():
        if not isinstance(k, str):
            raise TypeError("%s: a key must be a str, not %s" % (arg, _type_name(k)))
        if not _LABEL_KEY_RE.fullmatch(k):
            raise ValueError("%s: the key %r must be 1-%d characters of A-Z a-z 0-9 _ . -" % (arg, k, MAX_LABEL_KEY))
        what = "%s[%r]" % (arg, k)
        if not isinstance(v, str):
            raise TypeError("%s must be a str, not %s" % (what, _type_name(v)))
        _utf8(v, what, "is not valid Unicode text")
        size = len(v.encode("utf-8"))
        if size > MAX_LABEL_VALUE_BYTES:
            raise ValueError("%s must be at most %d bytes of UTF-8, not %d" % (what, MAX_LABEL_VALUE_BYTES, size))
        i = _control(v)
        if i >= 0:
            raise ValueError("%s contains the control character U+%04X at index %d" % (what, ord(v[i]), i))
        out[k] = v
    return out
