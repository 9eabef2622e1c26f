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

#include "mep/canonical.hpp"
#include "mep/json.hpp"
#include "mep/log.hpp"
#include "mep/problem.hpp"
#include "mep/sqlite.hpp"
#include "mep/sqlite_store.hpp"
#include "mep/time.hpp"
#include "mep/uuid.hpp"

#include <boost/json.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <deque>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <unistd.h>
#include <unordered_map>
#include <unordered_set>

namespace mep::server {
namespace {
using sqlite::Db;
using sqlite::Use;
using Clock = std::chrono::steady_clock;

// One legacy row, kept compact (a million of them are held at once): the memory id as
// 16 bytes, created_at as milliseconds (the text only when it does not parse), the
// reason as a small code.
struct Row {
  Row() = default;
  Row(std::string id, std::string name, const std::string& created, std::string ref, const std::string& memory)
      : legacy_id(std::move(id)), display_name(std::move(name)), legacy_memory_ref(std::move(ref)) {
    auto ms = parse_rfc3339(created);
    created_ms = ms.value_or(INT64_MAX);
    if (!ms) created_raw = created;
    if (auto u = Uuid::parse(memory)) {
      memory_id = *u;
      has_memory = true;
    }
    bad_memory = !memory.empty() && !has_memory;
  }
  std::string created_at() const { return created_raw.empty() ? format_rfc3339_ms(created_ms) : created_raw; }
  std::string reason() const { return reason_code ? std::string(to_string(static_cast<NameReason>(reason_code - 1))) : std::string(); }

