#!/usr/bin/env bash
# Installs the dependencies, builds with warnings as errors, and runs every test on the
# normal build (./build); with MEP_SANITIZERS=asan|tsan|"asan tsan" also under the
# sanitizers (scripts/sanitize.sh). Exit status: nonzero when any run failed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash packaging/install-deps.sh
bash scripts/build.sh -DMEP_WERROR=ON
# A throwaway PostgreSQL cluster for the *_pg tests (initdb as an unprivileged user,
# loopback only), stopped and removed when the tests end.
root="$(pwd)"
pgdir="$(mktemp -d /tmp/mep-test-pg.XXXXXX)"
trap 'bash "$root/scripts/pg-test-cluster.sh" stop "$pgdir"; rm -rf "$pgdir"' EXIT
MEP_TEST_PG_URL="$(bash "$root/scripts/pg-test-cluster.sh" start "$pgdir")"
export MEP_TEST_PG_URL

status=0
# The normal build: every test (fuzz_smoke runs each fuzz target for a few seconds).
(cd build && ctest -j2 --output-on-failure --timeout 600) || status=1

# Sanitizer runs (scripts/sanitize.sh), when asked: MEP_SANITIZERS=asan, tsan or "asan tsan".
# They are not part of the default run: a cold sanitizer build alone takes about half an
# hour on two cores, beyond CI's budget.
for kind in ${MEP_SANITIZERS:-}; do
  bash scripts/sanitize.sh "$kind" || status=1
done
exit "$status"
