// The daemon's socket server. Sessions are Beast HTTP/1.1 over local stream sockets;
// the route table is small and lives here (decode JSON → Keeper → encode).
#include "mep/local_server.hpp"

#include "mep/http/edge.hpp"
#include "mep/json.hpp"
#include "mep/log.hpp"
#include "mep/lease/wire.hpp"
#include "mep/uuid.hpp"

#include <boost/asio/post.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/url/parse.hpp>
#include <fmt/format.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <grp.h>
#include <limits>
#include <memory>
#include <mutex>
#include <poll.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <system_error>
#include <thread>
#include <unistd.h>

namespace mep::daemon {
namespace net = boost::asio;
namespace beast = boost::beast;
namespace bhttp = beast::http;
using local = net::local::stream_protocol;
using json::Need;
namespace fs = std::filesystem;

namespace {

constexpr auto k_io_timeout = std::chrono::seconds(60);
constexpr const char* k_system_group = "mep";
constexpr std::size_t k_body_limit = 16 * 1024;

// Resolves a path given by a local client: relative paths are taken from the client's
// working directory, so `curl` and the CLI behave like any other local tool. Read as the
// peer: /proc/PID/cwd is open to its own user (and a daemon running as `mep` needs no
// CAP_SYS_PTRACE for it).
expected<fs::path, Problem> client_path(const std::string& p, pid_t pid) {
  if (p.empty()) return make_unexpected(Problem(Code::invalid_request, "the path is empty"));
  // A NUL ends a path for the kernel: "a\0b" would be the file "a" under another name.
  if (p.find('\0') != std::string::npos)
    return make_unexpected(Problem(Code::invalid_request, "the path contains a NUL byte"));
  fs::path path(p);
  if (path.is_relative()) {
    std::error_code ec;
    fs::path cwd;
    if (pid > 0) {
      AsPeer as;
      cwd = fs::read_symlink("/proc/" + std::to_string(pid) + "/cwd", ec);
    }
    // Never the daemon's own working directory in its place.
    if (pid <= 0 || ec || cwd.is_relative())
      return make_unexpected(Problem(Code::invalid_request, "a relative path needs the client's working directory, "
                                                            "which could not be read (did the client exit?): give an "
                                                            "absolute path"));
    path = cwd / path;
  }
  return path.lexically_normal();
}

// The mode a file the client creates itself would get: 0666 less the client's umask, as
// Linux (4.7 and later) reports it in /proc/PID/status; 0600 when it cannot be read. A
// memory file mepd creates for `mep init` is then no more open than the user asked for.
mode_t client_file_mode(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("Umask:", 0) != 0) continue;
    const unsigned long mask = std::strtoul(line.c_str() + 6, nullptr, 8);
    return static_cast<mode_t>(0666 & ~mask);
  }
  return 0600;
}

} // namespace

// The daemon's side of the HTTP edge: who may connect, the body limit, and one route
// table whose handlers decode the request, call the Keeper and encode its result.
class DaemonHandler final : public http::Handler {
public:
  DaemonHandler(Keeper& keeper, std::function<bool(const http::Peer&)> allowed)
      : m_keeper(keeper), m_allowed(std::move(allowed)) {}

  std::optional<Problem> admit(const http::Peer& peer) override {
    if (peer.cred_known && m_allowed(peer)) return std::nullopt;
    log::warn("refused a client with uid {}", peer.cred_known ? static_cast<long>(peer.uid) : -1L);
    return Problem(Code::forbidden, "peer is not allowed to use this daemon");
  }

  http::BodyPlan plan(const http::RequestHeader&, const http::Peer&) override {
    http::BodyPlan plan;
    plan.limit = k_body_limit;
    return plan;
  }

