// What cmd_mcp.cpp and cmd_mcp_tools.cpp share: mep mcp's options and limits, and the
// Session (one MCP client's lease on one memory file). Included by those two files only.
#pragma once
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

namespace mep::cli::mcp_session {

namespace js = boost::json;
using json::Need;
using Clock = std::chrono::steady_clock;

struct McpOptions {
  std::string name, memory, if_held = "read-only";
  std::int64_t ttl = 30;
  HolderOptions holder;
};

inline constexpr int k_verify_timeout_ms = 5000;
inline constexpr int k_release_timeout_ms = 5000;
inline constexpr std::int64_t k_default_read = 256 * 1024;
inline constexpr std::int64_t k_max_read = 1024 * 1024;
inline constexpr std::size_t k_max_write = 4u << 20; // per call: the 16 MiB message holds it escaped
inline constexpr std::uint64_t k_max_resource = 4u << 20;
inline constexpr auto k_monitor_period = std::chrono::milliseconds(200);
inline constexpr std::int64_t k_switch_wait_s = 10;

enum class Phase { held, waiting, lost, none };

inline std::string_view to_string(Phase p) {
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

// "Name held: held by builder-7 on host-a since 14:02, expires in 21 s" for a problem.
inline std::string explain(const Problem& p) {
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
  daemon_api::AttachBody attach_body() const;
  // One attach, waiting up to `wait_s`; a grant (201) is taken. Returns the daemon's answer.
  DaemonReply attach_once(std::int64_t wait_s);
  // attach_once(), and on 423 the wait begins in the background; else the problem.
  expected<void, Problem> attach_now(std::int64_t wait_s = 0);
  // Takes a grant made for attach number `generation`; false (and nothing changes) when
  // another attach or the session's end has come since: the caller gives the lease back.
  bool granted(const daemon_api::Lease& lease, Clock::time_point sent, const std::shared_ptr<LeaseWatch>& watch,
               std::uint64_t generation);
  void give_back(const daemon_api::Lease& lease); // detaches a lease no longer wanted
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
  std::optional<daemon_api::Lease> m_lease;  // held, lost: the attach's answer
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

} // namespace mep::cli::mcp_session