  std::string legacy_id, display_name, legacy_memory_ref, created_raw;
  std::string canonical, skeleton;
  Uuid memory_id;
  bool has_memory = false;
  bool bad_memory = false;
  std::uint8_t reason_code = 0; ///< NameReason + 1, or 0
  std::int64_t created_ms = 0;
  enum Action : std::uint8_t { kept, renamed, generated, done };
  Action action = kept;
  Action done_as = kept; ///< for rows an earlier run wrote: what it did
};

// Rows live in a deque: no reallocation copies while a million of them are read.
using Rows = std::deque<Row>;

// An open-addressing set of 64-bit hashes (8 bytes a slot): the uniqueness checks of a
// million names in a few MB. A false positive only makes a fresh suffix be drawn again;
// the UNIQUE constraints of migration_rows stay the final word.
class HashSet64 {
public:
  explicit HashSet64(std::size_t expected) { m_slots.assign(std::max<std::size_t>(64, std::bit_ceil(expected * 2 + 1)), 0); }
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
  if (url.rfind("postgres://", 0) == 0 || url.rfind("postgresql://", 0) == 0)
    throw std::runtime_error("mep migrate works on sqlite: databases only (PostgreSQL is not supported yet)");
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

std::vector<std::string> parse_csv_line(const std::string& line, std::istream& in) {
  std::vector<std::string> out;
  std::string field, rest = line;
  bool quoted = false;
  for (std::size_t i = 0;; ++i) {
    if (i == rest.size()) {
      if (quoted) { // a newline inside quotes: continue with the next physical line
        std::string next;
        if (!std::getline(in, next)) break;
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
expected<Rows, std::string> read_rows(std::istream& in, const std::string& path) {
  Rows rows;
  std::string line;
  std::size_t lineno = 0;
  int c = in.peek();
  while (c == ' ' || c == '\n' || c == '\r' || c == '\t') {
    in.get();
    c = in.peek();
  }
  if (c == '{') {
    while (std::getline(in, line)) {
      ++lineno;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      auto o = json::parse_object(line);
      if (!o) return make_unexpected(fmt::format("{}:{}: {}", path, lineno, o.error().detail));
      auto get = [&](std::string_view k) -> std::string {
        auto* v = o->if_contains(k);
        if (!v || v->is_null()) return {};
        if (v->is_string()) return std::string(v->get_string());
        return json::dump(*v);
      };
      Row r{get("legacy_id"), get("display_name"), get("created_at"), get("legacy_memory_ref"), get("memory_instance_id")};
      if (r.legacy_id.empty()) return make_unexpected(fmt::format("{}:{}: legacy_id is missing", path, lineno));
      if (r.bad_memory) return make_unexpected(fmt::format("{}:{}: memory_instance_id is not a UUID", path, lineno));
      rows.push_back(std::move(r));
    }
    return rows;
  }
  if (!std::getline(in, line)) return rows;
  ++lineno;
  auto header = parse_csv_line(line, in);
  std::unordered_map<std::string, std::size_t> col;
  for (std::size_t i = 0; i < header.size(); ++i) col[header[i]] = i;
  for (const char* need : {"legacy_id", "display_name", "created_at", "legacy_memory_ref"})
    if (!col.count(need)) return make_unexpected(fmt::format("{}: the CSV header lacks the column {}", path, need));
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty() || line == "\r") continue;
    auto f = parse_csv_line(line, in);
    auto get = [&](const char* k) -> std::string {
      auto it = col.find(k);
      return it != col.end() && it->second < f.size() ? f[it->second] : std::string();
    };
    Row r{get("legacy_id"), get("display_name"), get("created_at"), get("legacy_memory_ref"), get("memory_instance_id")};
    if (r.legacy_id.empty()) return make_unexpected(fmt::format("{}:{}: legacy_id is missing", path, lineno));
    if (r.bad_memory) return make_unexpected(fmt::format("{}:{}: memory_instance_id is not a UUID", path, lineno));
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
  if (table.empty() || table.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_") !=
                           std::string::npos || std::isdigit(static_cast<unsigned char>(table[0])))
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
      rows.push_back(Row{s->text(0), s->text(1), s->text(2), s->text(3), s->opt_text(4).value_or("")});
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
      std::fprintf(stderr, "mep migrate: %s %zu/%zu rows (%d%%), %.0f rows/s\n", m_what.c_str(), done, m_total, pct, rate);
    }
  }

private:
  std::string m_what;
  std::size_t m_total;
  bool m_tty;
  Clock::time_point m_start = Clock::now();
  Clock::time_point m_last{};
};

const char* action_name(Row::Action a) {
  switch (a) {
  case Row::kept: return "kept";
  case Row::renamed: return "renamed";
  case Row::generated: return "generated";
  case Row::done: return "done";
  }
  return "kept";
}

bool table_exists(Db& db, const char* name) {
  Use s(db.prepare("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?1"));
  s->bind(1, name);
  return s->step();
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
  std::string path = db_path(o.db_url);
  try {
    // Open: a plan never writes (read-only connection, and no schema is created).
    std::unique_ptr<Db> db;
    if (o.dry_run) {
      if (std::filesystem::exists(path)) db = std::make_unique<Db>(path, sqlite::Mode::read_only);
    } else {
      { SqliteStore init(o.db_url); } // creates and migrates the schema
      db = std::make_unique<Db>(path, sqlite::Mode::read_write_create);
      db->exec("PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;");
    }
    bool has_tables = db && table_exists(*db, "migration_rows");

    // 1. Read the legacy rows.
    expected<Rows, std::string> input = o.input_file ? read_file(*o.input_file)
                                                   : db ? read_table(*db, *o.from_table)
                                                        : make_unexpected(std::string("the database does not exist"));
    if (!input) {
      std::fprintf(stderr, "mep migrate: %s\n", input.error().c_str());
      return exit_code::usage;
    }
    Rows& rows = *input;
    // Index by legacy id (hash → row), refusing duplicates.
    std::unordered_map<std::uint64_t, std::uint32_t> by_id;
    by_id.reserve(rows.size());
    for (std::size_t i = 0; i < rows.size(); ++i) {
      auto [it, fresh] = by_id.try_emplace(hash_of(rows[i].legacy_id), static_cast<std::uint32_t>(i));
      if (!fresh && rows[it->second].legacy_id == rows[i].legacy_id) {
        std::fprintf(stderr, "mep migrate: legacy_id %s appears twice in the input\n", rows[i].legacy_id.c_str());
        return exit_code::usage;
      }
    }

    // 2. What earlier runs already wrote (resume), and every name in use.
    HashSet64 used_names(rows.size()), used_skeletons(rows.size());
    std::unordered_set<std::string> taken_skeletons; // exact, from earlier runs
    std::unordered_map<std::uint64_t, std::uint32_t> ref_index; // legacy_memory_ref hash → row
    std::unordered_map<std::string, std::string> db_identity;     // refs mapped by earlier runs
    std::string tenant_id;
    if (db && table_exists(*db, "tenants")) {
      Use s(db->prepare("SELECT tenant_id FROM tenants WHERE name = ?1"));
      s->bind(1, o.tenant);
      if (s->step()) tenant_id = s->text(0);
    }
    if (has_tables) {
      Use s(db->prepare("SELECT legacy_id, canonical_name, skeleton, action, reason, memory_instance_id FROM migration_rows"));
      while (s->step()) {
        std::string id = s->text(0);
        used_names.insert(hash_of(s->text(1)));
        used_skeletons.insert(hash_of(s->text(2)));
        taken_skeletons.insert(s->text(2));
        auto it = by_id.find(hash_of(id));
        if (it == by_id.end() || rows[it->second].legacy_id != id) continue;
        Row& r = rows[it->second];
        r.canonical = s->text(1);
        r.skeleton = s->text(2);
        std::string a = s->text(3);
        r.done_as = a == "renamed" ? Row::renamed : a == "generated" ? Row::generated : Row::kept;
        std::string reason = s->opt_text(4).value_or("");
        r.reason_code = 0;
        for (int k = 0; k <= static_cast<int>(NameReason::invisible_character); ++k)
          if (reason == to_string(static_cast<NameReason>(k))) r.reason_code = static_cast<std::uint8_t>(k + 1);
        r.memory_id = *Uuid::parse(s->text(5));
        r.has_memory = true;
        r.action = Row::done;
      }
      // Only the references of rows still to write matter (a complete re-run loads none).
      HashSet64 pending_refs(rows.size());
      bool any_pending = false;
      for (const auto& r : rows)
        if (r.action != Row::done && !r.legacy_memory_ref.empty()) {
          pending_refs.insert(hash_of(r.legacy_memory_ref));
          any_pending = true;
        }
      if (any_pending) {
        Use m(db->prepare("SELECT legacy_memory_ref, memory_instance_id FROM migration_identity_map WHERE tenant_id = ?1"));
        m->bind(1, tenant_id);
        while (m->step())
          if (pending_refs.contains(hash_of(m->text(0)))) db_identity.emplace(m->text(0), m->text(1));
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
    auto fresh_name = [&](const std::string& base) {
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
        std::string candidate = (stem.empty() ? std::string("agent") : stem) + "-" + hex.substr(32 - suffix_len);
        auto n = canonicalize(candidate);
        if (!n || used_names.contains(hash_of(n->canonical_name)) || used_skeletons.contains(hash_of(n->skeleton)))
          continue;
        used_names.insert(hash_of(n->canonical_name));
        used_skeletons.insert(hash_of(n->skeleton));
        return std::make_pair(n->canonical_name, n->skeleton);
      }
    };
    for (auto& r : rows) {
      if (r.action == Row::renamed) std::tie(r.canonical, r.skeleton) = fresh_name(r.canonical);
      else if (r.action == Row::generated) std::tie(r.canonical, r.skeleton) = fresh_name("agent");
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
      if (!r.legacy_memory_ref.empty()) ref_index.try_emplace(hash_of(r.legacy_memory_ref), static_cast<std::uint32_t>(i));
    }
    std::unordered_map<std::uint64_t, std::uint32_t>().swap(ref_index);
    std::unordered_map<std::uint64_t, std::uint32_t>().swap(by_id);

    // 4. Write (run) in batches, resumable; a plan writes nothing.
    std::size_t fresh = 0;
    for (const auto& r : rows) fresh += r.action != Row::done;
    if (!o.dry_run && fresh > 0) {
      if (tenant_id.empty()) {
        tenant_id = uuid_v7().to_string();
        db->exec("BEGIN IMMEDIATE");
        Use t(db->prepare("INSERT OR IGNORE INTO tenants(tenant_id, name, audit_salt, created_at) VALUES (?1, ?2, ?3, ?4)"));
        t->bind(1, tenant_id).bind(2, o.tenant).bind(3, uuid_v7().to_hex() + uuid_v7().to_hex()).bind(4, now_unix_ms()).run();
        db->exec("COMMIT");
        Use s(db->prepare("SELECT tenant_id FROM tenants WHERE name = ?1"));
        s->bind(1, o.tenant);
        if (s->step()) tenant_id = s->text(0);
      }
      {
        Use s(db->prepare("INSERT INTO settings(key, value) VALUES ('migration_state', 'in-progress') "
                          "ON CONFLICT(key) DO UPDATE SET value = CASE WHEN value = 'active' THEN 'active' ELSE 'in-progress' END"));
        s->run();
      }
      Progress prog("migrating", fresh);
      std::size_t written = 0, in_batch = 0;
      std::string uv = unicode_version(), iv = icu_version();
      db->exec("BEGIN IMMEDIATE");
      for (auto& r : rows) {
        if (r.action == Row::done) continue;
        UnixMs now = now_unix_ms();
        {
          Use s(db->prepare("INSERT INTO migration_rows(legacy_id, tenant_id, display_name, canonical_name, skeleton, action, "
                            "reason, memory_instance_id, legacy_memory_ref, legacy_created_at, migrated_at) "
                            "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)"));
          s->bind(1, r.legacy_id).bind(2, tenant_id).bind(3, r.display_name).bind(4, r.canonical).bind(5, r.skeleton)
              .bind(6, action_name(r.action)).bind(7, r.reason_code ? std::optional<std::string>(r.reason()) : std::nullopt)
              .bind(8, r.memory_id.to_string()).bind(9, r.legacy_memory_ref).bind(10, r.created_at()).bind(11, now).run();
        }
        {
          Use s(db->prepare("INSERT OR IGNORE INTO memories(memory_id, tenant_id, fence_counter, created_at) VALUES (?1, ?2, 0, ?3)"));
          s->bind(1, r.memory_id.to_string()).bind(2, tenant_id).bind(3, now).run();
        }
        if (!r.legacy_memory_ref.empty()) {
          Use s(db->prepare("INSERT OR IGNORE INTO migration_identity_map(tenant_id, legacy_memory_ref, memory_instance_id) "
                            "VALUES (?1, ?2, ?3)"));
          s->bind(1, tenant_id).bind(2, r.legacy_memory_ref).bind(3, r.memory_id.to_string()).run();
        }
        {
          Use s(db->prepare("INSERT INTO agent_names(canonical_name, display_name, skeleton, tenant_id, unicode_version, "
                            "icu_version, first_claimed_at, last_claimed_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7) "
                            "ON CONFLICT(canonical_name) DO NOTHING"));
          s->bind(1, r.canonical).bind(2, r.display_name).bind(3, r.skeleton).bind(4, tenant_id).bind(5, uv).bind(6, iv)
              .bind(7, now).run();
        }
        ++written;
        if (++in_batch == o.batch) {
          db->exec("COMMIT");
          prog.update(written);
          db->exec("BEGIN IMMEDIATE");
          in_batch = 0;
        }
      }
      db->exec("COMMIT");
      prog.update(written, true);
    }

    // 5. The report (every legacy row) and the summary.
    std::size_t kept = 0, renamed = 0, generated = 0, resumed = 0;
    std::FILE* report = nullptr;
    if (!o.report_file.empty()) report = std::fopen(o.report_file.c_str(), "w");
    else if (o.dry_run && !o.json) report = stdout;
    if (!o.report_file.empty() && !report) {
      std::fprintf(stderr, "mep migrate: cannot write %s\n", o.report_file.c_str());
      return exit_code::other;
    }
    for (const auto& r : rows) {
      Row::Action a = r.action;
      if (a == Row::done) {
        ++resumed;
        a = r.done_as;
      }
      if (a == Row::kept) ++kept;
      else if (a == Row::renamed) ++renamed;
      else ++generated;
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
    if (report && report != stdout) std::fclose(report);
    boost::json::object summary{{"rows", static_cast<std::int64_t>(rows.size())},
                                {"kept", static_cast<std::int64_t>(kept)},
                                {"renamed", static_cast<std::int64_t>(renamed)},
                                {"generated", static_cast<std::int64_t>(generated)},
                                {"already_migrated", static_cast<std::int64_t>(resumed)},
                                {"written", static_cast<std::int64_t>(o.dry_run ? 0 : fresh)},
                                {"dry_run", o.dry_run}};
    if (o.json) std::printf("%s\n", json::dump(summary).c_str());
    else
      std::fprintf(o.dry_run && o.report_file.empty() ? stderr : stdout,
                   "%s: %zu rows: %zu kept, %zu renamed, %zu generated (%zu already migrated, %zu written)\n",
                   o.dry_run ? "plan" : "migrated", rows.size(), kept, renamed, generated, resumed,
                   o.dry_run ? std::size_t{0} : fresh);
    return exit_code::ok;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mep migrate: %s\n", e.what());
    return exit_code::other;
  }
}

int migrate_activate(const std::string& db_url, bool json) {
  try {
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
    if (json) std::printf("{\"migration_state\":\"active\"}\n");
    else std::printf("migration activated: lease endpoints are open (servers notice within a second)\n");
    return exit_code::ok;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mep migrate: %s\n", e.what());
    return exit_code::other;
  }
}

int migrate_status(const std::string& db_url, bool json) {
  try {
    std::string path = db_path(db_url);
    if (!std::filesystem::exists(path)) {
      std::fprintf(stderr, "mep migrate: no database at %s\n", path.c_str());
      return exit_code::other;
    }
    Db db(path, sqlite::Mode::read_only);
    std::string state = "none";
    std::int64_t kept = 0, renamed = 0, generated = 0, mapped = 0;
    if (table_exists(db, "settings")) {
      Use s(db.prepare("SELECT value FROM settings WHERE key = 'migration_state'"));
      if (s->step()) state = s->text(0);
    }
    if (table_exists(db, "migration_rows")) {
      Use s(db.prepare("SELECT action, count(*) FROM migration_rows GROUP BY action"));
      while (s->step()) {
        std::string a = s->text(0);
        (a == "kept" ? kept : a == "renamed" ? renamed : generated) = s->int64(1);
      }
      Use m(db.prepare("SELECT count(*) FROM migration_identity_map"));
      if (m->step()) mapped = m->int64(0);
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
                  state.c_str(), state == "in-progress" ? " (lease endpoints answer 503 until 'mep migrate activate')" : "",
                  static_cast<long long>(kept + renamed + generated), static_cast<long long>(kept),
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