  void handle(http::Request&& req, const http::Peer& peer, std::shared_ptr<http::BodySink>,
              http::Responder responder) override {
    if (req.method() == bhttp::verb::get && req.target() == "/v1/events") return start_events(responder, peer.uid);
    // Keeper calls may block on the control plane or the data plane: they run on the
    // worker pool, so the I/O threads keep serving event streams and other clients. An
    // attach that may wait for a held name gets a thread of its own: a queue of waiting
    // agents must not take the pool from everyone else.
    const int fd = responder.native_handle();
    // Decided before the request moves into `work` (it was read after the move, always
    // false, so waiting attaches took the pool's threads).
    const bool may_wait = req.method() == bhttp::verb::post && req.target() == "/v1/attach" &&
                          req.body().find("\"wait_seconds\"") != std::string::npos;
    auto work = [this, req = std::move(req), peer, responder, fd]() mutable {
      const std::string rid = uuid_v7().to_string();
      Out out = make_unexpected(Problem(Code::internal, "internal error"));
      std::string allow;
      try {
        // Every file this request touches is touched as the peer (peer.hpp).
        const Peer who = Peer::connected(peer.uid, peer.gid, peer.pid);
        PeerScope scope(&who);
        out = route(req, peer, allow, fd);
      } catch (const std::exception& e) {
        log::error("request {} {} failed: {}", rid, std::string(req.target()), e.what());
      }
      responder.send(response(out, allow, req.version(), req.keep_alive(), rid));
    };
    if (may_wait) {
      std::unique_lock lock(m_waiters_mutex);
      if (!m_stopping && m_waiters < k_max_waiting_attaches) {
        ++m_waiters;
        lock.unlock();
        auto shared = std::make_shared<decltype(work)>(std::move(work));
        try {
          std::thread([this, shared] {
            (*shared)();
            std::lock_guard l(m_waiters_mutex);
            if (--m_waiters == 0) m_waiters_done.notify_all();
          }).detach();
          return;
        } catch (const std::system_error& e) { // no thread to be had: the pool, then
          log::warn("no thread for a waiting attach ({}); it runs on the worker pool", e.what());
          std::lock_guard l(m_waiters_mutex);
          if (--m_waiters == 0) m_waiters_done.notify_all();
        }
        return net::post(m_work, [shared] { (*shared)(); });
      }
    }
    net::post(m_work, std::move(work));
  }

  void stop() {
    {
      std::lock_guard lock(m_waiters_mutex);
      m_stopping = true; // waiting attaches see their agent as gone and return
    }
    m_work.stop();
  }
  void join() {
    m_work.join();
    std::unique_lock lock(m_waiters_mutex);
    m_waiters_done.wait(lock, [this] { return m_waiters == 0; });
  }

private:
  // What a handler produces: a status and a JSON body (204: none; text: /metrics).
  struct Answer {
    int status = 200;
    boost::json::object body;
    std::optional<std::string> text;
  };
  using Out = expected<Answer, Problem>;
  struct Call {
    const http::Request& req;
    const http::Peer& peer;
    const http::Target& target;
    const std::vector<std::string>& params;
    int fd; ///< the agent's socket, for poll(2) only
  };
  using Handle = Out (DaemonHandler::*)(const Call&);
  struct Row {
    bhttp::verb method;
    std::string_view pattern;
    Handle handle;
  };

  static Answer json(int status, boost::json::object body) { return Answer{status, std::move(body), {}}; }
  template <class T, class F>
  static Out encode(expected<T, Problem> r, int status, F to) {
    if (!r) return make_unexpected(std::move(r.error()));
    return json(status, to(*r));
  }

  static http::Response response(const Out& out, const std::string& allow, unsigned version, bool keep_alive,
                                 const std::string& rid) {
    http::Response res{static_cast<bhttp::status>(out ? out->status : out.error().status()), version};
    res.set(bhttp::field::server, "mepd");
    res.set("X-Request-Id", rid);
    if (!out) {
      Problem p = out.error();
      p.instance = rid;
      res.set(bhttp::field::content_type, "application/problem+json");
      if (p.retry_after_s) res.set(bhttp::field::retry_after, std::to_string(*p.retry_after_s));
      res.body() = json::dump(p.to_json());
    } else if (out->text) {
      res.set(bhttp::field::content_type, "text/plain; version=0.0.4; charset=utf-8");
      res.body() = *out->text;
    } else if (out->status != 204) {
      res.set(bhttp::field::content_type, "application/json");
      res.body() = json::dump(out->body);
    }
    if (!allow.empty()) res.set(bhttp::field::allow, allow);
    res.keep_alive(keep_alive);
    res.prepare_payload();
    return res;
  }

