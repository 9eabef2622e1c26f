// bench_migrate: `mep migrate run` on 1,000,000 legacy rows with 5 % skeleton collisions,
// next to `mep migrate plan` (read + canonicalize + group, no writes) on the same input, on
// SQLite and on PostgreSQL (a private cluster with fsync and synchronous_commit on, started
// with scripts/pg-test-cluster.sh and stopped at the end; or --pg URL, or --pg off).
//
//   build/bench/bench_migrate [--mep PATH] [--rows N] [--pg auto|off|URL]
//
// Reports wall time, rows/s and peak RSS of the child process (wait4's ru_maxrss).
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "run_capture.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

struct Run {
  double seconds = 0;
  long max_rss_kib = 0;
  int status = -1;
};

Run run(const std::vector<std::string>& args) {
  std::fflush(stdout); // the child must not print our buffered output again
  auto start = std::chrono::steady_clock::now();
  pid_t pid = ::fork();
  if (pid == 0) {
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    std::freopen("/dev/null", "w", stdout);
    std::freopen("/dev/null", "w", stderr);
    ::execv(argv[0], argv.data());
    _exit(127);
  }
  int status = 0;
  rusage ru{};
  ::wait4(pid, &status, 0, &ru);
  Run r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.max_rss_kib = ru.ru_maxrss;
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

} // namespace

int main(int argc, char** argv) {
  std::string mep = MEP_BIN_DEFAULT;
  long rows = 1000000;
  std::string pg = "auto";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--mep" && i + 1 < argc)
      mep = argv[++i];
    else if (a == "--rows" && i + 1 < argc)
      rows = std::atol(argv[++i]);
    else if (a == "--pg" && i + 1 < argc)
      pg = argv[++i];
    else {
      std::fprintf(stderr, "usage: bench_migrate [--mep PATH] [--rows N] [--pg auto|off|URL]\n");
      return 2;
    }
  }
  fs::path dir = fs::path("/var/tmp") / ("mep-bench-migrate-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  fs::path input = dir / "legacy.jsonl";
  {
    // 95 % distinct names; 5 % collide with an earlier name through case, width or a
    // confusable digit/letter, so they share its skeleton.
    std::ofstream out(input);
    for (long i = 0; i < rows; ++i) {
      std::string name;
      long base = i;
      if (i % 20 == 19) base = i - 7; // a collision with an earlier row
      name = "Agent" + std::to_string(base);
      if (i % 20 == 19) {
        if (i % 3 == 0)
          name = "AGENT" + std::to_string(base); // case
        else if (i % 3 == 1)
          name = "agent " + std::to_string(base); // spaces
        else
          name = "agent" + std::to_string(base) + ""; // exact duplicate
      }
      int year = 2000 + static_cast<int>(i % 20);
      out << "{\"legacy_id\":\"" << i << "\",\"display_name\":\"" << name << "\",\"created_at\":\"" << year
          << "-01-01T00:00:00Z\",\"legacy_memory_ref\":\"legacy-mem-" << i << "\"}\n";
    }
  }
  // PostgreSQL: a private durable cluster (fsync, synchronous_commit and full page writes
  // on), unless a URL is given or --pg off.
  std::string pg_url, cluster_dir, script = std::string(MEP_SOURCE_DIR_DEFAULT) + "/scripts/pg-test-cluster.sh";
  if (pg != "off") {
    std::string admin = pg;
    if (pg == "auto") {
      cluster_dir = (dir / "cluster").string();
      admin = run_capture("MEP_PG_DURABLE=1 bash '" + script + "' start '" + cluster_dir + "' 2>&1");
    }
    if (admin.rfind("postgresql://", 0) != 0) {
      std::fprintf(stderr, "PostgreSQL not measured: %s\n", admin.c_str());
    } else {
      std::string name = "mep_bench_migrate_" + std::to_string(::getpid());
      run_capture("psql -X -q -d '" + admin + "' -c 'CREATE DATABASE " + name + "' 2>&1");
      auto slash = admin.rfind('/');
      pg_url = admin.substr(0, slash + 1) + name;
    }
  }
  std::printf("mep migrate benchmark — %ld legacy rows, 5 %% collisions; SQLite (WAL, synchronous=FULL)%s\n\n", rows,
              pg_url.empty() ? "" : " and PostgreSQL (fsync, synchronous_commit on), in the same run");
  std::printf("%-12s %-40s %10s %12s %14s %8s\n", "backend", "command", "seconds", "rows/s", "peak RSS MiB", "exit");
  auto row = [&](const char* backend, const char* what, const Run& r) {
    std::printf("%-12s %-40s %10.2f %12.0f %14.1f %8d\n", backend, what, r.seconds,
                static_cast<double>(rows) / r.seconds, static_cast<double>(r.max_rss_kib) / 1024, r.status);
    std::fflush(stdout);
  };
  int failures = 0;
  auto measure = [&](const char* backend, const std::string& db) {
    Run plan =
        run({mep, "migrate", "plan", "--db", db, "--input", input.string(), "--report", (dir / "plan.jsonl").string()});
    row(backend, "mep migrate plan (baseline: no writes)", plan);
    Run first = run({mep, "migrate", "run", "--db", db, "--input", input.string()});
    row(backend, "mep migrate run --batch 10000", first);
    Run again = run({mep, "migrate", "run", "--db", db, "--input", input.string()});
    row(backend, "mep migrate run again (idempotent)", again);
    failures += (plan.status != 0) + (first.status != 0) + (again.status != 0);
  };
  measure("sqlite", "sqlite:" + (dir / "control.db").string());
  if (!pg_url.empty()) measure("postgresql", pg_url);
  std::printf("\ntargets: run <= 60 s and peak RSS <= 500 MiB for 1,000,000 rows\n");
  if (!cluster_dir.empty()) run_capture("bash '" + script + "' stop '" + cluster_dir + "' 2>&1");
  fs::remove_all(dir);
  return failures ? 1 : 0;
}
