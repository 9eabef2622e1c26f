#!/usr/bin/env bash
# The bounded soak (tests/integration/soak.py) on the build in ./build: 200 simulated agents
# through 2 daemons against 2 servers on PostgreSQL and mep store, with faults injected; it
# prints a table of what it did and what it checked. Runs in a network namespace of its own
# (for the packet-loss window) when it may create one.
#
#   scripts/soak.sh                  10 minutes
#   scripts/soak.sh --seconds 60     as CI runs it (ctest integration_soak)
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
build="${MEP_BUILD_DIR:-$root/build}"
[[ -x "$build/cli/mep" && -x "$build/daemon/mepd" ]] || { echo "soak: build first (scripts/build.sh)" >&2; exit 2; }
export MEP_BIN="$build/cli/mep" MEPD_BIN="$build/daemon/mepd" MEP_SOURCE_DIR="$root" PYTHONDONTWRITEBYTECODE=1
cd tests/integration
if unshare -n true 2>/dev/null && command -v nft >/dev/null; then
  exec ./in_netns.sh python3 soak.py "$@"
fi
exec python3 soak.py "$@"
