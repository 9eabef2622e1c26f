// The PostgreSQL store's reads, authentication, health, sweep and administration.
#include "internal.hpp"

#include "mep/canonical.hpp"
#include "mep/crypto.hpp"
#include "mep/json.hpp"
#include "mep/lease/wire.hpp"
#include "mep/lease_rules.hpp"
#include "mep/log.hpp"
#include "mep/metrics.hpp"
#include "mep/pg_calls.hpp"
#include "mep/random.hpp"
#include "mep/rows.hpp"
#include "mep/sweeper.hpp"
#include "mep/time.hpp"
#include "mep/uuid.hpp"

#include <boost/json/array.hpp>
#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <poll.h>
#include <random>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <tuple>
#include <unistd.h>

namespace mep::server {

using namespace pg_results;

// ---- reads ----------------------------------------------------------------------------------

void PgStore::get_lease(const Ctx& ctx, std::string canonical_name, Then<lease::LeaseInfo> then) {
  read<lease::LeaseInfo>(
      [&](pg::Conn& c) -> Outcome<lease::LeaseInfo> {
        static const std::string sql =
            fmt::format("SELECT {}, mep_now_ms() FROM leases WHERE canonical_name = $1", k_lease_cols);
        auto res = c.exec("get_lease", sql, {canonical_name});
        if (res.rows() == 0) return Problem(Code::lease_not_found, "no live lease of this tenant under this name");
        LeaseRow l = read_lease(res, 0);
        UnixMs now = res.int64(0, k_lease_col_count);
        if (l.tenant_id != ctx.auth.tenant_id || l.expires_at <= now)
          return Problem(Code::lease_not_found, "no live lease of this tenant under this name");
        return to_lease_info(l, now);
      },
      then);
}

void PgStore::list_leases(const Ctx& ctx, ListLeases req, Then<lease::LeasePage> then) {
  read<lease::LeasePage>(
      [&](pg::Conn& c) -> Outcome<lease::LeasePage> {
        // Two statements, each planned onto its index in name order (schema v2); no name is
        // empty, so "" starts the first page.
        static const std::string by_tenant =
            fmt::format("SELECT {}, mep_now_ms() FROM leases WHERE tenant_id = $1 AND canonical_name > $2 "
                        "AND expires_at > mep_now_ms() ORDER BY canonical_name LIMIT $3::bigint",
                        k_lease_cols);
        static const std::string by_owner = fmt::format(
            "SELECT {}, mep_now_ms() FROM leases WHERE tenant_id = $1 AND canonical_name > $2 "
            "AND expires_at > mep_now_ms() AND owner_client_id = $4 ORDER BY canonical_name LIMIT $3::bigint",
            k_lease_cols);
        std::string limit = to_s(static_cast<std::int64_t>(req.limit + 1));
        auto res = req.owner_client_id
                       ? c.exec("list_leases_by_owner", by_owner,
                                {ctx.auth.tenant_id, req.cursor.value_or(""), limit, req.owner_client_id})
                       : c.exec("list_leases", by_tenant, {ctx.auth.tenant_id, req.cursor.value_or(""), limit});
        LeasePageBuilder page(req.limit);
        for (int i = 0; i < res.rows() && page.add(read_lease(res, i), res.int64(i, k_lease_col_count)); ++i) {}
        return page.take();
      },
      then);
}

void PgStore::get_memory(const Ctx& ctx, std::string memory_id, Then<lease::Memory> then) {
  read<lease::Memory>(
      [&](pg::Conn& c) -> Outcome<lease::Memory> {
        auto m = find_memory(c, memory_id);
        if (!m || m->tenant_id != ctx.auth.tenant_id)
          return Problem(Code::memory_not_found, "no such memory for this tenant");
        return to_memory(*m);
      },
      then);
}

void PgStore::history(const Ctx& ctx, HistoryQuery req, Then<lease::HistoryPage> then) {
  // Newest first by event id (UUIDv7: time-ordered); the cursor is the last id of the page
  // before. The name is hashed with the tenant's salt, as its audit rows were.
  static constexpr const char* k_sql =
      "SELECT event_id, event_type, fencing_token, renewals, created_at FROM audit_events "
      "WHERE tenant_id = $1 AND redacted_name_hash = mep_hash($1, $2) AND created_at >= $3::bigint "
      "AND ($4 = '' OR event_id < $4) ORDER BY event_id DESC LIMIT $5::bigint";
  read<lease::HistoryPage>(
      [&](pg::Conn& c) -> Outcome<lease::HistoryPage> {
        if (req.cursor && !Uuid::parse(*req.cursor))
          return Problem(Code::invalid_request, "cursor is not a next_cursor this server returned");
        auto res = c.exec("history", k_sql,
                          {ctx.auth.tenant_id, req.canonical_name, to_s(req.since.value_or(0)), req.cursor.value_or(""),
                           to_s(static_cast<std::int64_t>(req.limit) + 1)});
        lease::HistoryPage page;
        page.canonical_name = req.canonical_name;
        for (int i = 0; i < res.rows(); ++i) {
          if (page.events.size() == req.limit) {
            page.next_cursor = res.text(i - 1, 0);
            break;
          }
          page.events.push_back(
              lease::HistoryEvent{res.text(i, 1), res.opt_int64(i, 2), res.opt_int64(i, 3), res.int64(i, 4)});
        }
        return page;
      },
      then);
}

std::vector<std::pair<std::string, std::int64_t>> PgStore::active_leases_by_tenant() {
  try {
    return with_conn<std::vector<std::pair<std::string, std::int64_t>>>([](pg::Conn& c) {
      auto r = c.exec("active_by_tenant",
                      "SELECT t.name, count(*) FROM leases l JOIN tenants t ON t.tenant_id = l.tenant_id "
                      "WHERE l.expires_at > mep_now_ms() GROUP BY t.name",
                      {});
      std::vector<std::pair<std::string, std::int64_t>> out;
      for (int i = 0; i < r.rows(); ++i) out.emplace_back(r.text(i, 0), r.int64(i, 1));
      return out;
    });
  } catch (const pg::Error&) {
    return {};
  }
}

void PgStore::lineage(const Ctx& ctx, std::string memory_id, Then<lease::Lineage> then) {
  // One round trip: the memory, its ancestors (nearest first, within the tenant) and its
  // children (by id).
  static constexpr const char* k_sql =
      "WITH RECURSIVE chain AS ("
      "  SELECT memory_id, tenant_id, parent_memory_id, branched_at_token, fence_counter, created_at, 0 AS depth"
      "    FROM memories WHERE memory_id = $1 AND tenant_id = $2"
      "  UNION ALL"
      "  SELECT p.memory_id, p.tenant_id, p.parent_memory_id, p.branched_at_token, p.fence_counter, p.created_at,"
      "         c.depth + 1"
      "    FROM memories p JOIN chain c ON p.memory_id = c.parent_memory_id"
      "   WHERE p.tenant_id = $2 AND c.depth < 100000) "
      "SELECT 0 AS kind, depth AS ord, memory_id, tenant_id, parent_memory_id, branched_at_token, fence_counter,"
      "       created_at, '' AS k FROM chain "
      "UNION ALL "
      "SELECT 1, 0, memory_id, tenant_id, parent_memory_id, branched_at_token, fence_counter, created_at, memory_id"
      "  FROM memories WHERE parent_memory_id = $1 AND tenant_id = $2"
      "   AND EXISTS (SELECT 1 FROM memories WHERE memory_id = $1 AND tenant_id = $2) "
      "ORDER BY kind, ord, k";
  read<lease::Lineage>(
      [&](pg::Conn& c) -> Outcome<lease::Lineage> {
        auto res = c.exec("lineage", k_sql, {memory_id, ctx.auth.tenant_id});
        if (res.rows() == 0 || res.int64(0, 0) != 0 || res.int64(0, 1) != 0)
          return Problem(Code::memory_not_found, "no such memory for this tenant");
        auto row = [&](int i) {
          MemoryRow m;
          m.memory_id = res.text(i, 2);
          m.tenant_id = res.text(i, 3);
          m.parent_memory_id = res.opt_text(i, 4);
          m.branched_at_token = res.opt_int64(i, 5);
          m.fence_counter = res.int64(i, 6);
          m.created_at = res.int64(i, 7);
          return m;
        };
        lease::Lineage out;
        out.memory_id = memory_id;
        out.memory = to_memory(row(0));
        for (int i = 1; i < res.rows(); ++i)
          (res.int64(i, 0) == 0 ? out.ancestors : out.children).push_back(to_memory(row(i)));
        return out;
      },
      then);
}

void PgStore::identity_map(const Ctx& ctx, std::optional<std::string> cursor, std::size_t limit,
                           Then<lease::IdentityMapPage> then) {
  read<lease::IdentityMapPage>(
      [&](pg::Conn& c) -> Outcome<lease::IdentityMapPage> {
        auto res = c.exec("identity_map",
                          "SELECT legacy_memory_ref, memory_instance_id FROM migration_identity_map "
                          "WHERE tenant_id = $1 AND ($2::text IS NULL OR legacy_memory_ref > $2) "
                          "ORDER BY legacy_memory_ref LIMIT $3::bigint",
                          {ctx.auth.tenant_id, cursor, to_s(static_cast<std::int64_t>(limit + 1))});
        lease::IdentityMapPage page;
        for (int i = 0; i < res.rows(); ++i) {
          if (page.entries.size() == limit) {
            page.next_cursor = page.entries.back().legacy_memory_ref;
            break;
          }
          page.entries.push_back(lease::IdentityEntry{res.text(i, 0), res.text(i, 1)});
        }
        return page;
      },
      then);
}

// ---- authentication, health, maintenance ----------------------------------------------------

void PgStore::drop_auth_cache() {
  std::lock_guard lock(m_auth_mutex);
  ++m_auth_gen;
  m_auth_cache.clear();
}

std::optional<AuthInfo> PgStore::authenticate(const std::string& token_sha256) {
  using SteadyClock = std::chrono::steady_clock;
  if (const int fd = m_listen_fd.load(); fd >= 0) {
    // A notification already on its way to the listener (a revocation just committed) is
    // not trusted to be read first: with bytes waiting there, ask the database.
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 0) == 0) {
      std::lock_guard lock(m_auth_mutex);
      auto it = m_auth_cache.find(token_sha256);
      if (it != m_auth_cache.end() && SteadyClock::now() - it->second.second < k_auth_lifetime) return it->second.first;
    }
  }
  const std::uint64_t gen = m_auth_gen.load();
  // An entry's age counts from before the lookup, so it ends within k_auth_lifetime of a
  // read that a revocation committed after could not see (revoke_token waits that long).
  const auto looked_up = SteadyClock::now();
  auto found = with_conn<std::optional<AuthInfo>>([&](pg::Conn& c) -> std::optional<AuthInfo> {
    auto r = c.exec("authenticate",
                    "SELECT token_id, tenant_id, scopes FROM tokens WHERE token_sha256 = $1 AND revoked_at IS NULL",
                    {token_sha256});
    if (r.rows() == 0) return std::nullopt;
    AuthInfo a;
    a.token_id = r.text(0, 0);
    a.tenant_id = r.text(0, 1);
    std::string scopes = r.text(0, 2);
    a.scope_admin = scopes.find("admin") != std::string::npos;
    a.scope_lease = scopes.find("lease") != std::string::npos || a.scope_admin;
    return a;
  });
  if (found && m_listen_fd.load() >= 0) {
    std::lock_guard lock(m_auth_mutex);
    if (gen == m_auth_gen.load()) { // no revocation heard since the lookup began
      if (m_auth_cache.size() >= k_auth_capacity) m_auth_cache.clear();
      m_auth_cache[token_sha256] = {*found, looked_up};
    }
  }
  return found;
}

