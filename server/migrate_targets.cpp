// Where mep migrate reads and writes: a SQLite file or a PostgreSQL database (Cloud Spanner's
// target is spanner/migrate_target.cpp), behind migrate_rows.hpp's Target.
#include "mep/migrate.hpp"
#include "mep/migrate_rows.hpp"

#include "mep/canonical.hpp"
#include "mep/json.hpp"
#include "mep/crypto.hpp"
#include "mep/log.hpp"
#include "mep/pg.hpp"
#include "mep/pg_store.hpp"
#include "mep/problem.hpp"
#include "mep/random.hpp"
#include "mep/sqlite.hpp"
#include "mep/sqlite_store.hpp"
#include "mep/store.hpp"
#include "mep/time.hpp"
#include "mep/uuid.hpp"

#include <boost/json.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <deque>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <fstream>
#include <numeric>
#include <unistd.h>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace mep::server::migration {

using sqlite::Db;
using sqlite::Use;

bool is_postgres(const std::string& url) {
  return url.rfind("postgres://", 0) == 0 || url.rfind("postgresql://", 0) == 0;
}

bool is_spanner(const std::string& url) { return url.rfind("spanner:", 0) == 0; }

std::string db_path(const std::string& url) {
  if (url.rfind("sqlite://", 0) == 0) return url.substr(9);
  if (url.rfind("sqlite:", 0) == 0) return url.substr(7);
  return url;
}

bool table_exists(Db& db, const char* name) {
  Use s(db.prepare("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?1"));
  s->bind(1, name);
  return s->step();
}

