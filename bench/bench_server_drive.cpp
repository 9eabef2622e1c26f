// bench_server's HTTP clients: what each workload sends (Script), the two drivers (a
// thread per client, or epoll loops), and a cell's run. See bench_server.hpp.
#include "bench_server.hpp"

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

const char* driver_name() { return g_driver == Driver::threads ? "threads" : "epoll"; }

const char* const k_workload_titles[6] = {"HTTP cycle (claim+release)",    "HTTP renew",
                                          "HTTP re-claim (same owner)",    "HTTP contend (shared names)",
                                          "HTTP renew-batch of 50 leases", "HTTP claim (fresh name+memory)"};

// Fresh claims (mode 5): each claim is of a name never claimed before, on a memory
// registered before the cell (as mepd registers a new file's memory before its first
// claim) and never claimed. Each client registers its pool before the cell starts, sized
// for this many claims a second over all clients; one that runs out registers more inside
// the cell, and the run says how many (g_fresh_inline).
constexpr double k_fresh_rate_guess = 7000;

// Contended claims (mode 3): client i claims name i mod k_shared(clients), so about four
// clients want each name; the winner releases at once.
int k_shared(int clients) { return std::max(1, clients / 4); }

namespace {

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

} // namespace

Result run_http_once(int port, const std::string& token, int clients, double seconds, int mode,
                     const std::function<void()>& at_go) {
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

} // namespace mep::bench::srv
