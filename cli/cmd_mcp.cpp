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
#include "commands.hpp"
#include "daemon_client.hpp"
#include "lease_watch.hpp"

#include "mep/canonical.hpp"
#include "mep/json.hpp"
#include "mep/lease/wire.hpp"
#include "mep/mcp/memory_file.hpp"
#include "mep/mcp/protocol.hpp"
#include "mep/problem.hpp"
#include "mep/time.hpp"
#include "mep/utf8.hpp"

#include <boost/json.hpp>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <unistd.h>

#ifndef MEP_VERSION
#define MEP_VERSION "0.0.0"
#endif

namespace mep::cli {
namespace {
namespace js = boost::json;
using json::Need;
using Clock = std::chrono::steady_clock;

struct McpOptions {
  std::string name, memory, if_held = "read-only";
  std::int64_t ttl = 30;
  HolderOptions holder;
};

constexpr int k_verify_timeout_ms = 5000;
constexpr int k_release_timeout_ms = 5000;
constexpr std::int64_t k_default_read = 256 * 1024;
constexpr std::int64_t k_max_read = 1024 * 1024;
constexpr std::size_t k_max_write = 4u << 20; // per call: the 16 MiB message holds it escaped
constexpr std::uint64_t k_max_resource = 4u << 20;
constexpr auto k_monitor_period = std::chrono::milliseconds(200);
constexpr std::int64_t k_switch_wait_s = 10;

enum class Phase { held, waiting, lost, none };

std::string_view to_string(Phase p) {
  switch (p) {
  case Phase::held:
    return "held";
  case Phase::waiting:
    return "waiting";
  case Phase::lost:
    return "lost";
  case Phase::none:
    return "not-held";
  }
  return "not-held";
}

std::string str(const js::object& o, std::string_view k) {
  auto* v = o.if_contains(k);
  return v && v->is_string() ? std::string(v->get_string()) : std::string();
}

// "Name held: held by builder-7 on host-a since 14:02, expires in 21 s" for a problem.
std::string explain(const Problem& p) {
  if (auto holder = held_by(p); !holder.empty()) return std::string(p.title()) + ": " + holder;
  return std::string(p.title()) + (p.detail.empty() ? "" : ": " + p.detail);
}

class Session final : public mcp::Resources {
public:
  Session(const McpOptions& o, std::string socket, std::string path)
      : m_options(o), m_socket(std::move(socket)), m_path(std::move(path)),
        m_events(m_socket, [this](const std::string& line) {
          std::shared_ptr<LeaseWatch> w;
          {
            std::lock_guard lock(m_mutex);
            w = m_watch;
          }
          if (w) w->on_event(line);
        }) {
    m_events.wait_connected();
  }
  ~Session() override { stop(); }

  /// The first attach: 0 when the session may serve (held, or waiting read-only), else the
  /// exit status (the problem said on stderr).
  int start();
  void set_server(mcp::Server* s) { m_server.store(s); }
  /// The monitor thread: loss by the deadline, changes of a subscribed memory.
  void start_monitor();
  /// Ends the wait, releases a held lease, stops the threads.
  void stop();

  std::vector<mcp::Tool> tools();

  // mcp::Resources
  js::array list() override;
  expected<js::object, mcp::RpcError> read(const std::string& uri) override;
  expected<void, mcp::RpcError> subscribe(const std::string& uri) override;
  expected<void, mcp::RpcError> unsubscribe(const std::string& uri) override;

private:
  js::object attach_body() const;
  // One attach, waiting up to `wait_s`; a grant (201) is taken. Returns the daemon's answer.
  DaemonReply attach_once(std::int64_t wait_s);
  // attach_once(), and on 423 the wait begins in the background; else the problem.
  expected<void, Problem> attach_now(std::int64_t wait_s = 0);
  // Takes a grant made for attach number `generation`; false (and nothing changes) when
  // another attach or the session's end has come since: the caller gives the lease back.
  bool granted(const js::object& lease, Clock::time_point sent, const std::shared_ptr<LeaseWatch>& watch,
               std::uint64_t generation);
  void give_back(const js::object& lease); // detaches a lease no longer wanted
  void begin_wait(const Problem& refusal);
  void wait_for_lease(std::uint64_t generation, std::shared_ptr<Cancel> cancel, std::shared_ptr<LeaseWatch> watch);
  void end_wait();
  void release();
  void monitor();
  void log(std::string_view level, const std::string& text);
  std::string uri() const; // m_mutex held

