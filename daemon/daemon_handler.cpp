// mepd's socket API: the route table (decode JSON → DaemonService → encode).
#include "mep/daemon_handler.hpp"

#include "mep/allocator.hpp"
#include "mep/client_process.hpp"
#include "mep/json.hpp"
#include "mep/lease/wire.hpp"
#include "mep/log.hpp"
#include "mep/peer.hpp"
#include "mep/uuid.hpp"

#include <boost/asio/post.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>

#include <cstdlib>
#include <fstream>
#include <limits>
#include <optional>
#include <poll.h>
#include <sstream>
#include <system_error>
#include <thread>

namespace mep::daemon {
namespace net = boost::asio;
namespace bhttp = boost::beast::http;
namespace fs = std::filesystem;

namespace {

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
  // ".." after a symbolic link is the parent of the link's target for the kernel, not the
  // link's own directory: a path with ".." has its directory resolved by the kernel (as
  // the peer), the only reading that names the file the client would open.
  if (std::none_of(path.begin(), path.end(), [](const fs::path& c) { return c == ".."; }))
    return path.lexically_normal();
  std::error_code ec;
  fs::path dir;
  {
    AsPeer as;
    dir = fs::canonical(path.parent_path(), ec);
  }
  if (ec)
    return make_unexpected(
        Problem(Code::invalid_request, "cannot resolve the directory of " + path.string() + ": " + ec.message()));
  return dir / path.filename();
}

} // namespace

mode_t client_file_mode(std::istream& status, uid_t uid) {
  std::optional<mode_t> mode;
  bool same_user = false;
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("Umask:", 0) == 0) {
      mode = static_cast<mode_t>(0666 & ~std::strtoul(line.c_str() + 6, nullptr, 8));
    } else if (line.rfind("Uid:", 0) == 0) { // real, effective, saved, file-system
      std::istringstream ids(line.substr(4));
      unsigned long real = 0, effective = 0;
      same_user = (ids >> real >> effective) && effective == uid;
    }
  }
  return mode && same_user ? *mode : 0600;
}

mode_t client_file_mode(pid_t pid, uid_t uid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  return client_file_mode(status, uid);
}

DaemonHandler::DaemonHandler(DaemonService& service, std::function<bool(const http::Peer&)> allowed)
    : m_service(service), m_allowed(std::move(allowed)) {}

DaemonHandler::~DaemonHandler() {
  stop();
  join();
}

std::optional<Problem> DaemonHandler::admit(const http::Peer& peer) {
  if (peer.cred_known && m_allowed(peer)) {
    if (!peer.over_limit) return std::nullopt;
    // Logged by the listener, once per run of refusals.
    Problem p(Code::rate_limited, "your user holds as many connections to this daemon as one user may; close some "
                                  "(event streams, idle clients) and try again");
    p.retry_after_s = 1;
    return p;
  }
  log::warn("refused a client with uid {}", peer.cred_known ? static_cast<long>(peer.uid) : -1L);
  return Problem(Code::forbidden, "peer is not allowed to use this daemon");
}

http::BodyPlan DaemonHandler::plan(const http::RequestHeader&, const http::Peer&) {
  http::BodyPlan plan;
  plan.limit = k_daemon_body_limit;
  return plan;
}

// An attach that asks to wait for a held name (wait_seconds above 0), read with the API's own
// decoder; a body it refuses goes to the pool, where respond() answers it 400.
bool DaemonHandler::attach_waits(const std::string& body) {
  auto o = json::parse_object(body);
  if (!o) return false;
  auto a = daemon_api::decode_attach_body(*o);
  return a && a->wait_s > 0;
}

