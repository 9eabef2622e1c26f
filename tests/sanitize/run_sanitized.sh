#!/usr/bin/env bash
# Runs unit tests and integration suites on binaries built with a sanitizer, and fails on
# any test failure or any sanitizer report — also a report from a server or daemon that a
# test stopped without looking at its exit status (the reports go to files, one per process).
#
#   run_sanitized.sh asan TREE SOURCE_DIR SUITE...   TREE is the nested clang tree fuzz_smoke
#                                                    configured (every mep library built with
#                                                    ASan + UBSan); skipped (77) without it
#   run_sanitized.sh tsan TREE SOURCE_DIR SUITE...   TREE is configured here with clang and
#                                                    ThreadSanitizer when it is not yet
#
# A SUITE is a unit test executable (unit_daemon) or an integration module (test_daemon.py),
# run on SQLite. Only the targets the suites need are built (ccache, CCACHE_BASEDIR so that
# clones in other folders share the cache). Exit status: 0 clean, 1 failed or reported, 77
# skipped (no clang, no tree). $PYTHON is the interpreter for the modules (python3).
set -euo pipefail
kind="${1:?usage: run_sanitized.sh asan|tsan TREE SOURCE_DIR SUITE...}"
tree="$(realpath -m "${2:?missing TREE}")"
src="$(cd "${3:?missing SOURCE_DIR}" && pwd)"
shift 3
suites=("$@")
cmake_exe="${CMAKE:-cmake}"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}" CCACHE_BASEDIR="$src" CCACHE_NOHASHDIR=1

case "$kind" in
asan)
  if [[ ! -f "$tree/build.ninja" ]]; then
    echo "SKIP: the ASan tree ($tree) is not there: fuzz_smoke configures it (and skips without clang)"
    exit 77
  fi
  ;;
tsan)
  if [[ ! -f "$tree/build.ninja" ]]; then
    cxx=""
    for c in clang++ clang++-14; do
      if command -v "$c" >/dev/null; then cxx="$(command -v "$c")"; break; fi
    done
    if [[ -z "$cxx" ]]; then
      echo "SKIP: clang++ not found; the ThreadSanitizer build needs clang (apt install clang-14)"
      exit 77
    fi
    echo "== configuring $tree with $cxx and ThreadSanitizer"
    mkdir -p "$tree"
    "$cmake_exe" -S "$src" -B "$tree" -G Ninja -DCMAKE_C_COMPILER="${cxx/clang++/clang}" -DCMAKE_CXX_COMPILER="$cxx" \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" \
      -DMEP_SANITIZE_THREAD=ON -DMEP_BUILD_TESTS=ON -DMEP_BUILD_BENCH=OFF >"$tree.configure.log" 2>&1 ||
      { cat "$tree.configure.log"; echo "FAIL: configuring the ThreadSanitizer build"; exit 1; }
  fi
  ;;
*)
  echo "run_sanitized.sh: unknown sanitizer '$kind' (asan or tsan)" >&2
  exit 2
  ;;
esac

# What to build: the unit tests named, and mep and mepd for any integration module.
targets=()
integration=0
for s in "${suites[@]}"; do
  if [[ "$s" == *.py ]]; then integration=1; else targets+=("$s"); fi
done
[[ $integration -eq 1 ]] && targets+=(mep mepd)
echo "== building ${targets[*]} in $tree ($kind)"
"$cmake_exe" --build "$tree" --target "${targets[@]}" -j 2 || { echo "FAIL: building ${targets[*]}"; exit 1; }

reports="$tree/sanitizer-reports"
rm -rf "$reports"
mkdir -p "$reports"
# log_path: each process writes its reports to a file of its own, which this script reads
# at the end; the processes' stderr stays what the tests expect.
case "$kind" in
asan)
  export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:log_path=$reports/asan"
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$reports/ubsan"
  ;;
tsan)
  export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:log_path=$reports/tsan"
  ;;
esac
export MEP_TEST_SANITIZED="$kind" MEP_BIN="$tree/cli/mep" MEPD_BIN="$tree/daemon/mepd" MEP_SOURCE_DIR="$src" \
  MEP_BUILD_DIR="$tree" MEP_TEST_BACKEND=sqlite PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$src/tests/integration"

failed=()
for s in "${suites[@]}"; do
  log="$tree/$s.log"
  start=$SECONDS
  if [[ "$s" == *.py ]]; then
    (cd "$src/tests/integration" && timeout 900 "${PYTHON:-python3}" -m unittest "$s") >"$log" 2>&1 && rc=0 || rc=$?
  else
    timeout 900 "$tree/tests/unit/$s" >"$log" 2>&1 && rc=0 || rc=$?
  fi
  if [[ $rc -eq 0 ]]; then
    echo "== $s: passed ($((SECONDS - start)) s) $(grep -v '^\s*$' "$log" | tail -n 1)"
  else
    echo "== $s: FAILED (exit $rc, $((SECONDS - start)) s); the end of its log:"
    tail -n 60 "$log"
    failed+=("$s")
  fi
done

shopt -s nullglob
found=("$reports"/*)
if [[ ${#found[@]} -gt 0 ]]; then
  echo "== $kind reported in ${#found[@]} process(es):"
  for f in "${found[@]}"; do
    echo "--- $f"
    head -n 60 "$f"
  done
  failed+=("$kind reports")
fi
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "FAIL: ${failed[*]}"
  exit 1
fi
echo "PASS: ${suites[*]} under $kind, no reports"