  js::object status();
  mcp::ToolResult read_tool(const js::object& args);
  mcp::ToolResult write_tool(const js::object& args, mcp::WriteMode mode);
  mcp::ToolResult sync_tool(const js::object& args);
  mcp::ToolResult branch_tool(const js::object& args);
  mcp::ToolResult lineage_tool(const js::object& args);
  mcp::ToolResult claim_tool(const js::object& args);
  /// Why the session may not write now; nullopt when it may (held, not lost).
  std::optional<std::string> not_writable();

  const McpOptions& m_options;
  const std::string m_socket;
  std::atomic<mcp::Server*> m_server{nullptr};

  mutable std::mutex m_mutex;
  std::string m_path; // absolute, as mepd takes it
  std::string m_memory_id;
  Phase m_phase = Phase::none;
  std::string m_reason;                      // lost, none: why; waiting: who holds it
  js::object m_lease;                        // held, lost: the attach's answer
  std::optional<lease::HolderView> m_holder; // waiting: who holds it, when the control plane says
  std::shared_ptr<LeaseWatch> m_watch;       // the lease being attached or held
  std::shared_ptr<Cancel> m_cancel;          // the wait's
  std::uint64_t m_generation = 0;            // bumped by each new attach: a stale wait's grant is released
  std::set<std::string> m_subscribed;
  std::optional<mcp::Version> m_seen;

