// A Store for tests of what sits above it (the router): no database, answers at once from
// memory. A memory is "registered" once asked for, a claim is granted unless its memory is
// unknown, and the bearer token "mep_test" (lease and admin scope) is the only one known.
// It counts the calls it gets, and can be told to fail the Nth one (fault injection).
#pragma once
#include "mep/crypto.hpp"
#include "mep/store.hpp"
#include "mep/uuid.hpp"
#include "mep/wire.hpp"

#include <atomic>
#include <mutex>
#include <set>
#include <string>

namespace mep::test {

class FakeStore final : public server::Store {
public:
  static constexpr const char* k_token = "mep_test";

  // Calls counted; with fail_at > 0 the call of that number throws (a database error).
  std::atomic<int> calls{0};
  int fail_at = 0;

  void register_memory(const server::Ctx& ctx, server::Idempotency, server::RegisterMemory req, server::Done done) override {
    step();
    std::string id = req.memory_id.value_or(uuid_v7().to_string());
    {
      std::lock_guard lock(m_mutex);
      m_memories.insert(id);
    }
    done(server::json_reply(201, boost::json::object{{"memory_instance_id", id}, {"created_at", "2026-01-01T00:00:00.000Z"}}));
    (void)ctx;
  }
  void claim(const server::Ctx& ctx, server::Idempotency, server::Claim req, server::Done done) override {
    step();
    if (!req.name) return done(server::problem_reply(req.name.error().to_problem(), ctx.request_id));
    if (req.ttl_s < server::k_min_ttl_s || req.ttl_s > server::k_max_ttl_s)
      return done(server::problem_reply(Problem(Code::invalid_ttl, "ttl out of range"), ctx.request_id));
    if (!known(req.memory_id))
      return done(server::problem_reply(Problem(Code::memory_not_found, "no such memory"), ctx.request_id));
    server::LeaseRow l;
    l.lease_id = uuid_v7().to_string();
    l.canonical_name = req.name->canonical_name;
    l.display_name = req.display_name;
    l.memory_id = req.memory_id;
    l.fencing_token = 1;
    l.owner_client_id = req.owner_client_id;
    l.ttl_s = req.ttl_s;
    l.expires_at = 1767225600000 + req.ttl_s * 1000;
    done(server::json_reply(201, server::grant_json(l, 1767225600000), "granted"));
  }
  void branch(const server::Ctx& ctx, server::Idempotency, server::Branch req, server::Done done) override {
    step();
    if (!known(req.parent_memory_id))
      return done(server::problem_reply(Problem(Code::memory_not_found, "no such memory"), ctx.request_id));
    done(server::json_reply(201, boost::json::object{{"memory_instance_id", req.memory_id.value_or(uuid_v7().to_string())},
                                                     {"parent_memory_instance_id", req.parent_memory_id},
                                                     {"branched_at_token", req.parent_fencing_token}}));
  }
  void renew(const server::Ctx& ctx, server::LeaseRef, server::Done done) override { gone(ctx, done); }
  void renew_batch(const server::Ctx&, server::RenewBatch req, server::Done done) override {
    step();
    boost::json::array results;
    for (const auto& l : req.leases)
      results.emplace_back(boost::json::object{{"canonical_name", l.canonical_name}, {"status", 410}, {"code", "lease-expired"}});
    done(server::json_reply(200, boost::json::object{{"results", std::move(results)}}));
  }
  void release(const server::Ctx&, server::LeaseRef, server::Done done) override {
    step();
    done(server::no_content("released"));
  }
  void verify(const server::Ctx& ctx, server::Verify, server::Done done) override { gone(ctx, done); }
  void revoke(const server::Ctx& ctx, std::string, server::Done done) override {
    step();
    done(server::problem_reply(Problem(Code::lease_not_found, "no live lease under this name"), ctx.request_id));
  }
  void get_lease(const server::Ctx& ctx, std::string, server::Done done) override {
    step();
    done(server::problem_reply(Problem(Code::lease_not_found, "no live lease"), ctx.request_id));
  }
  void list_leases(const server::Ctx&, server::ListLeases req, server::Done done) override {
    step();
    done(server::LeasePage(req.limit).reply());
  }
  void get_memory(const server::Ctx& ctx, std::string id, server::Done done) override {
    step();
    if (!known(id)) return done(server::problem_reply(Problem(Code::memory_not_found, "no such memory"), ctx.request_id));
    server::MemoryRow m;
    m.memory_id = id;
    done(server::json_reply(200, server::memory_json(m)));
  }
  void lineage(const server::Ctx& ctx, std::string id, server::Done done) override { get_memory(ctx, std::move(id), std::move(done)); }
  std::optional<server::AuthInfo> authenticate(const std::string& token_sha256) override {
    if (token_sha256 != sha256_hex(k_token)) return std::nullopt;
    return server::AuthInfo{"tenant-test", "token-test", true, true};
  }
  void audit_auth_failure(const std::string&) override {}
  bool ready() override { return true; }
  std::int64_t active_leases() override { return 0; }
  std::int64_t sweep() override { return 0; }
  bool migration_in_progress() override { return m_migrating; }
  void identity_map(const server::Ctx&, std::optional<std::string>, std::size_t, server::Done done) override {
    step();
    done(server::json_reply(200, boost::json::object{{"entries", boost::json::array{}}, {"next_cursor", nullptr}}));
  }
  std::pair<std::string, std::string> create_token(const std::string&, server::Scope) override { return {"t", k_token}; }
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
  void gone(const server::Ctx& ctx, const server::Done& done) {
    step();
    done(server::problem_reply(Problem(Code::lease_expired, "the lease expired"), ctx.request_id));
  }

  std::mutex m_mutex;
  std::set<std::string> m_memories;
  bool m_migrating = false;
};

} // namespace mep::test
