// The legacy migration.
//
// Design notes. A run has two phases. Phase 1 reads every legacy row, canonicalizes its
// name and groups rows by skeleton; in each group the oldest created_at keeps its name
// (ties: the smallest legacy id) — this is deterministic, so a resumed run picks the same
// winners. Phase 2 writes the rows in order, in transactions of --batch rows: rows already
// in migration_rows (an earlier, interrupted run) are skipped, so every legacy row ends up
// there exactly once and a second complete run changes nothing. Losers get
// `<canonical>-<suffix>`, the suffix being the random tail of a fresh UUIDv7's hex, as
// long as fits in 64 code points, checked for uniqueness of name and skeleton against
// every name of the migration. The enforcement flag (settings.migration_state) is
// `in-progress` from the first write until `mep migrate activate` sets it `active`.
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

namespace mep::server {
namespace {
using sqlite::Db;
using sqlite::Use;
using Clock = std::chrono::steady_clock;
using namespace migration;

// An open-addressing set of 64-bit hashes (8 bytes a slot): the uniqueness checks of a
// million names in a few MB. A false positive only makes a fresh suffix be drawn again;
// the UNIQUE constraints of migration_rows stay the final word.
class HashSet64 {
public:
  explicit HashSet64(std::size_t expected) {
    m_slots.assign(std::max<std::size_t>(64, std::bit_ceil(expected * 2 + 1)), 0);
  }
  bool contains(std::uint64_t h) const {
    h = h ? h : 1;
    for (std::size_t i = h & (m_slots.size() - 1);; i = (i + 1) & (m_slots.size() - 1)) {
      if (m_slots[i] == h) return true;
      if (m_slots[i] == 0) return false;
    }
  }
  void insert(std::uint64_t h) {
    h = h ? h : 1;
    if ((m_size + 1) * 2 > m_slots.size()) grow();
    for (std::size_t i = h & (m_slots.size() - 1);; i = (i + 1) & (m_slots.size() - 1)) {
      if (m_slots[i] == h) return;
      if (m_slots[i] == 0) {
        m_slots[i] = h;
        ++m_size;
        return;
      }
    }
  }

private:
  void grow() {
    std::vector<std::uint64_t> old;
    old.swap(m_slots);
    m_slots.assign(old.size() * 2, 0);
    m_size = 0;
    for (auto h : old)
      if (h) insert(h);
  }
  std::vector<std::uint64_t> m_slots;
  std::size_t m_size = 0;
};

std::uint64_t hash_of(std::string_view s) { return std::hash<std::string_view>{}(s); }

std::string db_path(const std::string& url) {
  if (url.rfind("sqlite://", 0) == 0) return url.substr(9);
  if (url.rfind("sqlite:", 0) == 0) return url.substr(7);
  return url;
}

bool less_id(const std::string& a, const std::string& b) {
  bool na = !a.empty() && a.find_first_not_of("0123456789") == std::string::npos;
  bool nb = !b.empty() && b.find_first_not_of("0123456789") == std::string::npos;
  if (na && nb && a.size() != b.size()) return a.size() < b.size();
  return a < b;
}

// ---- input --------------------------------------------------------------------------------

// A quoted field still open at the end of the file: it would swallow the rows after it.
struct CsvUnterminated {};

// One record, from `line` and, while a quoted field holds newlines, the lines after it
// (counted in `lineno`).
std::vector<std::string> parse_csv_line(const std::string& line, std::istream& in, std::size_t& lineno) {
  std::vector<std::string> out;
  std::string field, rest = line;
  bool quoted = false;
  for (std::size_t i = 0;; ++i) {
    if (i == rest.size()) {
      if (quoted) { // a newline inside quotes: continue with the next physical line
        std::string next;
        if (!std::getline(in, next)) throw CsvUnterminated{};
        ++lineno;
        field.push_back('\n');
        rest += "\n" + next;
        continue;
      }
      break;
    }
    char c = rest[i];
    if (quoted) {
      if (c == '"' && i + 1 < rest.size() && rest[i + 1] == '"') {
        field.push_back('"');
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else if (c != '\n') {
        field.push_back(c);
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      out.push_back(field);
      field.clear();
    } else if (c != '\r') {
      field.push_back(c);
    }
  }
  out.push_back(field);
  return out;
}

// Reads JSON Lines or CSV (with a header); fails with a message naming the line.
// The CSV header in `line`, then the records (read_rows' CSV half).
expected<Rows, std::string> read_csv_records(const std::string& path, std::istream& in, std::string& line,
                                             std::size_t& lineno, std::size_t& record_line, Rows rows);

expected<Rows, std::string> read_rows(std::istream& in, const std::string& path) {
  Rows rows;
  std::string line;
  std::size_t lineno = 0;
  int c = in.peek();
  while (c == ' ' || c == '\n' || c == '\r' || c == '\t') {
    if (in.get() == '\n') ++lineno; // blank lines still count in the line numbers
    c = in.peek();
  }
  // JSON Lines: an object per line ('[' too: a JSON array where lines of objects belong).
  if (c == '{' || c == '[') {
    while (std::getline(in, line)) {
      ++lineno;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      auto o = json::parse_object(line, "a line of JSON Lines");
      if (!o) return make_unexpected(fmt::format("{}:{}: {}", path, lineno, o.error().detail));
      // A required field the object lacks is a file written with other names, not an empty value.
      std::optional<std::string_view> missing;
      auto get = [&](std::string_view k, bool required = true) -> std::string {
        auto* v = o->if_contains(k);
        if (!v || v->is_null()) {
          if (required && !missing) missing = k;
          return {};
        }
        if (v->is_string()) return std::string(v->get_string());
        return json::dump(*v);
      };
      Row r{get("legacy_id"), get("display_name"), get("created_at"), get("legacy_memory_ref"),
            get("memory_instance_id", false)};
      if (auto why = r.problem()) return make_unexpected(fmt::format("{}:{}: {}", path, lineno, *why));
      if (missing) return make_unexpected(fmt::format("{}:{}: the field {} is missing", path, lineno, *missing));
      r.line = static_cast<std::uint32_t>(lineno);
      rows.push_back(std::move(r));
    }
    return rows;
  }
  if (!std::getline(in, line)) return rows;
  ++lineno;
  std::size_t record_line = lineno; // where the record being read began
  try {
    return read_csv_records(path, in, line, lineno, record_line, std::move(rows));
  } catch (const CsvUnterminated&) {
    return make_unexpected(
        fmt::format("{}:{}: a quoted field is not closed before the end of the file", path, record_line));
  }
}

expected<Rows, std::string> read_csv_records(const std::string& path, std::istream& in, std::string& line,
                                             std::size_t& lineno, std::size_t& record_line, Rows rows) {
  auto header = parse_csv_line(line, in, lineno);
  std::unordered_map<std::string, std::size_t> col;
  for (std::size_t i = 0; i < header.size(); ++i) col[header[i]] = i;
  for (const char* need : {"legacy_id", "display_name", "created_at", "legacy_memory_ref"})
    if (!col.count(need)) return make_unexpected(fmt::format("{}: the CSV header lacks the column {}", path, need));
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty() || line == "\r") continue;
    record_line = lineno;
    auto f = parse_csv_line(line, in, lineno);
    auto get = [&](const char* k) -> std::string {
      auto it = col.find(k);
      return it != col.end() && it->second < f.size() ? f[it->second] : std::string();
    };
    // A line with more or fewer fields than the header has its values in the wrong columns
    // (an unquoted comma in a name, say).
    if (f.size() != header.size())
      return make_unexpected(
          fmt::format("{}:{}: {} fields where the header has {}", path, record_line, f.size(), header.size()));
    Row r{get("legacy_id"), get("display_name"), get("created_at"), get("legacy_memory_ref"),
          get("memory_instance_id")};
    if (auto why = r.problem()) return make_unexpected(fmt::format("{}:{}: {}", path, record_line, *why));
    r.line = static_cast<std::uint32_t>(record_line);
    rows.push_back(std::move(r));
  }
  return rows;
}

expected<Rows, std::string> read_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return make_unexpected("cannot read " + path);
  return read_rows(in, path);
}

expected<Rows, std::string> read_table(Db& db, const std::string& table) {
  if (table.empty() ||
      table.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_") != std::string::npos ||
      std::isdigit(static_cast<unsigned char>(table[0])))
    return make_unexpected("--from-table must be a plain table name");
  bool has_mid = false;
  {
    Use s(db.prepare("SELECT name FROM pragma_table_info(?1)"));
    s->bind(1, table);
    bool any = false;
    while (s->step()) {
      any = true;
      has_mid = has_mid || s->text(0) == "memory_instance_id";
    }
    if (!any) return make_unexpected("no table named " + table + " in the database");
  }
  Rows rows;
  try {
    Use s(db.prepare(fmt::format("SELECT CAST(legacy_id AS TEXT), display_name, CAST(created_at AS TEXT), "
                                 "CAST(legacy_memory_ref AS TEXT), {} FROM \"{}\"",
                                 has_mid ? "memory_instance_id" : "NULL", table)));
    while (s->step())
      rows.push_back(Row{s->text(0), s->text(1), s->text(2), s->text(3), s->opt_text(4).value_or(""), true});
  } catch (const sqlite::Error& e) {
    return make_unexpected(std::string("cannot read the table: ") + e.what());
  }
  return rows;
}

// ---- progress --------------------------------------------------------------------------------

class Progress {
public:
  Progress(std::string what, std::size_t total) : m_what(std::move(what)), m_total(total), m_tty(::isatty(2)) {}
  void update(std::size_t done, bool final = false) {
    auto now = Clock::now();
    if (!final && now - m_last < std::chrono::milliseconds(m_tty ? 100 : 2000)) return;
    m_last = now;
    double secs = std::chrono::duration<double>(now - m_start).count();
    double rate = secs > 0 ? static_cast<double>(done) / secs : 0;
    double eta = rate > 0 ? static_cast<double>(m_total - done) / rate : 0;
    int pct = m_total ? static_cast<int>(100.0 * static_cast<double>(done) / static_cast<double>(m_total)) : 100;
    if (m_tty) {
      int filled = pct * 30 / 100;
      std::fprintf(stderr, "\r%s [%s%s] %3d%% %zu/%zu rows  %.0f rows/s  ETA %.0f s ", m_what.c_str(),
                   std::string(static_cast<std::size_t>(filled), '#').c_str(),
                   std::string(static_cast<std::size_t>(30 - filled), '-').c_str(), pct, done, m_total, rate, eta);
      if (final) std::fputc('\n', stderr);
    } else {
      std::fprintf(stderr, "mep migrate: %s %zu/%zu rows (%d%%), %.0f rows/s\n", m_what.c_str(), done, m_total, pct,
                   rate);
    }
  }

private:
  std::string m_what;
  std::size_t m_total;
  bool m_tty;
  Clock::time_point m_start = Clock::now();
  Clock::time_point m_last{};
};

} // namespace

