#!/usr/bin/env bash
# The fuzz campaign: builds the libFuzzer targets with clang (ASan + UBSan) into
# ./build-fuzz and fuzzes each for MEP_FUZZ_SECONDS (600 unless set). CI runs the same
# targets for 10 s each as the ctest `fuzz_smoke`; run this before a release or after
# touching a parser. The corpus grows in build-fuzz/corpus/TARGET and is kept between runs;
# crash inputs land in build-fuzz/artifacts/TARGET/ (add them to tests/fuzz/corpus/TARGET
# with a regress_ name once fixed).
#
#   scripts/fuzz.sh                 every target
#   scripts/fuzz.sh json config     some of them
set -euo pipefail
cd "$(dirname "$0")/.."
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(canonicalize json http_request daemon_request store_headers config migrate_input)
exec bash tests/fuzz/run_fuzz.sh build "$PWD" "$PWD/build-fuzz" "${MEP_FUZZ_SECONDS:-600}" "${targets[@]}"
