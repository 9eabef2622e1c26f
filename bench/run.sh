#!/usr/bin/env bash
# Builds and runs one benchmark: bench/run.sh NAME [ARGS...], e.g. bench/run.sh canonicalize.
# Uses the build directory $MEP_BUILD_DIR (default ./build), configuring it if needed.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
name="${1:?usage: bench/run.sh NAME [ARGS...]   (NAME: canonicalize, server, store, daemon, migrate)}"
shift
build="${MEP_BUILD_DIR:-$root/build}"
if [[ ! -f "$build/build.ninja" ]]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
cmake --build "$build" --target "bench_$name" -j "${MEP_JOBS:-2}" >/dev/null
exec "$build/bench/bench_$name" "$@"
