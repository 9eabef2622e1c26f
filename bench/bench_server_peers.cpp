// bench_server's peers, measured in the same run: mep on PostgreSQL next to pgbench calling
// the same claim function (the floor), and every workload next to a private etcd 3.4.
// See bench_server.hpp.
#include "bench_server.hpp"
#include "etcd_peer.hpp"
#include "run_capture.hpp"
#include "stats.hpp"

#include <signal.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace mep::bench::srv {

using Clock = std::chrono::steady_clock;

std::string with_db(const std::string& admin_url, const std::string& name) {
  auto slash = admin_url.find('/', admin_url.find("://") + 3);
  auto q = admin_url.find('?', slash);
  return admin_url.substr(0, slash) + "/" + name + (q == std::string::npos ? "" : admin_url.substr(q));
}

std::string psql(const std::string& url, const std::string& sql) {
  return run_capture("psql -X -q -A -t -v ON_ERROR_STOP=1 -d '" + url + "' -c \"" + sql + "\" 2>&1");
}

namespace {

// pgbench with `script` at `clients` clients for `seconds` (whole seconds, at least 1):
// transactions per second and the average latency in ms.
// pgbench runs that did not run at all (missing, cannot connect, script error): the table
// is then incomplete and the benchmark fails.
int g_pgbench_failures = 0;

Result run_pgbench(const std::string& url, const std::string& script_path, int clients, double seconds) {
  int secs = std::max(1, static_cast<int>(seconds + 0.5));
  std::string out =
      run_capture("pgbench -n -M prepared -f '" + script_path + "' -c " + std::to_string(clients) + " -j " +
                  std::to_string(std::min(clients, 2)) + " -T " + std::to_string(secs) + " '" + url + "' 2>&1");
  Result r;
  auto tps = out.find("tps = ");
  auto lat = out.find("latency average = ");
  auto failed = out.find("number of failed transactions: ");
  if (tps == std::string::npos) {
    r.p99_ms = -1;
    // It ran, but no transaction finished within a short window: each new backend compiles
    // the PL/pgSQL functions on its first call, which takes more than a second for 64
    // backends on a loaded 2-core machine (the smoke test's 1 s cells). A rate of 0, not a
    // failure.
    if (out.find("number of transactions actually processed: 0") != std::string::npos) return r;
    std::fprintf(stderr, "pgbench failed:\n%s\n", out.c_str());
    ++g_pgbench_failures;
    r.errors = 1;
    return r;
  }
  r.ops_per_s = std::atof(out.c_str() + tps + 6);
  if (lat != std::string::npos) r.p50_ms = std::atof(out.c_str() + lat + 18);
  if (failed != std::string::npos) r.errors = std::atol(out.c_str() + failed + 31);
  r.p99_ms = -1;
  return r;
}

} // namespace

// The postmaster's pid, when the cluster runs on this machine and this user may read its
// data directory (0 otherwise): its process tree's CPU is the database's.
pid_t postmaster_pid(const std::string& admin_url) {
  std::string dir = psql(admin_url, "SELECT current_setting('data_directory')");
  while (!dir.empty() && (dir.back() == '\n' || dir.back() == ' ')) dir.pop_back();
  std::ifstream f(dir + "/postmaster.pid");
  long pid = 0;
  if (!(f >> pid) || pid <= 0 || ::kill(static_cast<pid_t>(pid), 0) != 0) return 0;
  return static_cast<pid_t>(pid);
}