namespace migration {
const char* action_name(Row::Action a) {
  switch (a) {
  case Row::kept:
    return "kept";
  case Row::renamed:
    return "renamed";
  case Row::generated:
    return "generated";
  case Row::done:
    return "done";
  }
  return "kept";
}
} // namespace migration

namespace {

bool table_exists(Db& db, const char* name) {
  Use s(db.prepare("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?1"));
  s->bind(1, name);
  return s->step();
}

// ---- where the migration reads and writes: a SQLite file or a PostgreSQL database ----------

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

bool is_spanner(const std::string& url) { return url.rfind("spanner:", 0) == 0; }

bool is_postgres(const std::string& url) {
  return url.rfind("postgres://", 0) == 0 || url.rfind("postgresql://", 0) == 0;
}

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
    return mep::server::read_table(*m_db, table);
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

} // namespace

int migrate_run(const MigrateOptions& o) {
  if (o.input_file.has_value() == o.from_table.has_value()) {
    std::fprintf(stderr, "mep migrate: give exactly one of --input FILE or --from-table TABLE\n");
    return exit_code::usage;
  }
  if (o.batch == 0) {
    std::fprintf(stderr, "mep migrate: --batch must be at least 1\n");
    return exit_code::usage;
  }
  if (o.from_table && is_spanner(o.db_url)) { // refused before the database is touched
    std::fprintf(stderr, "mep migrate: --from-table is not supported on Spanner: export the table as JSON Lines or "
                         "CSV and give it with --input\n");
    return exit_code::usage;
  }
  try {
    // 1. Read the legacy rows and check them: from a file before the database is opened
    //    (an input that does not pass changes nothing, not even a database that did not
    //    exist). `by_id` indexes them by legacy id (hash → row).
    std::unordered_map<std::uint64_t, std::uint32_t> by_id;
    auto refused = [&](const Rows& rows) {
      if (o.from_table) // a file's rows were checked as they were read, with their lines
        for (const Row& r : rows)
          if (auto why = r.problem()) {
            std::fprintf(stderr, "mep migrate: table %s, the row with legacy_id '%s': %s\n", o.from_table->c_str(),
                         r.legacy_id.c_str(), why->c_str());
            return true;
          }
      by_id.reserve(rows.size());
      for (std::size_t i = 0; i < rows.size(); ++i) {
        auto [it, fresh] = by_id.try_emplace(hash_of(rows[i].legacy_id), static_cast<std::uint32_t>(i));
        if (!fresh && rows[it->second].legacy_id == rows[i].legacy_id) {
          if (o.input_file)
            std::fprintf(stderr, "mep migrate: %s:%u: legacy_id %s appears twice (first on line %u)\n",
                         o.input_file->c_str(), rows[i].line, rows[i].legacy_id.c_str(), rows[it->second].line);
          else
            std::fprintf(stderr, "mep migrate: legacy_id %s appears twice in the table %s\n", rows[i].legacy_id.c_str(),
                         o.from_table->c_str());
          return true;
        }
      }
      if (rows.empty()) std::fprintf(stderr, "mep migrate: warning: the input holds no rows\n");
      return false;
    };
    std::optional<expected<Rows, std::string>> input;
    if (o.input_file) {
      input = read_file(*o.input_file);
      if (!*input) {
        std::fprintf(stderr, "mep migrate: %s\n", input->error().c_str());
        return exit_code::usage;
      }
      if (refused(**input)) return exit_code::usage;
    }
    // Open: a plan never writes (read-only on SQLite, and no schema is created).
    std::unique_ptr<Target> db = open_target(o.db_url, o.dry_run);
    bool has_tables = db && db->has_tables();
    if (!input) {
      input = db ? db->read_table(*o.from_table) : make_unexpected(std::string("the database does not exist"));
      if (!*input) {
        std::fprintf(stderr, "mep migrate: %s\n", input->error().c_str());
        return exit_code::usage;
      }
      if (refused(**input)) return exit_code::usage;
    }
    Rows& rows = **input;

    // 2. What earlier runs already wrote (resume), and every name in use.
    HashSet64 used_names(rows.size()), used_skeletons(rows.size());
    std::unordered_set<std::string> taken_skeletons;            // exact, from earlier runs
    std::unordered_map<std::uint64_t, std::uint32_t> ref_index; // legacy_memory_ref hash → row
    std::unordered_map<std::string, std::string> db_identity;   // refs mapped by earlier runs
    std::string tenant_id = db ? db->tenant_id(o.tenant) : std::string();
    if (has_tables) {
      db->each_migrated([&](Migrated&& m) {
        used_names.insert(hash_of(m.canonical));
        used_skeletons.insert(hash_of(m.skeleton));
        taken_skeletons.insert(m.skeleton);
        auto it = by_id.find(hash_of(m.legacy_id));
        if (it == by_id.end() || rows[it->second].legacy_id != m.legacy_id) return;
        Row& r = rows[it->second];
        r.canonical = std::move(m.canonical);
        r.skeleton = std::move(m.skeleton);
        r.done_as = m.action == "renamed" ? Row::renamed : m.action == "generated" ? Row::generated : Row::kept;
        r.reason_code = 0;
        for (int k = 0; k <= static_cast<int>(NameReason::invisible_character); ++k)
          if (m.reason == to_string(static_cast<NameReason>(k))) r.reason_code = static_cast<std::uint8_t>(k + 1);
        r.memory_id = *Uuid::parse(m.memory_id);
        r.has_memory = true;
        r.action = Row::done;
      });
      // Names claimed through a server: a legacy row may not take one, nor share its
      // skeleton.
      db->each_name([&](std::string canonical, std::string skeleton) {
        used_names.insert(hash_of(canonical));
        used_skeletons.insert(hash_of(skeleton));
        taken_skeletons.insert(std::move(skeleton));
      });
      // Only the references of rows still to write matter (a complete re-run loads none).
      HashSet64 pending_refs(rows.size());
      bool any_pending = false;
      for (const auto& r : rows)
        if (r.action != Row::done && !r.legacy_memory_ref.empty()) {
          pending_refs.insert(hash_of(r.legacy_memory_ref));
          any_pending = true;
        }
      if (any_pending) {
        db->each_identity(tenant_id, [&](std::string ref, std::string id) {
          if (pending_refs.contains(hash_of(ref))) db_identity.emplace(std::move(ref), std::move(id));
        });
      }
    }

    // 3. Canonicalize, then choose winners: sort by (skeleton, created_at, legacy id);
    //    the first of each run of equal skeletons keeps its name (deterministic).
    Progress prep("canonicalizing", rows.size());
    std::vector<std::uint32_t> order;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      Row& r = rows[i];
      if (r.action == Row::done) continue;
      auto name = canonicalize(r.display_name);
      if (!name) {
        r.action = Row::generated;
        r.reason_code = static_cast<std::uint8_t>(static_cast<int>(name.error().reason) + 1);
        continue;
      }
      r.canonical = std::move(name->canonical_name);
      r.skeleton = std::move(name->skeleton);
      order.push_back(static_cast<std::uint32_t>(i));
      if (i % 4096 == 0) prep.update(i);
    }
    prep.update(rows.size(), true);
    std::sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) {
      const Row& x = rows[a];
      const Row& y = rows[b];
      if (int c = x.skeleton.compare(y.skeleton)) return c < 0;
      if (x.created_ms != y.created_ms) return x.created_ms < y.created_ms;
      return less_id(x.legacy_id, y.legacy_id);
    });
    for (std::size_t k = 0; k < order.size(); ++k) {
      Row& r = rows[order[k]];
      bool first = k == 0 || rows[order[k - 1]].skeleton != r.skeleton;
      if (first && !taken_skeletons.count(r.skeleton)) {
        r.action = Row::kept;
        used_names.insert(hash_of(r.canonical));
        used_skeletons.insert(hash_of(r.skeleton));
      } else {
        r.action = Row::renamed;
      }
    }
    std::vector<std::uint32_t>().swap(order);
    taken_skeletons.clear();
    // Suffixed and generated names, unique in name and skeleton.
    std::function<std::pair<std::string, std::string>(const std::string&)> fresh_name_of;
    auto fresh_name = [&](const std::string& base) {
      int failures = 0;
      for (;;) {
        std::string hex = uuid_v7().to_hex();
        std::size_t base_cp = 0; // code points of `base` (UTF-8)
        for (unsigned char ch : base) base_cp += (ch & 0xC0) != 0x80;
        std::size_t room = k_max_name_code_points - 1;
        std::string stem = base;
        std::size_t suffix_len = std::min<std::size_t>(32, room > base_cp ? room - base_cp : 0);
        if (suffix_len < 8) {
          // Shorten the stem to leave 8 hex digits: cut at a code point boundary.
          std::size_t keep_cp = room - 8, cp = 0, cut = 0;
          for (; cut < stem.size(); ++cut) {
            if ((static_cast<unsigned char>(stem[cut]) & 0xC0) != 0x80) {
              if (cp == keep_cp) break;
              ++cp;
            }
          }
          stem.resize(cut);
          while (!stem.empty() && (stem.back() == '-' || stem.back() == '_')) stem.pop_back();
          suffix_len = 8;
        }
        std::string suffix = hex.substr(32 - suffix_len);
        std::string candidate = (stem.empty() ? std::string("agent") : stem) + "-" + suffix;
        auto n = canonicalize(candidate);
        if (!n && n.error().reason == NameReason::mixed_script) {
          // The hex letters are Latin: beside a stem in another script (Cyrillic, Greek, Han…)
          // they make a mixed-script name, which no draw can fix. Digits belong to every script.
          for (char& ch : suffix)
            ch = static_cast<char>('0' + (std::isdigit(static_cast<unsigned char>(ch)) ? ch - '0' : ch - 'a'));
          candidate = (stem.empty() ? std::string("agent") : stem) + "-" + suffix;
          n = canonicalize(candidate);
        }
        if (!n && ++failures > 64 && base != "agent") return fresh_name_of("agent"); // never loop forever
        if (!n || used_names.contains(hash_of(n->canonical_name)) || used_skeletons.contains(hash_of(n->skeleton)))
          continue;
        used_names.insert(hash_of(n->canonical_name));
        used_skeletons.insert(hash_of(n->skeleton));
        return std::make_pair(n->canonical_name, n->skeleton);
      }
    };
    fresh_name_of = fresh_name;
    for (auto& r : rows) {
      if (r.action == Row::renamed)
        std::tie(r.canonical, r.skeleton) = fresh_name(r.canonical);
      else if (r.action == Row::generated)
        std::tie(r.canonical, r.skeleton) = fresh_name("agent");
    }
    // Memory ids: given, mapped by an earlier run or an earlier row, or minted (one per
    // legacy reference).
    for (std::size_t i = 0; i < rows.size(); ++i) {
      Row& r = rows[i];
      if (r.action == Row::done || r.has_memory) continue;
      if (!r.legacy_memory_ref.empty()) {
        auto it = ref_index.find(hash_of(r.legacy_memory_ref));
        if (it != ref_index.end() && rows[it->second].legacy_memory_ref == r.legacy_memory_ref) {
          r.memory_id = rows[it->second].memory_id;
          r.has_memory = true;
          continue;
        }
      }
      if (auto d = db_identity.find(r.legacy_memory_ref); d != db_identity.end() && !r.legacy_memory_ref.empty()) {
        r.memory_id = *Uuid::parse(d->second);
      } else {
        r.memory_id = uuid_v7();
      }
      r.has_memory = true;
      if (!r.legacy_memory_ref.empty())
        ref_index.try_emplace(hash_of(r.legacy_memory_ref), static_cast<std::uint32_t>(i));
    }
    std::unordered_map<std::uint64_t, std::uint32_t>().swap(ref_index);
    std::unordered_map<std::uint64_t, std::uint32_t>().swap(by_id);

    // 4. The report's file is opened before anything is written: a report that cannot be
    //    written stops the run with the database as it was.
    std::FILE* report = nullptr;
    if (!o.report_file.empty())
      report = std::fopen(o.report_file.c_str(), "w");
    else if (o.dry_run && !o.json)
      report = stdout;
    if (!o.report_file.empty() && !report) {
      std::fprintf(stderr, "mep migrate: cannot write %s: %s (nothing was migrated)\n", o.report_file.c_str(),
                   std::strerror(errno));
      return exit_code::other;
    }
    struct CloseReport {
      std::FILE*& f;
      ~CloseReport() {
        if (f && f != stdout) std::fclose(f);
      }
    } close_report{report};

    // 5. Write (run) in batches, resumable; a plan writes nothing.
    std::size_t fresh = 0;
    for (const auto& r : rows) fresh += r.action != Row::done;
    if (!o.dry_run && fresh > 0) {
      if (tenant_id.empty()) tenant_id = db->ensure_tenant(o.tenant);
      if (tenant_id.empty()) throw std::runtime_error("could not create the tenant " + o.tenant);
      db->mark_in_progress();
      Progress prog("migrating", fresh);
      std::size_t written = 0;
      const std::string uv = unicode_version(), iv = icu_version();
      std::vector<const Row*> batch;
      batch.reserve(std::min(o.batch, fresh));
      for (const auto& r : rows) {
        if (r.action == Row::done) continue;
        batch.push_back(&r);
        if (batch.size() == o.batch) {
          db->write(tenant_id, batch, uv, iv); // one transaction
          written += batch.size();
          batch.clear();
          prog.update(written);
        }
      }
      if (!batch.empty()) db->write(tenant_id, batch, uv, iv);
      written += batch.size();
      prog.update(written, true);
    }

    // 6. The report (every legacy row) and the summary.
    std::size_t kept = 0, renamed = 0, generated = 0, resumed = 0;
    for (const auto& r : rows) {
      Row::Action a = r.action;
      if (a == Row::done) {
        ++resumed;
        a = r.done_as;
      }
      if (a == Row::kept)
        ++kept;
      else if (a == Row::renamed)
        ++renamed;
      else
        ++generated;
      if (!report) continue;
      boost::json::object line{{"legacy_id", r.legacy_id},
                               {"display_name", r.display_name},
                               {"canonical_name", r.canonical},
                               {"action", action_name(a)}};
      if (r.reason_code) line["reason"] = r.reason();
      line["memory_instance_id"] = r.memory_id.to_string();
      std::string text = json::dump(line) + "\n";
      std::fwrite(text.data(), 1, text.size(), report);
    }
    boost::json::object summary{{"rows", static_cast<std::int64_t>(rows.size())},
                                {"kept", static_cast<std::int64_t>(kept)},
                                {"renamed", static_cast<std::int64_t>(renamed)},
                                {"generated", static_cast<std::int64_t>(generated)},
                                {"already_migrated", static_cast<std::int64_t>(resumed)},
                                {"written", static_cast<std::int64_t>(o.dry_run ? 0 : fresh)},
                                {"dry_run", o.dry_run}};
    if (o.json)
      std::printf("%s\n", json::dump(summary).c_str());
    else
      std::fprintf(o.dry_run && o.report_file.empty() ? stderr : stdout,
                   "%s: %zu rows: %zu kept, %zu renamed, %zu generated (%zu already migrated, %zu written)\n",
                   o.dry_run ? "plan" : "migrated", rows.size(), kept, renamed, generated, resumed,
                   o.dry_run ? std::size_t{0} : fresh);
    return exit_code::ok;
  } catch (const RunInProgress&) {
    std::fprintf(stderr, "mep migrate: another 'mep migrate run' is writing to this database; nothing was done: "
                         "run again once it has finished (it resumes where that one ended)\n");
    return exit_code::held;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mep migrate: %s\n", e.what());
    return exit_code::other;
  }
}

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

expected<std::size_t, std::string> read_legacy_rows(std::istream& in, const std::string& label) {
  auto rows = read_rows(in, label);
  if (!rows) return make_unexpected(std::move(rows.error()));
  return rows->size();
}

} // namespace mep::server