namespace {

// The names a run must not hand out besides those of earlier runs (SQLite and PostgreSQL).
constexpr const char* k_names_not_migrated =
    "SELECT canonical_name, skeleton FROM agent_names a "
    "WHERE NOT EXISTS (SELECT 1 FROM migration_rows m WHERE m.canonical_name = a.canonical_name)";

constexpr std::int64_t k_run_lock_key = 0x6d65702d6d696772;

// A descriptor closed with its owner.
class Fd {
public:
  explicit Fd(int fd = -1) : m_fd(fd) {}
  Fd(Fd&& o) noexcept : m_fd(std::exchange(o.m_fd, -1)) {}
  Fd& operator=(Fd&&) = delete;
  explicit operator bool() const { return m_fd >= 0; }
  ~Fd() {
    if (m_fd >= 0) ::close(m_fd);
  }

private:
  int m_fd;
};

// `--from-table`: a plain identifier only (it is spliced into the query).
bool plain_identifier(const std::string& table) {
  return !table.empty() &&
         table.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_") ==
             std::string::npos &&
         !std::isdigit(static_cast<unsigned char>(table[0]));
}

class SqliteTarget final : public Target {
public:
  explicit SqliteTarget(std::unique_ptr<Db> db, Fd run_lock = Fd())
      : m_db(std::move(db)), m_run_lock(std::move(run_lock)) {
    if (!table_exists(*m_db, "schema_version")) return;
    Use s(m_db->prepare("SELECT max(version) FROM schema_version"));
    if (s->step() && !s->is_null(0)) refuse_newer_schema(s->int64(0), sqlite_schema_version());
  }
  bool has_tables() override { return table_exists(*m_db, "migration_rows"); }
  expected<Rows, std::string> read_table(const std::string& table) override {
    return migration::read_table(*m_db, table);
  }
  std::string tenant_id(const std::string& name) override {
    if (!table_exists(*m_db, "tenants")) return {};
    Use s(m_db->prepare("SELECT tenant_id FROM tenants WHERE name = ?1"));
    s->bind(1, name);
    return s->step() ? s->text(0) : std::string();
  }
  void each_migrated(const std::function<void(Migrated&&)>& f) override {
    Use s(m_db->prepare(
        "SELECT legacy_id, canonical_name, skeleton, action, reason, memory_instance_id FROM migration_rows"));
    while (s->step())
      f(Migrated{s->text(0), s->text(1), s->text(2), s->text(3), s->opt_text(4).value_or(""), s->text(5)});
  }
  void each_name(const std::function<void(std::string, std::string)>& f) override {
    Use s(m_db->prepare(k_names_not_migrated));
    while (s->step()) f(s->text(0), s->text(1));
  }
  void each_identity(const std::string& tenant, const std::function<void(std::string, std::string)>& f) override {
    Use m(
        m_db->prepare("SELECT legacy_memory_ref, memory_instance_id FROM migration_identity_map WHERE tenant_id = ?1"));
    m->bind(1, tenant);
    while (m->step()) f(m->text(0), m->text(1));
  }
  std::string ensure_tenant(const std::string& name) override {
    Use t(m_db->prepare(
        "INSERT OR IGNORE INTO tenants(tenant_id, name, audit_salt, created_at) VALUES (?1, ?2, ?3, ?4)"));
    t->bind(1, uuid_v7().to_string())
        .bind(2, name)
        .bind(3, uuid_v7().to_hex() + uuid_v7().to_hex())
        .bind(4, now_unix_ms())
        .run();
    return tenant_id(name);
  }
  void mark_in_progress() override {
    Use s(m_db->prepare(
        "INSERT INTO settings(key, value) VALUES ('migration_state', 'in-progress') "
        "ON CONFLICT(key) DO UPDATE SET value = CASE WHEN value = 'active' THEN 'active' ELSE 'in-progress' END"));
    s->run();
  }
  void write(const std::string& tenant, const std::vector<const Row*>& batch, const std::string& uv,
             const std::string& iv) override {
    sqlite::in_transaction(*m_db, "BEGIN IMMEDIATE", [&] {
      for (const Row* r : batch) {
        UnixMs now = now_unix_ms();
        {
          Use s(m_db->prepare(
              "INSERT INTO migration_rows(legacy_id, tenant_id, display_name, canonical_name, skeleton, action, "
              "reason, memory_instance_id, legacy_memory_ref, legacy_created_at, migrated_at) "
              "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)"));
          s->bind(1, r->legacy_id)
              .bind(2, tenant)
              .bind(3, r->display_name)
              .bind(4, r->canonical)
              .bind(5, r->skeleton)
              .bind(6, action_name(r->action))
              .bind(7, r->reason_code ? std::optional<std::string>(r->reason()) : std::nullopt)
              .bind(8, r->memory_id.to_string())
              .bind(9, r->legacy_memory_ref)
              .bind(10, r->created_at())
              .bind(11, now)
              .run();
        }
        {
          Use s(m_db->prepare("INSERT OR IGNORE INTO memories(memory_id, tenant_id, fence_counter, created_at) VALUES "
                              "(?1, ?2, 0, ?3)"));
          s->bind(1, r->memory_id.to_string()).bind(2, tenant).bind(3, now).run();
        }
        if (!r->legacy_memory_ref.empty()) {
          Use s(m_db->prepare(
              "INSERT OR IGNORE INTO migration_identity_map(tenant_id, legacy_memory_ref, memory_instance_id) "
              "VALUES (?1, ?2, ?3)"));
          s->bind(1, tenant).bind(2, r->legacy_memory_ref).bind(3, r->memory_id.to_string()).run();
        }
        {
          Use s(m_db->prepare(
              "INSERT INTO agent_names(canonical_name, display_name, skeleton, tenant_id, unicode_version, "
              "icu_version, first_claimed_at, last_claimed_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7) "
              "ON CONFLICT(canonical_name) DO NOTHING"));
          s->bind(1, r->canonical)
              .bind(2, r->display_name)
              .bind(3, r->skeleton)
              .bind(4, tenant)
              .bind(5, uv)
              .bind(6, iv)
              .bind(7, now)
              .run();
        }
      }
    });
  }
  Db& db() { return *m_db; }

private:
  std::unique_ptr<Db> m_db;
  Fd m_run_lock;
};

// A PostgreSQL text-array literal of `values` (NULL for nullopt): one parameter carries a
// whole batch's column, unnest() turns the columns back into rows.
std::string pg_array(const std::vector<std::optional<std::string>>& values) {
  std::string out = "{";
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (i) out += ',';
    if (!values[i]) {
      out += "NULL";
      continue;
    }
    out += '"';
    for (char ch : *values[i]) {
      if (ch == '"' || ch == '\\') out += '\\';
      out += ch;
    }
    out += '"';
  }
  return out + "}";
}

