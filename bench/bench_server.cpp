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
#include "etcd_peer.hpp"
#include "http_conn.hpp"
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

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

std::string g_mep = MEP_BIN_DEFAULT;
std::string g_source = MEP_SOURCE_DIR_DEFAULT;

// The headers of an API request: the bearer token and an optional Idempotency-Key.
std::string api_headers(const std::string& token, const std::string& idem = {}) {
  std::string headers = "Authorization: Bearer " + token + "\r\n";
  if (!idem.empty()) headers += "Idempotency-Key: " + idem + "\r\n";
  return headers;
}

// Keep-alive HTTP to the server with its bearer token and an optional Idempotency-Key.
class Conn {
public:
  explicit Conn(int port) : m_http(mep::bench::HttpConn::tcp(port)), m_port(port) {}
  int port() const { return m_port; }
  std::pair<int, std::string> request(const std::string& method, const std::string& path, const std::string& token,
                                      const std::string& body, const std::string& idem = {}) {
    return m_http.request(method, path, body, api_headers(token, idem));
  }

  mep::bench::HttpConn& raw() { return m_http; }

private:
  mep::bench::HttpConn m_http;
  int m_port;
};

std::string field(const std::string& json, const std::string& key) {
  auto k = json.find("\"" + key + "\":");
  if (k == std::string::npos) return {};
  auto v = k + key.size() + 3;
  if (json[v] == '"') return json.substr(v + 1, json.find('"', v + 1) - v - 1);
  return json.substr(v, json.find_first_of(",}", v) - v);
}

// ---- the server process ------------------------------------------------------------------------

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

struct Server {
  pid_t pid = -1;
  int port = 0;
  ~Server() {
    if (pid > 0) {
      ::kill(pid, SIGTERM);
      ::waitpid(pid, nullptr, 0);
    }
  }
};

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

// ---- measurements ---------------------------------------------------------------------------------

struct Result {
  double ops_per_s = 0;
  double p50_ms = 0;
  double p99_ms = 0;
  long errors = 0;
  double min_ops = 0; // over the repeats of a cell (--repeat)
  double max_ops = 0;
  mep::bench::Stalls paused; // pauses of the whole machine while the clients ran
};

int g_repeat = 1;
// Rounds of each mep/etcd pair (--rounds; 0: --repeat's count when above 1, else 3).
int g_rounds = 0;

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
int g_failed_cells = 0; // cells with failed requests: the run exits 1

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

// Idempotency keys of the measured requests (--keys). Stores index them, so their order
// matters: `ordered` keys grow with time, as mepd's do ("claim-" + a UUIDv7); `random`
// ones are spread over the key space (a client that sends UUIDv4s); `counter` is the
// client's tag and a decimal counter (clustered per client; the default before --keys).
enum class Keys { ordered, random, counter };
Keys g_keys = Keys::ordered;

// --keys VALUE; false for a value it does not know.
bool parse_keys(std::string_view v) {
  if (v == "ordered")
    g_keys = Keys::ordered;
  else if (v == "random")
    g_keys = Keys::random;
  else if (v == "counter")
    g_keys = Keys::counter;
  else
    return false;
  return true;
}

std::string request_key(const char* prefix, const std::string& tag, long k) {
  char buf[48];
  if (g_keys == Keys::ordered) {
    static std::atomic<std::uint32_t> seq{0};
    auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
                  .count();
    std::snprintf(buf, sizeof buf, "%016llx%08x", static_cast<unsigned long long>(ns), seq++);
    return std::string(prefix) + buf;
  }
  if (g_keys == Keys::random) {
    thread_local std::mt19937_64 rng(std::random_device{}());
    std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(rng()),
                  static_cast<unsigned long long>(rng()));
    return std::string(prefix) + buf;
  }
  return prefix + tag + "-" + std::to_string(k);
}

std::string uid() {
  static std::atomic<long> n{0};
  return std::to_string(::getpid()) + "-" + std::to_string(n++) + "-" +
         std::to_string(Clock::now().time_since_epoch().count());
}

// How the clients are driven (--driver). `threads`: a thread per client, blocking on its
// socket (each response wakes its own thread). `epoll`: two threads share the clients'
// sockets in epoll loops, as wrk and etcd's benchmark (goroutines on Go's netpoller) do;
// a wake there can collect several responses.
enum class Driver { threads, epoll };
Driver g_driver = Driver::threads;

bool parse_driver(std::string_view v) {
  if (v == "threads")
    g_driver = Driver::threads;
  else if (v == "epoll")
    g_driver = Driver::epoll;
  else
    return false;
  return true;
}

// The table's name for each workload (Script's modes 0 to 5).
const char* const k_workload_titles[] = {"HTTP cycle (claim+release)",    "HTTP renew",
                                         "HTTP re-claim (same owner)",    "HTTP contend (shared names)",
                                         "HTTP renew-batch of 50 leases", "HTTP claim (fresh name+memory)"};