void DaemonHandler::handle(http::Request&& req, const http::Peer& peer, std::shared_ptr<http::BodySink>,
                           http::Responder responder) {
  using daemon_api::Endpoint;
  if (req.method() == bhttp::verb::get && req.target() == daemon_api::route_of(Endpoint::events).pattern)
    return start_events(responder, peer.uid);
  // Service calls may block on the control plane or the data plane: they run on the
  // worker pool, so the I/O threads keep serving event streams and other clients. An
  // attach that may wait for a held name gets a thread of its own: a queue of waiting
  // agents must not take the pool from everyone else.
  const int fd = responder.native_handle();
  // Decided before the request moves into `work` (it was read after the move, always
  // false, so waiting attaches took the pool's threads).
  const bool may_wait = req.method() == bhttp::verb::post &&
                        req.target() == daemon_api::route_of(Endpoint::attach).pattern && attach_waits(req.body());
  const unsigned version = req.version();
  const bool keep_alive = req.keep_alive();
  auto work = [this, req = std::move(req), peer, responder, fd]() mutable { responder.send(respond(req, peer, fd)); };
  // A job for the pool: counted in m_busy until it has run (its threads are long-lived; a
  // waiting attach's own thread gives its memory back when it ends).
  auto pooled = [this](auto job) {
    m_busy.fetch_add(1, std::memory_order_relaxed);
    return [this, job = std::move(job)]() mutable {
      struct Done {
        DaemonHandler& h;
        ~Done() { h.finished(); }
      } done{*this};
      job();
    };
  };
  if (may_wait) {
    const bool member = peer.counted != nullptr && m_waiting_per_member > 0;
    const uid_t uid = peer.uid;
    std::unique_lock lock(m_waiters_mutex);
    if (member && !m_stopping) {
      auto it = m_waiters_of.find(uid);
      if (m_waiters >= k_max_waiting_attaches || (it != m_waiters_of.end() && it->second >= m_waiting_per_member)) {
        lock.unlock();
        Problem p(Code::rate_limited,
                  fmt::format("your user has as many attaches waiting on this daemon as one user may ({}), or the "
                              "daemon's threads for waiting are all taken; wait for some to end, or attach without "
                              "waiting",
                              m_waiting_per_member));
        p.retry_after_s = 1;
        return responder.send(response(make_unexpected(std::move(p)), {}, version, keep_alive, uuid_v7().to_string()));
      }
    }
    if (!m_stopping && m_waiters < k_max_waiting_attaches) {
      ++m_waiters;
      if (member) ++m_waiters_of[uid];
      lock.unlock();
      auto shared = std::make_shared<decltype(work)>(std::move(work));
      try {
        std::thread([this, shared, member, uid] {
          (*shared)();
          std::lock_guard l(m_waiters_mutex);
          waiter_done(member, uid);
        }).detach();
        return;
      } catch (const std::system_error& e) { // no thread to be had: the pool, then
        log::warn("no thread for a waiting attach ({}); it runs on the worker pool", e.what());
        std::lock_guard l(m_waiters_mutex);
        waiter_done(member, uid);
      }
      return net::post(m_work, pooled([shared] { (*shared)(); }));
    }
  }
  net::post(m_work, pooled(std::move(work)));
}

void DaemonHandler::waiter_done(bool member, uid_t uid) {
  if (member) {
    auto it = m_waiters_of.find(uid);
    if (it != m_waiters_of.end() && --it->second == 0) m_waiters_of.erase(it);
  }
  if (--m_waiters == 0) m_waiters_done.notify_all();
}

void DaemonHandler::finished() noexcept {
  const int left = m_busy.fetch_sub(1, std::memory_order_relaxed) - 1;
  if (left >= k_release_below) return;
  release_thread_cache();
  if (left > 0) return;
  // The last request of a burst: the pages freed since go back too, at most every 2 s.
  const std::int64_t now =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count();
  std::int64_t last = m_last_release_ms.load(std::memory_order_relaxed);
  if (now - last >= 2000 && m_last_release_ms.compare_exchange_strong(last, now)) release_free_memory();
}