// Returns false when the PostgreSQL run could not be made (the smoke test then fails).
bool run_postgresql(const std::string& pg_arg, double seconds, const fs::path& scratch, const std::string& etcd_mode) {
  fs::path dir = fs::path("/var/tmp") / ("mep-bench-pg-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::string script = g_source + "/scripts/pg-test-cluster.sh";
  std::string admin = pg_arg;
  bool own = pg_arg == "auto";
  if (own) {
    admin = run_capture("MEP_PG_DURABLE=1 bash '" + script + "' start '" + (dir / "cluster").string() + "'");
    if (admin.rfind("postgresql://", 0) != 0) {
      std::fprintf(stderr, "cannot start PostgreSQL: %s\n", admin.c_str());
      return false;
    }
  }
  std::string name = "mep_bench_" + std::to_string(::getpid());
  psql(admin, "CREATE DATABASE " + name);
  std::string url = with_db(admin, name);
  std::string created = run_capture(g_mep + " token create --db '" + url + "' --tenant bench --json");
  std::string token = field(created, "token"), tenant = field(created, "tenant_id");
  if (token.rfind("mep_", 0) != 0) {
    std::fprintf(stderr, "cannot create a token on PostgreSQL: %s\n", created.c_str());
    return false;
  }
  std::string settings = psql(url, "SELECT current_setting('server_version') || ', fsync=' || current_setting('fsync') "
                                   "|| ', synchronous_commit=' || current_setting('synchronous_commit')");
  // The floor: pgbench calling the same claim function (and release) in one round trip each,
  // with the audit row's event id and hashes given, as the server gives them.
  psql(url, "INSERT INTO memories(memory_id, tenant_id, fence_counter, created_at) SELECT 'pgb-' || g, '" + tenant +
                "', 0, 0 FROM generate_series(0, 63) g");
  // (The token is cut out of the answer's text, as cheaply as the server parses it.)
  std::string claim = "SELECT split_part(split_part(mep_claim_t('" + tenant +
                      "', 'pgb-' || :client_id || '-' || :k, 'fp', 'rid', NULL, 'pgb' || :client_id, "
                      "'pgb' || :client_id, 'pgb' || :client_id, 'pgb-' || :client_id, 'pgbench', 60, "
                      "'lease-' || :client_id || '-' || :k, 'u', 'i', NULL, NULL, 'ev-' || :client_id || '-' || :k, "
                      "'name-hash', 'memory-hash', true), '\"fencing_token\": ', 2), ',', 1) AS tok";
  std::string cycle = (dir / "cycle.sql").string(), reclaim = (dir / "reclaim.sql").string();
  {
    std::ofstream f(cycle);
    f << "\\set k random(1, 1000000000000)\n"
      << claim << " \\gset\n"
      << "SELECT mep_release('" << tenant << "', 'pgb' || :client_id, 'pgb-' || :client_id, :tok, 'pgbench', 'rid');\n";
  }
  {
    std::ofstream f(reclaim);
    f << "\\set k random(1, 1000000000000)\n" << claim << ";\n";
  }
  std::printf(
      "\nmep server on PostgreSQL %s; pool of 16 connections, claims in batches on up to 2 of them; %g s per cell\n"
      "(pgbench rows: the same claim function called directly, one round trip each; p50 column = average)\n\n",
      settings.c_str(), seconds);
  std::printf("%-34s %8s %12s %10s %10s %8s\n", "workload", "clients", "ops/s", "p50 ms", "p99 ms", "errors");
  auto row = [](const char* w, int c, const Result& r) {
    if (r.p99_ms < 0)
      std::printf("%-34s %8d %12.0f %10.3f %10s %8ld", w, c, r.ops_per_s, r.p50_ms, "-", r.errors);
    else
      std::printf("%-34s %8d %12.0f %10.3f %10.3f %8ld", w, c, r.ops_per_s, r.p50_ms, r.p99_ms, r.errors);
    if (r.errors) ++g_failed_cells;
    if (r.p99_ms >= 0 && g_repeat > 1 && r.max_ops > 0) std::printf("   %.0f..%.0f", r.min_ops, r.max_ops);
    std::printf("\n");
    std::fflush(stdout);
  };
  const int counts[] = {1, 8, 64};
  Result floor_cycle[3], floor_reclaim[3], http_cycle[3], http_reclaim[3];
  for (int i = 0; i < 3; ++i)
    row("pgbench claim+release (floor)", counts[i], floor_cycle[i] = run_pgbench(url, cycle, counts[i], seconds));
  Server s;
  start_server(s, url);
  for (int c : counts) row(k_workload_titles[5], c, run_http(s.port, token, c, seconds, 5));
  for (int i = 0; i < 3; ++i)
    row(k_workload_titles[0], counts[i], http_cycle[i] = run_http(s.port, token, counts[i], seconds, 0));
  for (int i = 0; i < 3; ++i)
    row("pgbench claim (re-claim, floor)", counts[i], floor_reclaim[i] = run_pgbench(url, reclaim, counts[i], seconds));
  for (int i = 0; i < 3; ++i)
    row(k_workload_titles[2], counts[i], http_reclaim[i] = run_http(s.port, token, counts[i], seconds, 2));
  for (int c : counts) row("HTTP renew", c, run_http(s.port, token, c, seconds, 1));
  std::printf("\nTarget: claims at >= 50%% of pgbench's rate; distinct claims scale from 1 to 8 clients.\n");
  for (int i = 0; i < 3; ++i)
    std::printf("  %2d clients: claim+release %.0f%% of pgbench, re-claim %.0f%% of pgbench\n", counts[i],
                100 * http_cycle[i].ops_per_s / std::max(1.0, floor_cycle[i].ops_per_s),
                100 * http_reclaim[i].ops_per_s / std::max(1.0, floor_reclaim[i].ops_per_s));
  std::printf("  scaling 1 -> 8 clients (claim+release on distinct names): %.2fx\n",
              http_cycle[1].ops_per_s / std::max(1.0, http_cycle[0].ops_per_s));
  compare_with_etcd(s, token, scratch, seconds, etcd_mode, true, postmaster_pid(admin), url);
  ::kill(s.pid, SIGTERM);
  ::waitpid(s.pid, nullptr, 0);
  s.pid = -1;
  psql(admin, "DROP DATABASE IF EXISTS " + name + " WITH (FORCE)");
  if (own) run_capture("bash '" + script + "' stop '" + (dir / "cluster").string() + "'");
  fs::remove_all(dir);
  if (g_pgbench_failures > 0) {
    std::fprintf(stderr, "pgbench did not run: the PostgreSQL table is incomplete\n");
    return false;
  }
  return true;
}

using mep::bench::median;

// The round whose pauses were the median share of its time.
mep::bench::Stalls median_stalls(std::vector<mep::bench::Stalls> v) {
  if (v.empty()) return {};
  std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.percent() < b.percent(); });
  return v[v.size() / 2];
}