// Large reads go through a cursor, a page at a time: a million rows never sit in one result.
void each_page(pg::Conn& c, const std::string& query, const std::function<void(const pg::Result&, int)>& f) {
  c.exec("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY");
  try {
    c.exec("DECLARE mep_migrate_cursor NO SCROLL CURSOR FOR " + query);
    for (;;) {
      auto r = c.exec("FETCH 20000 FROM mep_migrate_cursor");
      if (r.rows() == 0) break;
      for (int i = 0; i < r.rows(); ++i) f(r, i);
    }
    c.exec("COMMIT");
  } catch (...) {
    try {
      c.exec("ROLLBACK");
    } catch (...) {}
    throw;
  }
}

class PgTarget final : public Target {
public:
  explicit PgTarget(const std::string& url) : m_c(url) {
    if (!exists("schema_version")) return;
    auto r = m_c.exec("migrate_schema_version", "SELECT version FROM schema_version WHERE id = 1", {});
    if (r.rows()) refuse_newer_schema(r.int64(0, 0), pg_schema_version());
  }
  bool has_tables() override { return exists("migration_rows"); }
  expected<Rows, std::string> read_table(const std::string& table) override {
    if (!plain_identifier(table)) return make_unexpected(std::string("--from-table must be a plain table name"));
    auto cols = m_c.exec("migrate_columns",
                         "SELECT column_name::text, data_type::text FROM information_schema.columns "
                         "WHERE table_schema = current_schema() AND table_name = $1",
                         {table});
    if (cols.rows() == 0) return make_unexpected("no table named " + table + " in the database");
    std::unordered_map<std::string, std::string> type;
    for (int i = 0; i < cols.rows(); ++i) type[cols.text(i, 0)] = cols.text(i, 1);
    for (const char* need : {"legacy_id", "display_name", "created_at", "legacy_memory_ref"})
      if (!type.count(need)) return make_unexpected(fmt::format("the table {} lacks the column {}", table, need));
    // Timestamps as RFC 3339 in UTC, as a file would give them; anything else as its text.
    const std::string created = type["created_at"].rfind("timestamp", 0) == 0
                                    ? "to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')"
                                    : "created_at::text";
    Rows rows;
    try {
      each_page(m_c,
                fmt::format("SELECT legacy_id::text, display_name::text, {}, legacy_memory_ref::text, {} FROM \"{}\"",
                            created, type.count("memory_instance_id") ? "memory_instance_id::text" : "NULL::text",
                            table),
                [&](const pg::Result& r, int i) {
                  rows.push_back(Row{r.opt_text(i, 0).value_or(""), r.opt_text(i, 1).value_or(""),
                                     r.opt_text(i, 2).value_or(""), r.opt_text(i, 3).value_or(""),
                                     r.opt_text(i, 4).value_or("")});
                });
    } catch (const pg::Error& e) {
      return make_unexpected(std::string("cannot read the table: ") + e.what());
    }
    return rows;
  }
  std::string tenant_id(const std::string& name) override {
    if (!exists("tenants")) return {};
    auto r = m_c.exec("migrate_tenant", "SELECT tenant_id FROM tenants WHERE name = $1", {name});
    return r.rows() ? r.text(0, 0) : std::string();
  }
  void each_migrated(const std::function<void(Migrated&&)>& f) override {
    each_page(m_c, "SELECT legacy_id, canonical_name, skeleton, action, reason, memory_instance_id FROM migration_rows",
              [&](const pg::Result& r, int i) {
                f(Migrated{r.text(i, 0), r.text(i, 1), r.text(i, 2), r.text(i, 3), r.opt_text(i, 4).value_or(""),
                           r.text(i, 5)});
              });
  }
  void each_name(const std::function<void(std::string, std::string)>& f) override {
    each_page(m_c, k_names_not_migrated, [&](const pg::Result& r, int i) { f(r.text(i, 0), r.text(i, 1)); });
  }
  void each_identity(const std::string& tenant, const std::function<void(std::string, std::string)>& f) override {
    // The tenant id came from the database itself (a UUID), never from the user.
    if (!Uuid::parse(tenant)) return;
    each_page(m_c,
              "SELECT legacy_memory_ref, memory_instance_id FROM migration_identity_map WHERE tenant_id = '" + tenant +
                  "'",
              [&](const pg::Result& r, int i) { f(r.text(i, 0), r.text(i, 1)); });
  }
  std::string ensure_tenant(const std::string& name) override {
    const std::string salt = random_hex(32);
    const auto pads = hmac_sha256_pads(salt);
    auto hex = [](const std::string& b) { return "\\x" + hex_lower(b.data(), b.size()); };
    m_c.exec("migrate_new_tenant",
             "INSERT INTO tenants(tenant_id, name, audit_salt, audit_ipad, audit_opad, created_at) "
             "VALUES ($1, $2, $3, $4::bytea, $5::bytea, mep_now_ms()) ON CONFLICT (name) DO NOTHING",
             {uuid_v7().to_string(), name, salt, hex(pads.first), hex(pads.second)});
    return tenant_id(name);
  }
  void lock_run() {
    // A session-level advisory lock: released when the connection closes (the process ends).
    auto r = m_c.exec("migrate_lock_run", "SELECT pg_try_advisory_lock($1::bigint)", {std::to_string(k_run_lock_key)});
    if (r.text(0, 0) != "t") throw RunInProgress{};
  }
  void mark_in_progress() override {
    m_c.exec("INSERT INTO settings(key, value) VALUES ('migration_state', 'in-progress') "
             "ON CONFLICT (key) DO UPDATE SET value = CASE WHEN settings.value = 'active' THEN 'active' "
             "ELSE 'in-progress' END");
  }
  // One statement, one round trip, one transaction per batch: the batch's columns as
  // arrays, and each table written by its own INSERT of a data-modifying WITH.
  void write(const std::string& tenant, const std::vector<const Row*>& batch, const std::string& uv,
             const std::string& iv) override {
    std::vector<std::optional<std::string>> id, display, canonical, skeleton, action, reason, memory, ref, created;
    for (const Row* r : batch) {
      id.emplace_back(r->legacy_id);
      display.emplace_back(r->display_name);
      canonical.emplace_back(r->canonical);
      skeleton.emplace_back(r->skeleton);
      action.emplace_back(action_name(r->action));
      reason.emplace_back(r->reason_code ? std::optional<std::string>(r->reason()) : std::nullopt);
      memory.emplace_back(r->memory_id.to_string());
      ref.emplace_back(r->legacy_memory_ref);
      created.emplace_back(r->created_at());
    }
    m_c.exec(
        "migrate_batch",
        "WITH input AS ("
        "  SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], "
        "                       $8::text[], $9::text[]) WITH ORDINALITY "
        "  AS t(legacy_id, display_name, canonical_name, skeleton, action, reason, memory_instance_id, "
        "       legacy_memory_ref, legacy_created_at, ord)), "
        "now AS (SELECT mep_now_ms() AS ms), "
        "r AS (INSERT INTO migration_rows(legacy_id, tenant_id, display_name, canonical_name, skeleton, action, "
        "reason, "
        "        memory_instance_id, legacy_memory_ref, legacy_created_at, migrated_at) "
        "      SELECT legacy_id, $10, display_name, canonical_name, skeleton, action, reason, memory_instance_id, "
        "             legacy_memory_ref, legacy_created_at, now.ms FROM input, now), "
        "m AS (INSERT INTO memories(memory_id, tenant_id, fence_counter, created_at) "
        "      SELECT DISTINCT memory_instance_id, $10, 0, now.ms FROM input, now ON CONFLICT DO NOTHING), "
        "i AS (INSERT INTO migration_identity_map(tenant_id, legacy_memory_ref, memory_instance_id) "
        "      SELECT DISTINCT ON (legacy_memory_ref) $10, legacy_memory_ref, memory_instance_id FROM input "
        "      WHERE legacy_memory_ref <> '' ORDER BY legacy_memory_ref, ord ON CONFLICT DO NOTHING) "
        "INSERT INTO agent_names(canonical_name, display_name, skeleton, tenant_id, unicode_version, icu_version, "
        "  first_claimed_at, last_claimed_at) "
        "SELECT canonical_name, display_name, skeleton, $10, $11, $12, now.ms, now.ms FROM input, now "
        "ON CONFLICT (canonical_name) DO NOTHING",
        {pg_array(id), pg_array(display), pg_array(canonical), pg_array(skeleton), pg_array(action), pg_array(reason),
         pg_array(memory), pg_array(ref), pg_array(created), tenant, uv, iv});
  }

