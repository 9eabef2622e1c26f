"""The PEP 517 build backend of the ``mep`` package: standard library only, so
``pip install ./clients/python`` works offline, with or without build isolation, on any
Python the package supports.

Why not setuptools: the setuptools that a fresh venv gets from ``ensurepip`` (65.x with
Python 3.11; none at all from 3.12 on) cannot build a wheel without the separate ``wheel``
package (``error: invalid command 'bdist_wheel'``), which is not there offline.

It builds a pure-Python wheel of the ``mep`` directory (PEP 427: METADATA, WHEEL, RECORD
with SHA-256 digests), an sdist, and an editable install (PEP 660: a ``.pth`` file naming
this source tree). Metadata comes from the ``[project]`` table of pyproject.toml.
"""
from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import tarfile
import time
import sys
import zipfile
from typing import Any, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "mep"
_TAG = "py3-none-any"


def _project() -> Dict[str, Any]:
    """The ``[project]`` table of pyproject.toml (tomllib where Python has it, else a
    reader of the simple ``key = "string"`` / ``key = [..]`` lines this file uses)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        data = f.read().decode("utf-8")
    if sys.version_info >= (3, 11):
        import importlib

        tomllib: Any = importlib.import_module("tomllib")
        return dict(tomllib.loads(data).get("project", {}))
    out: Dict[str, Any] = {}
    section = None
    lines = iter(data.splitlines())
    for line in lines:
        s = line.strip()
        if s.startswith("["):
            section = s.strip("[]").strip()
            continue
        if section != "project" or not s or s.startswith("#"):
            continue
        m = re.match(r'^([A-Za-z0-9_-]+)\s*=\s*(.*)$', s)
        if not m:
            continue
        key, value = m.group(1), m.group(2)
        if value.startswith('"'):
            out[key] = value.split('"')[1]
        elif value.startswith("["):
            items = value
            while "]" not in items:
                items += next(lines)
            out[key] = re.findall(r'"([^"]*)"', items)
    return out


def _name_version() -> Tuple[str, str]:
    p = _project()
    return str(p["name"]), str(p["version"])


def _metadata() -> str:
    p = _project()
    lines = ["Metadata-Version: 2.1", "Name: %s" % p["name"], "Version: %s" % p["version"]]
    if p.get("description"):
        lines.append("Summary: %s" % p["description"])
    if p.get("requires-python"):
        lines.append("Requires-Python: %s" % p["requires-python"])
    classifiers = p.get("classifiers")
    for c in classifiers if isinstance(classifiers, list) else []:
        lines.append("Classifier: %s" % c)
    readme = os.path.join(ROOT, "README.md")
    body = ""
    if os.path.exists(readme):
        lines.append("Description-Content-Type: text/markdown")
        with open(readme, encoding="utf-8") as f:
            body = f.read()
    return "\n".join(lines) + "\n\n" + body


def _package_files() -> List[str]:
    """Paths (relative to ROOT) of the package's files: sources and py.typed."""
    out = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, PACKAGE)):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for fn in sorted(filenames):
            if fn.endswith((".py", ".typed")):
                out.append(os.path.relpath(os.path.join(dirpath, fn), ROOT))
    return out


def _record_line(arcname: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (arcname, digest, len(data))


def _write_wheel(wheel_directory: str, files: List[Tuple[str, bytes]]) -> str:
    name, version = _name_version()
    dist_info = "%s-%s.dist-info" % (name, version)
    meta = [
        (dist_info + "/METADATA", _metadata().encode("utf-8")),
        (dist_info + "/WHEEL", ("Wheel-Version: 1.0\nGenerator: mep_backend\nRoot-Is-Purelib: true\nTag: %s\n"
                                % _TAG).encode()),
        (dist_info + "/top_level.txt", (PACKAGE + "\n").encode()),
    ]
    filename = "%s-%s-%s.whl" % (name, version, _TAG)
    record = []
    date = time.gmtime(max(time.time(), 315532800))[:6]  # zip cannot store dates before 1980
    with zipfile.ZipFile(os.path.join(wheel_directory, filename), "w", zipfile.ZIP_DEFLATED) as z:
        for arcname, data in files + meta:
            info = zipfile.ZipInfo(arcname, date_time=date)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
            record.append(_record_line(arcname, data))
        record.append(dist_info + "/RECORD,,")
        info = zipfile.ZipInfo(dist_info + "/RECORD", date_time=date)
        info.external_attr = 0o644 << 16
        z.writestr(info, "\n".join(record) + "\n")
    return filename


# ---- PEP 517 hooks ----------------------------------------------------------------------------


def get_requires_for_build_wheel(config_settings: Optional[Dict[str, Any]] = None) -> List[str]:
    """Nothing to install first."""
    return []


def get_requires_for_build_sdist(config_settings: Optional[Dict[str, Any]] = None) -> List[str]:
    """Nothing to install first."""
    return []


def get_requires_for_build_editable(config_settings: Optional[Dict[str, Any]] = None) -> List[str]:
    """Nothing to install first."""
    return []


def build_wheel(wheel_directory: str, config_settings: Optional[Dict[str, Any]] = None,
                metadata_directory: Optional[str] = None) -> str:
    """Build the wheel into ``wheel_directory``; its file name."""
    files = []
    for rel in _package_files():
        with open(os.path.join(ROOT, rel), "rb") as f:
            files.append((rel.replace(os.sep, "/"), f.read()))
    return _write_wheel(wheel_directory, files)


def build_editable(wheel_directory: str, config_settings: Optional[Dict[str, Any]] = None,
                   metadata_directory: Optional[str] = None) -> str:
    """An editable wheel: a ``.pth`` file that puts this source tree on sys.path."""
    name, _ = _name_version()
    return _write_wheel(wheel_directory, [("__editable__.%s.pth" % name, (ROOT + "\n").encode())])


def build_sdist(sdist_directory: str, config_settings: Optional[Dict[str, Any]] = None) -> str:
    """Build the source distribution (package, backend, tests, pyproject, README)."""
    name, version = _name_version()
    base = "%s-%s" % (name, version)
    filename = base + ".tar.gz"
    members = ["pyproject.toml", "README.md"] + _package_files()
    for sub in ("_backend", "tests"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, sub)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            members += [os.path.relpath(os.path.join(dirpath, fn), ROOT) for fn in sorted(filenames)
                        if fn.endswith(".py")]
    with tarfile.open(os.path.join(sdist_directory, filename), "w:gz", format=tarfile.PAX_FORMAT) as t:
        for rel in members:
            path = os.path.join(ROOT, rel)
            if os.path.exists(path):
                t.add(path, arcname=base + "/" + rel, recursive=False)
        pkg_info = _metadata().encode("utf-8")
        info = tarfile.TarInfo(base + "/PKG-INFO")
        info.size = len(pkg_info)
        info.mtime = int(time.time())
        info.mode = 0o644
        t.addfile(info, io.BytesIO(pkg_info))
    return filename