  EventFollower m_events;
  std::thread m_waiter, m_monitor;
  std::atomic<bool> m_stopping{false};
};

js::object Session::attach_body() const {
  js::object body{{"name", m_options.name}, {"path", m_path}, {"ttl_seconds", m_options.ttl}, {"bind", "pid"}};
  m_options.holder.add_to(body);
  return body;
}

DaemonReply Session::attach_once(std::int64_t wait_s) {
  auto watch = std::make_shared<LeaseWatch>(m_options.ttl);
  js::object body;
  std::uint64_t generation;
  {
    std::lock_guard lock(m_mutex);
    body = attach_body();
    m_watch = watch;
    generation = ++m_generation;
  }
  if (wait_s > 0) body["wait_seconds"] = wait_s;
  const auto sent = Clock::now();
  DaemonReply r =
      daemon_request(m_socket, "POST", "/v1/attach", json::dump(body), static_cast<int>(wait_s * 1000 + 30000));
  if (r.status == 201 && !granted(r.json(), sent, watch, generation)) {
    give_back(r.json());
    r.status = 0;
    r.error = "the session ended";
  }
  return r;
}

expected<void, Problem> Session::attach_now(std::int64_t wait_s) {
  DaemonReply r = attach_once(wait_s);
  if (r.status == 201) return {};
  if (r.status == 423) {
    begin_wait(r.problem(m_socket));
    return {};
  }
  return make_unexpected(r.problem(m_socket));
}

int Session::start() {
  DaemonReply r = attach_once(0);
  if (r.status == 201) return exit_code::ok;
  if (r.status != 423 || m_options.if_held == "fail") return report_problem(r, m_socket, false);
  begin_wait(r.problem(m_socket));
  std::fprintf(stderr, "mep: %s; serving read-only and waiting for it\n", explain(r.problem(m_socket)).c_str());
  return exit_code::ok;
}

bool Session::granted(const js::object& lease, Clock::time_point sent, const std::shared_ptr<LeaseWatch>& watch,
                      std::uint64_t generation) {
  auto granted_at = sent;
  if (auto* after = lease.if_contains("granted_after_ms"); after && after->is_int64() && after->get_int64() > 0)
    granted_at += std::chrono::milliseconds(after->get_int64());
  watch->attached(str(lease, "canonical_name"), str(lease, "lease_id"), granted_at);
  std::lock_guard lock(m_mutex);
  if (generation != m_generation || m_stopping) return false;
  m_lease = lease;
  m_lease.erase("path"); // a local path is not for the model: it named the file itself
  m_lease.erase("granted_after_ms");
  m_memory_id = str(lease, "memory_instance_id");
  m_phase = Phase::held;
  m_reason.clear();
  m_holder.reset();
  return true;
}

void Session::give_back(const js::object& lease) {
  daemon_request(m_socket, "POST", "/v1/detach",
                 json::dump(js::object{{"name", str(lease, "canonical_name")}, {"lease_id", str(lease, "lease_id")}}),
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
    std::string target = "/v1/identify?path=";
    for (unsigned char c : path) { // percent-encode what is not unreserved
      if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' || c == '/') {
        target += static_cast<char>(c);
      } else {
        char hex[4];
        std::snprintf(hex, sizeof hex, "%%%02X", c);
        target += hex;
      }
    }
    DaemonReply ident = daemon_request(m_socket, "GET", target);
    if (ident.status == 200) id = str(ident.json(), "memory_instance_id");
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
      js::object body;
      {
        std::lock_guard lock(m_mutex);
        body = attach_body();
      }
      body["wait_seconds"] = k_wait_forever;
      const auto sent = Clock::now();
      DaemonReply r = daemon_request(m_socket, "POST", "/v1/attach", json::dump(body), -1, cancel.get());
      if (r.status == 201) {
        const auto lease = r.json();
        // Granted as the wait was given up (a branch switch, the session's end): not wanted.
        if (cancel->cancelled() || !granted(lease, sent, watch, generation)) {
          give_back(lease);
          return;
        }
        log("notice", "granted: " + str(lease, "display_name") + " now holds its memory (fencing token " +
                          std::to_string(lease.contains("fencing_token") && lease.at("fencing_token").is_int64()
                                             ? lease.at("fencing_token").get_int64()
                                             : 0) +
                          "); writes are accepted");
        return;
      }
      if (cancel->cancelled()) return;
      if (r.status == 0 || r.status == 423 || r.status == 503) {
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
  js::object lease;
  {
    std::lock_guard lock(m_mutex);
    if (m_phase != Phase::held) return;
    lease = m_lease;
    m_phase = Phase::none;
    m_reason = "released";
  }
  give_back(lease);
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
    name = str(m_lease, "display_name");
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

// ---- tools ----

js::object Session::status() {
  std::lock_guard lock(m_mutex);
  js::object o{{"name", m_options.name}};
  if (auto c = str(m_lease, "canonical_name"); !c.empty()) o["canonical_name"] = c;
  if (!m_memory_id.empty()) o["memory_instance_id"] = m_memory_id;
  Phase phase = m_phase;
  std::string reason = m_reason;
  if (phase == Phase::held && m_watch) {
    const auto s = m_watch->state();
    if (s.lost) {
      phase = Phase::lost;
      reason = s.lost_reason;
    }
  }
  o["state"] = to_string(phase);
  o["writable"] = phase == Phase::held;
  if (phase == Phase::held) {
    for (auto k : {"fencing_token", "lease_id", "expires_at"})
      if (auto* v = m_lease.if_contains(k)) o[k] = *v;
    if (m_watch)
      if (auto e = m_watch->state().expires_at; !e.empty()) o["expires_at"] = e;
  }
  o["ttl_seconds"] = m_options.ttl;
  if (phase == Phase::waiting && m_holder) {
    js::object h{{"display_name", m_holder->display_name}};
    if (!m_holder->host.empty()) h["host"] = m_holder->host;
    h["since"] = format_rfc3339_ms(m_holder->since);
    h["expires_at"] = format_rfc3339_ms(m_holder->expires_at);
    o["holder"] = std::move(h);
  }
  if (phase != Phase::held && !reason.empty()) o["reason"] = reason;
  return o;
}

std::optional<std::string> Session::not_writable() {
  std::lock_guard lock(m_mutex);
  switch (m_phase) {
  case Phase::held:
    if (m_watch)
      if (auto s = m_watch->state(); s.lost) return "the lease was lost (" + s.lost_reason + ")";
    return std::nullopt;
  case Phase::waiting:
    return "the lease is held elsewhere (" + m_reason + "); this server waits for it and says when it is granted";
  case Phase::lost:
    return "the lease was lost (" + m_reason + "); lease_claim queues for it again";
  case Phase::none:
    return "the lease is not held (" + m_reason + "); lease_claim tries again";
  }
  return "the lease is not held";
}

mcp::ToolResult Session::read_tool(const js::object& args) {
  json::ObjectReader rd(args);
  auto offset = rd.integer("offset", Need::optional, 0, std::numeric_limits<std::int64_t>::max());
  auto length = rd.integer("length", Need::optional, 1, k_max_read);
  auto encoding = rd.string("encoding", Need::optional);
  if (encoding && *encoding != "text" && *encoding != "base64") rd.fail("encoding must be \"text\" or \"base64\"");
  if (auto ok = rd.finish(); !ok) return mcp::ToolResult::error(ok.error().detail);
  std::string path, id;
  {
    std::lock_guard lock(m_mutex);
    path = m_path;
    id = m_memory_id;
  }
  const auto enc = encoding.value_or("text") == "base64" ? mcp::Encoding::base64 : mcp::Encoding::text;
  auto s = mcp::read_slice(path, static_cast<std::uint64_t>(offset.value_or(0)),
                           static_cast<std::uint64_t>(length.value_or(k_default_read)), enc);
  if (!s) return mcp::ToolResult::error(s.error());
  js::object o;
  if (!id.empty()) o["memory_instance_id"] = id;
  o["offset"] = s->offset;
  o["size"] = s->size;
  if (s->next_offset) o["next_offset"] = *s->next_offset;
  if (enc == mcp::Encoding::text)
    o["text"] = s->bytes;
  else
    o["base64"] = mcp::base64(s->bytes);
  return mcp::ToolResult::ok(std::move(o));
}

mcp::ToolResult Session::write_tool(const js::object& args, mcp::WriteMode mode) {
  json::ObjectReader rd(args);
  auto text = rd.string("text", Need::required);
  if (auto ok = rd.finish(); !ok) return mcp::ToolResult::error(ok.error().detail);
  if (text->size() > k_max_write)
    return mcp::ToolResult::error("the text is " + std::to_string(text->size()) + " bytes; at most " +
                                  std::to_string(k_max_write) + " per call (append the rest)");
  const char* verb = mode == mcp::WriteMode::append ? "appended" : "written";
  if (auto why = not_writable()) return mcp::ToolResult::error(std::string("nothing was ") + verb + ": " + *why);
  js::object lease;
  std::shared_ptr<LeaseWatch> watch;
  std::string path, id;
  {
    std::lock_guard lock(m_mutex);
    lease = m_lease;
    watch = m_watch;
    path = m_path;
    id = m_memory_id;
  }
  // 1. The control plane confirms the token is current (a revoked or superseded lease is
  //    refused here at once). When it cannot be asked, the local deadline stands alone.
  DaemonReply v = daemon_request(
      m_socket, "POST", "/v1/verify",
      json::dump(js::object{{"name", str(lease, "canonical_name")}, {"lease_id", str(lease, "lease_id")}}),
      k_verify_timeout_ms);
  const bool verified = v.status == 200;
  if (v.status >= 400 && v.status < 500) {
    const Problem p = v.problem(m_socket);
    const std::string reason = std::string(p.slug()) + (p.detail.empty() ? "" : ": " + p.detail);
    watch->lose(reason);
    {
      std::lock_guard lock(m_mutex);
      if (m_watch == watch && m_phase == Phase::held) {
        m_phase = Phase::lost;
        m_reason = reason;
      }
    }
    log("warning", "lost the lease (" + reason + "): writes are refused from now on");
    return mcp::ToolResult::error(std::string("nothing was ") + verb + ": the lease is not live (" + reason + ")");
  }
  // 2. Written beside the file, then renamed over it only while the lease is still live.
  auto written = mcp::write_atomically(path, *text, mode, [&]() -> std::optional<std::string> {
    if (auto s = watch->state(); s.lost) return "the lease was lost (" + s.lost_reason + ")";
    return std::nullopt;
  });
  if (!written) return mcp::ToolResult::error(std::string("nothing was ") + verb + ": " + written.error());
  js::object o;
  if (!id.empty()) o["memory_instance_id"] = id;
  o["fencing_token"] = lease.contains("fencing_token") ? lease.at("fencing_token") : js::value(0);
  o["size"] = *written;
  o["bytes_written"] = text->size();
  o["verified"] = verified;
  return mcp::ToolResult::ok(std::move(o));
}

mcp::ToolResult Session::sync_tool(const js::object& args) {
  json::ObjectReader rd(args);
  if (auto ok = rd.finish(); !ok) return mcp::ToolResult::error(ok.error().detail);
  if (auto why = not_writable()) return mcp::ToolResult::error("nothing was synced: " + *why);
  js::object lease;
  {
    std::lock_guard lock(m_mutex);
    lease = m_lease;
  }
  // The daemon uploads the file under the lease's token; the data plane refuses a token
  // older than its mark (a takeover elsewhere), and the daemon then takes the lease as lost.
  DaemonReply r = daemon_request(
      m_socket, "POST", "/v1/sync",
      json::dump(js::object{{"name", str(lease, "canonical_name")}, {"lease_id", str(lease, "lease_id")}}));
  if (r.status != 200) {
    const Problem p = r.problem(m_socket);
    return mcp::ToolResult::error("nothing was synced: " + explain(p) + " (" + std::string(p.slug()) + ")");
  }
  js::object o = r.json();
  o.erase("canonical_name");
  return mcp::ToolResult::ok(std::move(o));
}

mcp::ToolResult Session::branch_tool(const js::object& args) {
  json::ObjectReader rd(args);
  auto new_path = rd.string("path", Need::required);
  auto switch_to = rd.boolean("switch", Need::optional).value_or(true);
  if (auto ok = rd.finish(); !ok) return mcp::ToolResult::error(ok.error().detail);
  std::string abs;
  try {
    abs = path_argument(*new_path);
  } catch (const UserError& e) {
    return mcp::ToolResult::error(e.what());
  }
  std::string path;
  {
    std::lock_guard lock(m_mutex);
    path = m_path;
  }
  DaemonReply r =
      daemon_request(m_socket, "POST", "/v1/branch", json::dump(js::object{{"path", path}, {"new_path", abs}}));
  if (r.status != 201) return mcp::ToolResult::error("no branch was made: " + explain(r.problem(m_socket)));
  js::object o = r.json();
  if (switch_to) {
    // The session moves to the branch: no more wait for the old memory, no lease on it.
    end_wait();
    release();
    {
      std::lock_guard lock(m_mutex);
      m_path = abs;
      m_memory_id = str(o, "memory_instance_id");
      m_lease = js::object{};
      m_seen.reset();
      m_subscribed.clear();
    }
    // A wait given up a moment ago keeps its place in the control plane's queue for a few
    // seconds (for a retry after a crash), ahead of this claim of the same name: a short
    // wait here lets it go first.
    if (auto a = attach_now(k_switch_wait_s); !a) {
      std::lock_guard lock(m_mutex);
      m_phase = Phase::none;
      m_reason = explain(a.error());
    }
    if (auto* s = m_server.load()) s->notify("notifications/resources/list_changed");
  }
  o["switched"] = switch_to;
  js::object st = status();
  o["state"] = st.at("state");
  o["writable"] = st.at("writable");
  return mcp::ToolResult::ok(std::move(o));
}

mcp::ToolResult Session::lineage_tool(const js::object& args) {
  json::ObjectReader rd(args);
  auto id = rd.uuid("memory_instance_id", Need::optional);
  if (auto ok = rd.finish(); !ok) return mcp::ToolResult::error(ok.error().detail);
  std::string of = id.value_or("");
  if (of.empty()) {
    std::lock_guard lock(m_mutex);
    of = m_memory_id;
  }
  if (of.empty()) return mcp::ToolResult::error("this memory has no id yet");
  DaemonReply r = daemon_request(m_socket, "GET", "/v1/lineage?id=" + of);
  if (r.status != 200) return mcp::ToolResult::error(explain(r.problem(m_socket)));
  return mcp::ToolResult::ok(r.json());
}

mcp::ToolResult Session::claim_tool(const js::object& args) {
  json::ObjectReader rd(args);
  if (auto ok = rd.finish(); !ok) return mcp::ToolResult::error(ok.error().detail);
  Phase phase;
  {
    std::lock_guard lock(m_mutex);
    phase = m_phase;
  }
  if (phase == Phase::held && !not_writable()) return mcp::ToolResult::ok(status());
  if (phase != Phase::waiting) {
    end_wait();
    if (auto a = attach_now(); !a) {
      {
        std::lock_guard lock(m_mutex);
        m_phase = Phase::none;
        m_reason = explain(a.error());
      }
      return mcp::ToolResult::error("the lease was not granted: " + explain(a.error()));
    }
  }
  return mcp::ToolResult::ok(status());
}

// ---- resources ----

js::array Session::list() {
  std::lock_guard lock(m_mutex);
  if (m_memory_id.empty()) return {};
  js::object r{{"uri", uri()},
               {"name", m_options.name},
               {"title", "Memory of " + m_options.name},
               {"description", "The memory file of agent " + m_options.name + " (memory " + m_memory_id + ")"},
               {"mimeType", "text/plain"}};
  if (auto v = mcp::version_of(m_path)) r["size"] = v->size;
  return js::array{std::move(r)};
}

expected<js::object, mcp::RpcError> Session::read(const std::string& u) {
  std::string path;
  {
    std::lock_guard lock(m_mutex);
    if (u.empty() || u != uri())
      return make_unexpected(
          mcp::RpcError{mcp::rpc::resource_not_found, "Resource not found: " + u, js::object{{"uri", u}}});
    path = m_path;
  }
  auto bytes = mcp::read_all(path, k_max_resource);
  if (!bytes) return make_unexpected(mcp::RpcError{mcp::rpc::internal_error, bytes.error(), nullptr});
  js::object item{{"uri", u}};
  if (utf8::decode(*bytes)) {
    item["mimeType"] = "text/plain";
    item["text"] = *bytes;
  } else {
    item["mimeType"] = "application/octet-stream";
    item["blob"] = mcp::base64(*bytes);
  }
  return js::object{{"contents", js::array{std::move(item)}}};
}

expected<void, mcp::RpcError> Session::subscribe(const std::string& u) {
  std::lock_guard lock(m_mutex);
  if (u.empty() || u != uri())
    return make_unexpected(
        mcp::RpcError{mcp::rpc::resource_not_found, "Resource not found: " + u, js::object{{"uri", u}}});
  if (m_subscribed.insert(u).second) m_seen = mcp::version_of(m_path);
  return {};
}

expected<void, mcp::RpcError> Session::unsubscribe(const std::string& u) {
  std::lock_guard lock(m_mutex);
  m_subscribed.erase(u);
  return {};
}

// ---- the tools' declarations ----

js::object schema(js::object properties, std::initializer_list<std::string_view> required = {}) {
  js::object s{{"type", "object"}, {"properties", std::move(properties)}, {"additionalProperties", false}};
  if (required.size()) {
    js::array r;
    for (auto k : required) r.emplace_back(k);
    s["required"] = std::move(r);
  }
  return s;
}

js::object type(std::string_view t, std::string_view description = {}) {
  js::object o{{"type", t}};
  if (!description.empty()) o["description"] = description;
  return o;
}

js::object out(js::object properties, std::initializer_list<std::string_view> required) {
  js::object s = schema(std::move(properties), required);
  s.erase("additionalProperties"); // answers may grow
  return s;
}

js::object hints(bool read_only, bool destructive, bool idempotent) {
  js::object a{{"readOnlyHint", read_only}};
  if (!read_only) {
    a["destructiveHint"] = destructive;
    a["idempotentHint"] = idempotent;
  }
  a["openWorldHint"] = false;
  return a;
}

std::vector<mcp::Tool> Session::tools() {
  js::object holder_schema = out(js::object{{"display_name", type("string")},
                                            {"host", type("string")},
                                            {"since", type("string")},
                                            {"expires_at", type("string")}},
                                 {"display_name", "since", "expires_at"});
  js::object status_schema = out(
      js::object{{"name", type("string", "the agent name this server was started with")},
                 {"canonical_name", type("string")},
                 {"memory_instance_id", type("string")},
                 {"state", js::object{{"type", "string"}, {"enum", js::array{"held", "waiting", "lost", "not-held"}}}},
                 {"writable", type("boolean")},
                 {"fencing_token", type("integer")},
                 {"lease_id", type("string")},
                 {"expires_at", type("string")},
                 {"ttl_seconds", type("integer")},
                 {"holder", holder_schema},
                 {"reason", type("string")}},
      {"name", "state", "writable", "ttl_seconds"});
  js::object written_schema = out(js::object{{"memory_instance_id", type("string")},
                                             {"fencing_token", type("integer")},
                                             {"size", type("integer")},
                                             {"bytes_written", type("integer")},
                                             {"verified", type("boolean")}},
                                  {"fencing_token", "size", "bytes_written", "verified"});
  js::object text_in = schema(js::object{{"text", type("string", "UTF-8 text, at most 4 MiB")}}, {"text"});

  std::vector<mcp::Tool> t;
  t.push_back({"lease_status", "Lease status",
               "Who holds this agent's memory: the lease's state (held, waiting, lost, not-held), whether writes are "
               "accepted, the fencing token and expiry when held, and the holder (display name, since when) while "
               "another agent holds it.",
               schema({}), status_schema, hints(true, false, true), [this](const js::object& a) {
                 json::ObjectReader rd(a);
                 if (auto ok = rd.finish(); !ok) return mcp::ToolResult::error(ok.error().detail);
                 return mcp::ToolResult::ok(status());
               }});
  t.push_back({"memory_read", "Read the memory",
               "The memory's bytes as text (or base64), from offset for at most length bytes (default 262144, at most "
               "1048576). next_offset is where the rest starts when there is more. Works while another agent holds "
               "the memory.",
               schema(js::object{{"offset", js::object{{"type", "integer"}, {"minimum", 0}}},
                                 {"length", js::object{{"type", "integer"}, {"minimum", 1}, {"maximum", k_max_read}}},
                                 {"encoding", js::object{{"type", "string"}, {"enum", js::array{"text", "base64"}}}}}),
               out(js::object{{"memory_instance_id", type("string")},
                              {"offset", type("integer")},
                              {"size", type("integer")},
                              {"next_offset", type("integer")},
                              {"text", type("string")},
                              {"base64", type("string")}},
                   {"offset", "size"}),
               hints(true, false, true), [this](const js::object& a) { return read_tool(a); }});
  t.push_back({"memory_write", "Replace the memory",
               "Replaces the memory's content with text, atomically (a reader sees the old content or the new) and "
               "durably. Refused while this agent does not hold the lease.",
               text_in, written_schema, hints(false, true, true),
               [this](const js::object& a) { return write_tool(a, mcp::WriteMode::replace); }});
  t.push_back({"memory_append", "Append to the memory",
               "Appends text to the memory, atomically and durably. Refused while this agent does not hold the lease.",
               text_in, written_schema, hints(false, false, false),
               [this](const js::object& a) { return write_tool(a, mcp::WriteMode::append); }});
  t.push_back({"memory_sync", "Upload the memory",
               "Uploads the memory to the data plane (mep store) under the lease's fencing token, so another host can "
               "fetch it; the store refuses it once another holder's token reached it.",
               schema({}),
               out(js::object{{"memory_instance_id", type("string")},
                              {"fencing_token", type("integer")},
                              {"etag", type("string")},
                              {"size", type("integer")}},
                   {"memory_instance_id", "fencing_token"}),
               hints(false, false, true), [this](const js::object& a) { return sync_tool(a); }});
  t.push_back(
      {"memory_branch", "Branch the memory",
       "Copies the memory to a new file at path with an identity of its own and this memory as its parent (lineage). "
       "With switch (default true) this server then works on the branch: for an agent that must not wait for a "
       "memory another agent holds.",
       schema(js::object{{"path", type("string", "the new memory file; it must not exist")},
                         {"switch", type("boolean", "work on the branch from now on (default true)")}},
              {"path"}),
       out(js::object{{"memory_instance_id", type("string")},
                      {"parent_memory_instance_id", type("string")},
                      {"branched_at_token", type("integer")},
                      {"path", type("string")},
                      {"switched", type("boolean")},
                      {"state", type("string")},
                      {"writable", type("boolean")}},
           {"memory_instance_id", "parent_memory_instance_id", "switched", "state", "writable"}),
       hints(false, false, false), [this](const js::object& a) { return branch_tool(a); }});
  t.push_back({"memory_lineage", "Memory lineage",
               "The memory's ancestors and children (branches), or those of memory_instance_id.",
               schema(js::object{{"memory_instance_id", type("string")}}),
               out(js::object{{"memory_instance_id", type("string")},
                              {"memory", type("object")},
                              {"ancestors", type("array")},
                              {"children", type("array")}},
                   {"memory_instance_id"}),
               hints(true, false, true), [this](const js::object& a) { return lineage_tool(a); }});
  t.push_back({"lease_claim", "Claim the lease again",
               "After the lease was lost (or could not be had), asks for it again: granted at once when free, else "
               "this server waits in the queue and says when it is granted. Does nothing while the lease is held or "
               "waited for.",
               schema({}), status_schema, hints(false, false, true),
               [this](const js::object& a) { return claim_tool(a); }});
  return t;
}

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
    js::object probe;
    o.holder.add_to(probe); // UsageError for a malformed --label
  }
  // 2. The memory file: created empty (with an identity of its own) on the first run.
  const std::string socket = resolve_socket(g.socket, g.config_file);
  const std::string path = path_argument(o.memory);
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    DaemonReply r = daemon_request(socket, "POST", "/v1/init", json::dump(js::object{{"path", path}}));
    if (r.status != 201 && r.status != 409) return report_problem(r, socket, false);
    if (r.status == 201) std::fprintf(stderr, "mep: created the memory file %s\n", o.memory.c_str());
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
