// The lease and memory rows of the SQLite store, read and written (server/sqlite/internal.hpp).
#include "internal.hpp"

namespace mep::server::sqlite_rows {

LeaseRow read_lease(sqlite::Stmt& s) {
  LeaseRow l;
  l.lease_id = s.text(0);
  l.tenant_id = s.text(1);
  l.canonical_name = s.text(2);
  l.display_name = s.text(3);
  l.skeleton = s.text(4);
  l.memory_id = s.text(5);
  l.fencing_token = s.int64(6);
  l.owner_client_id = s.text(7);
  l.ttl_s = s.int64(8);
  l.expires_at = s.int64(9);
  l.acquired_at = s.int64(10);
  l.holder = s.opt_text(11).value_or("");
  l.granted_at = s.opt_int64(12).value_or(l.acquired_at);
  l.renewed_at = s.opt_int64(13);
  l.renewals = s.int64(14);
  l.hold_until = s.opt_int64(15);
  return l;
}

std::optional<MemoryRow> find_memory(Db& db, const std::string& memory_id) {
  Use s(db.prepare("SELECT memory_id, tenant_id, parent_memory_id, branched_at_token, "
                   "fence_counter, created_at, revoked_token, revoke_reason FROM memories WHERE memory_id = ?1"));
  s->bind(1, memory_id);
  if (!s->step()) return std::nullopt;
  MemoryRow m;
  m.memory_id = s->text(0);
  m.tenant_id = s->text(1);
  m.parent_memory_id = s->opt_text(2);
  m.branched_at_token = s->opt_int64(3);
  m.fence_counter = s->int64(4);
  m.created_at = s->int64(5);
  m.revoked_token = s->opt_int64(6);
  m.revoke_reason = s->opt_text(7).value_or("");
  return m;
}

std::optional<LeaseRow> lease_by_memory(Db& db, const std::string& memory_id) {
  static const std::string sql = fmt::format("SELECT {} FROM leases WHERE memory_id = ?1", k_lease_cols);
  Use s(db.prepare(sql));
  s->bind(1, memory_id);
  if (!s->step()) return std::nullopt;
  return read_lease(*s);
}

std::optional<LeaseRow> lease_by_name(Db& db, const std::string& name) {
  static const std::string sql = fmt::format("SELECT {} FROM leases WHERE canonical_name = ?1", k_lease_cols);
  Use s(db.prepare(sql));
  s->bind(1, name);
  if (!s->step()) return std::nullopt;
  return read_lease(*s);
}

void delete_lease(Db& db, const std::string& memory_id) {
  Use s(db.prepare("DELETE FROM leases WHERE memory_id = ?1"));
  s->bind(1, memory_id).run();
}

void mark_released(Db& db, const std::string& memory_id) {
  Use s(db.prepare("UPDATE leases SET expires_at = ?2 WHERE memory_id = ?1"));
  s->bind(1, memory_id).bind(2, k_released).run();
}

void rewrite_lease(Db& db, const LeaseRow& l, bool owner_changed) {
  // Two statements: SQLite updates every index with a column named in SET, changed or not.
  static const auto sql = [](std::string_view owner) {
    return fmt::format("UPDATE leases SET lease_id = ?1, display_name = ?2, fencing_token = ?3, "
                       "ttl_seconds = ?4, expires_at = ?5, acquired_at = ?6, holder = ?9, granted_at = ?10, "
                       "renewed_at = ?11, renewals = ?12, hold_until = ?13{} WHERE memory_id = ?7",
                       owner);
  };
  static const std::string keep_owner = sql(""), new_owner = sql(", owner_client_id = ?8");
  Use s(db.prepare(owner_changed ? new_owner : keep_owner));
  s->bind(1, l.lease_id)
      .bind(2, l.display_name)
      .bind(3, l.fencing_token)
      .bind(4, l.ttl_s)
      .bind(5, l.expires_at)
      .bind(6, l.acquired_at)
      .bind(7, l.memory_id)
      .bind(9, l.holder.empty() ? std::nullopt : std::optional<std::string>(l.holder))
      .bind(10, l.granted_at)
      .bind(11, l.renewed_at)
      .bind(12, l.renewals)
      .bind(13, l.hold_until);
  if (owner_changed) s->bind(8, l.owner_client_id);
  s->run();
}

} // namespace mep::server::sqlite_rows