void PgStore::audit_auth_failure(const std::string& tenant_id) {
  enqueue(
      [tenant_id](pg::Conn& c) {
        c.exec("audit_auth", "SELECT mep_audit($1, 'AUTH_FAILED', NULL, NULL, NULL, mep_now_ms())", {tenant_id});
      },
      [](std::optional<Problem>) {}, {});
}

bool PgStore::ready() {
  try {
    bool ok = with_conn<bool>([](pg::Conn& c) { return c.exec("SELECT 1").rows() == 1; });
    if (ok && !m_healthy.exchange(true)) log::info("database reachable again");
    return ok;
  } catch (const std::exception&) {
    return false;
  }
}

std::int64_t PgStore::active_leases() {
  try {
    return with_conn<std::int64_t>([](pg::Conn& c) {
      return c.exec("active", "SELECT count(*) FROM leases WHERE expires_at > mep_now_ms()", {}).int64(0, 0);
    });
  } catch (const pg::Error&) {
    return 0;
  }
}

std::int64_t PgStore::sweep() {
  return with_conn<std::int64_t>([this](pg::Conn& c) {
    auto state = c.exec("migration_state", "SELECT value FROM settings WHERE key = 'migration_state'", {});
    m_migration_in_progress = state.rows() > 0 && state.text(0, 0) == "in-progress";
    // The migration state above is read every second; the sweep itself is spaced by its
    // cost (sweep_spacing: it scans the leases table).
    const auto began = std::chrono::steady_clock::now();
    if (began < m_next_sweep) return std::int64_t{0};
    const json::object swept =
        parse_result(c.exec("sweep", "SELECT mep_sweep_r($1::bigint)", {clock_bound()}).text(0, 0));
    count_ends(swept.if_contains("ends"));
    const std::int64_t removed = i64(swept.at("removed"));
    m_next_sweep = began + sweep_spacing(std::chrono::steady_clock::now() - began, removed);
    return removed;
  });
}