// "9.6 % (19 pauses over 1 ms, the longest 12.3 ms)", and whether the probe could run real-time.
std::string describe(const mep::bench::Stalls& s) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "%.1f %% (%ld pauses over 1 ms, the longest %.1f ms%s)", s.percent(), s.count,
                s.max_ms, s.realtime ? "" : "; probe not real-time: counts scheduling delays too");
  return buf;
}

// mep next to etcd, measured now on this machine: for each workload and client count,
// rounds of a mep cell then an etcd cell (interleaved, so that drift hits both), the
// medians, their ranges, and the median of the per-round ratios against the targets.
// The private etcd of this run, started on first use (nullptr: not measured, said why).
std::unique_ptr<mep::bench::EtcdPeer> g_etcd;
bool g_etcd_tried = false;

mep::bench::EtcdPeer* etcd_peer(const fs::path& dir, const std::string& mode) {
  if (mode == "off") return nullptr;
  if (g_etcd_tried) return g_etcd.get();
  g_etcd_tried = true;
  const std::string why = mep::bench::etcd_unavailable();
  if (!why.empty()) {
    std::printf("\netcd: not measured here: %s\n", why.c_str());
    return nullptr;
  }
  try {
    g_etcd = std::make_unique<mep::bench::EtcdPeer>(dir / "etcd");
  } catch (const std::exception& e) {
    std::printf("\netcd: not measured here: %s\n", e.what());
    ++g_failed_cells;
  }
  return g_etcd.get();
}

