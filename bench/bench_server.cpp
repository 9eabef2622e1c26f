// bench_server: control-plane throughput and latency over real HTTP (keep-alive), next
// to the same claim transaction run directly on SQLite at the same durability, and to etcd.
//
//   build/bench/bench_server [--mep PATH] [--seconds S] [--repeat N] [--rounds N] [--rss-leases N] [--pg auto|off|URL]
//   [--etcd auto|off]
//                            [--keys ordered|random|counter] [--driver threads|epoll] [--only WORKLOAD:CLIENTS]
//
// Starts the real `mep server` on a fresh SQLite file (on disk, synchronous=FULL), runs
// fresh claims (a new name on a new memory), claim+release cycles, same-owner re-claims and
// renews at 1, 8 and 64 clients, then each workload next to its etcd equivalent (both etcd
// client setups, the better kept), then fills the server with N live leases (each renewed
// twice) and reads its RSS. Then the same on PostgreSQL (a throwaway cluster with
// PostgreSQL's durable defaults, or the cluster whose maintenance URL is given), next to
// pgbench running the same claim function directly in one round trip (the floor).
// Prints tables. Nothing here asserts a timing.
//
// The cells' clients are in bench_server_drive.cpp, PostgreSQL and etcd in
// bench_server_peers.cpp; bench_server.hpp is what the three share.
#include "bench_server.hpp"
#include "etcd_peer.hpp"
#include "run_capture.hpp"
#include "stats.hpp"

#include <signal.h>
#include <sqlite3.h>
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

std::string g_mep = MEP_BIN_DEFAULT;
std::string g_source = MEP_SOURCE_DIR_DEFAULT;
int g_repeat = 1;
int g_rounds = 0;
int g_failed_cells = 0;
double g_seconds = 3;
std::atomic<long> g_fresh_inline{0};

void start_server(Server& s, const std::string& db) {
  int pipefd[2];
  if (::pipe(pipefd) != 0) throw std::runtime_error("pipe");
  s.pid = ::fork();
  if (s.pid == 0) {
    ::dup2(pipefd[1], 2);
    ::close(pipefd[0]);
    ::execl(g_mep.c_str(), g_mep.c_str(), "server", "--db", db.c_str(), "--listen", "127.0.0.1:0", "--rate-limit", "0",
            "--log-level", "warn", "--threads", "2", nullptr);
    _exit(127);
  }
  ::close(pipefd[1]);
  std::string line, before; // before: what the server said before it was ready
  char c;
  auto deadline = Clock::now() + std::chrono::seconds(20);
  while (Clock::now() < deadline && ::read(pipefd[0], &c, 1) == 1) {
    if (c != '\n') {
      line += c;
      continue;
    }
    auto at = line.find("listening on http://127.0.0.1:");
    if (at != std::string::npos) {
      s.port = std::atoi(line.c_str() + at + 30);
      break;
    }
    before += line + "\n";
    line.clear();
  }
  // Keep draining stderr in the background so the server never blocks on it.
  std::thread([fd = pipefd[0]] {
    char b[4096];
    while (::read(fd, b, sizeof b) > 0) {}
    ::close(fd);
  }).detach();
  if (!s.port) throw std::runtime_error("mep server did not become ready:\n" + before + line);
}

// The nice value of the server's commit thread (`mep server --writer-nice`, best effort),

Result summarize(std::vector<std::vector<double>>& lat, double secs, long errors) {
  std::vector<double> all;
  for (auto& v : lat) all.insert(all.end(), v.begin(), v.end());
  Result r;
  r.errors = errors;
  if (all.empty()) return r;
  std::sort(all.begin(), all.end());
  r.ops_per_s = static_cast<double>(all.size()) / secs;
  r.p50_ms = all[all.size() / 2];
  r.p99_ms = all[std::min(all.size() - 1, all.size() * 99 / 100)];
  return r;
}

} // namespace mep::bench::srv

