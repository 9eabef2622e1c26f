#!/usr/bin/env bash
# Installs the dependencies, builds, and runs mep on its embedded default: mepd with the
# control plane in-process on SQLite (no server to set up). Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash packaging/install-deps.sh
bash scripts/build.sh
socket="${MEP_SOCKET:-${XDG_RUNTIME_DIR:-/tmp/mep-$(id -u)}/mep/mepd.sock}"
export MEP_SOCKET="$socket"
cat <<MSG

mep is built in ./build. Starting mepd (embedded control plane) on $socket.
In another terminal (with MEP_SOCKET=$socket):
  ./build/cli/mep init demo.uai
  ./build/cli/mep claim "My Agent" demo.uai
  ./build/cli/mep branch demo.uai work.uai
  ./build/cli/mep run worker work.uai -- sh -c 'echo token \$MEP_FENCING_TOKEN'
  ./build/cli/mep status
MSG
exec ./build/daemon/mepd --socket "$socket"
