"""mep: globally unique agent names and exclusive, fenced use of ``.uai`` memory files,
through the local daemon ``mepd``.

    import mep

    with mep.lease("My Agent", "memory.uai", ttl=30) as lease:
        while not lease.lost.is_set():
            work()
            lease.sync()          # upload under the lease's fencing token

The module-level functions use a default :class:`Client` (socket found as the ``mep``
CLI finds it); make your own ``Client(socket_path=..., timeout=...)`` for anything else.
:mod:`mep.aio` has the same for asyncio. Standard library only.
"""
from __future__ import annotations

import threading
from typing import List, Mapping, Optional

from . import errors, types
from ._config import find_mep_bin, find_socket
from .client import Client, EventStream, PathLike
from .errors import *  # noqa: F401,F403 - one class per problem code
from .errors import __all__ as _errors_all
from .lease import Lease, LeaseBase, LeaseContext, current_lease
from .types import (
    BranchResult,
    CanonicalName,
    Event,
    FetchResult,
    Health,
    Holder,
    LeaseInfo,
    Lineage,
    MemoryIdentity,
    SyncResult,
    VerifyResult,
)

__version__ = "0.1.0"

_default: Optional[Client] = None
_default_lock = threading.Lock()


def default_client() -> Client:
    """The :class:`Client` the module-level functions use (made on first use; it finds
    the socket anew on each call, so a changed ``$MEP_SOCKET`` is seen)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Client()
        return _default


def set_default_client(client: Optional[Client]) -> None:
    """Make ``client`` the one the module-level functions use (None: back to the default)."""
    global _default
    with _default_lock:
        _default = client


def lease(name: str, path: PathLike, ttl: Optional[int] = 30, wait: Optional[float] = None, *,
          bind: str = "pid", labels: Optional[Mapping[str, str]] = None,
          max_hold: Optional[int] = None) -> LeaseContext:
    """``with mep.lease("My Agent", "memory.uai", ttl=30, wait=None) as lease:`` — claim the
    agent name and the memory file through mepd, bound to this process, for the block;
    released on exit, also when the block raises (whose exception is never masked). See
    :meth:`Client.acquire` for the arguments (``labels``, ``max_hold``, ...) and errors,
    :class:`Lease` for the lease."""
    return default_client().lease(name, path, ttl, wait, bind=bind, labels=labels, max_hold=max_hold)


def acquire(name: str, path: PathLike, ttl: Optional[int] = 30, wait: Optional[float] = None, *,
            bind: str = "pid", labels: Optional[Mapping[str, str]] = None,
            max_hold: Optional[int] = None) -> Lease:
    """Claim now and return the :class:`Lease`; give it up with ``lease.release()``."""
    return default_client().acquire(name, path, ttl=ttl, wait=wait, bind=bind, labels=labels, max_hold=max_hold)


def canonicalize(name: str) -> CanonicalName:
    """The canonical name, skeleton and scripts of ``name`` (or :class:`InvalidName`),
    computed by the ``mep canonicalize --json`` CLI (``$MEP_BIN`` or PATH): the daemon has
    no endpoint for it."""
    return default_client().canonicalize(name)


def init(path: PathLike) -> MemoryIdentity:
    """Create a new, empty memory file with a fresh identity."""
    return default_client().init(path)


def branch(path: PathLike, new_path: PathLike) -> BranchResult:
    """Copy the held memory at ``path`` to ``new_path`` as a new identity with recorded lineage."""
    return default_client().branch(path, new_path)


def identify(path: PathLike) -> MemoryIdentity:
    """The memory identity of the file ``path``."""
    return default_client().identify(path)


def lineage(path_or_id: PathLike) -> Lineage:
    """Ancestors and children of a memory, given by file path or memory id."""
    return default_client().lineage(path_or_id)


def status() -> List[LeaseInfo]:
    """The leases the daemon keeps (what ``mep status`` lists)."""
    return default_client().status()


def events() -> EventStream:
    """Follow the daemon's event stream: ``for event in mep.events(): ...``."""
    return default_client().events()


def fetch(memory_instance_id: str, path: PathLike, *, timeout: Optional[float] = None) -> FetchResult:
    """Download a memory's latest stored object into the new file ``path``, bound to its
    identity. ``timeout``: seconds to wait for the answer; None (default): as long as the
    download takes (see :meth:`Client.fetch`)."""
    return default_client().fetch(memory_instance_id, path, timeout=timeout)


def health() -> Health:
    """The daemon's ``/healthz``."""
    return default_client().health()


__all__ = [
    "Client",
    "EventStream",
    "Lease",
    "LeaseBase",
    "LeaseContext",
    "LeaseInfo",
    "Event",
    "MemoryIdentity",
    "BranchResult",
    "Lineage",
    "CanonicalName",
    "VerifyResult",
    "SyncResult",
    "FetchResult",
    "Health",
    "Holder",
    "PathLike",
    "lease",
    "acquire",
    "canonicalize",
    "init",
    "branch",
    "identify",
    "lineage",
    "status",
    "events",
    "fetch",
    "health",
    "current_lease",
    "default_client",
    "set_default_client",
    "find_socket",
    "find_mep_bin",
    "errors",
    "types",
    "__version__",
] + list(_errors_all)