void compare_with_etcd(Server& s, const std::string& token, const fs::path& dir, double seconds,
                       const std::string& mode, bool postgresql, pid_t db_pid, const std::string& pg_url) {
  mep::bench::EtcdPeer* etcd = etcd_peer(dir, mode);
  if (!etcd) return;
  const int rounds = g_rounds > 0 ? g_rounds : g_repeat > 1 ? g_repeat : 3;
  std::printf("\nmep (%s, above) and %s, single node, fresh data dir, WAL fsync on; C++ gRPC clients, a\n"
              "thread each, measured both multiplexed on one connection (as clientv3 does) and with a connection\n"
              "each: the better of the two is etcd's figure (the other in brackets). Interleaved: %d rounds of a\n"
              "mep cell then the etcd cells, %g s each; medians (range). The workloads (bench/README.md says\n"
              "what each side does, call by call):\n"
              "  claim    a fresh name on a fresh, registered memory / etcd LeaseGrant + Txn put-if-absent of a\n"
              "           fresh key: what an agent's first claim is. The headline.\n"
              "  re-claim the same owner claims its held name again (a new token) / etcd Txn put of the client's\n"
              "           own key if it is still its own (a new mod_revision), one raft write\n"
              "  contend  an attempt at a name about 4 clients want (mep claim, released when it wins / etcd Txn\n"
              "           put-if-absent with a lease granted for it, revoked when it wins)\n"
              "  cycle    mep claim+release / etcd LeaseGrant + Txn + LeaseRevoke\n"
              "  renew    mep renew / etcd LeaseKeepAlive on a stream\n"
              "  batch    leases renewed by mep renew-batch (%d a request, as mepd sends them) / LeaseKeepAlive\n"
              "cpu: cores used by the clients (this process) / by the server, during the cell. paused: share of\n"
              "the cell's time the whole machine stood still (a real-time probe thread woke over 1 ms late; on a\n"
              "VM, the host), mep's / etcd's: every request in flight waits it out.%s\n\n",
              postgresql ? "PostgreSQL" : "SQLite", etcd->version().c_str(), rounds, seconds, k_batch_leases,
              !postgresql ? ""
              : db_pid    ? "\ndb ms/op: CPU of PostgreSQL's processes (the postmaster's tree, from /proc) during\n"
                            "the mep cell, in ms per operation (from when its clients are set up); WAL B/op: WAL\n"
                            "bytes written per operation (pg_current_wal_lsn() around the cell)."
                          : "\ndb ms/op: not measured (the cluster's postmaster is not readable from here).");
  const bool db_cpu = postgresql && db_pid > 0;
  const bool wal = postgresql && !pg_url.empty();
  std::printf("%-9s %7s %22s %31s %9s %13s %13s %12s%s%s\n", "workload", "clients", "mep ops/s", "etcd ops/s [other]",
              "mep/etcd", "mep cpu c/s", "etcd cpu c/s", "paused %", db_cpu ? "  db ms/op" : "",
              wal ? "  WAL B/op" : "");
  struct Cell {
    int mode;
    const char* name;
    int etcd_mode; // etcd's equivalent workload (EtcdPeer::run)
    int per_op;    // what one mep operation counts for (the leases of a renew-batch)
  };
  double claim_ratio[2] = {0, 0};
  double claim_db_ms[2] = {0, 0};
  double renew_p99_64 = 0, keepalive_p99_64 = 0;
  mep::bench::Stalls renew_paused_64, keepalive_paused_64; // the median round's
  // Leases kept alive per second per core of the server (and of the database): mep's
  // renew-batch, etcd's LeaseKeepAlive.
  double batch_per_core[2] = {0, 0}, keepalive_per_core[2] = {0, 0};
  const int counts[] = {8, 64};
  for (Cell cell : {Cell{5, "claim", 2, 1}, Cell{2, "re-claim", 4, 1}, Cell{3, "contend", 3, 1}, Cell{0, "cycle", 0, 1},
                    Cell{1, "renew", 1, 1}, Cell{4, "batch", 1, k_batch_leases}}) {
    for (int i = 0; i < 2; ++i) {
      const int clients = counts[i];
      std::vector<double> m_ops, e_ops, e_other, ratios, m_p99, e_p99, ccpu, scpu, mccpu, mscpu, db_ms, wal_b,
          m_per_core, e_per_core;
      std::vector<mep::bench::Stalls> m_stalls, e_stalls;
      std::vector<double> e_mux, e_each;
      long errors = 0;
      for (int r = 0; r < rounds; ++r) {
        double c0 = 0, s0 = 0, d0 = 0;
        std::string lsn0;
        auto t0 = Clock::now();
        Result m = run_http_once(s.port, token, clients, seconds, cell.mode, [&] {
          c0 = mep::bench::process_cpu_seconds(::getpid());
          s0 = mep::bench::process_cpu_seconds(s.pid);
          d0 = db_cpu ? mep::bench::process_tree_cpu_seconds(db_pid) : 0;
          if (wal) lsn0 = psql(pg_url, "SELECT pg_current_wal_lsn()");
          t0 = Clock::now();
        });
        m.ops_per_s *= cell.per_op;
        const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
        const double db_s = db_cpu ? mep::bench::process_tree_cpu_seconds(db_pid) - d0 : 0;
        if (wal && m.ops_per_s > 0)
          wal_b.push_back(
              std::atof(psql(pg_url, "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '" + lsn0 + "')").c_str()) /
              (m.ops_per_s * wall));
        mccpu.push_back((mep::bench::process_cpu_seconds(::getpid()) - c0) / wall);
        mscpu.push_back((mep::bench::process_cpu_seconds(s.pid) - s0) / wall);
        if (db_cpu && m.ops_per_s > 0) db_ms.push_back(db_s * 1000 / (m.ops_per_s * seconds));
        const double m_cores = mscpu.back() + db_s / wall;
        m_per_core.push_back(m_cores > 0 ? m.ops_per_s / m_cores : 0);
        // etcd both ways; the better is its figure for this round.
        mep::bench::EtcdResult e1 = etcd->run(clients, seconds, cell.etcd_mode, 1);
        mep::bench::EtcdResult en = etcd->run(clients, seconds, cell.etcd_mode, clients);
        e_mux.push_back(e1.ops_per_s);
        e_each.push_back(en.ops_per_s);
        const bool mux_better = e1.ops_per_s >= en.ops_per_s;
        const mep::bench::EtcdResult& e = mux_better ? e1 : en;
        e_other.push_back(mux_better ? en.ops_per_s : e1.ops_per_s);
        e_per_core.push_back(e.server_cores > 0 ? e.ops_per_s / e.server_cores : 0);
        m_ops.push_back(m.ops_per_s);
        m_p99.push_back(m.p99_ms);
        e_p99.push_back(e.p99_ms);
        m_stalls.push_back(m.paused);
        e_stalls.push_back(e.paused);
        e_ops.push_back(e.ops_per_s);
        ratios.push_back(e.ops_per_s > 0 ? m.ops_per_s / e.ops_per_s : 0);
        ccpu.push_back(e.client_cores);
        scpu.push_back(e.server_cores);
        errors += m.errors + e1.errors + en.errors;
      }
      const bool mux = median(e_mux) >= median(e_each);
      char etcd_col[64];
      std::snprintf(etcd_col, sizeof etcd_col, "%s %s [%.0f %s]", mep::bench::median_range(e_ops).c_str(),
                    mux ? "1c" : "Nc", median(e_other), mux ? "Nc" : "1c");
      std::printf("%-9s %7d %22s %31s %8.2fx   %4.2f / %-4.2f   %4.2f / %-4.2f  %4.1f / %-4.1f", cell.name, clients,
                  mep::bench::median_range(m_ops).c_str(), etcd_col, median(ratios), median(mccpu), median(mscpu),
                  median(ccpu), median(scpu), median_stalls(m_stalls).percent(), median_stalls(e_stalls).percent());
      if (db_cpu) std::printf("  %9.3f", median(db_ms));
      if (wal) std::printf("  %8.0f", median(wal_b));
      std::printf("%s\n", errors ? "  ERRORS" : "");
      if (errors) ++g_failed_cells;
      if (cell.mode == 5) claim_ratio[i] = median(ratios);
      if (cell.mode == 5) claim_db_ms[i] = median(db_ms);
      if (cell.mode == 1 && clients == 64) {
        renew_p99_64 = median(m_p99);
        keepalive_p99_64 = median(e_p99);
        renew_paused_64 = median_stalls(m_stalls);
        keepalive_paused_64 = median_stalls(e_stalls);
      }
      if (cell.mode == 4) batch_per_core[i] = median(m_per_core), keepalive_per_core[i] = median(e_per_core);
      std::fflush(stdout);
    }
  }
  std::printf("(1c: etcd's clients multiplexed on one connection; Nc: a connection per client)\n");
  if (g_fresh_inline > 0)
    std::printf("fresh claims: %ld memories were registered inside the cells (the pools ran out)\n",
                g_fresh_inline.load());
  std::printf("\nleases kept alive per second per core (the server's%s, medians of the rounds):\n",
              db_cpu ? " and the database's" : "");
  for (int i = 0; i < 2; ++i)
    std::printf("  %2d clients: mep renew-batch %.0f, etcd LeaseKeepAlive %.0f: %.2fx\n", counts[i], batch_per_core[i],
                keepalive_per_core[i], keepalive_per_core[i] > 0 ? batch_per_core[i] / keepalive_per_core[i] : 0);
  auto met = [](bool ok) { return ok ? "met" : "NOT met"; };
  std::printf("\ntargets (issue 52), from this run (claims: fresh name, fresh memory):\n");
  if (postgresql) {
    std::printf("  PostgreSQL fresh claims,  8 clients >= 1.0x etcd:  %.2fx  %s\n", claim_ratio[0],
                met(claim_ratio[0] >= 1.0));
    std::printf("  PostgreSQL fresh claims, 64 clients >= 1.25x etcd: %.2fx  %s\n", claim_ratio[1],
                met(claim_ratio[1] >= 1.25));
    if (db_cpu)
      for (int i : {0, 1})
        std::printf("  PostgreSQL database CPU per fresh claim, %2d clients: %.3f ms\n", counts[i], claim_db_ms[i]);
    else
      std::printf("  PostgreSQL database CPU per claim: not measured (postmaster not readable)\n");
    return;
  }
  std::printf("  SQLite fresh claims,  8 clients >= 3.0x etcd: %.2fx  %s\n", claim_ratio[0],
              met(claim_ratio[0] >= 3.0));
  std::printf("  SQLite fresh claims, 64 clients >= 3.0x etcd: %.2fx  %s\n", claim_ratio[1],
              met(claim_ratio[1] >= 3.0));
  std::printf("  SQLite renew p99, 64 clients <= 5 ms:   %.2f ms  %s\n", renew_p99_64, met(renew_p99_64 <= 5.0));
  std::printf("    in the same cells, etcd LeaseKeepAlive p99: %.2f ms\n"
              "    the machine stood still in mep's cells for %s,\n"
              "    in etcd's for %s\n",
              keepalive_p99_64, describe(renew_paused_64).c_str(), describe(keepalive_paused_64).c_str());
}

void stop_etcd() { g_etcd.reset(); }

} // namespace mep::bench::srv