// ---- administration -------------------------------------------------------------------------

std::pair<std::string, std::string> PgStore::create_token(const std::string& tenant_name, Scope scope) {
  std::string salt = random_hex(32);
  const auto pads = hmac_sha256_pads(salt); // not a structured binding: clang 14 cannot capture one
  const std::string ipad = bytea_hex(pads.first), opad = bytea_hex(pads.second);
  std::string token = "mep_" + random_hex(32);
  return with_conn<std::pair<std::string, std::string>>(
      [&](pg::Conn& c) {
        auto t =
            c.exec({},
                   "WITH t AS (INSERT INTO tenants(tenant_id, name, audit_salt, audit_ipad, audit_opad, created_at) "
                   "VALUES ($1, $2, $3, $4::bytea, $5::bytea, mep_now_ms()) ON CONFLICT (name) DO NOTHING "
                   "RETURNING tenant_id) "
                   "SELECT tenant_id FROM t UNION ALL SELECT tenant_id FROM tenants WHERE name = $2 LIMIT 1",
                   {uuid_v7().to_string(), tenant_name, salt, ipad, opad});
        if (t.rows() == 0) throw std::runtime_error("could not create the tenant");
        std::string tenant_id = t.text(0, 0);
        c.exec({},
               "INSERT INTO tokens(token_id, tenant_id, token_sha256, scopes, created_at) "
               "VALUES ($1, $2, $3, $4, mep_now_ms())",
               {uuid_v7().to_string(), tenant_id, sha256_hex(token), scope == Scope::admin ? "lease admin" : "lease"});
        return std::make_pair(tenant_id, token);
      },
      false);
}

