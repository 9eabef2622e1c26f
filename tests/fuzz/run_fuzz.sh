#!/usr/bin/env bash
# Builds (with clang, in a nested build directory) and runs mep's libFuzzer targets for a
# fixed time each; fails on any crash, invariant violation or sanitizer report.
#
#   run_fuzz.sh build SOURCE_DIR WORK_DIR SECONDS TARGET...  configure WORK_DIR/build with
#                                                            clang and MEP_FUZZ=ON, build, run
#   run_fuzz.sh run   BINARY_DIR WORK_DIR SECONDS TARGET...  run targets already built in
#                                                            BINARY_DIR (fuzz_TARGET)
#
# The nested tree is also where CI runs unit tests and integration suites under ASan + UBSan
# (tests/sanitize/run_sanitized.sh asan).
#
# Exit status: 0 clean, 1 findings or build failure, 77 skipped (no clang or no libFuzzer
# runtime; ctest's SKIP_RETURN_CODE). New corpus entries go to WORK_DIR/corpus/TARGET, crash
# inputs to WORK_DIR/artifacts/TARGET/; the seed corpus in the source tree is only read.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
mode="${1:?usage: run_fuzz.sh build SOURCE_DIR WORK_DIR [SECONDS] | run BINARY WORK_DIR [SECONDS]}"
target="${2:?missing SOURCE_DIR or BINARY}"
work="${3:?missing WORK_DIR}"
seconds="${4:-10}"
shift 4 || true
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(canonicalize)
skip=77
mkdir -p "$work"

if [[ "$mode" == build ]]; then
  # 1. Find clang and check that it can link a libFuzzer binary with the sanitizers.
  cxx="${MEP_FUZZ_CXX:-}"
  if [[ -z "$cxx" ]]; then
    for c in clang++ clang++-14; do
      if command -v "$c" >/dev/null; then cxx="$(command -v "$c")"; break; fi
    done
  fi
  if [[ -z "$cxx" ]]; then
    echo "SKIP: clang++ not found; the fuzz target needs clang's libFuzzer (apt install clang-14 libclang-rt-14-dev)"
    exit "$skip"
  fi
  cc="${cxx/clang++/clang}"
  probe="$work/probe"
  if ! printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' |
      "$cxx" -x c++ - -fsanitize=fuzzer,address,undefined -o "$probe" 2>"$probe.log"; then
    echo "SKIP: $cxx cannot link -fsanitize=fuzzer,address,undefined (libclang-rt-14-dev missing?):"
    cat "$probe.log"
    exit "$skip"
  fi
  rm -f "$probe" "$probe.log"

  # 2. Configure the nested build (clang, MEP_FUZZ=ON) and build only the fuzz target.
  cmake_exe="${CMAKE:-cmake}"
  extra=()
  if [[ -n "${MEP_CONFORMANCE_DIR:-}" ]]; then extra+=("-DMEP_CONFORMANCE_DIR=$MEP_CONFORMANCE_DIR"); fi
  # CCACHE_BASEDIR: a clone in another folder (CI clones anew each time) hits the cache.
  export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}" CCACHE_BASEDIR="$(cd "$target" && pwd)" CCACHE_NOHASHDIR=1
  echo "== configuring $work/build with $cxx"
  CC="$cc" CXX="$cxx" "$cmake_exe" -S "$target" -B "$work/build" -G Ninja \
    -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" \
    -DMEP_FUZZ=ON -DMEP_BUILD_TESTS=ON -DMEP_BUILD_BENCH=OFF "${extra[@]}" >"$work/configure.log" 2>&1 ||
    { cat "$work/configure.log"; echo "FAIL: configuring the fuzz build"; exit 1; }
  echo "== building the fuzz targets (${targets[*]})"
  "$cmake_exe" --build "$work/build" --target fuzz_all -j 2 ||
    { echo "FAIL: building the fuzz targets"; exit 1; }
  bindir="$work/build/tests/fuzz"
elif [[ "$mode" == run ]]; then
  bindir="$target"
else
  echo "run_fuzz.sh: unknown mode '$mode'" >&2
  exit 2
fi

# 3. Fuzz each target: the work corpus first (libFuzzer writes new inputs there), the seeds
#    second; then the verdict: libFuzzer's exit status, and any sanitizer report even if it
#    did not halt.
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
export ASAN_OPTIONS="detect_leaks=1"
failed=0
for t in "${targets[@]}"; do
  binary="$bindir/fuzz_$t"
  corpus="$work/corpus/$t"
  artifacts="$work/artifacts/$t"
  mkdir -p "$corpus" "$artifacts"
  log="$work/fuzz_$t.log"
  dict=()
  [[ -f "$here/$t.dict" ]] && dict=(-dict="$here/$t.dict")
  echo "== fuzzing $t for ${seconds}s"
  set +e
  "$binary" -max_total_time="$seconds" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 "${dict[@]}" -artifact_prefix="$artifacts/" "$corpus" "$here/corpus/$t" >"$log" 2>&1
  rc=$?
  set -e
  grep -E '^(#[0-9]+[[:space:]]+(INITED|DONE)|stat::number_of_executed_units|Done )' "$log" || true
  if [[ $rc -ne 0 ]] || grep -qE 'runtime error:|ERROR: (Address|Leak|UndefinedBehavior)Sanitizer|invariant violated' "$log"; then
    echo "FAIL: fuzz_$t exited with $rc; log follows (crash inputs in $artifacts/)"
    tail -n 80 "$log"
    failed=1
  fi
done
[[ $failed -eq 0 ]] || exit 1
echo "PASS: no crash, no sanitizer report, invariants held (${targets[*]})"
