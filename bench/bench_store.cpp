// bench_store: fenced PUTs to the real `mep store` next to the floor measured in the same
// run — the same bytes written to files directly with write + fsync + rename — for 4 KiB and
// 1 MiB objects at 1, 8 and 64 clients, interleaved cell by cell (store, floor, then floor,
// store in the next round); and the store's RSS while 64 clients upload 256 MiB objects.
// Prints a table; asserts nothing.
#include "http_conn.hpp"
#include "stats.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

namespace {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using mep::bench::HttpConn;

struct Options {
  std::string mep = MEP_BIN_DEFAULT;
  double seconds = 3;
  int rounds = 3;
  std::vector<std::size_t> sizes{4096, 1 << 20};
  std::vector<int> clients{1, 8, 64};
  int rss_clients = 64;
  std::size_t rss_object = 256u << 20;
  std::string dir;
};

struct Cell {
  double ops = 0; // per second
  double p50_ms = 0, p99_ms = 0;
  long errors = 0;
};

double percentile(std::vector<double>& v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())))];
}

using mep::bench::median;

std::string run_capture(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) throw std::runtime_error("cannot run " + cmd);
  char buf[512];
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  if (::pclose(p) != 0) throw std::runtime_error(cmd + " failed");
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

// `mep store` on a fresh directory; stopped by its PID.
class Store {
public:
  Store(const Options& o, const fs::path& dir) {
    fs::create_directories(dir);
    m_token = run_capture("'" + o.mep + "' token new");
    std::ofstream(dir / "hashes") << run_capture("'" + o.mep + "' token hash " + m_token) << "\n";
    int err[2];
    if (::pipe(err) != 0) throw std::runtime_error("pipe");
    m_pid = ::fork();
    if (m_pid == 0) {
      ::dup2(err[1], 2);
      ::close(err[0]);
      ::close(err[1]);
      const std::string data = (dir / "data").string(), hashes = (dir / "hashes").string();
      ::execl(o.mep.c_str(), o.mep.c_str(), "store", "--listen", "127.0.0.1:0", "--dir", data.c_str(), "--token-file",
              hashes.c_str(), "--log-level", "warn", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::close(err[1]);
    std::string seen;
    char buf[256];
    auto deadline = Clock::now() + std::chrono::seconds(30);
    while (Clock::now() < deadline) {
      ssize_t n = ::read(err[0], buf, sizeof buf);
      if (n <= 0) break;
      seen.append(buf, static_cast<std::size_t>(n));
      auto at = seen.find("listening on http://127.0.0.1:");
      if (at != std::string::npos && seen.find('\n', at) != std::string::npos) {
        m_port = std::atoi(seen.c_str() + at + 30);
        break;
      }
    }
    m_err = err[0];
    if (!m_port) {
      stop();
      throw std::runtime_error("mep store did not start: " + seen);
    }
  }
  ~Store() { stop(); }
  void stop() {
    if (m_pid > 0) {
      ::kill(m_pid, SIGTERM);
      int st;
      ::waitpid(m_pid, &st, 0);
      m_pid = -1;
    }
    if (m_err >= 0) ::close(m_err);
    m_err = -1;
  }
  int port() const { return m_port; }
  pid_t pid() const { return m_pid; }
  const std::string& token() const { return m_token; }

private:
  pid_t m_pid = -1;
  int m_port = 0;
  int m_err = -1;
  std::string m_token;
};

std::string memory_id(int i, int round) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "01900000-0000-7000-8000-%06d%06d", round, i);
  return buf;
}

