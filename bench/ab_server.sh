#!/usr/bin/env bash
# A/B of two mep binaries on the server benchmark's cells, interleaved A B A B … in one run
# on this machine: bench/ab_server.sh A_MEP B_MEP [ROUNDS] [SECONDS] [CELL ...]
# (CELL: cycles|reclaim|renew|contend|batch:CLIENTS, default cycles:1 cycles:8 reclaim:64 renew:64).
# Prints, per cell, each binary's median ops/s over the rounds with its range, the median
# of the per-round ratios B/A, and each binary's median p99 latency. Needs bench_server
# built (bench/run.sh builds it).
# MEP_BENCH_PG=postgresql://… runs the cells on PostgreSQL (a fresh database per cell), and
# adds each binary's median database CPU per operation (when the cluster runs here).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
a="${1:?usage: bench/ab_server.sh A_MEP B_MEP [ROUNDS] [SECONDS] [CELL ...]}"
b="${2:?usage: bench/ab_server.sh A_MEP B_MEP [ROUNDS] [SECONDS] [CELL ...]}"
rounds="${3:-5}"
seconds="${4:-4}"
shift $(( $# < 4 ? $# : 4 ))
cells=("$@")
[[ ${#cells[@]} -gt 0 ]] || cells=(cycles:1 cycles:8 reclaim:64 renew:64)
bench="${MEP_BUILD_DIR:-$root/build}/bench/bench_server"
[[ -x "$bench" ]] || { echo "ab_server: $bench not built (bench/run.sh server --help builds it)" >&2; exit 2; }

pg=()
[[ -n "${MEP_BENCH_PG:-}" ]] && pg=(--pg "$MEP_BENCH_PG") # on PostgreSQL: a fresh database there per cell
one() { # MEP CELL -> "ops/s db-ms/op p99-ms" (db ms/op: 0 when not on PostgreSQL)
  "$bench" --mep "$1" --only "$2" --seconds "$seconds" "${pg[@]}" 2>/dev/null |
    awk 'BEGIN { ops = 0; db = 0; p99 = 0 }
         $0 ~ /^HTTP/ && !ops { for (i = 1; i <= NF; ++i) if ($i ~ /^[0-9]+$/ && $(i+1) ~ /^[0-9]+$/) { ops = $(i+1); p99 = $(i+3); break } }
         $1 == "db" && $2 == "ms/op:" { db = $3 }
         END { print ops, db, p99 }'
}

printf '%-14s %8s %22s %22s %14s\n' cell rounds "A ops/s median (range)" "B ops/s median (range)" "B/A median"
for cell in "${cells[@]}"; do
  as=() bs=() ratios=() ads=() bds=() aps=() bps=()
  for ((r = 0; r < rounds; ++r)); do
    read -r x xd xp <<<"$(one "$a" "$cell")"; read -r y yd yp <<<"$(one "$b" "$cell")"
    as+=("$x"); bs+=("$y"); ratios+=("$(awk -v x="$x" -v y="$y" 'BEGIN { printf "%.3f", (x > 0 ? y / x : 0) }')")
    ads+=("$xd"); bds+=("$yd"); aps+=("$xp"); bps+=("$yp")
  done
  stats() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf "%s (%s-%s)", m, v[1], v[NR] }'; }
  med() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { printf "%.3f", (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
  printf '%-14s %8s %22s %22s %14s' "$cell" "$rounds" "$(stats "${as[@]}")" "$(stats "${bs[@]}")" "$(med "${ratios[@]}")"
  printf '   p99 ms A %s  B %s' "$(med "${aps[@]}")" "$(med "${bps[@]}")"
  [[ ${#pg[@]} -gt 0 ]] && printf '   db ms/op A %s  B %s' "$(med "${ads[@]}")" "$(med "${bds[@]}")"
  printf '\n'

done