  // The event stream: one JSON line per event until the client goes.
  void start_events(const http::Responder& responder, uid_t viewer) {
    auto stream = responder.stream("application/x-ndjson");
    int id = m_keeper.subscribe([stream](const std::string& line) { stream->push(line); }, viewer);
    stream->on_close([this, id] { m_keeper.unsubscribe(id); });
  }

  // The row's handler's answer; a 405 sets `allow` to what the path accepts.
  Out route(const http::Request& req, const http::Peer& peer, std::string& allow, int fd) {
    auto target = http::parse_target(req.target());
    if (!target) return make_unexpected(Problem(Code::invalid_request, "malformed target"));
    // HEAD is GET without the content (RFC 9110 9.3.2); the edge drops the content.
    const auto method = req.method() == bhttp::verb::head ? bhttp::verb::get : req.method();
    std::vector<std::string> params;
    const Row* row = http::find_route(k_routes, method, target->segments, params, allow);
    const bool events = target->segments.size() == 2 && target->segments[0] == "v1" && target->segments[1] == "events";
    if (!row || (events && req.method() == bhttp::verb::head)) {
      if (allow.empty() && !events) return make_unexpected(Problem(Code::not_found, "no such endpoint"));
      // RFC 9110 15.5.6: a 405 names what the path accepts; the stream has no HEAD.
      if (events) allow = "GET";
      return make_unexpected(Problem(Code::method_not_allowed, "this endpoint does not accept that method"));
    }
    return (this->*(row->handle))(Call{req, peer, *target, params, fd});
  }

  static expected<boost::json::object, Problem> body(const http::Request& req) {
    if (req.body().empty()) return boost::json::object{};
    return json::parse_object(req.body());
  }

  static std::optional<std::string> query(const Call& c, std::string_view key) {
    for (const auto& [k, v] : c.target.query)
      if (k == key) return v;
    return std::nullopt;
  }

  // ---- handlers ----

  Out on_events(const Call&) {
    // A plain GET of /v1/events became the stream before routing.
    return make_unexpected(Problem(Code::invalid_request, "GET /v1/events takes no query"));
  }

  Out on_health(const Call&) { return json(200, m_keeper.health()); }

  Out on_metrics(const Call&) {
    Answer a;
    a.text = m_keeper.metrics();
    return a;
  }

  Out on_attach(const Call& c) {
    auto o = body(c.req);
    if (!o) return make_unexpected(std::move(o.error()));
    json::ObjectReader rd(*o);
    AttachRequest a;
    auto name = rd.string("name", Need::required);
    auto p = rd.string("path", Need::required);
    auto ttl = rd.integer("ttl_seconds", Need::optional, -(1LL << 40), 1LL << 40);
    auto bind = rd.string("bind", Need::optional);
    if (bind && *bind != "pid" && *bind != "none") rd.fail("field \"bind\" must be \"pid\" or \"none\"");
    // Seconds to wait for a held name or memory; 0 (the default) fails fast.
    auto wait = rd.seconds("wait_seconds", Need::optional, std::numeric_limits<std::int32_t>::max());
    if (auto ok = rd.finish(); !ok) return make_unexpected(std::move(ok.error()));
    a.name = *name;
    a.wait = std::chrono::seconds(wait.value_or(0));
    a.cancelled = [this, fd = c.fd] { return agent_gone(fd); };
    auto path = client_path(*p, c.peer.pid);
    if (!path) return make_unexpected(std::move(path.error()));
    a.path = std::move(*path);
    a.ttl_s = ttl.value_or(lease::k_default_ttl_s);
    a.bind_pid = !bind || *bind == "pid";
    a.pid = c.peer.pid;
    a.uid = c.peer.uid;
    a.gid = c.peer.gid;
    return encode(m_keeper.attach(a), 201, [](const Held& h) {
      auto held = api::to_json(h);
      // How long after the attach began the grant was made at the earliest (after a wait):
      // an agent counts its local deadline from its request plus this.
      held["granted_after_ms"] = static_cast<std::int64_t>(h.granted_after.count());
      return held;
    });
  }