// Fresh claims (mode 5): each claim is of a name never claimed before, on a memory
// registered before the cell (as mepd registers a new file's memory before its first
// claim) and never claimed. Each client registers its pool before the cell starts, sized
// for this many claims a second over all clients; one that runs out registers more inside
// the cell, and the run says how many (g_fresh_inline).
constexpr double k_fresh_rate_guess = 7000;
double g_seconds = 3;
std::atomic<long> g_fresh_inline{0};

// Contended claims (mode 3): client i claims name i mod k_shared(clients), so about four
// clients want each name; the winner releases at once.
int k_shared(int clients) { return std::max(1, clients / 4); }

// Batched renewals (mode 4): each client holds this many leases and renews them all in one
// renew-batch, as mepd does each tick for the leases due. An operation is one batch.
constexpr int k_batch_leases = 50;

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

// What one client sends: claim+release cycles (mode 0), renews of one held lease (mode 1),
// claims again and again as the same owner (mode 2: each request is a whole durable grant
// with a new fencing token), claims of a name other clients want too (mode 3: a claim
// that wins is released at once; one that finds the name held, 423, is done), renew-batches
// (mode 4), or claims of fresh names on fresh memories (mode 5: what an agent's first claim
// is). An operation is one cycle, one renew, one claim, one attempt or one batch.
class Script {
public:
  enum class Step { more, done, failed };

  Script(Conn& c, const std::string& token, int i, int mode, int clients, int run)
      : m_token(token), m_port(c.port()), m_mode(mode) {
    m_tag = uid();
    auto [st, reg] = c.request("POST", "/v1/memories", token, "{}", "reg-" + m_tag);
    m_mem = field(reg, "memory_instance_id");
    m_name = "bench" + std::to_string(mode == 3 ? i % k_shared(clients) : i) + "x" + std::to_string(mode) + "c" +
             std::to_string(clients) + "r" + std::to_string(run);
    m_owner = mode == 3 ? "bench" + std::to_string(i) : "bench";
    m_claim_body = "{\"display_name\":\"" + m_name + "\",\"memory_instance_id\":\"" + m_mem +
                   "\",\"owner_client_id\":\"" + m_owner + "\",\"ttl_seconds\":60}";
    if (mode == 1 || mode == 2) {
      auto [cs, cb] = c.request("POST", "/v1/leases", token, m_claim_body, "hold-" + m_tag);
      m_held_token = field(cb, "fencing_token");
      if (cs != 201) throw std::runtime_error("the first claim failed");
    }
    if (mode == 5) {
      const auto pool = static_cast<long>(k_fresh_rate_guess * g_seconds / clients) + 50;
      for (long j = 0; j < pool; ++j) m_pool.push_back(register_memory(c, j));
    }
    if (mode == 4) {
      m_batch_body = "{\"owner_client_id\":\"bench\",\"leases\":[";
      for (int j = 0; j < k_batch_leases; ++j) {
        auto [rs, rb] = c.request("POST", "/v1/memories", token, "{}", "reg-" + m_tag + "-" + std::to_string(j));
        const std::string mem = field(rb, "memory_instance_id");
        const std::string name = m_name + "b" + std::to_string(j);
        auto [cs, cb] = c.request("POST", "/v1/leases", token,
                                  "{\"display_name\":\"" + name + "\",\"memory_instance_id\":\"" + mem +
                                      "\",\"owner_client_id\":\"bench\",\"ttl_seconds\":60}",
                                  "hold-" + m_tag + "-" + std::to_string(j));
        if (cs != 201) throw std::runtime_error("a claim to renew failed");
        m_batch_body += std::string(j ? "," : "") + "{\"canonical_name\":\"" + field(cb, "canonical_name") +
                        "\",\"memory_instance_id\":\"" + mem + "\",\"fencing_token\":" + field(cb, "fencing_token") +
                        ",\"ttl_seconds\":60}";
      }
      m_batch_body += "]}";
    }
  }

