// The Spanner store's reads (strong, single-use read-only transactions: one call each), its
// tokens and audit, and the sweep.
#include "mep/spanner/store.hpp"

#include "mep/crypto.hpp"
#include "mep/log.hpp"
#include "mep/metrics.hpp"
#include "mep/random.hpp"
#include "mep/sweeper.hpp"
#include "mep/uuid.hpp"
#include "rows.hpp"

#include <boost/json/array.hpp>
#include <fmt/format.h>

#include <thread>

namespace mep::server::spanner {
namespace json = boost::json;

namespace {

// How long a token found valid is trusted without asking the database again; a revocation
// waits this long before it returns (see revoke_token).
constexpr auto k_auth_cache = std::chrono::seconds(1);

Problem unavailable(const RpcError& e) {
  log::warn("spanner: {}", e.describe());
  Problem p(Code::unavailable, "the database is unavailable; retry later");
  p.retry_after_s = 1;
  return p;
}

std::string first_str(const json::object& result) {
  auto rows = rows_of(result);
  return rows.empty() ? std::string() : rows.front().str(0);
}

} // namespace

// ---- reads ---------------------------------------------------------------------------------------

void SpannerStore::get_lease(const Ctx& ctx, std::string canonical_name, Then<lease::LeaseInfo> then) {
  submit<lease::LeaseInfo>(
      [this, ctx, canonical_name](std::string& session) -> Outcome<lease::LeaseInfo> {
        auto r = read_once(session,
                           fmt::format("SELECT UNIX_MILLIS(CURRENT_TIMESTAMP()), ARRAY(SELECT AS STRUCT {} FROM "
                                       "leases WHERE canonical_name = @n)",
                                       k_lease_cols),
                           Params().str("n", canonical_name));
        if (!r) return unavailable(r.error());
        const auto row = rows_of(*r).at(0);
        const UnixMs now = row.int64(0);
        auto leases = row.rows(1);
        if (leases.empty()) return Problem(Code::lease_not_found, "no live lease of this tenant under this name");
        LeaseRow l = lease_of(leases.front());
        if (l.tenant_id != ctx.auth.tenant_id || l.expires_at <= now)
          return Problem(Code::lease_not_found, "no live lease of this tenant under this name");
        return to_lease_info(l, now);
      },
      std::move(then));
}

void SpannerStore::list_leases(const Ctx& ctx, ListLeases req, Then<lease::LeasePage> then) {
  submit<lease::LeasePage>(
      [this, ctx, req = std::move(req)](std::string& session) -> Outcome<lease::LeasePage> {
        Params p;
        p.str("t", ctx.auth.tenant_id)
            .str("c", req.cursor.value_or(""))
            .int64("l", static_cast<std::int64_t>(req.limit) + 1);
        std::string where = "tenant_id = @t AND canonical_name > @c AND expires_at > UNIX_MILLIS(CURRENT_TIMESTAMP())";
        if (req.owner_client_id) {
          where += " AND owner_client_id = @o";
          p.str("o", *req.owner_client_id);
        }
        auto r = read_once(session,
                           fmt::format("SELECT UNIX_MILLIS(CURRENT_TIMESTAMP()), ARRAY(SELECT AS STRUCT {} FROM "
                                       "leases WHERE {} ORDER BY canonical_name LIMIT @l)",
                                       k_lease_cols, where),
                           p);
        if (!r) return unavailable(r.error());
        const auto row = rows_of(*r).at(0);
        const UnixMs now = row.int64(0);
        LeasePageBuilder page(req.limit);
        for (const auto& l : row.rows(1))
          if (!page.add(lease_of(l), now)) break;
        return page.take();
      },
      std::move(then));
}

void SpannerStore::get_memory(const Ctx& ctx, std::string memory_id, Then<lease::Memory> then) {
  submit<lease::Memory>(
      [this, ctx, memory_id](std::string& session) -> Outcome<lease::Memory> {
        auto r = read_once(session, fmt::format("SELECT {} FROM memories WHERE memory_key = @mk", k_memory_cols),
                           Params().str("mk", spread_key(memory_id)));
        if (!r) return unavailable(r.error());
        auto rows = rows_of(*r);
        if (rows.empty()) return Problem(Code::memory_not_found, "no such memory for this tenant");
        MemoryRow m = memory_of(rows.front());
        if (m.tenant_id != ctx.auth.tenant_id) return Problem(Code::memory_not_found, "no such memory for this tenant");
        return to_memory(m);
      },
      std::move(then));
}

void SpannerStore::lineage(const Ctx& ctx, std::string memory_id, Then<lease::Lineage> then) {
  submit<lease::Lineage>(
      [this, ctx, memory_id](std::string& session) -> Outcome<lease::Lineage> {
        auto one = [&](const std::string& id) -> Rpc<std::optional<MemoryRow>> {
          auto r = read_once(session, fmt::format("SELECT {} FROM memories WHERE memory_key = @mk", k_memory_cols),
                             Params().str("mk", spread_key(id)));
          if (!r) return make_unexpected(std::move(r.error()));
          auto rows = rows_of(*r);
          if (rows.empty()) return std::optional<MemoryRow>();
          return std::optional<MemoryRow>(memory_of(rows.front()));
        };
        auto m = one(memory_id);
        if (!m) return unavailable(m.error());
        if (!*m || (*m)->tenant_id != ctx.auth.tenant_id)
          return Problem(Code::memory_not_found, "no such memory for this tenant");
        lease::Lineage out;
        out.memory_id = memory_id;
        out.memory = to_memory(**m);
        std::string parent = (*m)->parent_memory_id.value_or("");
        for (int depth = 0; !parent.empty() && depth < 10000; ++depth) {
          auto p = one(parent);
          if (!p) return unavailable(p.error());
          if (!*p || (*p)->tenant_id != ctx.auth.tenant_id) break;
          out.ancestors.push_back(to_memory(**p));
          parent = (*p)->parent_memory_id.value_or("");
        }
        auto c = read_once(session,
                           fmt::format("SELECT {} FROM memories WHERE parent_memory_id = @p AND tenant_id = @t "
                                       "ORDER BY memory_id",
                                       k_memory_cols),
                           Params().str("p", memory_id).str("t", ctx.auth.tenant_id));
        if (!c) return unavailable(c.error());
        for (const auto& row : rows_of(*c)) out.children.push_back(to_memory(memory_of(row)));
        return out;
      },
      std::move(then));
}

void SpannerStore::history(const Ctx& ctx, HistoryQuery req, Then<lease::HistoryPage> then) {
  submit<lease::HistoryPage>(
      [this, ctx, req = std::move(req)](std::string& session) -> Outcome<lease::HistoryPage> {
        if (req.cursor && !Uuid::parse(*req.cursor))
          return Problem(Code::invalid_request, "cursor is not a next_cursor this server returned");
        const std::string nh = HmacSha256(audit_salt(session, ctx.auth.tenant_id)).hex(req.canonical_name);
        // The name's rows are one key range (their bucket), newest first by event id (UUIDv7).
        Params p;
        p.str("t", ctx.auth.tenant_id)
            .str("b", nh.substr(0, 8))
            .str("h", nh)
            .int64("since", req.since.value_or(0))
            .str("c", req.cursor.value_or(""))
            .int64("l", static_cast<std::int64_t>(req.limit) + 1);
        auto r = read_once(session,
                           "SELECT event_id, event_type, fencing_token, renewals, created_at FROM audit_events "
                           "WHERE tenant_id = @t AND bucket = @b AND redacted_name_hash = @h AND created_at >= @since "
                           "AND (@c = '' OR event_id < @c) ORDER BY event_id DESC LIMIT @l",
                           p);
        if (!r) return unavailable(r.error());
        lease::HistoryPage page;
        page.canonical_name = req.canonical_name;
        std::string last;
        for (const auto& row : rows_of(*r)) {
          if (page.events.size() == req.limit) {
            page.next_cursor = last;
            break;
          }
          last = row.str(0);
          page.events.push_back(lease::HistoryEvent{row.str(1), row.opt_int64(2), row.opt_int64(3), row.int64(4)});
        }
        return page;
      },
      std::move(then));
}

void SpannerStore::identity_map(const Ctx& ctx, std::optional<std::string> cursor, std::size_t limit,
                                Then<lease::IdentityMapPage> then) {
  submit<lease::IdentityMapPage>(
      [this, ctx, cursor, limit](std::string& session) -> Outcome<lease::IdentityMapPage> {
        auto r = read_once(session,
                           "SELECT legacy_memory_ref, memory_instance_id FROM migration_identity_map "
                           "WHERE tenant_id = @t AND legacy_memory_ref > @c ORDER BY legacy_memory_ref LIMIT @l",
                           Params()
                               .str("t", ctx.auth.tenant_id)
                               .str("c", cursor.value_or(""))
                               .int64("l", static_cast<std::int64_t>(limit) + 1));
        if (!r) return unavailable(r.error());
        lease::IdentityMapPage page;
        for (const auto& row : rows_of(*r)) {
          if (page.entries.size() == limit) {
            page.next_cursor = page.entries.back().legacy_memory_ref;
            break;
          }
          page.entries.push_back(lease::IdentityEntry{row.str(0), row.str(1)});
        }
        return page;
      },
      std::move(then));
}

// ---- tokens and health ---------------------------------------------------------------------------

std::optional<AuthInfo> SpannerStore::authenticate(const std::string& token_sha256) {
  const auto now = std::chrono::steady_clock::now();
  {
    std::lock_guard lock(m_auth_mutex);
    if (auto it = m_auth_cache.find(token_sha256); it != m_auth_cache.end()) {
      if (now - it->second.second < k_auth_cache) return it->second.first;
      m_auth_cache.erase(it);
    }
  }
  std::string s = borrow_session();
  auto r = read_once(s, "SELECT token_id, tenant_id, scopes FROM tokens WHERE token_sha256 = @h AND revoked_at IS NULL",
                     Params().str("h", token_sha256));
  return_session(std::move(s));
  if (!r) throw std::runtime_error("cannot look the token up: " + r.error().describe());
  auto rows = rows_of(*r);
  if (rows.empty()) return std::nullopt;
  AuthInfo a;
  a.token_id = rows[0].str(0);
  a.tenant_id = rows[0].str(1);
  const std::string scopes = rows[0].str(2);
  a.scope_admin = scopes.find("admin") != std::string::npos;
  a.scope_lease = scopes.find("lease") != std::string::npos || a.scope_admin;
  std::lock_guard lock(m_auth_mutex);
  if (m_auth_cache.size() > 10000) m_auth_cache.clear();
  m_auth_cache[token_sha256] = {a, now};
  return a;
}

void SpannerStore::audit_auth_failure(const std::string& tenant_id) {
  submit<std::uint64_t>(
      [this, tenant_id](std::string& session) -> Outcome<std::uint64_t> {
        auto r = read_once(session, "SELECT UNIX_MILLIS(CURRENT_TIMESTAMP())");
        if (!r) return std::uint64_t{0};
        (void)audit_salt(session, tenant_id);
        Mutations m;
        add_audit(m, tenant_id, "AUTH_FAILED", {}, {}, std::nullopt, rows_of(*r).at(0).int64(0));
        (void)write_once(session, m);
        return std::uint64_t{0};
      },
      [](Outcome<std::uint64_t>) {});
}

bool SpannerStore::ready() {
  try {
    std::string s = borrow_session();
    auto r = read_once(s, "SELECT 1");
    return_session(std::move(s));
    return r.has_value();
  } catch (const std::exception&) {
    return false;
  }
}

std::int64_t SpannerStore::active_leases() {
  try {
    std::string s = borrow_session();
    auto r = read_once(s, "SELECT COUNT(*) FROM leases WHERE expires_at > UNIX_MILLIS(CURRENT_TIMESTAMP())");
    return_session(std::move(s));
    if (!r) return 0;
    auto rows = rows_of(*r);
    return rows.empty() ? 0 : rows[0].int64(0);
  } catch (const std::exception&) {
    return 0;
  }
}

std::vector<std::pair<std::string, std::int64_t>> SpannerStore::active_leases_by_tenant() {
  std::vector<std::pair<std::string, std::int64_t>> out;
  try {
    std::string s = borrow_session();
    auto r = read_once(s, "SELECT t.name, COUNT(*) FROM leases l JOIN tenants t ON t.tenant_id = l.tenant_id "
                          "WHERE l.expires_at > UNIX_MILLIS(CURRENT_TIMESTAMP()) GROUP BY t.name");
    return_session(std::move(s));
    if (r)
      for (const auto& row : rows_of(*r)) out.emplace_back(row.str(0), row.int64(1));
  } catch (const std::exception&) {}
  return out;
}

std::pair<std::string, std::string> SpannerStore::create_token(const std::string& tenant_name, Scope scope) {
  std::string s = borrow_session();
  std::string token = "mep_" + random_hex(32);
  std::string tenant_id;
  auto failed = run_rw(s, Repeat::safe, [&](Tx& tx) -> Rpc<Decision> {
    auto r = tx.query("SELECT UNIX_MILLIS(CURRENT_TIMESTAMP()), ARRAY(SELECT AS STRUCT tenant_id FROM tenants "
                      "WHERE name = @n)",
                      Params().str("n", tenant_name));
    if (!r) return make_unexpected(std::move(r.error()));
    const auto row = rows_of(*r).at(0);
    const UnixMs now = row.int64(0);
    Decision d;
    auto found = row.rows(1);
    tenant_id = found.empty() ? uuid_v7().to_string() : found.front().str(0);
    if (found.empty())
      d.mutations.write("insert", "tenants", {"tenant_id", "name", "audit_salt", "created_at"},
                        json::array{tenant_id, tenant_name, random_hex(32), int64_value(now)});
    d.mutations.write("insert", "tokens", {"token_id", "tenant_id", "token_sha256", "scopes", "created_at"},
                      json::array{uuid_v7().to_string(), tenant_id, sha256_hex(token),
                                  scope == Scope::admin ? "lease admin" : "lease", int64_value(now)});
    return d;
  });
  return_session(std::move(s));
  if (failed) throw std::runtime_error("cannot create the token: " + failed->detail);
  return {tenant_id, token};
}

std::vector<TokenInfo> SpannerStore::list_tokens(const std::optional<std::string>& tenant_name) {
  std::string s = borrow_session();
  auto r = read_once(s,
                     "SELECT t.token_id, t.tenant_id, n.name, t.scopes, t.created_at, t.revoked_at FROM tokens t "
                     "JOIN tenants n ON n.tenant_id = t.tenant_id WHERE (@n IS NULL OR n.name = @n) "
                     "ORDER BY t.created_at, t.token_id",
                     Params().opt_str("n", tenant_name));
  return_session(std::move(s));
  if (!r) throw std::runtime_error("cannot list the tokens: " + r.error().describe());
  std::vector<TokenInfo> out;
  for (const auto& row : rows_of(*r))
    out.push_back(TokenInfo{row.str(0), row.str(1), row.str(2), row.str(3), row.int64(4), row.opt_int64(5)});
  return out;
}

bool SpannerStore::revoke_token(const std::string& token_id) {
  std::string s = borrow_session();
  bool found = false;
  auto failed = run_rw(s, Repeat::safe, [&](Tx& tx) -> Rpc<Decision> {
    auto r = tx.query("SELECT UNIX_MILLIS(CURRENT_TIMESTAMP()), ARRAY(SELECT AS STRUCT revoked_at FROM tokens "
                      "WHERE token_id = @id)",
                      Params().str("id", token_id));
    if (!r) return make_unexpected(std::move(r.error()));
    const auto row = rows_of(*r).at(0);
    Decision d;
    auto t = row.rows(1);
    found = !t.empty();
    if (found && t.front().is_null(0))
      d.mutations.write("update", "tokens", {"token_id", "revoked_at"},
                        json::array{token_id, int64_value(row.int64(0))});
    return d;
  });
  return_session(std::move(s));
  if (failed) throw std::runtime_error("cannot revoke the token: " + failed->detail);
  // Every server trusts a token it found valid for up to k_auth_cache: once this returns,
  // none answers from that cache any more.
  if (found) std::this_thread::sleep_for(k_auth_cache + std::chrono::milliseconds(100));
  return found;
}

std::vector<AuditRow> SpannerStore::list_audit(const std::optional<std::string>& tenant_name, std::size_t limit) {
  std::string s = borrow_session();
  auto r = read_once(s,
                     "SELECT a.event_id, a.tenant_id, a.event_type, a.redacted_name_hash, a.redacted_memory_hash, "
                     "a.fencing_token, a.created_at, a.renewals FROM audit_events a "
                     "WHERE @n IS NULL OR a.tenant_id = (SELECT tenant_id FROM tenants WHERE name = @n) "
                     "ORDER BY a.created_at DESC, a.event_id DESC LIMIT @l",
                     Params().opt_str("n", tenant_name).int64("l", static_cast<std::int64_t>(limit)));
  return_session(std::move(s));
  if (!r) throw std::runtime_error("cannot list the audit rows: " + r.error().describe());
  std::vector<AuditRow> out;
  for (const auto& row : rows_of(*r))
    out.push_back(AuditRow{row.str(0), row.str(1), row.str(2), row.str(3), row.str(4), row.opt_int64(5), row.int64(6),
                           row.opt_int64(7)});
  return out;
}

// ---- the sweep ----------------------------------------------------------------------------------------

std::int64_t SpannerStore::sweep() {
  std::string s = borrow_session();
  struct Return {
    SpannerStore* self;
    std::string& s;
    ~Return() { self->return_session(std::move(s)); }
  } give_back{this, s};
  // The migration state, read every second; the sweep itself spaced by its cost (it scans).
  if (auto r = read_once(s, "SELECT value FROM settings WHERE key = 'migration_state'"); r)
    m_migration_in_progress = first_str(*r) == "in-progress";
  const auto began = std::chrono::steady_clock::now();
  if (began < m_next_sweep) return 0;
  std::int64_t removed = 0;
  std::vector<LeaseRow> expired;
  auto failed = run_rw(s, Repeat::safe, [&](Tx& tx) -> Rpc<Decision> {
    removed = 0;
    expired.clear();
    auto r = tx.query(fmt::format(
        "SELECT UNIX_MILLIS(CURRENT_TIMESTAMP()), "
        "ARRAY(SELECT AS STRUCT {} FROM leases WHERE expires_at <= UNIX_MILLIS(CURRENT_TIMESTAMP()) LIMIT {}), "
        "ARRAY(SELECT AS STRUCT tenant_id, key_hash, idem_key FROM idempotency "
        "      WHERE expires_at <= UNIX_MILLIS(CURRENT_TIMESTAMP()) LIMIT 2000), "
        "ARRAY(SELECT waiter_id FROM waiters WHERE alive_until < UNIX_MILLIS(CURRENT_TIMESTAMP()) - 60000 LIMIT 1000), "
        "ARRAY(SELECT free_id FROM lease_frees WHERE freed_at < TIMESTAMP_SUB(CURRENT_TIMESTAMP(), INTERVAL 60 SECOND) "
        "      LIMIT 1000)",
        k_lease_cols, k_sweep_batch));
    if (!r) return make_unexpected(std::move(r.error()));
    const auto row = rows_of(*r).at(0);
    const UnixMs now = row.int64(0);
    Decision d;
    std::vector<std::string> tenants;
    for (const auto& l : row.rows(1)) {
      expired.push_back(lease_of(l));
      tenants.push_back(expired.back().tenant_id);
    }
    if (auto loaded = load_salts(tx, tenants); !loaded) return make_unexpected(std::move(loaded.error()));
    for (const auto& e : expired) {
      d.mutations.remove("leases", {key_of(e.memory_id)});
      add_audit(d.mutations, e.tenant_id, "LEASE_EXPIRED", e.canonical_name, e.memory_id, e.fencing_token, now,
                e.renewals);
      ++removed;
    }
    std::vector<json::array> idem_keys, waiter_keys, free_keys;
    for (const auto& k : row.rows(2)) idem_keys.push_back(json::array{k.str(0), k.str(1), k.str(2)});
    removed += static_cast<std::int64_t>(idem_keys.size());
    d.mutations.remove("idempotency", std::move(idem_keys));
    auto scalars = [&](std::size_t col, std::vector<json::array>& keys, bool int64) {
      const json::array& list = r->at("rows").as_array().at(0).as_array().at(col).as_array();
      for (const auto& v : list) keys.push_back(json::array{int64 && v.is_string() ? json::value(v.as_string()) : v});
    };
    scalars(3, waiter_keys, true);
    scalars(4, free_keys, false);
    d.mutations.remove("waiters", std::move(waiter_keys));
    d.mutations.remove("lease_frees", std::move(free_keys));
    return d;
  });
  if (failed) throw std::runtime_error("the sweep failed: " + failed->detail);
  for (const auto& e : expired) count_lease_end(e, "expired", e.expires_at);
  m_next_sweep = began + sweep_spacing(std::chrono::steady_clock::now() - began, removed);
  return removed;
}

} // namespace mep::server::spanner