namespace {

using namespace mep::bench::srv;
using Clock = std::chrono::steady_clock;

// A directory removed with what is in it when the run ends, failed or not.
struct ScratchDir {
  fs::path path;
  explicit ScratchDir(fs::path p) : path(std::move(p)) { fs::create_directories(path); }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
};

// as a line under a table: tables from runs that differ in it do not compare.
std::string writer_nice_line(pid_t pid) {
  std::error_code ec;
  for (const auto& t : fs::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    std::ifstream comm(t.path() / "comm");
    std::string name;
    std::getline(comm, name);
    if (name != "mep-writer") continue;
    errno = 0; // getpriority(2) on a thread id: that thread's nice value, which may be -1
    int nice = ::getpriority(PRIO_PROCESS, static_cast<id_t>(std::stoi(t.path().filename().string())));
    if (errno != 0) break;
    return "server's commit thread (mep-writer): nice " + std::to_string(nice);
  }
  return "server's commit thread (mep-writer): not found";
}

long rss_kib(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::atol(line.c_str() + 6);
  return -1;
}

std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

// How this machine's CPUs idle. On a VM whose idle vCPUs halt at once (cpuidle driver
// haltpoll with guest_halt_poll_ns=0), every wake of a sleeping thread costs a VM exit and
// entry, and request latency pays for each. In one run with halt polling at 200 us, the
// same binary ran the 1-client cycles about 60 % and the 8-client cycles about 20 % faster
// than its usual runs here. Printed above the table, so that tables compare like with like.
std::string cpu_idle_policy() {
  std::string driver = read_line("/sys/devices/system/cpu/cpuidle/current_driver");
  if (driver.empty()) return "cpuidle: unknown";
  std::string out = "cpuidle: " + driver;
  if (driver != "haltpoll") return out;
  std::string poll = read_line("/sys/module/haltpoll/parameters/guest_halt_poll_ns");
  return poll.empty() ? out : out + ", guest_halt_poll_ns=" + poll;
}

// --only WORKLOAD:CLIENTS, one HTTP cell alone (for A/B runs of one cell): the workload's
// mode (see Script) and the number of clients; false for a value it does not know.
struct Only {
  int mode = -1; // none: the whole benchmark
  int clients = 0;
};
Only g_only;

bool parse_only(std::string_view v) {
  auto colon = v.find(':');
  if (colon == std::string_view::npos) return false;
  std::string_view w = v.substr(0, colon);
  int clients = std::atoi(std::string(v.substr(colon + 1)).c_str());
  if (clients < 1 || clients > 1024) return false;
  if (w == "cycles")
    g_only = {0, clients};
  else if (w == "reclaim")
    g_only = {2, clients};
  else if (w == "renew")
    g_only = {1, clients};
  else if (w == "contend")
    g_only = {3, clients};
  else if (w == "batch")
    g_only = {4, clients};
  else if (w == "fresh")
    g_only = {5, clients};
  else
    return false;
  return true;
}

void exec_sql(sqlite3* db, const char* sql) {
  char* err = nullptr;
  if (sqlite3_exec(db, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    std::string m = err ? err : "?";
    sqlite3_free(err);
    throw std::runtime_error(m);
  }
}

// The floor: the claim transaction (and the release) straight on SQLite, one client,
// one transaction per operation, WAL + synchronous=FULL like the server.
Result run_direct_sqlite(const std::string& path, double seconds) {
  sqlite3* db = nullptr;
  sqlite3_open(path.c_str(), &db);
  exec_sql(
      db,
      "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;"
      "CREATE TABLE memories(memory_id TEXT PRIMARY KEY, tenant_id TEXT, fence_counter INTEGER, created_at INTEGER);"
      "CREATE TABLE leases(lease_id TEXT PRIMARY KEY, tenant_id TEXT, canonical_name TEXT UNIQUE, skeleton TEXT UNIQUE,"
      " memory_id TEXT UNIQUE, fencing_token INTEGER, owner_client_id TEXT, expires_at INTEGER);"
      "CREATE INDEX le ON leases(expires_at);"
      "CREATE TABLE audit_events(event_id TEXT PRIMARY KEY, event_type TEXT, h TEXT, created_at INTEGER);"
      "INSERT INTO memories VALUES ('m1', 't', 0, 0);");
  auto prep = [&](const char* sql) {
    sqlite3_stmt* s = nullptr;
    sqlite3_prepare_v2(db, sql, -1, &s, nullptr);
    return s;
  };
  sqlite3_stmt* sel_mem = prep("SELECT tenant_id, fence_counter FROM memories WHERE memory_id='m1'");
  sqlite3_stmt* del_exp =
      prep("DELETE FROM leases WHERE (canonical_name='n' OR skeleton='n' OR memory_id='m1') AND expires_at <= ?1");
  sqlite3_stmt* sel_live =
      prep("SELECT lease_id FROM leases WHERE canonical_name='n' OR skeleton='n' OR memory_id='m1'");
  sqlite3_stmt* upd = prep("UPDATE memories SET fence_counter = fence_counter + 1 WHERE memory_id='m1'");
  sqlite3_stmt* ins = prep("INSERT INTO leases VALUES (?1, 't', 'n', 'n', 'm1', 1, 'o', ?2)");
  sqlite3_stmt* aud = prep("INSERT INTO audit_events VALUES (?1, 'LEASE_ACQUIRED', 'h', ?2)");
  sqlite3_stmt* rel = prep("DELETE FROM leases WHERE memory_id='m1'");
  auto step = [](sqlite3_stmt* s) {
    while (sqlite3_step(s) == SQLITE_ROW) {}
    sqlite3_reset(s);
  };
  std::vector<std::vector<double>> lat(1);
  long k = 0;
  auto start = Clock::now();
  auto end = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  while (Clock::now() < end) {
    auto t0 = Clock::now();
    long now =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count();
    exec_sql(db, "BEGIN IMMEDIATE");
    step(sel_mem);
    sqlite3_bind_int64(del_exp, 1, now);
    step(del_exp);
    step(sel_live);
    step(upd);
    std::string id = "l" + std::to_string(k++);
    sqlite3_bind_text(ins, 1, id.c_str(), -1, SQLITE_TRANSIENT);
    sqlite3_bind_int64(ins, 2, now + 30000);
    step(ins);
    sqlite3_bind_text(aud, 1, id.c_str(), -1, SQLITE_TRANSIENT);
    sqlite3_bind_int64(aud, 2, now);
    step(aud);
    exec_sql(db, "COMMIT");
    exec_sql(db, "BEGIN IMMEDIATE");
    step(rel);
    exec_sql(db, "COMMIT");
    lat[0].push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  double secs = std::chrono::duration<double>(Clock::now() - start).count();
  for (auto* s : {sel_mem, del_exp, sel_live, upd, ins, aud, rel}) sqlite3_finalize(s);
  sqlite3_close(db);
  return summarize(lat, secs, 0);
}

// Fills the server with `n` live leases (ttl 300 s) from 16 clients, each renewed twice as
// a holder keeps it (on SQLite the second renewal is answered from memory, which then holds
// the lease); returns RSS in KiB.
long fill_and_measure(const Server& s, const std::string& token, int n) {
  std::atomic<int> next{0};
  std::atomic<long> errors{0};
  std::vector<std::thread> threads;
  std::string run = uid();
  for (int t = 0; t < 16; ++t)
    threads.emplace_back([&] {
      Conn c(s.port);
      for (int i; (i = next++) < n;) {
        std::string tag = run + "-" + std::to_string(i);
        auto [st, reg] = c.request("POST", "/v1/memories", token, "{}", "r" + tag);
        std::string body = "{\"display_name\":\"fill" + std::to_string(i) + "\",\"memory_instance_id\":\"" +
                           field(reg, "memory_instance_id") + "\",\"owner_client_id\":\"fill\",\"ttl_seconds\":300}";
        auto [cs, cb] = c.request("POST", "/v1/leases", token, body, "c" + tag);
        if (cs != 201) {
          ++errors;
          continue;
        }
        const std::string renew = "{\"canonical_name\":\"" + field(cb, "canonical_name") +
                                  "\",\"memory_instance_id\":\"" + field(reg, "memory_instance_id") +
                                  "\",\"fencing_token\":" + field(cb, "fencing_token") +
                                  ",\"owner_client_id\":\"fill\",\"ttl_seconds\":300}";
        for (int r = 0; r < 2; ++r)
          if (c.request("POST", "/v1/leases/renew", token, renew, "").first != 200) ++errors;
      }
    });
  for (auto& t : threads) t.join();
  if (errors) {
    std::fprintf(stderr, "fill: %ld errors\n", errors.load());
    ++g_failed_cells;
  }
  return rss_kib(s.pid);
}

} // namespace

static int run(int argc, char** argv) {
  double seconds = 3;
  int rss_leases = 100000;
  std::string pg = "auto";
  std::string etcd_mode = "auto";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--mep" && i + 1 < argc)
      g_mep = argv[++i];
    else if (a == "--seconds" && i + 1 < argc)
      seconds = std::atof(argv[++i]);
    else if (a == "--rss-leases" && i + 1 < argc)
      rss_leases = std::atoi(argv[++i]);
    else if (a == "--pg" && i + 1 < argc)
      pg = argv[++i];
    else if (a == "--etcd" && i + 1 < argc)
      etcd_mode = argv[++i];
    else if (a == "--repeat" && i + 1 < argc)
      g_repeat = std::max(1, std::atoi(argv[++i]));
    else if (a == "--rounds" && i + 1 < argc)
      g_rounds = std::max(1, std::atoi(argv[++i]));
    else if (a == "--keys" && i + 1 < argc && parse_keys(argv[i + 1]))
      ++i;
    else if (a == "--driver" && i + 1 < argc && parse_driver(argv[i + 1]))
      ++i;
    else if (a == "--only" && i + 1 < argc && parse_only(argv[i + 1]))
      ++i;
    else {
      std::fprintf(
          stderr,
          "usage: bench_server [--mep PATH] [--seconds S] [--repeat N] [--rounds N] [--rss-leases N] "
          "[--pg auto|off|URL] [--etcd auto|off] [--keys ordered|random|counter] [--driver threads|epoll] "
          "[--only fresh|cycles|reclaim|renew|contend|batch:CLIENTS (with --pg URL: on a fresh database there)]\n");
      return 2;
    }
  }
  ::signal(SIGPIPE, SIG_IGN);
  g_seconds = seconds;
  ScratchDir scratch(fs::path("/var/tmp") / ("mep-bench-" + std::to_string(::getpid())));
  const fs::path& dir = scratch.path;
  std::string db = "sqlite:" + (dir / "control.db").string();
  std::string token = run_capture(g_mep + " token create --db " + db + " --tenant bench");
  if (token.rfind("mep_", 0) != 0) {
    std::fprintf(stderr, "cannot create a token with %s\n", g_mep.c_str());
    return 1;
  }

  std::printf("mep server benchmark — SQLite, WAL, synchronous=FULL, keep-alive HTTP on loopback, %g s per cell\n",
              seconds);
  std::printf("%ld CPUs, %s; clients: --driver %s\n", ::sysconf(_SC_NPROCESSORS_ONLN), cpu_idle_policy().c_str(),
              driver_name());
  if (g_repeat > 1) std::printf("HTTP cells run %d times each: the median run, then the range of ops/s\n", g_repeat);
  std::printf("\n");
  std::printf("%-34s %8s %12s %10s %10s %8s\n", "workload", "clients", "ops/s", "p50 ms", "p99 ms", "errors");
  auto row = [](const char* w, int c, const Result& r) {
    std::printf("%-34s %8d %12.0f %10.3f %10.3f %8ld", w, c, r.ops_per_s, r.p50_ms, r.p99_ms, r.errors);
    if (r.errors) ++g_failed_cells;
    if (g_repeat > 1 && r.max_ops > 0) std::printf("   %.0f..%.0f", r.min_ops, r.max_ops);
    std::printf("\n");
    std::fflush(stdout);
  };
  Server s;
  if (g_only.mode >= 0) {
    // One cell, nothing else: no floor, no RSS. With --pg URL, on a fresh database there
    // (for A/B pairs of builds on PostgreSQL); else on SQLite.
    if (pg.rfind("postgresql://", 0) == 0) {
      std::string name = "mep_bench_only_" + std::to_string(::getpid());
      psql(pg, "CREATE DATABASE " + name);
      db = with_db(pg, name);
      token = field(run_capture(g_mep + " token create --db '" + db + "' --tenant bench --json"), "token");
      if (token.rfind("mep_", 0) != 0) {
        std::fprintf(stderr, "cannot create a token on %s\n", db.c_str());
        return 1;
      }
    }
    start_server(s, db);
    // Read before the cell: a writer that last committed renewals alone runs at the
    // process's own nice until its next synced commit (SqliteStore::writer_loop).
    const std::string nice_line = writer_nice_line(s.pid);
    const pid_t db_pid = pg.rfind("postgresql://", 0) == 0 ? postmaster_pid(pg) : 0;
    // On PostgreSQL one run, whose database CPU is counted from when its clients are set up.
    double d0 = 0;
    Result r = db_pid ? run_http_once(s.port, token, g_only.clients, seconds, g_only.mode,
                                      [&] { d0 = mep::bench::process_tree_cpu_seconds(db_pid); })
                      : run_http(s.port, token, g_only.clients, seconds, g_only.mode);
    row(k_workload_titles[g_only.mode], g_only.clients, r);
    std::printf("the machine stood still for %s of the cell\n", describe(r.paused).c_str());
    if (db_pid && r.ops_per_s > 0)
      std::printf("db ms/op: %.3f (CPU of PostgreSQL's processes, from /proc, per operation)\n",
                  (mep::bench::process_tree_cpu_seconds(db_pid) - d0) * 1000 / (r.ops_per_s * seconds));
    std::printf("%s\n", nice_line.c_str());
    return g_failed_cells > 0 ? 1 : 0; // ~Server stops the server, then ~ScratchDir
  }
  Result floor = run_direct_sqlite((dir / "direct.db").string(), seconds);
  row("direct SQLite claim+release (floor)", 1, floor);
  start_server(s, db);
  for (int clients : {1, 8, 64}) row(k_workload_titles[5], clients, run_http(s.port, token, clients, seconds, 5));
  std::vector<std::pair<int, Result>> claims;
  for (int clients : {1, 8, 64}) {
    Result r = run_http(s.port, token, clients, seconds, 0);
    claims.emplace_back(clients, r);
    row(k_workload_titles[0], clients, r);
  }
  std::vector<std::pair<int, Result>> reclaims;
  for (int clients : {1, 8, 64}) {
    Result r = run_http(s.port, token, clients, seconds, 2);
    reclaims.emplace_back(clients, r);
    row(k_workload_titles[2], clients, r);
  }
  // Read after synced commits: renewals alone commit at the process's own nice.
  const std::string nice_line = writer_nice_line(s.pid);
  for (int clients : {1, 8, 64}) row(k_workload_titles[1], clients, run_http(s.port, token, clients, seconds, 1));
  std::printf("%s\n", nice_line.c_str());

  compare_with_etcd(s, token, dir, seconds, etcd_mode, false);

  if (rss_leases > 0) {
    long before = rss_kib(s.pid);
    long after = fill_and_measure(s, token, rss_leases);
    const double after_mib = static_cast<double>(after) / 1024;
    std::printf("\nserver RSS: %.1f MiB before, %.1f MiB holding %d live leases, each renewed\n",
                static_cast<double>(before) / 1024, after_mib, rss_leases);
    if (rss_leases == 100000) // the target's own count
      std::printf("  server RSS with 100,000 live leases <= 64 MiB: %.1f MiB  %s\n", after_mib,
                  after_mib <= 64 ? "met" : "NOT met");
  }
  ::kill(s.pid, SIGTERM);
  ::waitpid(s.pid, nullptr, 0);
  s.pid = -1;
  if (pg != "off" && !run_postgresql(pg, seconds, dir, etcd_mode)) return 1;
  stop_etcd(); // stopped by PID before the scratch directory goes
  if (g_failed_cells > 0) {
    std::fprintf(stderr, "bench_server: requests failed in %d cells (see the errors column)\n", g_failed_cells);
    return 1;
  }
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_server: %s\n", e.what());
    return 1;
  }
}