  // The bytes of the next request.
  std::string next() {
    if (m_mode == 5) {
      if (static_cast<std::size_t>(m_k) >= m_pool.size()) {
        ++g_fresh_inline; // counted and reported: the pool was too small for this rate
        Conn c(m_port);
        m_pool.push_back(register_memory(c, m_k));
      }
      std::string body = "{\"display_name\":\"" + m_name + "f" + std::to_string(m_k) + "\",\"memory_instance_id\":\"" +
                         m_pool[static_cast<std::size_t>(m_k)] +
                         "\",\"owner_client_id\":\"bench\",\"ttl_seconds\":300}";
      std::string key = request_key("f-", m_tag, m_k++);
      return mep::bench::HttpConn::format("POST", "/v1/leases", body, api_headers(m_token, key));
    }
    if ((m_mode == 0 || m_mode == 3) && m_releasing) {
      std::string rel = "{\"canonical_name\":\"" + m_name + "\",\"memory_instance_id\":\"" + m_mem +
                        "\",\"fencing_token\":" + m_held_token + ",\"owner_client_id\":\"" + m_owner + "\"}";
      return mep::bench::HttpConn::format("POST", "/v1/leases/release", rel, api_headers(m_token));
    }
    if (m_mode == 4)
      return mep::bench::HttpConn::format("POST", "/v1/leases/renew-batch", m_batch_body, api_headers(m_token));
    if (m_mode == 1) {
      std::string ren = "{\"canonical_name\":\"" + m_name + "\",\"memory_instance_id\":\"" + m_mem +
                        "\",\"fencing_token\":" + m_held_token + ",\"owner_client_id\":\"bench\",\"ttl_seconds\":60}";
      return mep::bench::HttpConn::format("POST", "/v1/leases/renew", ren, api_headers(m_token));
    }
    std::string key = request_key(m_mode == 0 ? "c-" : "r-", m_tag, m_k++);
    return mep::bench::HttpConn::format("POST", "/v1/leases", m_claim_body, api_headers(m_token, key));
  }

  // Takes the response to next()'s request.
  Step on_response(int status, const std::string& body) {
    if (m_mode == 4) // every lease renewed: no result other than 200 in the answer
      return status == 200 && body.find("\"status\":4") == std::string::npos ? Step::done : Step::failed;
    if (m_mode == 1) return status == 200 ? Step::done : Step::failed;
    if (m_mode == 2 || m_mode == 5) return status == 201 ? Step::done : Step::failed;
    if (!m_releasing) {
      if (m_mode == 3 && status == 423) return Step::done; // another client holds the name
      if (status != 201) return Step::failed;
      m_held_token = field(body, "fencing_token");
      m_releasing = true;
      return Step::more;
    }
    m_releasing = false;
    return status == 204 ? Step::done : Step::failed;
  }

private:
  std::string register_memory(Conn& c, long j) {
    auto [st, reg] = c.request("POST", "/v1/memories", m_token, "{}", "reg-" + m_tag + "-f" + std::to_string(j));
    if (st != 201 && st != 200) throw std::runtime_error("a memory could not be registered");
    return field(reg, "memory_instance_id");
  }

  std::string m_token, m_tag, m_mem, m_name, m_owner, m_claim_body, m_held_token, m_batch_body;
  std::vector<std::string> m_pool;
  int m_port;
  int m_mode;
  long m_k = 0;
  bool m_releasing = false;
};

struct Shared {
  std::vector<std::vector<double>> lat;
  std::atomic<long> errors{0};
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  Clock::time_point end_time;
};