  // The agent closed its connection (or the daemon is stopping): a waiting attach ends.
  bool agent_gone(int fd) {
    {
      std::lock_guard lock(m_waiters_mutex);
      if (m_stopping) return true;
    }
    if (fd < 0) return false;
    pollfd p{fd, POLLRDHUP, 0};
    return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL));
  }

  Out on_detach(const Call& c) {
    auto o = body(c.req);
    if (!o) return make_unexpected(std::move(o.error()));
    json::ObjectReader rd(*o);
    auto name = rd.string("name", Need::required);
    auto lease_id = rd.string("lease_id", Need::optional);
    if (auto ok = rd.finish(); !ok) return make_unexpected(std::move(ok.error()));
    auto r = m_keeper.detach(*name, lease_id, c.peer.uid);
    if (!r) return make_unexpected(std::move(r.error()));
    return Answer{204, {}, {}};
  }

  Out on_list(const Call& c) {
    boost::json::array arr;
    for (const auto& h : m_keeper.list(c.peer.uid)) arr.emplace_back(api::to_json(h));
    return json(200, boost::json::object{{"leases", std::move(arr)}});
  }

  Out on_get(const Call& c) {
    return encode(m_keeper.get(c.params[0], c.peer.uid), 200, [](const Held& h) { return api::to_json(h); });
  }

  // {path, new_path} (branch) or {path} (init).
  Out on_branch_or_init(const Call& c, bool branch) {
    auto o = body(c.req);
    if (!o) return make_unexpected(std::move(o.error()));
    json::ObjectReader rd(*o);
    auto p = rd.string("path", Need::required);
    std::optional<std::string> np;
    if (branch) np = rd.string("new_path", Need::required);
    if (auto ok = rd.finish(); !ok) return make_unexpected(std::move(ok.error()));
    auto path = client_path(*p, c.peer.pid);
    if (!path) return make_unexpected(std::move(path.error()));
    if (!branch)
      return encode(m_keeper.init(*path, client_file_mode(c.peer.pid)), 201,
                    [](const Initialized& i) { return api::to_json(i); });
    auto new_path = client_path(*np, c.peer.pid);
    if (!new_path) return make_unexpected(std::move(new_path.error()));
    return encode(m_keeper.branch(*path, *new_path, c.peer.uid), 201,
                  [](const BranchedFile& b) { return api::to_json(b); });
  }
  Out on_branch(const Call& c) { return on_branch_or_init(c, true); }
  Out on_init(const Call& c) { return on_branch_or_init(c, false); }

  Out on_lineage(const Call& c) {
    auto p = query(c, "path");
    auto id = query(c, "id");
    if (!p && !id) return make_unexpected(Problem(Code::invalid_request, "query parameter path or id is required"));
    std::optional<fs::path> path;
    if (p) {
      auto resolved = client_path(*p, c.peer.pid);
      if (!resolved) return make_unexpected(std::move(resolved.error()));
      path = std::move(*resolved);
    }
    return encode(m_keeper.lineage(path, id.value_or("")), 200,
                  [](const lease::Lineage& l) { return lease::wire::to_json(l); });
  }

  Out on_identify(const Call& c) {
    auto p = query(c, "path");
    if (!p || p->empty()) return make_unexpected(Problem(Code::invalid_request, "query parameter path is required"));
    auto path = client_path(*p, c.peer.pid);
    if (!path) return make_unexpected(std::move(path.error()));
    return encode(m_keeper.identify(*path), 200, [](const Identified& i) { return api::to_json(i); });
  }

  // {name}: verify and sync.
  expected<std::string, Problem> name_of(const Call& c) {
    auto o = body(c.req);
    if (!o) return make_unexpected(std::move(o.error()));
    json::ObjectReader rd(*o);
    auto name = rd.string("name", Need::required);
    if (auto ok = rd.finish(); !ok) return make_unexpected(std::move(ok.error()));
    return *name;
  }

  Out on_verify(const Call& c) {
    auto name = name_of(c);
    if (!name) return make_unexpected(std::move(name.error()));
    return encode(m_keeper.verify(*name, c.peer.uid), 200, [](const VerifiedLease& v) { return api::to_json(v); });
  }

  Out on_sync(const Call& c) {
    auto name = name_of(c);
    if (!name) return make_unexpected(std::move(name.error()));
    return encode(m_keeper.sync(*name, c.peer.uid), 200, [](const ObjectResult& o) { return api::to_json_sync(o); });
  }

  Out on_fetch(const Call& c) {
    auto o = body(c.req);
    if (!o) return make_unexpected(std::move(o.error()));
    json::ObjectReader rd(*o);
    auto id = rd.uuid("memory_instance_id", Need::required);
    auto p = rd.string("path", Need::required);
    if (auto ok = rd.finish(); !ok) return make_unexpected(std::move(ok.error()));
    auto path = client_path(*p, c.peer.pid);
    if (!path) return make_unexpected(std::move(path.error()));
    return encode(m_keeper.fetch(*id, *path, client_file_mode(c.peer.pid)), 201,
                  [](const ObjectResult& r) { return api::to_json_fetch(r); });
  }

  static const std::vector<Row> k_routes;

  Keeper& m_keeper;
  std::function<bool(const http::Peer&)> m_allowed;
  net::thread_pool m_work{16};
  static constexpr int k_max_waiting_attaches = 1024; // beyond, they queue for the pool
  std::mutex m_waiters_mutex;
  std::condition_variable m_waiters_done;
  int m_waiters = 0;
  bool m_stopping = false;
};

