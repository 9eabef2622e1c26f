"""``python -m mep``: a small command line on top of the SDK.

    python -m mep status [--json] [--socket PATH]   the daemon's leases (a table, or JSON)
    python -m mep events [--socket PATH]            follow the event stream (NDJSON)

Exit status as the ``mep`` CLI's for the same problem: 0 ok, 1 other, 2 usage (and a config
file that cannot be read), 3 held, 4 lost, 5 unavailable, 6 invalid name, 7 authentication.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import List, Optional, Sequence

from ._config import load_config
from .client import Client
from .types import LeaseInfo
from .errors import ConfigError, MepError

EXIT_OK, EXIT_OTHER, EXIT_USAGE, EXIT_HELD, EXIT_LOST, EXIT_UNAVAILABLE, EXIT_INVALID_NAME, EXIT_AUTH = range(8)

#: The ``mep`` CLI's exit status for each problem code (its table: common/problem.cpp).
EXIT_BY_CODE = {
    "invalid-request": EXIT_USAGE, "idempotency-key-missing": EXIT_OTHER, "idempotency-key-invalid": EXIT_OTHER,
    "unauthenticated": EXIT_AUTH, "forbidden": EXIT_AUTH, "not-found": EXIT_OTHER,
    "memory-not-found": EXIT_OTHER, "lease-not-found": EXIT_OTHER, "method-not-allowed": EXIT_USAGE,
    "memory-id-taken": EXIT_HELD, "stale-fence": EXIT_LOST, "idempotency-request-in-flight": EXIT_UNAVAILABLE,
    "lease-expired": EXIT_LOST, "payload-too-large": EXIT_USAGE, "unsupported-media-type": EXIT_USAGE,
    "invalid-name": EXIT_INVALID_NAME, "invalid-ttl": EXIT_USAGE, "idempotency-key-reused": EXIT_OTHER,
    "name-held": EXIT_HELD, "name-confusable": EXIT_HELD, "memory-attached": EXIT_HELD,
    "rate-limited": EXIT_UNAVAILABLE, "internal": EXIT_OTHER, "transaction-conflict": EXIT_UNAVAILABLE,
    "unavailable": EXIT_UNAVAILABLE, "migration-in-progress": EXIT_UNAVAILABLE, "precondition-failed": EXIT_OTHER,
    "store-unavailable": EXIT_UNAVAILABLE, "insufficient-storage": EXIT_UNAVAILABLE,
    "store-not-configured": EXIT_OTHER, "control-plane-unreachable": EXIT_UNAVAILABLE,
}


def exit_status(error: MepError) -> int:
    """The exit status the ``mep`` CLI gives for `error`'s problem: a config file that
    cannot be read is a usage error (2), as for the CLI; a code it does not know, 1."""
    if isinstance(error, ConfigError):
        return EXIT_USAGE
    return EXIT_BY_CODE.get(error.code or "", EXIT_OTHER)


def _expires_in(info: LeaseInfo, now: datetime.datetime) -> str:
    if info.state == "lost" or info.expires_at is None:
        return "-"
    secs = (info.expires_at - now).total_seconds()
    return "%d s" % max(0, int(round(secs)))


def format_table(leases: Sequence[LeaseInfo], now: Optional[datetime.datetime] = None) -> str:
    """The leases as the table ``mep status`` prints (NAME, MEMORY, TOKEN, EXPIRES IN,
    STATE, PATH); a line saying there are none when empty."""
    if not leases:
        return "no leases"
    now = now or datetime.datetime.now(datetime.timezone.utc)
    rows: List[List[str]] = [["NAME", "MEMORY", "TOKEN", "EXPIRES IN", "STATE", "PATH"]]
    for l in sorted(leases, key=lambda x: x.canonical_name):
        state = l.state + (" (%s)" % l.lost_reason if l.lost_reason else "")
        rows.append([l.canonical_name, l.memory_instance_id,
                     "-" if l.fencing_token is None else str(l.fencing_token),
                     _expires_in(l, now), state, l.path])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    out = []
    for r in rows:
        cells = [r[i].rjust(widths[i]) if i == 2 else r[i].ljust(widths[i]) for i in range(len(widths))]
        out.append("  ".join(cells + [r[-1]]).rstrip())
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m mep", description="The mep Python SDK's command line.")
    parser.add_argument("--socket", help="mepd's socket (default: as the mep CLI finds it)")
    sub = parser.add_subparsers(dest="command")
    st = sub.add_parser("status", help="list the leases mepd keeps")
    st.add_argument("--json", action="store_true", help="print one JSON document, for machines")
    st.add_argument("--socket", dest="socket_sub", help=argparse.SUPPRESS)
    ev = sub.add_parser("events", help="follow mepd's event stream (one JSON object per line)")
    ev.add_argument("--socket", dest="socket_sub", help=argparse.SUPPRESS)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return EXIT_USAGE if e.code not in (0, None) else EXIT_OK
    if not args.command:
        parser.print_usage(sys.stderr)
        return EXIT_USAGE
    try:
        socket_path = getattr(args, "socket_sub", None) or args.socket
        if socket_path:
            # As the CLI: the config file is read (and must be valid) even with --socket.
            load_config()
        client = Client(socket_path)
        if args.command == "status":
            leases = client.leases()
            if args.json:
                print(json.dumps({"leases": [l.raw for l in leases]}, ensure_ascii=False))
            else:
                print(format_table(leases))
            return EXIT_OK
        with client.events() as stream:
            for event in stream:
                print(json.dumps(event.raw, ensure_ascii=False), flush=True)
        return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_OK
    except MepError as e:
        if getattr(args, "json", False):
            print(json.dumps(e.to_problem(), ensure_ascii=False))
        else:
            print("mep: %s" % e, file=sys.stderr)
        return exit_status(e)


if __name__ == "__main__":
    sys.exit(main())
