#!/usr/bin/env bash
# The Cloud Spanner emulator for the tests (Debian package google-cloud-cli-spanner-emulator:
# gateway_main runs emulator_main as its child), on free loopback ports, its log and pid in a
# directory of ours. Nothing outside it is touched; all state is in memory.
#
#   spanner-test-emulator.sh start DIR   starts it; prints its REST URL (http://127.0.0.1:PORT)
#   spanner-test-emulator.sh stop DIR    stops both processes by PID
# Exit 77 from start when the emulator is not installed (the tests then skip, saying why).
set -euo pipefail

cmd="${1:-}"
dir="${2:-}"
[[ -n "$cmd" && -n "$dir" ]] || { echo "usage: spanner-test-emulator.sh start|stop DIR" >&2; exit 2; }

bin=""
for d in /usr/lib/google-cloud-sdk/bin/cloud_spanner_emulator /usr/share/google-cloud-sdk/bin/cloud_spanner_emulator; do
  [[ -x "$d/gateway_main" ]] && bin="$d"
done

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

case "$cmd" in
start)
  [[ -n "$bin" ]] || { echo "spanner-test-emulator: not installed (google-cloud-cli-spanner-emulator)" >&2; exit 77; }
  mkdir -p "$dir"
  http=$(free_port)
  grpc=$(free_port)
  "$bin/gateway_main" --hostname 127.0.0.1 --grpc_port "$grpc" --http_port "$http" \
    --grpc_binary "$bin/emulator_main" >"$dir/emulator.log" 2>&1 </dev/null &
  echo $! >"$dir/gateway.pid"
  for _ in $(seq 1 300); do
    if curl -sf "http://127.0.0.1:$http/v1/projects/mep-test/instances" >/dev/null 2>&1; then
      echo "http://127.0.0.1:$http"
      exit 0
    fi
    kill -0 "$(cat "$dir/gateway.pid")" 2>/dev/null || break
    sleep 0.1
  done
  echo "spanner-test-emulator: did not start; its log:" >&2
  tail -20 "$dir/emulator.log" >&2
  exit 1
  ;;
stop)
  [[ -f "$dir/gateway.pid" ]] || exit 0
  gw=$(cat "$dir/gateway.pid")
  # emulator_main outlives a SIGTERM to the gateway: both by PID.
  children=$(pgrep -P "$gw" || true)
  kill -9 $children "$gw" 2>/dev/null || true
  for _ in $(seq 1 100); do
    alive=0
    for p in $children $gw; do kill -0 "$p" 2>/dev/null && alive=1; done
    [[ $alive == 0 ]] && break
    sleep 0.05
  done
  rm -f "$dir/gateway.pid"
  ;;
*)
  echo "usage: spanner-test-emulator.sh start|stop DIR" >&2
  exit 2
  ;;
esac