std::vector<TokenInfo> PgStore::list_tokens(const std::optional<std::string>& tenant_name) {
  return with_conn<std::vector<TokenInfo>>([&](pg::Conn& c) {
    auto r = c.exec({},
                    "SELECT t.token_id, t.tenant_id, n.name, t.scopes, t.created_at, t.revoked_at "
                    "FROM tokens t JOIN tenants n ON n.tenant_id = t.tenant_id "
                    "WHERE $1::text IS NULL OR n.name = $1 ORDER BY t.token_id",
                    {tenant_name});
    std::vector<TokenInfo> out;
    for (int i = 0; i < r.rows(); ++i)
      out.push_back(
          TokenInfo{r.text(i, 0), r.text(i, 1), r.text(i, 2), r.text(i, 3), r.int64(i, 4), r.opt_int64(i, 5)});
    return out;
  });
}

bool PgStore::revoke_token(const std::string& token_id) {
  const bool revoked = with_conn<bool>(
      [&](pg::Conn& c) {
        // Every server drops its cached tokens when it hears this commit (LISTEN mep_tokens).
        return c.exec(
                    {},
                    "WITH r AS (UPDATE tokens SET revoked_at = mep_now_ms() WHERE token_id = $1 AND revoked_at IS NULL "
                    "RETURNING 1) SELECT (SELECT count(*) FROM r), pg_notify('mep_tokens', '')",
                    {token_id})
                   .int64(0, 0) > 0;
      },
      false);
  // Hearing is not instant: a server may answer a request from its cache before its
  // listener has read the notification. Every entry cached from a read before the commit
  // ends within k_auth_lifetime of that read (Chubby's rule: a write that invalidates
  // cached copies completes once they have been dropped or have expired), so from the
  // return of this call on, every server refuses the token.
  if (revoked) std::this_thread::sleep_for(k_auth_lifetime + std::chrono::milliseconds(50));
  return revoked;
}

std::vector<AuditRow> PgStore::list_audit(const std::optional<std::string>& tenant_name, std::size_t limit) {
  return with_conn<std::vector<AuditRow>>([&](pg::Conn& c) {
    auto r =
        c.exec({},
               "SELECT a.event_id, a.tenant_id, a.event_type, a.redacted_name_hash, a.redacted_memory_hash, "
               "a.fencing_token, a.created_at FROM audit_events a LEFT JOIN tenants n ON n.tenant_id = a.tenant_id "
               "WHERE $1::text IS NULL OR n.name = $1 ORDER BY a.created_at DESC, a.event_id DESC LIMIT $2::bigint",
               {tenant_name, to_s(static_cast<std::int64_t>(limit))});
    std::vector<AuditRow> out;
    for (int i = 0; i < r.rows(); ++i)
      out.push_back(AuditRow{r.text(i, 0), r.text(i, 1), r.text(i, 2), r.text(i, 3), r.text(i, 4), r.opt_int64(i, 5),
                             r.int64(i, 6)});
    return out;
  });
}
} // namespace mep::server