  bool exists(const char* table) {
    auto r = m_c.exec("migrate_exists", "SELECT to_regclass($1) IS NOT NULL", {std::string(table)});
    return r.rows() && r.text(0, 0) == "t";
  }
  pg::Conn& conn() { return m_c; }

private:
  pg::Conn m_c;
};

} // namespace

// The database of `url`, its schema created first unless `dry_run` (a plan writes nothing);
// null for a plan on a SQLite file that does not exist.
std::unique_ptr<Target> open_target(const std::string& url, bool dry_run) {
  if (is_spanner(url)) return open_spanner_target(url, !dry_run); // a run's lock taken there
  if (is_postgres(url)) {
    auto target = std::make_unique<PgTarget>(url);
    if (!dry_run) {
      target->lock_run();
      open_store(url); // creates and upgrades the schema
    }
    return target;
  }
  const std::string path = db_path(url);
  if (dry_run) {
    if (!std::filesystem::exists(path)) return nullptr;
    return std::make_unique<SqliteTarget>(std::make_unique<Db>(path, sqlite::Mode::read_only));
  }
  Fd lock(try_lock_beside(path, "-migrate.lock"));
  if (!lock) throw RunInProgress{};
  { SqliteStore init(url); } // creates and migrates the schema
  auto db = std::make_unique<Db>(path, sqlite::Mode::read_write_create);
  db->exec("PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;");
  return std::make_unique<SqliteTarget>(std::move(db), std::move(lock));
}

} // namespace mep::server::migration

