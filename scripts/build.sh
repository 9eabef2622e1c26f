#!/usr/bin/env bash
# Configures and builds mep into ./build (ccache, Ninja), or into $MEP_BUILD_DIR. Extra
# arguments go to cmake.
set -euo pipefail
cd "$(dirname "$0")/.."
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}"
# Cache hits across checkouts in different folders (CI clones anew each time).
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1
jobs="${MEP_JOBS:-$(nproc)}"
dir="${MEP_BUILD_DIR:-build}"
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
cmake --build "$dir" -j "$jobs"
