// `mep mcp --name NAME --memory PATH`: a Model Context Protocol server on standard input and
// output, through which an agent holds its memory file exclusively. The lease is attached
// through mepd, bound to this process (released within a second of its end, however it
// ends); every write is fenced (checked with the control plane, then against the local
// deadline right before it is applied), atomic and durable.
//
// Design notes — the session's lease (Session::m_phase):
//   held     attach answered 201 (attach_once(), wait_for_lease()); writable.
//   waiting  another holder (423): read-only; wait_for_lease() queues for it on a thread of
//            its own (the daemon's fair queue) and tells the client once it is granted.
//   lost     held, then lost: the daemon's `lost`/`released` event, the local deadline
//            (monitor()), or a refused verify (write_tool()). Read-only; lease_claim queues again.
//   none     the lease could not be had for another reason (reason says which); read-only.
// A memory_branch with switch moves the session to the new file: the wait is cancelled, the
// lease released, and NAME attached there.
//
// This file: the session's life (attach, wait, monitor, release) and the server's loop;
// cmd_mcp_tools.cpp: the tools and resources; cmd_mcp_session.hpp: what they share.
#include "cmd_mcp_session.hpp"

namespace mep::cli {
namespace mcp_session {

daemon_api::AttachBody Session::attach_body() const {
  daemon_api::AttachBody body;
  body.name = m_options.name;
  body.path = m_path;
  body.ttl_s = m_options.ttl;
  m_options.holder.add_to(body);
  return body;
}

DaemonReply Session::attach_once(std::int64_t wait_s) {
  auto watch = std::make_shared<LeaseWatch>(m_options.ttl);
  daemon_api::AttachBody body;
  std::uint64_t generation;
  {
    std::lock_guard lock(m_mutex);
    body = attach_body();
    m_watch = watch;
    generation = ++m_generation;
  }
  body.wait_s = std::max<std::int64_t>(wait_s, 0);
  const auto sent = Clock::now();
  DaemonReply r = daemon_request(m_socket, daemon_api::target(daemon_api::Endpoint::attach),
                                 json::dump(daemon_api::to_json(body)), static_cast<int>(wait_s * 1000 + 30000));
  if (r.ok()) {
    auto lease = daemon_api::decode_lease(r.json());
    if (!lease) {
      // Bound to this process: mepd releases it when the session's process ends.
      r.status = 0;
      r.error = unreadable_answer("the attach", lease.error());
    } else if (!granted(*lease, sent, watch, generation)) {
      give_back(*lease);
      r.status = 0;
      r.error = "the session ended";
    }
  }
  return r;
}

expected<void, Problem> Session::attach_now(std::int64_t wait_s) {
  DaemonReply r = attach_once(wait_s);
  if (r.ok()) return {};
  if (r.held()) {
    begin_wait(r.problem(m_socket));
    return {};
  }
  return make_unexpected(r.problem(m_socket));
}

int Session::start() {
  DaemonReply r = attach_once(0);
  if (r.ok()) return exit_code::ok;
  if (!r.held() || m_options.if_held == "fail") return report_problem(r, m_socket, false);
  begin_wait(r.problem(m_socket));
  std::fprintf(stderr, "mep: %s; serving read-only and waiting for it\n", explain(r.problem(m_socket)).c_str());
  return exit_code::ok;
}

bool Session::granted(const daemon_api::Lease& lease, Clock::time_point sent, const std::shared_ptr<LeaseWatch>& watch,
                      std::uint64_t generation) {
  auto granted_at = sent;
  if (lease.granted_after_ms && *lease.granted_after_ms > 0)
    granted_at += std::chrono::milliseconds(*lease.granted_after_ms);
  watch->attached(lease.canonical_name, lease.lease_id, granted_at);
  std::lock_guard lock(m_mutex);
  if (generation != m_generation || m_stopping) return false;
  m_lease = lease;
  m_lease->path.clear(); // a local path is not for the model: it named the file itself
  m_memory_id = lease.memory_id;
  m_phase = Phase::held;
  m_reason.clear();
  m_holder.reset();
  return true;
}

void Session::give_back(const daemon_api::Lease& lease) {
  daemon_request(m_socket, daemon_api::target(daemon_api::Endpoint::detach),
                 json::dump(daemon_api::to_json(daemon_api::LeaseNamed{lease.canonical_name, lease.lease_id})),
                 k_release_timeout_ms);
}

void Session::begin_wait(const Problem& refusal) {
  std::optional<lease::HolderView> holder;
  if (auto* v = refusal.extensions.if_contains("holder"); v && v->is_object())
    holder = lease::wire::decode_holder_view(v->get_object());
  // The memory's id while another holds it: the attach resolved (or minted) it already.
  std::string id;
  {
    std::string path;
    {
      std::lock_guard lock(m_mutex);
      path = m_path;
    }
    DaemonReply ident = daemon_request(
        m_socket, daemon_api::target(daemon_api::Endpoint::identify, "path=" + daemon_api::query_value(path)));
    if (ident.ok())
      if (auto i = daemon_api::decode_identified(ident.json())) id = i->memory_id;
  }
  auto watch = std::make_shared<LeaseWatch>(m_options.ttl);
  auto cancel = std::make_shared<Cancel>();
  std::uint64_t generation;
  {
    std::lock_guard lock(m_mutex);
    m_phase = Phase::waiting;
    m_reason = explain(refusal);
    m_holder = holder;
    if (!id.empty()) m_memory_id = id;
    m_watch = watch;
    m_cancel = cancel;
    generation = ++m_generation;
  }
  if (m_waiter.joinable()) m_waiter.join(); // a wait that ended (end_wait() cancelled any other)
  m_waiter = std::thread([this, generation, cancel, watch] { wait_for_lease(generation, cancel, watch); });
}

// The wait in the daemon's fair queue, as long as it takes. A daemon that goes away (a
// restart) is asked again: the place in the queue is lost, the wait is not.
void Session::wait_for_lease(std::uint64_t generation, std::shared_ptr<Cancel> cancel,
                             std::shared_ptr<LeaseWatch> watch) {
  try {
    for (;;) {
      daemon_api::AttachBody body;
      {
        std::lock_guard lock(m_mutex);
        body = attach_body();
      }
      body.wait_s = k_wait_forever;
      const auto sent = Clock::now();
      DaemonReply r = daemon_request(m_socket, daemon_api::target(daemon_api::Endpoint::attach),
                                     json::dump(daemon_api::to_json(body)), -1, cancel.get());
      if (r.ok()) {
        auto lease = daemon_api::decode_lease(r.json());
        if (!lease) {
          // Bound to this process: mepd releases it when the session's process ends.
          log("error", unreadable_answer("the attach", lease.error()) + "; are mep and mepd the same version?");
          return;
        }
        // Granted as the wait was given up (a branch switch, the session's end): not wanted.
        if (cancel->cancelled() || !granted(*lease, sent, watch, generation)) {
          give_back(*lease);
          return;
        }
        log("notice", "granted: " + lease->display_name + " now holds its memory (fencing token " +
                          std::to_string(lease->fencing_token.value_or(0)) + "); writes are accepted");
        return;
      }
      if (cancel->cancelled()) return;
      // Not reached (a restart), held, or not now: asked again. Refused for good: said why.
      const auto refused = r.refusal();
      if (!r.reached() || refused == Kind::held || refused == Kind::retry || refused == Kind::unreachable) {
        for (int i = 0; i < 10 && !cancel->cancelled(); ++i)
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      const Problem p = r.problem(m_socket);
      {
        std::lock_guard lock(m_mutex);
        if (generation != m_generation) return;
        m_phase = Phase::none;
        m_reason = explain(p);
        m_holder.reset();
      }
      log("error", "the wait for the lease ended: " + explain(p));
      return;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mep: the wait for the lease failed: %s\n", e.what());
  }
}

void Session::end_wait() {
  std::shared_ptr<Cancel> cancel;
  {
    std::lock_guard lock(m_mutex);
    cancel = m_cancel;
    ++m_generation;
  }
  if (cancel) cancel->cancel();
  if (m_waiter.joinable()) m_waiter.join();
}

void Session::release() {
  std::optional<daemon_api::Lease> lease;
  {
    std::lock_guard lock(m_mutex);
    if (m_phase != Phase::held) return;
    lease = m_lease;
    m_phase = Phase::none;
    m_reason = "released";
  }
  if (lease) give_back(*lease);
}

void Session::stop() {
  if (m_stopping.exchange(true)) return;
  end_wait();
  if (m_monitor.joinable()) m_monitor.join();
  release();
  m_events.stop();
}

void Session::log(std::string_view level, const std::string& text) {
  std::fprintf(stderr, "mep: %s\n", text.c_str());
  if (auto* s = m_server.load()) s->log(level, js::value(text));
}

std::string Session::uri() const { return m_memory_id.empty() ? std::string() : "mep://memory/" + m_memory_id; }

void Session::start_monitor() {
  m_monitor = std::thread([this] {
    while (!m_stopping) {
      try {
        monitor();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "mep: monitor: %s\n", e.what());
      }
      std::this_thread::sleep_for(k_monitor_period);
    }
  });
}

void Session::monitor() {
  std::shared_ptr<LeaseWatch> watch;
  std::string path, u, name;
  bool subscribed;
  Phase phase;
  {
    std::lock_guard lock(m_mutex);
    watch = m_watch;
    path = m_path;
    u = uri();
    phase = m_phase;
    subscribed = !u.empty() && m_subscribed.count(u) > 0;
    name = m_lease ? m_lease->display_name : std::string();
  }
  if (phase == Phase::held && watch) {
    const auto s = watch->state();
    if (s.lost) {
      {
        std::lock_guard lock(m_mutex);
        if (m_watch != watch || m_phase != Phase::held) return;
        m_phase = Phase::lost;
        m_reason = s.lost_reason;
      }
      log("warning", "lost the lease of " + name + " (" + s.lost_reason +
                         "): writes are refused from now on; lease_claim queues for it again");
    }
  }
  if (subscribed) {
    auto v = mcp::version_of(path);
    bool changed;
    {
      std::lock_guard lock(m_mutex);
      changed = v != m_seen;
      m_seen = v;
    }
    if (auto* s = m_server.load(); changed && s) s->notify("notifications/resources/updated", js::object{{"uri", u}});
  }
}

} // namespace mcp_session

namespace {
using namespace mcp_session;

// ---- the server's loop ----

bool write_line(const std::string& message) {
  std::string line = message;
  line.push_back('\n');
  std::string_view rest = line;
  while (!rest.empty()) {
    ssize_t n = ::write(STDOUT_FILENO, rest.data(), rest.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    rest.remove_prefix(static_cast<std::size_t>(n));
  }
  return true;
}

// Reads standard input line by line until its end, handing each line to the server; a line
// longer than the limit is skipped and answered with an error.
void serve(mcp::Server& server, const std::atomic<bool>& broken) {
  std::string line;
  std::string tail;
  bool oversized = false;
  char buf[65536];
  while (!broken) {
    ssize_t n = ::read(STDIN_FILENO, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    std::string_view chunk(buf, static_cast<std::size_t>(n));
    while (!chunk.empty()) {
      const auto nl = chunk.find('\n');
      const std::string_view part = chunk.substr(0, nl);
      if (oversized) {
        tail.append(part);
        if (tail.size() > 512) tail.erase(0, tail.size() - 512);
      } else {
        line.append(part);
        if (line.size() > mcp::k_max_message) {
          oversized = true;
          tail = line.substr(line.size() - 512);
          line.resize(4096); // the head, for the id
        }
      }
      if (nl == std::string_view::npos) break;
      chunk.remove_prefix(nl + 1);
      if (oversized) {
        server.handle_oversized(line, tail);
        oversized = false;
        tail.clear();
      } else {
        if (!line.empty() && line.back() == '\r') line.pop_back();
        if (line.find_first_not_of(" \t") != std::string::npos) server.handle(line);
      }
      line.clear();
    }
  }
}

int mcp_main(const McpOptions& o, const GlobalOptions& g) {
  // Standard output carries MCP messages only: problems go to stderr as lines, --json or not.
  // 1. The arguments, before anything is created: the name and the labels.
  if (auto name = canonicalize(o.name); !name) {
    std::fprintf(stderr, "mep: Invalid agent name: %s\n", name.error().message().c_str());
    return exit_code::invalid_name;
  }
  {
    daemon_api::AttachBody probe;
    o.holder.add_to(probe); // UsageError for a malformed --label
  }
  // 2. The memory file: created empty (with an identity of its own) on the first run.
  const std::string socket = resolve_socket(g.socket, g.config_file);
  const std::string path = path_argument(o.memory);
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    DaemonReply r =
        daemon_request(socket, daemon_api::target(daemon_api::Endpoint::init), json::dump(js::object{{"path", path}}));
    if (r.ok())
      std::fprintf(stderr, "mep: created the memory file %s\n", o.memory.c_str());
    else if (!std::filesystem::exists(path, ec)) // made meanwhile by another (mepd refuses to init it): used
      return report_problem(r, socket, false);
  }
  // A client that goes away mid-answer is an end of input, not a signal.
  std::signal(SIGPIPE, SIG_IGN);

  // 3. The lease: held, or waited for while the memory is served read-only.
  Session session(o, socket, path);
  if (int status = session.start(); status != exit_code::ok) return status;

  // 4. The protocol, on standard input and output, until the client closes its end.
  std::atomic<bool> broken{false};
  mcp::Server server(mcp::Server::Info{"mep", "mep: exclusive memory for " + o.name, MEP_VERSION,
                                       "This server gives agent " + o.name +
                                           " exclusive use of its memory file through a fenced lease. Call "
                                           "lease_status first: while another agent holds the memory, reads work "
                                           "and writes are refused until this server says the lease is granted."},
                     session.tools(), &session, [&broken](const std::string& m) {
                       if (!write_line(m)) broken = true;
                     });
  session.set_server(&server);
  session.start_monitor();
  serve(server, broken);

  // 5. The end of the session: the lease is released (mepd would within a second anyway).
  session.set_server(nullptr);
  session.stop();
  return exit_code::ok;
}

} // namespace

void register_mcp(CLI::App& app, GlobalOptions& g, Action& action) {
  auto o = std::make_shared<McpOptions>();
  auto* cmd = app.add_subcommand("mcp", "Serve an agent's memory over the Model Context Protocol (stdio), fenced");
  cmd->add_option("--name", o->name, "The agent's name")->required();
  cmd->add_option("--memory", o->memory, "The .uai memory file (created empty when missing)")->required();
  cmd->add_option("--ttl", o->ttl, "Lease TTL in seconds (5-300)")
      ->check(CLI::Range(lease::k_min_ttl_s, lease::k_max_ttl_s))
      ->capture_default_str();
  cmd->add_option("--if-held", o->if_held,
                  "When another agent holds the memory: read-only (serve it read-only and wait for the lease) or fail "
                  "(exit 3)")
      ->check(CLI::IsMember({"read-only", "fail"}))
      ->capture_default_str();
  add_holder_options(cmd, o->holder);
  cmd->footer("Add to an MCP client's config: {\"command\": \"mep\", \"args\": [\"mcp\", \"--name\", \"NAME\", "
              "\"--memory\", \"/abs/path/memory.uai\"]}.\n"
              "Tools: lease_status, memory_read, memory_write, memory_append, memory_sync, memory_branch, "
              "memory_lineage, lease_claim.\n"
              "Exit status: 0 when the client closed the session, 3 held (--if-held fail), else as 'mep --help'.");
  cmd->callback([o, &g, &action] { action = [o, &g] { return mcp_main(*o, g); }; });
}

} // namespace mep::cli