namespace mep::server {

using namespace migration;
using sqlite::Db;
using sqlite::Use;

int migrate_activate(const std::string& db_url, bool json) {
  try {
    if (is_spanner(db_url)) {
      auto db = open_spanner_target(db_url, false);
      if (!db) {
        std::fprintf(stderr, "mep migrate: the database has no mep schema: nothing was migrated into it\n");
        return exit_code::other;
      }
      db->activate();
      if (json)
        std::printf("{\"migration_state\":\"active\"}\n");
      else
        std::printf("migration activated: lease endpoints are open (servers notice within a second)\n");
      return exit_code::ok;
    }
    if (is_postgres(db_url)) {
      PgTarget db(db_url);
      if (!db.exists("settings")) {
        std::fprintf(stderr, "mep migrate: the database has no mep schema: nothing was migrated into it\n");
        return exit_code::other;
      }
      db.conn().exec("INSERT INTO settings(key, value) VALUES ('migration_state', 'active') "
                     "ON CONFLICT (key) DO UPDATE SET value = 'active'");
      if (json)
        std::printf("{\"migration_state\":\"active\"}\n");
      else
        std::printf("migration activated: lease endpoints are open (servers notice within a second)\n");
      return exit_code::ok;
    }
    // The URL is checked before anything touches the file system: a PostgreSQL URL must
    // not become a SQLite file under a folder called "postgresql:".
    const std::string path = db_path(db_url);
    if (!std::filesystem::exists(path)) {
      std::fprintf(stderr, "mep migrate: no database at %s\n", path.c_str());
      return exit_code::other;
    }
    { SqliteStore init(db_url); }
    Db db(path, sqlite::Mode::read_write_create);
    db.exec("INSERT INTO settings(key, value) VALUES ('migration_state', 'active') "
            "ON CONFLICT(key) DO UPDATE SET value = 'active'");
    if (json)
      std::printf("{\"migration_state\":\"active\"}\n");
    else
      std::printf("migration activated: lease endpoints are open (servers notice within a second)\n");
    return exit_code::ok;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mep migrate: %s\n", e.what());
    return exit_code::other;
  }
}

int migrate_status(const std::string& db_url, bool json) {
  try {
    std::string state = "none";
    std::int64_t kept = 0, renamed = 0, generated = 0, mapped = 0;
    auto count = [&](const std::string& a, std::int64_t n) {
      (a == "kept" ? kept : a == "renamed" ? renamed : generated) = n;
    };
    if (is_spanner(db_url)) {
      if (auto db = open_spanner_target(db_url, false)) {
        state = db->state();
        for (const auto& [action, n] : db->action_counts()) count(action, n);
        mapped = db->identity_entries();
      }
    } else if (is_postgres(db_url)) {
      PgTarget db(db_url);
      if (db.exists("settings")) {
        auto r = db.conn().exec("SELECT value FROM settings WHERE key = 'migration_state'");
        if (r.rows()) state = r.text(0, 0);
      }
      if (db.exists("migration_rows")) {
        auto r = db.conn().exec("SELECT action, count(*) FROM migration_rows GROUP BY action");
        for (int i = 0; i < r.rows(); ++i) count(r.text(i, 0), r.int64(i, 1));
        auto m = db.conn().exec("SELECT count(*) FROM migration_identity_map");
        if (m.rows()) mapped = m.int64(0, 0);
      }
    } else {
      std::string path = db_path(db_url);
      if (!std::filesystem::exists(path)) {
        std::fprintf(stderr, "mep migrate: no database at %s\n", path.c_str());
        return exit_code::other;
      }
      SqliteTarget target(std::make_unique<Db>(path, sqlite::Mode::read_only)); // refuses a newer schema
      Db& db = target.db();
      if (table_exists(db, "settings")) {
        Use s(db.prepare("SELECT value FROM settings WHERE key = 'migration_state'"));
        if (s->step()) state = s->text(0);
      }
      if (table_exists(db, "migration_rows")) {
        Use s(db.prepare("SELECT action, count(*) FROM migration_rows GROUP BY action"));
        while (s->step()) count(s->text(0), s->int64(1));
        Use m(db.prepare("SELECT count(*) FROM migration_identity_map"));
        if (m->step()) mapped = m->int64(0);
      }
    }
    if (json) {
      std::printf("%s\n", json::dump(boost::json::object{{"migration_state", state},
                                                         {"rows", kept + renamed + generated},
                                                         {"kept", kept},
                                                         {"renamed", renamed},
                                                         {"generated", generated},
                                                         {"identity_map_entries", mapped}})
                              .c_str());
    } else {
      std::printf("state: %s%s\nrows: %lld (%lld kept, %lld renamed, %lld generated)\nidentity map: %lld entries\n",
                  state.c_str(),
                  state == "in-progress" ? " (lease endpoints answer 503 until 'mep migrate activate')" : "",
                  static_cast<long long>(kept) + renamed + generated, static_cast<long long>(kept),
                  static_cast<long long>(renamed), static_cast<long long>(generated), static_cast<long long>(mapped));
    }
    return exit_code::ok;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mep migrate: %s\n", e.what());
    return exit_code::other;
  }
}

} // namespace mep::server
