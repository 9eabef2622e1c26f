// Reads of the SQLite store (leases, memories, lineage, history, authentication, health),
// the sweep, and the administration of tokens and the audit log.
#include "internal.hpp"

#include "mep/crypto.hpp"
#include "mep/random.hpp"
#include "mep/uuid.hpp"

#include <boost/json/array.hpp>

#include <charconv>
#include <filesystem>

namespace mep::server {

using namespace sqlite_rows;

// ---- reads --------------------------------------------------------------------------------

void SqliteStore::get_lease(const Ctx& ctx, std::string canonical_name, Then<lease::LeaseInfo> then) {
  read<lease::LeaseInfo>(
      [&](Db& db, UnixMs now) -> Outcome<lease::LeaseInfo> {
        auto lease = lease_by_name(db, canonical_name);
        if (lease) overlay(*lease);
        if (!lease || lease->tenant_id != ctx.auth.tenant_id || lease->expires_at <= now)
          return Problem(Code::lease_not_found, "no live lease of this tenant under this name");
        return to_lease_info(*lease, now);
      },
      then);
}

void SqliteStore::list_leases(const Ctx& ctx, ListLeases req, Then<lease::LeasePage> then) {
  read<lease::LeasePage>(
      [&](Db& db, UnixMs now) -> Outcome<lease::LeasePage> {
        // Two statements, so each is planned onto its index (leases_owner_name or
        // leases_tenant_name) in name order; no name is empty, so "" starts the first page.
        // No LIMIT: rows that ended lately are read too (k_unflushed_margin_ms), and the
        // page stops reading once full.
        static const std::string by_tenant =
            fmt::format("SELECT {} FROM leases WHERE tenant_id = ?1 AND canonical_name > ?3 AND expires_at > ?2 "
                        "ORDER BY canonical_name",
                        k_lease_cols);
        static const std::string by_owner =
            fmt::format("SELECT {} FROM leases WHERE tenant_id = ?1 AND owner_client_id = ?4 AND canonical_name > ?3 "
                        "AND expires_at > ?2 ORDER BY canonical_name",
                        k_lease_cols);
        Use s(db.prepare(req.owner_client_id ? by_owner : by_tenant));
        s->bind(1, ctx.auth.tenant_id)
            .bind(2, std::max<UnixMs>(k_released, now - k_unflushed_margin_ms))
            .bind(3, req.cursor.value_or(""));
        if (req.owner_client_id) s->bind(4, *req.owner_client_id);
        LeasePageBuilder page(req.limit);
        for (bool more = true; more && s->step();) {
          LeaseRow row = read_lease(*s);
          overlay(row);
          if (row.expires_at > now) more = page.add(row, now);
        }
        return page.take();
      },
      then);
}

void SqliteStore::get_memory(const Ctx& ctx, std::string memory_id, Then<lease::Memory> then) {
  read<lease::Memory>(
      [&](Db& db, UnixMs) -> Outcome<lease::Memory> {
        auto m = find_memory(db, memory_id);
        if (!m || m->tenant_id != ctx.auth.tenant_id)
          return Problem(Code::memory_not_found, "no such memory for this tenant");
        return to_memory(*m);
      },
      then);
}

void SqliteStore::lineage(const Ctx& ctx, std::string memory_id, Then<lease::Lineage> then) {
  read<lease::Lineage>(
      [&](Db& db, UnixMs) -> Outcome<lease::Lineage> {
        auto m = find_memory(db, memory_id);
        if (!m || m->tenant_id != ctx.auth.tenant_id)
          return Problem(Code::memory_not_found, "no such memory for this tenant");
        lease::Lineage out;
        out.memory_id = memory_id;
        out.memory = to_memory(*m);
        std::string parent = m->parent_memory_id.value_or("");
        for (int depth = 0; !parent.empty() && depth < 100000; ++depth) {
          auto p = find_memory(db, parent);
          if (!p || p->tenant_id != ctx.auth.tenant_id) break;
          out.ancestors.push_back(to_memory(*p));
          parent = p->parent_memory_id.value_or("");
        }
        Use s(db.prepare("SELECT memory_id FROM memories WHERE parent_memory_id = ?1 AND tenant_id = ?2 "
                         "ORDER BY memory_id"));
        s->bind(1, memory_id).bind(2, ctx.auth.tenant_id);
        std::vector<std::string> ids;
        while (s->step()) ids.push_back(s->text(0));
        for (const auto& id : ids)
          if (auto c = find_memory(db, id)) out.children.push_back(to_memory(*c));
        return out;
      },
      then);
}

void SqliteStore::history(const Ctx& ctx, HistoryQuery req, Then<lease::HistoryPage> then) {
  read<lease::HistoryPage>(
      [&](Db& db, UnixMs) -> Outcome<lease::HistoryPage> {
        lease::HistoryPage page;
        page.canonical_name = req.canonical_name;
        std::string salt;
        {
          Use q(db.prepare("SELECT audit_salt FROM tenants WHERE tenant_id = ?1"));
          q->bind(1, ctx.auth.tenant_id);
          if (q->step()) salt = q->text(0);
        }
        // Newest first, in rowid order (rows are appended); the cursor is the last rowid
        // of the page before. A scan: the audit table keeps no index (see version 7).
        std::int64_t before = INT64_MAX;
        if (req.cursor) {
          auto c = std::from_chars(req.cursor->data(), req.cursor->data() + req.cursor->size(), before);
          if (c.ec != std::errc() || c.ptr != req.cursor->data() + req.cursor->size())
            return Problem(Code::invalid_request, "cursor is not a next_cursor this server returned");
        }
        Use s(db.prepare("SELECT rowid, event_type, fencing_token, renewals, created_at FROM audit_events "
                         "WHERE tenant_id = ?1 AND redacted_name_hash = ?2 AND created_at >= ?3 AND rowid < ?4 "
                         "ORDER BY rowid DESC LIMIT ?5"));
        s->bind(1, ctx.auth.tenant_id)
            .bind(2, HmacSha256(salt).hex(req.canonical_name))
            .bind(3, req.since.value_or(0))
            .bind(4, before)
            .bind(5, static_cast<std::int64_t>(req.limit) + 1);
        std::int64_t last = 0;
        while (s->step()) {
          if (page.events.size() == req.limit) {
            page.next_cursor = std::to_string(last);
            break;
          }
          last = s->int64(0);
          page.events.push_back(lease::HistoryEvent{s->text(1), s->opt_int64(2), s->opt_int64(3), s->int64(4)});
        }
        return page;
      },
      then);
}

std::vector<std::pair<std::string, std::int64_t>> SqliteStore::active_leases_by_tenant() {
  auto rd = reader();
  Use s(rd.db().prepare("SELECT t.name, count(*) FROM leases l JOIN tenants t ON t.tenant_id = l.tenant_id "
                        "WHERE l.expires_at > ?1 GROUP BY l.tenant_id"));
  s->bind(1, m_clock.now());
  std::vector<std::pair<std::string, std::int64_t>> out;
  while (s->step()) out.emplace_back(s->text(0), s->int64(1));
  return out;
}

std::optional<AuthInfo> SqliteStore::authenticate(const std::string& token_sha256) {
  // Read before the lookup: a revocation committed after it changes the epoch.
  auto epoch = m_tokens.epoch();
  if (auto hit = m_tokens.find(token_sha256, epoch)) return hit;
  auto rd = reader();
  Use s(rd.db().prepare("SELECT token_id, tenant_id, scopes FROM tokens "
                        "WHERE token_sha256 = ?1 AND revoked_at IS NULL"));
  s->bind(1, token_sha256);
  if (!s->step()) return std::nullopt;
  AuthInfo a;
  a.token_id = s->text(0);
  a.tenant_id = s->text(1);
  std::string scopes = s->text(2);
  a.scope_admin = scopes.find("admin") != std::string::npos;
  a.scope_lease = scopes.find("lease") != std::string::npos || a.scope_admin;
  m_tokens.put(token_sha256, a, epoch);
  return a;
}

void SqliteStore::audit_auth_failure(const std::string& tenant_id) {
  enqueue([this, tenant_id](Db&, UnixMs) { audit(tenant_id, "AUTH_FAILED", {}, {}, std::nullopt); },
          [](std::optional<Problem>) {}, {});
}

bool SqliteStore::ready() {
  if (!m_healthy) {
    // A failed commit marks the store unhealthy until a write succeeds again; probe with
    // a durable write to the database itself (a full disk fails it; a TEMP table would not).
    try {
      run_sync<int>([](Db& db, UnixMs now) {
        Use s(db.prepare("INSERT INTO settings(key, value) VALUES ('readiness_probe', ?1) "
                         "ON CONFLICT(key) DO UPDATE SET value = excluded.value"));
        s->bind(1, std::to_string(now)).run();
        return 0;
      });
    } catch (...) {}
    if (!m_healthy) return false;
  }
  try {
    auto rd = reader();
    Use s(rd.db().prepare("SELECT 1"));
    return s->step();
  } catch (...) {
    return false;
  }
}

std::int64_t SqliteStore::active_leases() {
  auto rd = reader();
  Use s(rd.db().prepare("SELECT count(*) FROM leases WHERE expires_at > ?1"));
  s->bind(1, m_clock.now());
  return s->step() ? s->int64(0) : 0;
}

void SqliteStore::refresh_migration_state(Db& db) {
  Use s(db.prepare("SELECT value FROM settings WHERE key = 'migration_state'"));
  m_migration_in_progress = s->step() && s->text(0) == "in-progress";
}

bool SqliteStore::migration_in_progress() { return m_migration_in_progress; }

void SqliteStore::identity_map(const Ctx& ctx, std::optional<std::string> cursor, std::size_t limit,
                               Then<lease::IdentityMapPage> then) {
  read<lease::IdentityMapPage>(
      [&](Db& db, UnixMs) -> Outcome<lease::IdentityMapPage> {
        Use s(db.prepare("SELECT legacy_memory_ref, memory_instance_id FROM migration_identity_map "
                         "WHERE tenant_id = ?1 AND (?2 IS NULL OR legacy_memory_ref > ?2) "
                         "ORDER BY legacy_memory_ref LIMIT ?3"));
        s->bind(1, ctx.auth.tenant_id).bind(2, cursor).bind(3, static_cast<std::int64_t>(limit + 1));
        lease::IdentityMapPage page;
        while (s->step()) {
          if (page.entries.size() == limit) {
            page.next_cursor = page.entries.back().legacy_memory_ref;
            break;
          }
          page.entries.push_back(lease::IdentityEntry{s->text(0), s->text(1)});
        }
        return page;
      },
      then);
}

std::int64_t SqliteStore::sweep() {
  return run_sync<std::int64_t>([this](Db& db, UnixMs now) {
    refresh_migration_state(db);
    save_clock_checkpoint(db, m_flushed_at);
    Metrics::global().set("mep_sqlite_renewals_from_memory_total", static_cast<double>(m_renewals.renewals()));
    std::int64_t removed = 0;
    std::vector<LeaseRow> expired;
    {
      static const std::string sql =
          fmt::format("SELECT {} FROM leases WHERE expires_at <= ?1 LIMIT {}", k_lease_cols, k_sweep_batch);
      Use s(db.prepare(sql));
      s->bind(1, now);
      while (s->step()) expired.push_back(read_lease(*s));
    }
    for (auto& e : expired) {
      settle(db, e);
      if (e.expires_at > now) continue; // renewed from memory
      delete_lease(db, e.memory_id);
      if (e.expires_at != k_released) {
        audit(e.tenant_id, "LEASE_EXPIRED", e.canonical_name, e.memory_id, e.fencing_token, e.renewals);
        count_lease_end(e, "expired", e.expires_at);
      }
      ++removed;
    }
    // Idempotency records expire in the order they were written (the retention is fixed),
    // so the expired ones are the oldest rowids: read from the first, stop at a live one.
    // (A clock stepped back only delays the records written after the step.)
    std::optional<std::int64_t> last_expired;
    {
      Use s(db.prepare("SELECT rowid, expires_at FROM idempotency ORDER BY rowid LIMIT 5000"));
      while (s->step() && s->int64(1) <= now) last_expired = s->int64(0);
    }
    if (last_expired) {
      Use s(db.prepare("DELETE FROM idempotency WHERE rowid <= ?1 AND expires_at <= ?2"));
      s->bind(1, *last_expired).bind(2, now).run();
      removed += db.changes();
    }
    return removed;
  });
}

// ---- administration -------------------------------------------------------------------------

std::pair<std::string, std::string> SqliteStore::create_token(const std::string& tenant_name, Scope scope) {
  return run_sync<std::pair<std::string, std::string>>([&](Db& db, UnixMs now) {
    std::string tenant_id;
    {
      Use s(db.prepare("SELECT tenant_id FROM tenants WHERE name = ?1"));
      s->bind(1, tenant_name);
      if (s->step()) tenant_id = s->text(0);
    }
    if (tenant_id.empty()) {
      tenant_id = uuid_v7().to_string();
      std::string salt = random_hex(32);
      Use s(db.prepare("INSERT INTO tenants(tenant_id, name, audit_salt, created_at) VALUES (?1, ?2, ?3, ?4)"));
      s->bind(1, tenant_id).bind(2, tenant_name).bind(3, salt).bind(4, now).run();
    }
    std::string token = "mep_" + random_hex(32);
    Use s(db.prepare("INSERT INTO tokens(token_id, tenant_id, token_sha256, scopes, created_at) "
                     "VALUES (?1, ?2, ?3, ?4, ?5)"));
    s->bind(1, uuid_v7().to_string())
        .bind(2, tenant_id)
        .bind(3, sha256_hex(token))
        .bind(4, scope == Scope::admin ? "lease admin" : "lease")
        .bind(5, now)
        .run();
    return std::make_pair(tenant_id, token);
  });
}

std::vector<TokenInfo> SqliteStore::list_tokens(const std::optional<std::string>& tenant_name) {
  auto rd = reader();
  Use s(rd.db().prepare("SELECT t.token_id, t.tenant_id, n.name, t.scopes, t.created_at, t.revoked_at "
                        "FROM tokens t JOIN tenants n ON n.tenant_id = t.tenant_id "
                        "WHERE ?1 IS NULL OR n.name = ?1 ORDER BY t.token_id"));
  s->bind(1, tenant_name);
  std::vector<TokenInfo> out;
  while (s->step())
    out.push_back(TokenInfo{s->text(0), s->text(1), s->text(2), s->text(3), s->int64(4), s->opt_int64(5)});
  return out;
}

bool SqliteStore::revoke_token(const std::string& token_id) {
  bool revoked = run_sync<bool>([&](Db& db, UnixMs now) {
    Use s(db.prepare("UPDATE tokens SET revoked_at = ?1 WHERE token_id = ?2 AND revoked_at IS NULL"));
    s->bind(1, now).bind(2, token_id).run();
    return db.changes() > 0;
  });
  // After the commit: a server that sees the new epoch looks the token up again and finds
  // it revoked. Without the epoch file, servers drop their entries within a second.
  if (revoked && !m_tokens.invalidate())
    log::warn("cannot update {}-token-epoch; a running server may accept the token for up to 1 s",
              std::filesystem::path(m_path).filename().string());
  return revoked;
}

std::vector<AuditRow> SqliteStore::list_audit(const std::optional<std::string>& tenant_name, std::size_t limit) {
  auto rd = reader();
  Use s(rd.db().prepare("SELECT a.event_id, a.tenant_id, a.event_type, a.redacted_name_hash, "
                        "a.redacted_memory_hash, a.fencing_token, a.created_at FROM audit_events a "
                        "LEFT JOIN tenants n ON n.tenant_id = a.tenant_id "
                        "WHERE ?1 IS NULL OR n.name = ?1 ORDER BY a.rowid DESC LIMIT ?2"));
  s->bind(1, tenant_name).bind(2, static_cast<std::int64_t>(limit));
  std::vector<AuditRow> out;
  while (s->step())
    out.push_back(AuditRow{s->text(0), s->text(1), s->text(2), s->text(3), s->text(4), s->opt_int64(5), s->int64(6)});
  return out;
}

} // namespace mep::server