http::Response DaemonHandler::respond(const http::Request& req, const http::Peer& peer, int fd) {
  const std::string rid = uuid_v7().to_string();
  Out out = make_unexpected(Problem(Code::internal, "internal error"));
  std::string allow;
  try {
    // Every file this request touches is touched as the peer (peer.hpp).
    const Peer who = Peer::connected(peer.uid, peer.gid, peer.pid, peer.groups);
    PeerScope scope(&who);
    out = route(req, peer, allow, fd);
  } catch (const std::exception& e) {
    log::error("request {} {} failed: {}", rid, std::string(req.target()), e.what());
  }
  return response(out, allow, req.version(), req.keep_alive(), rid);
}

void DaemonHandler::stop() {
  {
    std::lock_guard lock(m_waiters_mutex);
    m_stopping = true; // waiting attaches see their agent as gone and return
  }
  m_work.stop();
}

void DaemonHandler::join() {
  m_work.join();
  std::unique_lock lock(m_waiters_mutex);
  m_waiters_done.wait(lock, [this] { return m_waiters == 0; });
}

http::Response DaemonHandler::response(const Out& out, const std::string& allow, unsigned version, bool keep_alive,
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
void DaemonHandler::start_events(const http::Responder& responder, uid_t viewer) {
  auto stream = responder.stream("application/x-ndjson");
  int id = m_service.subscribe([stream](const std::string& line) { stream->push(line); }, viewer);
  // The service, not the handler: a stream still open at shutdown closes when the
  // io_context is destroyed, after the LocalServer and its handler (found by TSan as a
  // heap-use-after-free in mepd's exit). The service outlives the io_context.
  stream->on_close([&service = m_service, id] { service.unsubscribe(id); });
}

// The row's handler's answer; a 405 sets `allow` to what the path accepts.
DaemonHandler::Out DaemonHandler::route(const http::Request& req, const http::Peer& peer, std::string& allow, int fd) {
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

expected<boost::json::object, Problem> DaemonHandler::body(const http::Request& req) {
  if (req.body().empty()) return boost::json::object{};
  return json::parse_object(req.body());
}

std::optional<std::string> DaemonHandler::query(const Call& c, std::string_view key) {
  for (const auto& [k, v] : c.target.query)
    if (k == key) return v;
  return std::nullopt;
}

// ---- handlers ----

DaemonHandler::Out DaemonHandler::on_events(const Call&) {
  // A plain GET of /v1/events became the stream before routing.
  return make_unexpected(Problem(Code::invalid_request, "GET /v1/events takes no query"));
}

// A system daemon's other users (members of the group mep) learn of the host only what is
// theirs: their own leases' count, and no path of the daemon's state directory (an embedded
// control plane's database). Its metrics, counts of every user's leases, are for root and
// the daemon's own user.
DaemonHandler::Out DaemonHandler::on_health(const Call& c) {
  auto h = m_service.health();
  if (!acts_for_all(c.peer.uid)) {
    h["leases"] = static_cast<std::int64_t>(m_service.list(c.peer.uid).size());
    if (auto* cp = h.if_contains("control_plane"); cp && cp->is_string() && cp->get_string().starts_with("embedded"))
      *cp = "embedded";
  }
  return json(200, std::move(h));
}

DaemonHandler::Out DaemonHandler::on_metrics(const Call& c) {
  if (!acts_for_all(c.peer.uid))
    return make_unexpected(
        Problem(Code::forbidden, "the daemon's metrics count every user's leases: root and its own user read them"));
  Answer a;
  a.text = m_service.metrics();
  return a;
}

DaemonHandler::Out DaemonHandler::on_attach(const Call& c) {
  auto o = body(c.req);
  if (!o) return make_unexpected(std::move(o.error()));
  auto d = daemon_api::decode_attach_body(*o);
  if (!d) return make_unexpected(std::move(d.error()));
  AttachRequest a;
  a.name = std::move(d->name);
  a.wait = std::chrono::seconds(d->wait_s);
  a.cancelled = [this, fd = c.fd] { return agent_gone(fd); };
  auto path = client_path(d->path, c.peer.pid);
  if (!path) return make_unexpected(std::move(path.error()));
  a.path = std::move(*path);
  a.ttl_s = d->ttl_s.value_or(lease::k_default_ttl_s);
  a.bind_pid = d->bind_pid;
  a.labels = std::move(d->labels);
  a.exe = std::move(d->exe);
  a.max_hold_s = d->max_hold_s;
  a.pid = c.peer.pid;
  a.uid = c.peer.uid;
  a.gid = c.peer.gid;
  return encode(m_service.attach(a), 201, [](const Held& h) {
    auto view = api::view_of(h);
    // How long after the attach began the grant was made at the earliest (after a wait):
    // an agent counts its local deadline from its request plus this.
    view.granted_after_ms = static_cast<std::int64_t>(h.granted_after.count());
    return api::to_json(view);
  });
}

// The agent closed its connection (or the daemon is stopping): a waiting attach ends.
bool DaemonHandler::agent_gone(int fd) {
  {
    std::lock_guard lock(m_waiters_mutex);
    if (m_stopping) return true;
  }
  if (fd < 0) return false;
  pollfd p{fd, POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL));
}

DaemonHandler::Out DaemonHandler::on_detach(const Call& c) {
  auto l = lease_of(c);
  if (!l) return make_unexpected(std::move(l.error()));
  auto r = m_service.detach(l->name, l->lease_id, c.peer.uid);
  if (!r) return make_unexpected(std::move(r.error()));
  if (!r->control_plane) return Answer{204, {}, {}};
  // Ended here, not confirmed there: 200 with the control plane's problem, for the caller
  // to tell (mep release exits with its status; the SDKs take any 2xx as released).
  return json(200, boost::json::object{{"released", true}, {"control_plane", r->control_plane->to_json()}});
}

DaemonHandler::Out DaemonHandler::on_list(const Call& c) {
  boost::json::array arr;
  for (const auto& h : m_service.list(c.peer.uid)) arr.emplace_back(api::to_json(h));
  return json(200, boost::json::object{{"leases", std::move(arr)}});
}

DaemonHandler::Out DaemonHandler::on_get(const Call& c) {
  return encode(m_service.get(c.params[0], c.peer.uid), 200, [](const Held& h) { return api::to_json(h); });
}

// {path, new_path} (branch) or {path} (init).
DaemonHandler::Out DaemonHandler::on_branch_or_init(const Call& c, bool branch) {
  auto o = body(c.req);
  if (!o) return make_unexpected(std::move(o.error()));
  auto d = daemon_api::decode_path_body(*o, branch);
  if (!d) return make_unexpected(std::move(d.error()));
  auto path = client_path(d->path, c.peer.pid);
  if (!path) return make_unexpected(std::move(path.error()));
  if (!branch)
    return encode(m_service.init(*path, client_file_mode(c.peer.pid, c.peer.uid)), 201,
                  [](const Initialized& i) { return api::to_json(i); });
  auto new_path = client_path(d->new_path, c.peer.pid);
  if (!new_path) return make_unexpected(std::move(new_path.error()));
  return encode(m_service.branch(*path, *new_path, c.peer.uid, client_file_mode(c.peer.pid, c.peer.uid)), 201,
                [](const BranchedFile& b) { return api::to_json(b); });
}
DaemonHandler::Out DaemonHandler::on_branch(const Call& c) { return on_branch_or_init(c, true); }
DaemonHandler::Out DaemonHandler::on_init(const Call& c) { return on_branch_or_init(c, false); }

DaemonHandler::Out DaemonHandler::on_lineage(const Call& c) {
  auto p = query(c, "path");
  auto id = query(c, "id");
  if (!p && !id) return make_unexpected(Problem(Code::invalid_request, "query parameter path or id is required"));
  std::optional<fs::path> path;
  if (p) {
    auto resolved = client_path(*p, c.peer.pid);
    if (!resolved) return make_unexpected(std::move(resolved.error()));
    path = std::move(*resolved);
  }
  return encode(m_service.lineage(path, id.value_or("")), 200,
                [](const lease::Lineage& l) { return lease::wire::to_json(l); });
}

DaemonHandler::Out DaemonHandler::on_identify(const Call& c) {
  auto p = query(c, "path");
  if (!p || p->empty()) return make_unexpected(Problem(Code::invalid_request, "query parameter path is required"));
  auto path = client_path(*p, c.peer.pid);
  if (!path) return make_unexpected(std::move(path.error()));
  return encode(m_service.identify(*path), 200, [](const Identified& i) { return api::to_json(i); });
}

// {name, lease_id?}: detach, verify and sync.
expected<DaemonHandler::LeaseOf, Problem> DaemonHandler::lease_of(const Call& c) {
  auto o = body(c.req);
  if (!o) return make_unexpected(std::move(o.error()));
  auto d = daemon_api::decode_lease_named(*o);
  if (!d) return make_unexpected(std::move(d.error()));
  return LeaseOf{std::move(d->name), std::move(d->lease_id)};
}

DaemonHandler::Out DaemonHandler::on_verify(const Call& c) {
  auto l = lease_of(c);
  if (!l) return make_unexpected(std::move(l.error()));
  return encode(m_service.verify(l->name, l->lease_id, c.peer.uid), 200,
                [](const VerifiedLease& v) { return api::to_json(v); });
}

DaemonHandler::Out DaemonHandler::on_sync(const Call& c) {
  auto l = lease_of(c);
  if (!l) return make_unexpected(std::move(l.error()));
  return encode(m_service.sync(l->name, l->lease_id, c.peer.uid), 200,
                [](const ObjectResult& o) { return api::to_json_sync(o); });
}

DaemonHandler::Out DaemonHandler::on_fetch(const Call& c) {
  auto o = body(c.req);
  if (!o) return make_unexpected(std::move(o.error()));
  auto d = daemon_api::decode_fetch_body(*o);
  if (!d) return make_unexpected(std::move(d.error()));
  auto path = client_path(d->path, c.peer.pid);
  if (!path) return make_unexpected(std::move(path.error()));
  return encode(m_service.fetch(d->memory_id, *path, client_file_mode(c.peer.pid, c.peer.uid)), 201,
                [](const ObjectResult& r) { return api::to_json_fetch(r); });
}

// The member that serves each endpoint of the API's table: a switch without a default, so
// an endpoint added to the table without its handler does not build (-Wswitch, -Werror).
DaemonHandler::Handle DaemonHandler::handler_of(daemon_api::Endpoint e) {
  using E = daemon_api::Endpoint;
  switch (e) {
  case E::health:
    return &DaemonHandler::on_health;
  case E::metrics:
    return &DaemonHandler::on_metrics;
  case E::events:
    return &DaemonHandler::on_events;
  case E::attach:
    return &DaemonHandler::on_attach;
  case E::detach:
    return &DaemonHandler::on_detach;
  case E::list:
    return &DaemonHandler::on_list;
  case E::get:
    return &DaemonHandler::on_get;
  case E::branch:
    return &DaemonHandler::on_branch;
  case E::init:
    return &DaemonHandler::on_init;
  case E::lineage:
    return &DaemonHandler::on_lineage;
  case E::identify:
    return &DaemonHandler::on_identify;
  case E::verify:
    return &DaemonHandler::on_verify;
  case E::sync:
    return &DaemonHandler::on_sync;
  case E::fetch:
    return &DaemonHandler::on_fetch;
  }
  return nullptr;
}

const std::vector<DaemonHandler::Row> DaemonHandler::k_routes = [] {
  std::vector<Row> rows;
  for (const auto& r : daemon_api::k_routes)
    rows.push_back(Row{bhttp::string_to_verb(r.method), r.pattern, handler_of(r.endpoint)});
  return rows;
}();

std::vector<std::string> DaemonHandler::route_names() {
  std::vector<std::string> out;
  for (const auto& r : k_routes) out.push_back(std::string(bhttp::to_string(r.method)) + " " + std::string(r.pattern));
  return out;
}

} // namespace mep::daemon
