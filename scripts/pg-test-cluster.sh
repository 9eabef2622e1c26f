#!/usr/bin/env bash
# A throwaway PostgreSQL cluster for the tests: initdb in a directory of ours, run as an
# unprivileged user (postgres when we are root), listening on 127.0.0.1 and on a Unix
# socket inside that directory. Nothing outside the directory is touched.
#
#   pg-test-cluster.sh start DIR   initdb + start (or start again after stop, same port; a
#                                  cluster already running there is left as it is);
#                                  prints the URL (postgresql://…/postgres)
#   pg-test-cluster.sh stop DIR    fast shutdown (the directory is left for the caller)
set -euo pipefail

die() { echo "pg-test-cluster: $*" >&2; exit 1; }

bindir=""
for d in /usr/lib/postgresql/*/bin; do
  [[ -x "$d/initdb" ]] && bindir="$d"
done
[[ -n "$bindir" ]] || die "PostgreSQL server binaries not found (install postgresql-15)"

cmd="${1:-}"
dir="${2:-}"
[[ -n "$cmd" && -n "$dir" ]] || die "usage: pg-test-cluster.sh start|stop DIR"

as_owner() {
  if [[ "$(id -u)" == 0 ]]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

case "$cmd" in
  start)
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    if [[ "$(id -u)" == 0 ]]; then
      id postgres >/dev/null 2>&1 || die "user postgres does not exist (install postgresql-15)"
      chown postgres: "$dir"
    fi
    chmod 0700 "$dir"
    if [[ -f "$dir/port" && -d "$dir/data" ]]; then
      port="$(cat "$dir/port")" # started before: already running, or start it again, same port
      if as_owner "$bindir/pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then
        echo "postgresql://mep@127.0.0.1:$port/postgres"
        exit 0
      fi
    else
      port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
      as_owner "$bindir/initdb" -D "$dir/data" -U mep --auth=trust --no-sync -E UTF8 --locale=C.UTF-8 \
        >"$dir/initdb.log" 2>&1 || { cat "$dir/initdb.log" >&2; die "initdb failed"; }
    fi
    # Tests trade durability for speed (fsync off); MEP_PG_DURABLE=1 (the benchmark) keeps
    # PostgreSQL's defaults: fsync on, synchronous_commit on, full page writes.
    opts="-c listen_addresses=127.0.0.1 -p $port -k $dir -c max_connections=400 -c shared_buffers=128MB"
    if [[ "${MEP_PG_DURABLE:-0}" != 1 ]]; then
      opts="$opts -c fsync=off -c full_page_writes=off"
    fi
    # MEP_PG_OPTS: more server options (bench/pg_statements.sh preloads pg_stat_statements).
    opts="$opts ${MEP_PG_OPTS:-}"
    as_owner "$bindir/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 -o "$opts" start >/dev/null \
      || { cat "$dir/server.log" >&2; die "pg_ctl start failed"; }
    echo "$port" >"$dir/port"
    echo "postgresql://mep@127.0.0.1:$port/postgres"
    ;;
  stop)
    [[ -d "$dir/data" ]] || exit 0
    as_owner "$bindir/pg_ctl" -D "$dir/data" -m fast -w -t 30 stop >/dev/null 2>&1 || true
    ;;
  *)
    die "unknown command $cmd (start or stop)"
    ;;
esac