// A thread per client, blocking on its socket.
void drive_one(Shared& sh, int port, const std::string& token, int i, int mode, int clients, int run) {
  try {
    Conn c(port);
    Script script(c, token, i, mode, clients, run);
    ++sh.ready;
    while (!sh.go) std::this_thread::yield();
    auto& lat = sh.lat[static_cast<std::size_t>(i)];
    while (Clock::now() < sh.end_time) {
      auto t0 = Clock::now();
      Script::Step step;
      do {
        auto [st, body] = c.raw().request_bytes(script.next());
        step = script.on_response(st, body);
      } while (step == Script::Step::more);
      if (step == Script::Step::failed)
        ++sh.errors;
      else
        lat.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
  } catch (const std::exception&) {
    ++sh.errors;
    ++sh.ready;
  }
}

// Clients first..last-1 in one epoll loop.
void drive_many(Shared& sh, int port, const std::string& token, int first, int last, int mode, int clients, int run) {
  struct Client {
    Conn conn;
    Script script;
    Clock::time_point t0;
  };
  std::vector<std::unique_ptr<Client>> cs;
  int ep = ::epoll_create1(EPOLL_CLOEXEC);
  try {
    for (int i = first; i < last; ++i) {
      Conn c(port);
      Script script(c, token, i, mode, clients, run);
      cs.push_back(std::make_unique<Client>(Client{std::move(c), std::move(script), {}}));
      cs.back()->conn.raw().set_nonblocking();
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.u32 = static_cast<std::uint32_t>(cs.size() - 1);
      ::epoll_ctl(ep, EPOLL_CTL_ADD, cs.back()->conn.raw().fd(), &ev);
    }
  } catch (const std::exception&) {
    ++sh.errors;
    sh.ready += last - first;
    ::close(ep);
    return;
  }
  sh.ready += last - first;
  while (!sh.go) std::this_thread::yield();
  std::size_t open = cs.size();
  auto drop = [&](Client& c) { // a failed connection, or one whose run is over
    ::epoll_ctl(ep, EPOLL_CTL_DEL, c.conn.raw().fd(), nullptr);
    --open;
  };
  auto send_next = [&](Client& c) {
    try {
      c.conn.raw().send_all(c.script.next());
      return true;
    } catch (const std::exception&) {
      ++sh.errors;
      drop(c);
      return false;
    }
  };
  for (auto& c : cs) {
    c->t0 = Clock::now();
    send_next(*c);
  }
  epoll_event evs[64];
  while (open > 0) {
    int n = ::epoll_wait(ep, evs, 64, 1000);
    if (n <= 0 && Clock::now() > sh.end_time + std::chrono::seconds(10)) {
      sh.errors += static_cast<long>(open); // responses that never came: give up, do not hang
      break;
    }
    for (int e = 0; e < n; ++e) {
      auto k = evs[e].data.u32;
      Client& c = *cs[k];
      if (!c.conn.raw().receive_available()) {
        ++sh.errors;
        drop(c);
        continue;
      }
      std::pair<int, std::string> res;
      while (c.conn.raw().take_response(res)) {
        auto step = c.script.on_response(res.first, res.second);
        auto now = Clock::now();
        if (step == Script::Step::failed) ++sh.errors;
        if (step == Script::Step::done)
          sh.lat[k + static_cast<std::size_t>(first)].push_back(
              std::chrono::duration<double, std::milli>(now - c.t0).count());
        if (step != Script::Step::more) {
          if (now >= sh.end_time) {
            drop(c);
            break;
          }
          c.t0 = now;
        }
        if (!send_next(c)) break;
      }
    }
  }
  ::close(ep);
}

// at_go, when given, is called once every client is set up (its memories registered, its
// leases claimed), just before they start: where a caller starts counting CPU.
Result run_http_once(int port, const std::string& token, int clients, double seconds, int mode,
                     const std::function<void()>& at_go = {}) {
  static std::atomic<int> runs{0};
  const int run = runs++; // names differ between runs: a held lease outlives its run
  Shared sh;
  sh.lat.resize(static_cast<std::size_t>(clients));
  sh.end_time = Clock::time_point::max();
  std::vector<std::thread> threads;
  if (g_driver == Driver::threads) {
    for (int i = 0; i < clients; ++i)
      threads.emplace_back([&, i] { drive_one(sh, port, token, i, mode, clients, run); });
  } else {
    const int loops = std::min(clients, 2);
    for (int t = 0; t < loops; ++t)
      threads.emplace_back(
          [&, t] { drive_many(sh, port, token, clients * t / loops, clients * (t + 1) / loops, mode, clients, run); });
  }
  while (sh.ready < clients) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (at_go) at_go();
  sh.end_time = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  mep::bench::StallProbe probe;
  auto start = Clock::now();
  sh.go = true;
  for (auto& t : threads) t.join();
  double secs = std::chrono::duration<double>(Clock::now() - start).count();
  Result r = summarize(sh.lat, secs, sh.errors);
  r.paused = probe.stop();
  return r;
}

// run_http_once --repeat times: the run with the median rate, and the range of rates. This
// machine's cells vary by +-15 % from run to run; a median of several says more than one.
Result run_http(int port, const std::string& token, int clients, double seconds, int mode) {
  std::vector<Result> runs;
  for (int i = 0; i < g_repeat; ++i) runs.push_back(run_http_once(port, token, clients, seconds, mode));
  std::sort(runs.begin(), runs.end(), [](const Result& a, const Result& b) { return a.ops_per_s < b.ops_per_s; });
  Result r = runs[runs.size() / 2];
  r.min_ops = runs.front().ops_per_s;
  r.max_ops = runs.back().ops_per_s;
  for (const auto& x : runs) r.errors = std::max(r.errors, x.errors);
  return r;
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

// ---- PostgreSQL ----------------------------------------------------------------------------------

std::string with_db(const std::string& admin_url, const std::string& name) {
  auto slash = admin_url.find('/', admin_url.find("://") + 3);
  auto q = admin_url.find('?', slash);
  return admin_url.substr(0, slash) + "/" + name + (q == std::string::npos ? "" : admin_url.substr(q));
}

std::string psql(const std::string& url, const std::string& sql) {
  return run_capture("psql -X -q -A -t -v ON_ERROR_STOP=1 -d '" + url + "' -c \"" + sql + "\" 2>&1");
}

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

void compare_with_etcd(Server& s, const std::string& token, const fs::path& dir, double seconds,
                       const std::string& mode, bool postgresql, pid_t db_pid = 0, const std::string& pg_url = {});

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
              g_driver == Driver::threads ? "threads" : "epoll");
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
  g_etcd.reset(); // stopped by PID before the scratch directory goes
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
