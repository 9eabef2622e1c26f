#!/usr/bin/env bash
# Installs the dependencies, builds with warnings as errors, and runs the product's tests on
# the normal build (./build): unit, conformance, integration (SQLite, PostgreSQL, Spanner),
# MCP, SDKs, bench smoke, lint.
#   --hardening   also the hardening stages, in the same ctest run (CI: .ci/run): fuzz_smoke
#                 (every fuzz target for a few seconds) and sanitize_asan / sanitize_tsan
#                 (ASan+UBSan and TSan over the unit tests and the daemon/server suites).
#                 Each builds a clang tree of its own: about 40 minutes more on a cold cache.
# With MEP_SANITIZERS=asan|tsan|"asan tsan", also the whole suite under those sanitizers
# (scripts/sanitize.sh). Exit status: nonzero when any run failed.
set -euo pipefail
cd "$(dirname "$0")/.."
select=(-LE '^(fuzz|sanitize)$')
case "${1:-}" in
  --hardening) select=() ;;
  "") ;;
  *) echo "usage: scripts/test.sh [--hardening]" >&2; exit 2 ;;
esac
bash packaging/install-deps.sh
bash scripts/build.sh -DMEP_WERROR=ON
# A throwaway PostgreSQL cluster for the *_pg tests (initdb as an unprivileged user,
# loopback only), stopped and removed when the tests end.
root="$(pwd)"
pgdir="$(mktemp -d /tmp/mep-test-pg.XXXXXX)"
# The Cloud Spanner emulator for the *_spanner tests (one database per test class; the
# store's unit rules run on one of their own), stopped by PID when the tests end. Without
# the emulator (its package is the image's, not ours) those tests skip and say why.
spdir="$(mktemp -d /tmp/mep-test-spanner.XXXXXX)"
# The emulator's log outlives it, beside ctest's own (a failure of a *_spanner test can then
# be read against what the emulator said).
trap 'bash "$root/scripts/pg-test-cluster.sh" stop "$pgdir"; rm -rf "$pgdir";
      bash "$root/scripts/spanner-test-emulator.sh" stop "$spdir";
      cp "$spdir/emulator.log" "$root/build/Testing/Temporary/spanner-emulator.log" 2>/dev/null; rm -rf "$spdir"' EXIT
MEP_TEST_PG_URL="$(bash "$root/scripts/pg-test-cluster.sh" start "$pgdir")"
export MEP_TEST_PG_URL
if MEP_TEST_SPANNER_EMULATOR="$(bash "$root/scripts/spanner-test-emulator.sh" start "$spdir")"; then
  export MEP_TEST_SPANNER_EMULATOR
  export MEP_TEST_SPANNER_LOG="$spdir/emulator.log"
  MEP_TEST_SPANNER_URL="$(python3 -c 'import sys; sys.path.insert(0, sys.argv[1]); import spannerfixture
print(spannerfixture.SpannerDb(sys.argv[2]).url)' "$root/tests/integration" "$MEP_TEST_SPANNER_EMULATOR")"
  export MEP_TEST_SPANNER_URL
else
  echo "test.sh: the Spanner emulator is not available; the Spanner tests will say they are skipped"
fi

status=0
# The normal build: the product's tests, and with --hardening the fuzz and sanitizer stages.
# Four at a time on two cores: the integration suites mostly wait on processes, sockets and
# TTLs (two at a time left the CPU 76 % idle); MEP_TEST_JOBS sets another number.
(cd build && ctest -j"${MEP_TEST_JOBS:-4}" --output-on-failure --timeout 600 ${select[@]+"${select[@]}"}) || status=1

# Sanitizer runs (scripts/sanitize.sh), when asked: MEP_SANITIZERS=asan, tsan or "asan tsan".
# They are not part of the default run: a cold sanitizer build alone takes about half an
# hour on two cores, beyond CI's budget.
for kind in ${MEP_SANITIZERS:-}; do
  bash scripts/sanitize.sh "$kind" || status=1
done
exit "$status"
