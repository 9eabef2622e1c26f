// A private etcd and its gRPC clients (see etcd_peer.hpp).
#include "etcd_peer.hpp"

#ifdef MEP_BENCH_ETCD
#include "etcd_min.grpc.pb.h"

#include <grpcpp/grpcpp.h>
#endif

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fcntl.h>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

namespace mep::bench {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

[[maybe_unused]] std::string etcd_binary() {
  if (const char* e = std::getenv("MEP_BENCH_ETCD"); e && *e) return e;
  for (const char* dir : {"/usr/bin", "/usr/local/bin"}) {
    std::string p = std::string(dir) + "/etcd";
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  return {};
}

[[maybe_unused]] int free_port() {
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  int port = ntohs(a.sin_port);
  ::close(s);
  return port;
}

// The fields of /proc/PID/stat from the fourth (ppid) on, as numbers; empty when gone.
std::vector<double> stat_fields(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  auto close = line.rfind(')');
  std::vector<double> out;
  if (close == std::string::npos) return out;
  std::istringstream in(line.substr(close + 2));
  std::string field;
  for (int i = 3; in >> field && i <= 17; ++i) out.push_back(std::atof(field.c_str()));
  return out; // out[0] is field 3 (state, not a number: 0), out[1] field 4 (ppid), …
}

// Field N (1-based, as proc(5) numbers them) of stat_fields' result.
double field(const std::vector<double>& f, int n) {
  const auto i = static_cast<std::size_t>(n - 3);
  return i < f.size() ? f[i] : 0;
}

// CPU seconds (user + system) of a process, from /proc.
[[maybe_unused]] double cpu_seconds(pid_t pid) {
  auto f = stat_fields("/proc/" + std::to_string(pid) + "/stat");
  return (field(f, 14) + field(f, 15)) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

} // namespace

double process_cpu_seconds(pid_t pid) { return cpu_seconds(pid); }

double process_tree_cpu_seconds(pid_t pid) {
  auto root = stat_fields("/proc/" + std::to_string(pid) + "/stat");
  double ticks = field(root, 14) + field(root, 15) + field(root, 16) + field(root, 17);
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    const std::string name = e.path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    auto f = stat_fields(e.path().string() + "/stat");
    if (static_cast<pid_t>(field(f, 4)) == pid) ticks += field(f, 14) + field(f, 15);
  }
  return ticks / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

#ifdef MEP_BENCH_ETCD

std::string etcd_unavailable() {
  if (etcd_binary().empty()) return "no etcd binary (apt install etcd-server, or set MEP_BENCH_ETCD)";
  return {};
}

struct EtcdPeer::Impl {
  pid_t pid = -1;
  int port = 0;
  std::string version;
  std::atomic<int> runs{0};

  std::shared_ptr<grpc::Channel> channel() const {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1); // a connection of its own
    return grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials(), args);
  }
};