// Runs `op` on `n` threads for `seconds`; each call is one timed operation (false: an error).
Cell measure(int n, double seconds, const std::function<bool(int, std::uint64_t)>& op) {
  std::atomic<bool> stop{false};
  std::vector<std::vector<double>> lat(static_cast<std::size_t>(n));
  std::vector<long> errors(static_cast<std::size_t>(n), 0);
  std::vector<std::thread> threads;
  const auto start = Clock::now();
  for (int t = 0; t < n; ++t) {
    threads.emplace_back([&, t] {
      for (std::uint64_t k = 0; !stop.load(std::memory_order_relaxed); ++k) {
        auto a = Clock::now();
        bool ok = op(t, k);
        lat[static_cast<std::size_t>(t)].push_back(std::chrono::duration<double, std::milli>(Clock::now() - a).count());
        if (!ok) ++errors[static_cast<std::size_t>(t)];
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop = true;
  for (auto& th : threads) th.join();
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  std::vector<double> all;
  Cell c;
  for (int t = 0; t < n; ++t) {
    all.insert(all.end(), lat[static_cast<std::size_t>(t)].begin(), lat[static_cast<std::size_t>(t)].end());
    c.errors += errors[static_cast<std::size_t>(t)];
  }
  c.ops = static_cast<double>(all.size()) / elapsed;
  c.p50_ms = percentile(all, 0.50);
  c.p99_ms = percentile(all, 0.99);
  return c;
}

Cell store_cell(const Store& s, std::size_t size, int clients, double seconds, int round) {
  std::string body(size, 'm');
  std::vector<HttpConn> conns;
  std::vector<std::string> heads;
  for (int i = 0; i < clients; ++i) {
    conns.push_back(HttpConn::tcp(s.port()));
    heads.push_back("PUT /v1/objects/" + memory_id(i, round) + " HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer " +
                    s.token() + "\r\nFencing-Token: 1\r\nContent-Type: application/octet-stream\r\nContent-Length: " +
                    std::to_string(size) + "\r\n\r\n");
  }
  return measure(clients, seconds, [&](int t, std::uint64_t) {
    auto& c = conns[static_cast<std::size_t>(t)];
    c.send_all(heads[static_cast<std::size_t>(t)]);
    c.send_all(body);
    return c.request_bytes(std::string()).first == 200;
  });
}

// The floor: the same bytes to a file of each client's own with write + fsync, then renamed
// over the previous version (what an object store does at the least).
Cell floor_cell(const fs::path& dir, std::size_t size, int clients, double seconds) {
  fs::create_directories(dir);
  std::string body(size, 'm');
  return measure(clients, seconds, [&](int t, std::uint64_t k) {
    std::string final_path = (dir / ("obj-" + std::to_string(t))).string();
    std::string tmp = final_path + ".tmp" + std::to_string(k & 1);
    int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return false;
    bool ok = true;
    for (std::size_t off = 0; off < size && ok;) {
      ssize_t w = ::write(fd, body.data() + off, size - off);
      if (w <= 0)
        ok = false;
      else
        off += static_cast<std::size_t>(w);
    }
    ok = ok && ::fsync(fd) == 0;
    ::close(fd);
    return ok && ::rename(tmp.c_str(), final_path.c_str()) == 0;
  });
}

long rss_kib(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::atol(line.c_str() + 6);
  return 0;
}

std::string human_size(std::size_t b) {
  if (b >= (1u << 20) && b % (1u << 20) == 0) return std::to_string(b >> 20) + " MiB";
  if (b >= 1024 && b % 1024 == 0) return std::to_string(b >> 10) + " KiB";
  return std::to_string(b) + " B";
}

int usage() {
  std::fprintf(stderr, "usage: bench_store [--mep PATH] [--seconds S] [--rounds N] [--dir DIR] [--clients 1,8,64]\n"
                       "                   [--rss-clients N] [--rss-object-mib M] [--quick]\n");
  return 2;
}

} // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--mep")
      o.mep = next();
    else if (a == "--seconds")
      o.seconds = std::atof(next().c_str());
    else if (a == "--rounds")
      o.rounds = std::atoi(next().c_str());
    else if (a == "--dir")
      o.dir = next();
    else if (a == "--rss-clients")
      o.rss_clients = std::atoi(next().c_str());
    else if (a == "--rss-object-mib")
      o.rss_object = static_cast<std::size_t>(std::atoi(next().c_str())) << 20;
    else if (a == "--clients") {
      o.clients.clear();
      std::string v = next();
      for (std::size_t p = 0; p < v.size();) {
        auto q = v.find(',', p);
        o.clients.push_back(std::atoi(v.substr(p, q - p).c_str()));
        p = q == std::string::npos ? v.size() : q + 1;
      }
    } else if (a == "--quick") {
      o.seconds = 0.3;
      o.rounds = 1;
      o.clients = {1, 4};
      o.rss_clients = 4;
      o.rss_object = 8u << 20;
    } else
      return usage();
  }
  if (o.seconds <= 0 || o.rounds < 1 || o.clients.empty()) return usage();
  std::signal(SIGPIPE, SIG_IGN);
  const fs::path dir =
      o.dir.empty() ? fs::path("/var/tmp") / ("mep-bench-store-" + std::to_string(::getpid())) : fs::path(o.dir);
  fs::create_directories(dir);
  int rc = 0;
  try {
    Store store(o, dir / "store");
    std::printf(
        "mep store benchmark — fenced PUTs (keep-alive HTTP on loopback) against write + fsync + rename of the\n"
        "same bytes, on the same file system (%s), %g s per cell, %d round%s interleaved; %u CPUs\n",
        dir.c_str(), o.seconds, o.rounds, o.rounds == 1 ? "" : "s", std::thread::hardware_concurrency());
    std::printf(
        "each client writes its own memory (token 1); the table gives the median round and the range of ratios\n\n");
    std::printf("%-7s %7s | %10s %9s %8s %8s | %10s %9s %8s %8s | %6s %s\n", "object", "clients", "store/s", "MiB/s",
                "p50 ms", "p99 ms", "floor/s", "MiB/s", "p50 ms", "p99 ms", "ratio", "range");
    struct Row {
      std::size_t size;
      int clients;
      std::vector<Cell> s, f;
      std::vector<double> ratios;
    };
    std::vector<Row> rows;
    for (auto size : o.sizes)
      for (int c : o.clients) rows.push_back(Row{size, c, {}, {}, {}});
    for (int round = 0; round < o.rounds; ++round) {
      for (auto& r : rows) {
        Cell s, f;
        if (round % 2 == 0) {
          s = store_cell(store, r.size, r.clients, o.seconds, round);
          f = floor_cell(dir / "floor", r.size, r.clients, o.seconds);
        } else {
          f = floor_cell(dir / "floor", r.size, r.clients, o.seconds);
          s = store_cell(store, r.size, r.clients, o.seconds, round);
        }
        r.s.push_back(s);
        r.f.push_back(f);
        r.ratios.push_back(f.ops > 0 ? s.ops / f.ops : 0);
      }
    }
    auto med_cell = [](std::vector<Cell> v) {
      std::sort(v.begin(), v.end(), [](const Cell& a, const Cell& b) { return a.ops < b.ops; });
      return v[v.size() / 2];
    };
    for (auto& r : rows) {
      Cell s = med_cell(r.s), f = med_cell(r.f);
      const double mib = static_cast<double>(r.size) / (1 << 20);
      auto [lo, hi] = std::minmax_element(r.ratios.begin(), r.ratios.end());
      std::printf("%-7s %7d | %10.0f %9.1f %8.2f %8.2f | %10.0f %9.1f %8.2f %8.2f | %5.0f%% %3.0f-%.0f%%%s\n",
                  human_size(r.size).c_str(), r.clients, s.ops, s.ops * mib, s.p50_ms, s.p99_ms, f.ops, f.ops * mib,
                  f.p50_ms, f.p99_ms, 100 * median(r.ratios), 100 * *lo, 100 * *hi,
                  s.errors ? ("  (" + std::to_string(s.errors) + " store errors)").c_str() : "");
    }
    std::printf("\ntargets (median ratio of the rounds):\n");
    for (auto& r : rows) {
      double need = r.size == 4096 && r.clients == 8 ? 0.70 : r.size == (1u << 20) ? 0.80 : 0;
      if (need == 0) continue;
      double m = median(r.ratios);
      std::printf("  %s at %d clients >= %.0f %% of the floor: %.0f %% — %s\n", human_size(r.size).c_str(), r.clients,
                  100 * need, 100 * m, m >= need ? "met" : "NOT met");
    }

    // RSS while many clients upload large objects at once.
    const std::uint64_t need = static_cast<std::uint64_t>(o.rss_clients) * o.rss_object * 2;
    struct statvfs vfs {};
    ::statvfs(dir.c_str(), &vfs);
    const std::uint64_t free_bytes = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    if (o.rss_clients <= 0) {
      // no RSS cell asked for
    } else if (free_bytes < need) {
      std::printf("\nRSS cell skipped: it needs %llu MiB free in %s, %llu MiB are\n",
                  static_cast<unsigned long long>(need >> 20), dir.c_str(),
                  static_cast<unsigned long long>(free_bytes >> 20));
    } else {
      std::atomic<bool> done{false};
      std::atomic<long> peak{rss_kib(store.pid())};
      std::thread sampler([&] {
        while (!done) {
          peak = std::max(peak.load(), rss_kib(store.pid()));
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
      });
      std::atomic<int> ok{0};
      std::vector<std::thread> up;
      const auto t0 = Clock::now();
      for (int i = 0; i < o.rss_clients; ++i) {
        up.emplace_back([&, i] {
          try {
            auto c = HttpConn::tcp(store.port());
            c.send_all("PUT /v1/objects/" + memory_id(i, 999) + " HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer " +
                       store.token() + "\r\nFencing-Token: 1\r\nContent-Length: " + std::to_string(o.rss_object) +
                       "\r\n\r\n");
            std::string chunk(1 << 20, 'r');
            for (std::size_t sent = 0; sent < o.rss_object; sent += chunk.size()) c.send_all(chunk);
            if (c.request_bytes(std::string()).first == 200) ++ok;
          } catch (const std::exception&) {}
        });
      }
      for (auto& t : up) t.join();
      done = true;
      sampler.join();
      const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
      std::printf("\nstore RSS: %.1f MiB at most while %d clients uploaded %s objects at once (%d of %d answered 200, "
                  "%.0f MiB/s in all); target <= 64 MiB: %s\n",
                  static_cast<double>(peak.load()) / 1024, o.rss_clients, human_size(o.rss_object).c_str(), ok.load(),
                  o.rss_clients, static_cast<double>(o.rss_object) * o.rss_clients / (1 << 20) / secs,
                  peak.load() <= 64 * 1024 ? "met" : "NOT met");
    }
    store.stop();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_store: %s\n", e.what());
    rc = 1;
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
  return rc;
}
