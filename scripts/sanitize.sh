#!/usr/bin/env bash
# Builds mep with sanitizers and runs the tests under them (clang -O1, ccache):
#   scripts/sanitize.sh asan   AddressSanitizer + UndefinedBehaviorSanitizer, instrumented for
#                              libFuzzer too, into ./build-asan: the whole suite (but the .deb,
#                              which packages the normal build) and the fuzz targets' smoke run
#   scripts/sanitize.sh tsan   ThreadSanitizer into ./build-tsan: the unit tests and the suites
#                              where many threads meet (server concurrency and faults, daemon,
#                              store, data plane, waits)
# A finding ends the process, so its test fails. Needs what scripts/test.sh installs, and
# $MEP_TEST_PG_URL for the PostgreSQL tests (scripts/test.sh starts a cluster and calls this
# when MEP_SANITIZERS is set). A cold build takes about half an hour on two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
kind="${1:-}"
san=(-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG"
     -DMEP_BUILD_BENCH=OFF)
case "$kind" in
asan)
  echo "== AddressSanitizer + UndefinedBehaviorSanitizer (and the fuzz targets)"
  MEP_BUILD_DIR=build-asan bash scripts/build.sh "${san[@]}" -DMEP_FUZZ=ON -DMEP_SANITIZE_ADDRESS=OFF \
    -DMEP_SANITIZE_UNDEFINED=OFF
  cd build-asan
  MEP_TEST_SANITIZED=asan ASAN_OPTIONS="detect_leaks=1:abort_on_error=0" \
    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
    ctest -j2 --output-on-failure --timeout 900 -E "^cli_deb$"
  ;;
tsan)
  echo "== ThreadSanitizer"
  MEP_BUILD_DIR=build-tsan bash scripts/build.sh "${san[@]}" -DMEP_SANITIZE_THREAD=ON
  cd build-tsan
  MEP_TEST_SANITIZED=tsan TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1" \
    ctest -j2 --output-on-failure --timeout 900 \
    -R "^(unit_|integration_server_history|integration_server_faults|integration_daemon$|integration_store|integration_data_plane|integration_waits$|cli_daemon)"
  ;;
*)
  echo "usage: scripts/sanitize.sh asan|tsan" >&2
  exit 2
  ;;
esac