const std::vector<DaemonHandler::Row> DaemonHandler::k_routes = {
    {bhttp::verb::get, "/healthz", &DaemonHandler::on_health},
    {bhttp::verb::get, "/metrics", &DaemonHandler::on_metrics},
    {bhttp::verb::get, "/v1/events", &DaemonHandler::on_events},
    {bhttp::verb::post, "/v1/attach", &DaemonHandler::on_attach},
    {bhttp::verb::post, "/v1/detach", &DaemonHandler::on_detach},
    {bhttp::verb::get, "/v1/leases", &DaemonHandler::on_list},
    {bhttp::verb::get, "/v1/leases/{name}", &DaemonHandler::on_get},
    {bhttp::verb::post, "/v1/branch", &DaemonHandler::on_branch},
    {bhttp::verb::post, "/v1/init", &DaemonHandler::on_init},
    {bhttp::verb::get, "/v1/lineage", &DaemonHandler::on_lineage},
    {bhttp::verb::get, "/v1/identify", &DaemonHandler::on_identify},
    {bhttp::verb::post, "/v1/verify", &DaemonHandler::on_verify},
    {bhttp::verb::post, "/v1/sync", &DaemonHandler::on_sync},
    {bhttp::verb::post, "/v1/fetch", &DaemonHandler::on_fetch},
};

LocalServer::LocalServer(net::io_context& ioc, Keeper& keeper, const fs::path& socket_path, int inherited_fd,
                         bool system)
    : m_ioc(ioc), m_keeper(keeper), m_path(socket_path), m_system(system) {
  local::acceptor acceptor(net::make_strand(ioc));
  if (inherited_fd >= 0)
    acceptor.assign(local(), inherited_fd);
  else
    bind_socket(acceptor);
  m_handler =
      std::make_unique<DaemonHandler>(keeper, [this](const http::Peer& p) { return peer_allowed(p.uid, p.gid); });
  http::EdgeOptions options;
  options.server_name = "mepd";
  options.io_timeout = k_io_timeout;
  m_listener = std::make_unique<http::UnixListener>(ioc, std::move(acceptor), *m_handler, options);
}

