// A Store for tests of what sits above it (the router): no database, answers at once from
// memory. A memory is "registered" once asked for, a claim is granted unless its memory is
// unknown, and the bearer token "mep_test" (lease and admin scope) is the only one known.
// It counts the calls it gets, and can be told to fail the Nth one (fault injection).
#pragma once
#include "mep/crypto.hpp"
#include "mep/store.hpp"
#include "mep/uuid.hpp"

#include <atomic>
#include <mutex>
#include <set>
#include <string>

namespace mep::test {

class FakeStore final : public server::Store {
public:
  static constexpr const char* k_token = "mep_test";
  static constexpr UnixMs k_now = 1767225600000; // 2026-01-01T00:00:00Z

  // Calls counted; with fail_at > 0 the call of that number throws (a database error).
  std::atomic<int> calls{0};
  int fail_at = 0;
  // Set by a test: claims answer this problem; outcomes are replays of stored ones.
  std::optional<Problem> claim_problem;
  bool replay = false;

  void register_memory(const server::Ctx&, server::Idempotency, server::RegisterMemory req,
                       server::Then<lease::Registered> then) override {
    step();
    std::string id = req.memory_id.value_or(uuid_v7().to_string());
    {
      std::lock_guard lock(m_mutex);
      m_memories.insert(id);
    }
    then(server::Outcome<lease::Registered>(lease::Registered{id, k_now, !replay}, replay));
  }
  void claim(const server::Ctx&, server::Idempotency, server::Claim req, server::Then<lease::Grant> then) override {
    step();
    if (!req.name) return then(req.name.error().to_problem());
    if (req.ttl_s < server::k_min_ttl_s || req.ttl_s > server::k_max_ttl_s)
      return then(Problem(Code::invalid_ttl, "ttl out of range"));
    if (!known(req.memory_id)) return then(Problem(Code::memory_not_found, "no such memory"));
    if (claim_problem) return then(server::Outcome<lease::Grant>(*claim_problem, replay));
    lease::Grant g;
    g.lease_id = uuid_v7().to_string();
    g.canonical_name = req.name->canonical_name;
    g.display_name = req.display_name;
    g.memory_id = req.memory_id;
    g.fencing_token = 1;
    g.ttl_s = req.ttl_s;
    g.expires_at = k_now + req.ttl_s * 1000;
    g.server_time = k_now;
    then(server::Outcome<lease::Grant>(std::move(g), replay));
  }
  void branch(const server::Ctx&, server::Idempotency, server::Branch req,
              server::Then<lease::Branched> then) override {
    step();
    if (!known(req.parent_memory_id)) return then(Problem(Code::memory_not_found, "no such memory"));
    then(lease::Branched{req.memory_id.value_or(uuid_v7().to_string()), req.parent_memory_id, req.parent_fencing_token,
                         true});
  }
  void renew(const server::Ctx&, server::LeaseRef, server::Then<lease::Renewed> then) override { gone(then); }
  void renew_batch(const server::Ctx&, server::RenewBatch req, server::Then<lease::RenewBatchResult> then) override {
    step();
    lease::RenewBatchResult out;
    for (const auto& l : req.leases)
      out.results.push_back(lease::RenewItem{l.canonical_name, 410, std::nullopt, "lease-expired"});
    then(std::move(out));
  }
  void release(const server::Ctx&, server::LeaseRef, server::Then<server::Released> then) override {
    step();
    then(server::Released{});
  }
  void verify(const server::Ctx&, server::Verify, server::Then<lease::Verified> then) override { gone(then); }
  void revoke(const server::Ctx&, server::Revoke, server::Then<server::Revoked> then) override {
    step();
    then(Problem(Code::lease_not_found, "no live lease under this name"));
  }
  void history(const server::Ctx&, server::HistoryQuery req, server::Then<lease::HistoryPage> then) override {
    step();
    lease::HistoryPage page;
    page.canonical_name = req.canonical_name;
    then(std::move(page));
  }
  void get_lease(const server::Ctx&, std::string, server::Then<lease::LeaseInfo> then) override {
    step();
    then(Problem(Code::lease_not_found, "no live lease"));
  }
  void list_leases(const server::Ctx&, server::ListLeases, server::Then<lease::LeasePage> then) override {
    step();
    then(lease::LeasePage{});
  }
  void get_memory(const server::Ctx&, std::string id, server::Then<lease::Memory> then) override {
    step();
    if (!known(id)) return then(Problem(Code::memory_not_found, "no such memory"));
    lease::Memory m;
    m.memory_id = id;
    then(std::move(m));
  }
  void lineage(const server::Ctx&, std::string id, server::Then<lease::Lineage> then) override {
    step();
    if (!known(id)) return then(Problem(Code::memory_not_found, "no such memory"));
    lease::Lineage l;
    l.memory_id = id;
    l.memory.memory_id = id;
    then(std::move(l));
  }
  std::optional<server::AuthInfo> authenticate(const std::string& token_sha256) override {
    if (token_sha256 != sha256_hex(k_token)) return std::nullopt;
    return server::AuthInfo{"tenant-test", "token-test", true, true};
  }
  void audit_auth_failure(const std::string&) override {}
  void enter_queue(const server::Ctx&, server::QueuePlace, server::Then<std::uint64_t> then) override {
    then(++m_last_ticket);
  }
  bool ready() override { return true; }
  std::int64_t active_leases() override { return 0; }
  std::int64_t sweep() override { return 0; }
  bool migration_in_progress() override { return m_migrating; }
  void identity_map(const server::Ctx&, std::optional<std::string>, std::size_t,
                    server::Then<lease::IdentityMapPage> then) override {
    step();
    then(lease::IdentityMapPage{});
  }
  std::pair<std::string, std::string> create_token(const std::string&, server::Scope) override {
    return {"t", k_token};
  }
  std::vector<server::TokenInfo> list_tokens(const std::optional<std::string>&) override { return {}; }
  bool revoke_token(const std::string&) override { return false; }
  std::vector<server::AuditRow> list_audit(const std::optional<std::string>&, std::size_t) override { return {}; }

  void set_migrating(bool on) { m_migrating = on; }

private:
  void step() {
    int n = ++calls;
    if (fail_at > 0 && n == fail_at) throw std::runtime_error("injected store failure");
  }
  bool known(const std::string& id) {
    std::lock_guard lock(m_mutex);
    return m_memories.count(id) > 0;
  }
  template <class T>
  void gone(const server::Then<T>& then) {
    step();
    then(Problem(Code::lease_expired, "the lease expired"));
  }

  std::mutex m_mutex;
  std::set<std::string> m_memories;
  bool m_migrating = false;
  std::uint64_t m_last_ticket = 0;
};

} // namespace mep::test