EtcdPeer::EtcdPeer(const fs::path& dir) : m(std::make_unique<Impl>()) {
  std::string bin = etcd_binary();
  if (bin.empty()) throw std::runtime_error(etcd_unavailable());
  fs::create_directories(dir);
  {
    std::string out;
    if (FILE* p = ::popen((bin + " --version 2>&1").c_str(), "r")) {
      char buf[256];
      if (std::fgets(buf, sizeof buf, p)) out = buf;
      ::pclose(p);
    }
    while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
    m->version = out.empty() ? "etcd" : out;
  }
  m->port = free_port();
  const int peer = free_port();
  const std::string client_url = "http://127.0.0.1:" + std::to_string(m->port);
  const std::string peer_url = "http://127.0.0.1:" + std::to_string(peer);
  std::vector<std::string> argv{bin,
                                "--name=bench",
                                "--data-dir=" + (dir / "data").string(),
                                "--listen-client-urls=" + client_url,
                                "--advertise-client-urls=" + client_url,
                                "--listen-peer-urls=" + peer_url,
                                "--initial-advertise-peer-urls=" + peer_url,
                                "--initial-cluster=bench=" + peer_url,
                                "--initial-cluster-state=new",
                                "--log-level=error"};
  const std::string log = (dir / "etcd.log").string();
  m->pid = ::fork();
  if (m->pid == 0) {
    int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    ::execv(bin.c_str(), args.data());
    ::_exit(127);
  }
  // Ready when it grants a lease.
  auto stub = etcdserverpb::Lease::NewStub(m->channel());
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  for (;;) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
    etcdserverpb::LeaseGrantRequest req;
    req.set_ttl(10);
    etcdserverpb::LeaseGrantResponse res;
    if (stub->LeaseGrant(&ctx, req, &res).ok()) break;
    int status = 0;
    if (::waitpid(m->pid, &status, WNOHANG) == m->pid) {
      m->pid = -1;
      throw std::runtime_error("etcd exited at start (see " + log + ")");
    }
    if (Clock::now() > deadline) throw std::runtime_error("etcd did not answer within 20 s (see " + log + ")");
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

EtcdPeer::~EtcdPeer() {
  if (m->pid <= 0) return;
  ::kill(m->pid, SIGTERM);
  for (int i = 0; i < 50; ++i) {
    if (::waitpid(m->pid, nullptr, WNOHANG) == m->pid) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ::kill(m->pid, SIGKILL);
  ::waitpid(m->pid, nullptr, 0);
}

std::string EtcdPeer::version() const { return m->version; }
pid_t EtcdPeer::pid() const { return m->pid; }

namespace {
// A claim in etcd: put `key` under `lease` if it does not exist (compare create_revision = 0).
etcdserverpb::TxnRequest put_if_absent(const std::string& key, std::int64_t lease, const std::string& value = "bench") {
  etcdserverpb::TxnRequest t;
  auto* cmp = t.add_compare();
  cmp->set_target(etcdserverpb::Compare::CREATE);
  cmp->set_result(etcdserverpb::Compare::EQUAL);
  cmp->set_key(key);
  cmp->set_create_revision(0);
  auto* put = t.add_success()->mutable_request_put();
  put->set_key(key);
  put->set_value(value);
  put->set_lease(lease);
  return t;
}
} // namespace

EtcdResult EtcdPeer::run(int clients, double seconds, int mode, int conns) {
  const int run = m->runs++;
  std::vector<std::vector<double>> lat(static_cast<std::size_t>(clients));
  std::atomic<long> errors{0};
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  Clock::time_point end = Clock::time_point::max();
  // Connections: the clients share one, as etcd's clientv3 multiplexes a process's calls
  // on one HTTP/2 connection (on this 2-core machine etcd did more with one than with one
  // per client: its clients then cost less CPU). MEP_BENCH_ETCD_CONNS=N uses N.
  if (conns <= 0) {
    conns = 1;
    if (const char* e = std::getenv("MEP_BENCH_ETCD_CONNS"); e && std::atoi(e) > 0) conns = std::atoi(e);
  }
  conns = std::clamp(conns, 1, clients);
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < conns; ++i) channels.push_back(m->channel());
  std::vector<std::thread> threads;
  for (int i = 0; i < clients; ++i) {
    threads.emplace_back([&, i] {
      auto ch = channels[static_cast<std::size_t>(i % conns)];
      auto kv = etcdserverpb::KV::NewStub(ch);
      auto lease = etcdserverpb::Lease::NewStub(ch);
      auto grant = [&]() -> std::int64_t { // a lease of 60 s; 0 when the call fails
        grpc::ClientContext c;
        etcdserverpb::LeaseGrantRequest g;
        g.set_ttl(60);
        etcdserverpb::LeaseGrantResponse gr;
        return lease->LeaseGrant(&c, g, &gr).ok() ? gr.id() : 0;
      };
      auto revoke = [&](std::int64_t id) {
        grpc::ClientContext c;
        etcdserverpb::LeaseRevokeRequest r;
        r.set_id(id);
        etcdserverpb::LeaseRevokeResponse rr;
        return lease->LeaseRevoke(&c, r, &rr).ok();
      };
      const std::string key = "bench/" + std::to_string(run) + "/" + std::to_string(i);
      auto ms_since = [](Clock::time_point t) {
        return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
      };
      if (mode == 1) {
        // One held lease, kept alive on one stream.
        const std::int64_t held = grant();
        if (held == 0) ++errors;
        grpc::ClientContext sctx;
        auto stream = lease->LeaseKeepAlive(&sctx);
        etcdserverpb::LeaseKeepAliveRequest k;
        k.set_id(held);
        etcdserverpb::LeaseKeepAliveResponse kr;
        ++ready;
        while (!go) std::this_thread::yield();
        while (Clock::now() < end) {
          auto t0 = Clock::now();
          if (!stream->Write(k) || !stream->Read(&kr) || kr.ttl() <= 0) {
            ++errors;
            break;
          }
          lat[static_cast<std::size_t>(i)].push_back(ms_since(t0));
        }
        stream->WritesDone();
        sctx.TryCancel();
        (void)stream->Finish();
        return;
      }
      if (mode == 3) {
        // Contended: an attempt at a key about 4 clients want, put if absent with a lease of
        // its own; the winner revokes that lease (deleting the key), a loser keeps it for its
        // next attempt (so a lost attempt is one Txn, as mep's is one claim).
        const std::string shared =
            "bench/" + std::to_string(run) + "/shared/" + std::to_string(i % std::max(1, clients / 4));
        std::int64_t spare = 0;
        ++ready;
        while (!go) std::this_thread::yield();
        while (Clock::now() < end) {
          auto t0 = Clock::now();
          if (spare == 0 && (spare = grant()) == 0) {
            ++errors;
            continue;
          }
          grpc::ClientContext c2;
          etcdserverpb::TxnResponse tr;
          if (!kv->Txn(&c2, put_if_absent(shared, spare), &tr).ok()) {
            ++errors;
            continue;
          }
          if (tr.succeeded()) {
            if (!revoke(spare)) ++errors;
            spare = 0;
          }
          lat[static_cast<std::size_t>(i)].push_back(ms_since(t0));
        }
        if (spare != 0) (void)revoke(spare);
        return;
      }
      if (mode == 4) {
        // A same-owner re-claim: the client's key, put again under its held lease only while
        // its value is still the client's own (a new mod_revision each time, one raft write).
        const std::int64_t held = grant();
        const std::string me = "owner-" + std::to_string(i);
        {
          grpc::ClientContext c0;
          etcdserverpb::TxnResponse tr0;
          if (held == 0 || !kv->Txn(&c0, put_if_absent(key, held, me), &tr0).ok() || !tr0.succeeded()) ++errors;
        }
        etcdserverpb::TxnRequest again;
        auto* cmp = again.add_compare();
        cmp->set_target(etcdserverpb::Compare::VALUE);
        cmp->set_result(etcdserverpb::Compare::EQUAL);
        cmp->set_key(key);
        cmp->set_value(me);
        auto* put = again.add_success()->mutable_request_put();
        put->set_key(key);
        put->set_value(me);
        put->set_lease(held);
        ++ready;
        while (!go) std::this_thread::yield();
        while (Clock::now() < end) {
          auto t0 = Clock::now();
          grpc::ClientContext c2;
          etcdserverpb::TxnResponse tr;
          if (!kv->Txn(&c2, again, &tr).ok() || !tr.succeeded()) {
            ++errors;
            continue;
          }
          lat[static_cast<std::size_t>(i)].push_back(ms_since(t0));
        }
        (void)revoke(held);
        return;
      }
      ++ready;
      while (!go) std::this_thread::yield();
      long k = 0;
      while (Clock::now() < end) {
        auto t0 = Clock::now();
        grpc::ClientContext c2;
        const std::string op_key = mode == 2 ? key + "/" + std::to_string(k++) : key;
        const std::int64_t id = grant();
        if (id == 0) {
          ++errors;
          continue;
        }
        etcdserverpb::TxnResponse tr;
        if (!kv->Txn(&c2, put_if_absent(op_key, id), &tr).ok() || !tr.succeeded()) ++errors;
        if (mode == 2) { // a claim alone: the lease stays until its TTL
          lat[static_cast<std::size_t>(i)].push_back(ms_since(t0));
          continue;
        }
        if (!revoke(id)) ++errors;
        lat[static_cast<std::size_t>(i)].push_back(ms_since(t0));
      }
    });
  }
  while (ready < clients) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const double cpu0 = cpu_seconds(::getpid()), scpu0 = cpu_seconds(m->pid);
  StallProbe probe;
  const auto start = Clock::now();
  end = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  go = true;
  for (auto& t : threads) t.join();
  const double wall = std::chrono::duration<double>(Clock::now() - start).count();
  EtcdResult r;
  r.paused = probe.stop();
  r.errors = errors;
  r.client_cores = (cpu_seconds(::getpid()) - cpu0) / wall;
  r.server_cores = (cpu_seconds(m->pid) - scpu0) / wall;
  std::vector<double> all;
  for (auto& v : lat) all.insert(all.end(), v.begin(), v.end());
  if (all.empty()) return r;
  std::sort(all.begin(), all.end());
  r.ops_per_s = static_cast<double>(all.size()) / wall;
  r.p50_ms = all[all.size() / 2];
  r.p99_ms = all[std::min(all.size() - 1, all.size() * 99 / 100)];
  return r;
}

double EtcdPeer::swarm(int clients, int conns) {
  const int run = m->runs++;
  conns = std::clamp(conns, 1, clients);
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < conns; ++i) {
    channels.push_back(m->channel());
    channels.back()->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10));
  }
  std::atomic<int> ready{0}, failed{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  std::vector<Clock::time_point> done(static_cast<std::size_t>(clients));
  for (int i = 0; i < clients; ++i) {
    threads.emplace_back([&, i] {
      auto ch = channels[static_cast<std::size_t>(i % conns)];
      auto kv = etcdserverpb::KV::NewStub(ch);
      auto lease = etcdserverpb::Lease::NewStub(ch);
      ++ready;
      while (!go) std::this_thread::yield();
      grpc::ClientContext c1;
      etcdserverpb::LeaseGrantRequest g;
      g.set_ttl(60);
      etcdserverpb::LeaseGrantResponse gr;
      grpc::ClientContext c2;
      etcdserverpb::TxnResponse tr;
      if (!lease->LeaseGrant(&c1, g, &gr).ok() ||
          !kv->Txn(&c2, put_if_absent("swarm/" + std::to_string(run) + "/" + std::to_string(i), gr.id()), &tr).ok() ||
          !tr.succeeded())
        ++failed;
      done[static_cast<std::size_t>(i)] = Clock::now();
    });
  }
  while (ready < clients) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const auto start = Clock::now();
  go = true;
  for (auto& t : threads) t.join();
  if (failed > 0) return -1;
  return std::chrono::duration<double>(*std::max_element(done.begin(), done.end()) - start).count();
}

#else // built without gRPC

std::string etcd_unavailable() {
  return "bench_server was built without gRPC (apt install libgrpc++-dev libprotobuf-dev protobuf-compiler-grpc, then "
         "reconfigure)";
}
struct EtcdPeer::Impl {};
EtcdPeer::EtcdPeer(const fs::path&) { throw std::runtime_error(etcd_unavailable()); }
EtcdPeer::~EtcdPeer() = default;
std::string EtcdPeer::version() const { return {}; }
pid_t EtcdPeer::pid() const { return -1; }
EtcdResult EtcdPeer::run(int, double, int, int) { return {}; }
double EtcdPeer::swarm(int, int) { return -1; }

#endif

} // namespace mep::bench