void LocalServer::bind_socket(local::acceptor& acceptor) {
  const fs::path& socket_path = m_path;
  net::io_context& ioc = m_ioc;
  std::error_code ec;
  fs::path dir = socket_path.parent_path();
  // System mode: the group mep reaches the socket (SPEC §7: directory 0750, socket 0660).
  gid_t sock_gid = static_cast<gid_t>(-1);
  if (m_system) {
    const struct group* g = ::getgrnam(k_system_group);
    if (!g)
      throw std::runtime_error(
          fmt::format("--system serves the members of the group {}, which does not exist (create it "
                      "with systemd-sysusers or groupadd --system {})",
                      k_system_group, k_system_group));
    sock_gid = g->gr_gid;
  }
  if (!dir.empty() && !fs::exists(dir, ec)) {
    fs::create_directories(dir, ec);
    if (ec) throw std::runtime_error("cannot create " + dir.string() + ": " + ec.message());
    ::chmod(dir.c_str(), m_system ? 0750 : 0700);
    if (m_system && ::chown(dir.c_str(), static_cast<uid_t>(-1), sock_gid) != 0)
      throw std::runtime_error(
          fmt::format("cannot give {} to the group {}: {}", dir.string(), k_system_group, std::strerror(errno)));
  } else if (struct stat st{}; !dir.empty() && ::stat(dir.c_str(), &st) == 0 &&
                               (st.st_mode & (S_IWGRP | S_IWOTH)) != 0 && (st.st_mode & S_ISVTX) == 0) {
    // Whoever may write there may replace the socket with their own.
    throw std::runtime_error(fmt::format("the socket's directory {} is writable by others (mode {:04o}); make it 0700",
                                         dir.string(), st.st_mode & 07777));
  }
  if (fs::exists(socket_path, ec)) {
    // A socket left by a daemon that died: remove it only if nobody answers on it.
    local::socket probe(ioc);
    beast::error_code cec;
    probe.connect(local::endpoint(socket_path.string()), cec);
    if (!cec) throw std::runtime_error("another mepd is already listening on " + socket_path.string());
    fs::remove(socket_path, ec);
  }
  mode_t old = ::umask(077);
  beast::error_code bec;
  acceptor.open(local(), bec);
  if (!bec) acceptor.bind(local::endpoint(socket_path.string()), bec);
  ::umask(old);
  if (bec) throw std::runtime_error("cannot bind " + socket_path.string() + ": " + bec.message());
  ::chmod(socket_path.c_str(), m_system ? 0660 : 0600);
  if (m_system && ::chown(socket_path.c_str(), static_cast<uid_t>(-1), sock_gid) != 0)
    throw std::runtime_error(
        fmt::format("cannot give {} to the group {}: {}", socket_path.string(), k_system_group, std::strerror(errno)));
  acceptor.listen(net::socket_base::max_listen_connections, bec);
  if (bec) throw std::runtime_error("cannot listen on " + socket_path.string() + ": " + bec.message());
  m_owns_path = true;
}

LocalServer::~LocalServer() {
  m_handler->stop();
  m_handler->join();
  if (m_owns_path) {
    std::error_code ec;
    fs::remove(m_path, ec);
  }
}

void LocalServer::start() { m_listener->start(); }

void LocalServer::stop() { m_listener->stop_accepting(); }

// SPEC §7: the daemon's own user; in system mode also root and the members of the socket's
// group (mep), each of whom then sees only its own leases (Keeper, may_act_on).
bool LocalServer::peer_allowed(uid_t uid, gid_t gid) const {
  if (uid == ::getuid()) return true;
  if (!m_system) return false;
  if (uid == 0) return true;
  struct stat st {};
  std::string path = m_path.string();
  if (path.empty() || ::stat(path.c_str(), &st) != 0 || !(st.st_mode & S_IWGRP)) return false;
  if (gid == st.st_gid) return true;
  passwd pw{};
  passwd* found = nullptr;
  std::vector<char> buf(16384);
  if (::getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) != 0 || !found) return false;
  int n = 64;
  std::vector<gid_t> groups(static_cast<std::size_t>(n));
  if (::getgrouplist(pw.pw_name, pw.pw_gid, groups.data(), &n) < 0) {
    groups.resize(static_cast<std::size_t>(n));
    if (::getgrouplist(pw.pw_name, pw.pw_gid, groups.data(), &n) < 0) return false;
  }
  for (int i = 0; i < n; ++i)
    if (groups[static_cast<std::size_t>(i)] == st.st_gid) return true;
  return false;
}

} // namespace mep::daemon
