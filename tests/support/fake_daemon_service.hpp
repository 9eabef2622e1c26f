// A DaemonService for tests of what sits above it (mepd's request handler): no state, no
// files, no control plane. Each call is recorded (what it was and the paths and names it
// got) and answered at once with a plausible result, or with `problem` when a test sets
// one. A name or path containing "throw" makes the call throw, as a bug in the service
// would.
#pragma once
#include "mep/daemon_service.hpp"

#include <filesystem>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace mep::test {

class FakeDaemonService final : public daemon::DaemonService {
public:
  struct Call {
    std::string what; ///< the method's name
    std::vector<std::string> names;
    std::vector<std::filesystem::path> paths;
    daemon::AttachRequest attach; ///< for "attach"
    std::optional<std::string> lease_id;
  };
  std::vector<Call> calls;
  std::optional<Problem> problem;

  expected<daemon::Held, Problem> attach(const daemon::AttachRequest& req) override {
    Call& c = record("attach", {req.name}, {req.path});
    c.attach = req;
    if (problem) return make_unexpected(*problem);
    daemon::Held h = held(req.name);
    h.path = req.path.string();
    h.ttl_s = req.ttl_s;
    h.bind_pid = req.bind_pid ? req.pid : 0;
    return h;
  }
  /// Given, a detach ends the lease but reports this as the control plane's refusal.
  std::optional<Problem> control_plane_refusal;
  expected<daemon::Detached, Problem> detach(const std::string& name, const std::optional<std::string>& lease_id,
                                             uid_t) override {
    record("detach", {name}, {}).lease_id = lease_id;
    if (problem) return make_unexpected(*problem);
    return daemon::Detached{control_plane_refusal};
  }
  std::vector<daemon::Held> list(uid_t) const override { return {held("a"), held("b")}; }
  expected<daemon::Held, Problem> get(const std::string& name, uid_t) const override {
    if (name.find("throw") != std::string::npos) throw std::runtime_error("the fake service threw");
    if (problem) return make_unexpected(*problem);
    return held(name);
  }
  expected<daemon::BranchedFile, Problem> branch(const std::filesystem::path& path,
                                                 const std::filesystem::path& new_path, uid_t, mode_t) override {
    record("branch", {}, {path, new_path});
    if (problem) return make_unexpected(*problem);
    return daemon::BranchedFile{lease::Branched{k_child, k_memory, 7, true}, new_path.string()};
  }
  expected<daemon::Identified, Problem> identify(const std::filesystem::path& path) override {
    record("identify", {}, {path});
    if (problem) return make_unexpected(*problem);
    return daemon::Identified{k_memory, path.string(), std::nullopt, std::nullopt};
  }
  expected<daemon::Initialized, Problem> init(const std::filesystem::path& path, mode_t) override {
    record("init", {}, {path});
    if (problem) return make_unexpected(*problem);
    return daemon::Initialized{k_memory, path.string()};
  }
  expected<lease::Lineage, Problem> lineage(const std::optional<std::filesystem::path>& path,
                                            const std::string& id) override {
    std::vector<std::filesystem::path> paths;
    if (path) paths.push_back(*path);
    record("lineage", {id}, paths);
    if (problem) return make_unexpected(*problem);
    lease::Lineage l;
    l.memory_id = k_memory;
    l.memory.memory_id = k_memory;
    return l;
  }
  expected<daemon::VerifiedLease, Problem> verify(const std::string& name, const std::optional<std::string>& lease_id,
                                                  uid_t) override {
    record("verify", {name}, {}).lease_id = lease_id;
    if (problem) return make_unexpected(*problem);
    return daemon::VerifiedLease{name, k_memory, 3, k_expires};
  }
  expected<daemon::ObjectResult, Problem> sync(const std::string& name, const std::optional<std::string>& lease_id,
                                               uid_t) override {
    record("sync", {name}, {}).lease_id = lease_id;
    if (problem) return make_unexpected(*problem);
    return daemon::ObjectResult{name, k_memory, {}, 3, "\"e1\"", 12};
  }
  expected<daemon::ObjectResult, Problem> fetch(const std::string& memory_id, const std::filesystem::path& path,
                                                mode_t) override {
    record("fetch", {memory_id}, {path});
    if (problem) return make_unexpected(*problem);
    return daemon::ObjectResult{{}, memory_id, path.string(), 3, "\"e1\"", 12};
  }
  boost::json::object health() const override { return {{"status", "ok"}}; }
  std::string metrics() const override { return "mepd_up 1\n"; }
  int subscribe(std::function<void(const std::string&)>, uid_t) override { return 1; }
  void unsubscribe(int) override {}

  static constexpr const char* k_memory = "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b";
  static constexpr const char* k_child = "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5c";
  static constexpr UnixMs k_expires = 1767225630000; // 2026-01-01T00:00:30Z

private:
  Call& record(std::string what, std::vector<std::string> names, std::vector<std::filesystem::path> paths) {
    for (const auto& n : names)
      if (n.find("throw") != std::string::npos) throw std::runtime_error("the fake service threw");
    for (const auto& p : paths)
      if (p.string().find("throw") != std::string::npos) throw std::runtime_error("the fake service threw");
    std::lock_guard lock(m_mutex);
    calls.push_back(Call{std::move(what), std::move(names), std::move(paths), {}, {}});
    return calls.back();
  }
  static daemon::Held held(const std::string& name) {
    daemon::Held h;
    h.canonical_name = name;
    h.display_name = name;
    h.memory_id = k_memory;
    h.lease_id = "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a60";
    h.owner_client_id = "mepd-test";
    h.fencing_token = 3;
    h.ttl_s = 30;
    h.expires_at = k_expires;
    return h;
  }
  std::mutex m_mutex;
};

} // namespace mep::test
