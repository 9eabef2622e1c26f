// What mep migrate's phases share with the databases it writes to: the legacy rows, what
// an earlier run wrote, and the Target interface each backend implements (SQLite and
// PostgreSQL in migrate_targets.cpp, Cloud Spanner in spanner/migrate_target.cpp).
#pragma once
#include "mep/canonical.hpp"
#include "mep/expected.hpp"
#include "mep/time.hpp"
#include "mep/uuid.hpp"

#include <cstdint>
#include <iosfwd>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mep::sqlite {
class Db;
}

namespace mep::server::migration {

// A legacy row's created_at: RFC 3339, with "T" or (as its section 5.6 allows) a space
// between date and time. `zoneless_is_utc`: SQLite's own text form, "2021-03-04 05:06:07",
// which its date functions write in UTC, read from a --from-table of a SQLite database.
inline std::optional<UnixMs> parse_legacy_time(std::string_view text, bool zoneless_is_utc) {
  if (text.size() < 19 || (text[10] != ' ' && text[10] != 'T' && text[10] != 't')) return std::nullopt;
  std::string t(text);
  t[10] = 'T';
  if (zoneless_is_utc && t.find_first_of("Zz+-", 19) == std::string::npos) t += 'Z';
  return parse_rfc3339(t);
}

// One legacy row, kept compact (a million of them are held at once): the memory id as
// 16 bytes, created_at as milliseconds, the reason as a small code.
struct Row {
  Row() = default;
  Row(std::string id, std::string name, const std::string& created, std::string ref, const std::string& memory,
      bool zoneless_is_utc = false)
      : legacy_id(std::move(id)), display_name(std::move(name)), legacy_memory_ref(std::move(ref)) {
    auto ms = parse_legacy_time(created, zoneless_is_utc);
    created_ms = ms.value_or(0);
    bad_created = !ms;
    no_created = created.empty();
    if (auto u = Uuid::parse(memory)) {
      memory_id = *u;
      has_memory = true;
      nil_memory = memory_id.is_nil();
    }
    bad_memory = !memory.empty() && !has_memory;
  }
  // Why the row cannot be migrated, or nothing. Every field but memory_instance_id is
  // required: the oldest created_at decides who keeps a name, so a time that does not
  // parse cannot be guessed at; an empty display_name is a name that cannot be
  // canonicalized (it is given a generated one, as the report says).
  std::optional<std::string> problem() const {
    if (legacy_id.empty()) return "legacy_id is missing";
    if (no_created) return "created_at is missing";
    if (bad_created) return "created_at is not an RFC 3339 time such as 2021-03-04T05:06:07Z";
    if (bad_memory) return "memory_instance_id is not a UUID";
    if (nil_memory) return "memory_instance_id is the nil UUID";
    return std::nullopt;
  }
  std::string created_at() const { return format_rfc3339_ms(created_ms); }
  std::string reason() const {
    return reason_code ? std::string(to_string(static_cast<NameReason>(reason_code - 1))) : std::string();
  }

  std::string legacy_id, display_name, legacy_memory_ref;
  std::string canonical, skeleton;
  Uuid memory_id;
  bool has_memory = false;
  bool bad_memory = false;
  bool nil_memory = false;
  bool bad_created = false;
  bool no_created = false;
  std::uint32_t line = 0;       ///< where a file gave it (0: a table)
  std::uint8_t reason_code = 0; ///< NameReason + 1, or 0
  std::int64_t created_ms = 0;
  enum Action : std::uint8_t { kept, renamed, generated, done };
  Action action = kept;
  Action done_as = kept; ///< for rows an earlier run wrote: what it did
};

// Rows live in a deque: no reallocation copies while a million of them are read.
using Rows = std::deque<Row>;

// A row an earlier run wrote (resumption).
struct Migrated {
  std::string legacy_id, canonical, skeleton, action, reason, memory_id;
};

// Thrown when another `mep migrate run` is writing to the same database: two runs would read
// the same resume state, then collide on each other's rows. So open_target takes a lock that
// a run holds until its process ends (a crash lets it go), before the schema is touched or
// anything is read: PostgreSQL's advisory lock of this key ("mep-migr" in ASCII), or
// DB_PATH-migrate.lock on SQLite, a lock row with an expiry on Spanner.
struct RunInProgress {};

// What the migration needs of a control-plane database. Each write() is one transaction of
// a batch (on Spanner, of up to k_spanner_batch rows of it); nothing else holds a lock while
// the servers answer 503 migration-in-progress.
class Target {
public:
  virtual ~Target() = default;
  /// The migration's tables exist (a database the schema was created in).
  virtual bool has_tables() = 0;
  virtual expected<Rows, std::string> read_table(const std::string& table) = 0;
  /// The tenant's id, or empty when there is no such tenant (yet).
  virtual std::string tenant_id(const std::string& name) = 0;
  /// The rows earlier runs wrote.
  virtual void each_migrated(const std::function<void(Migrated&&)>& f) = 0;
  /// The names of agent_names (canonical, skeleton) that no migrated row has: those claimed
  /// through a server (each_migrated gives the others).
  virtual void each_name(const std::function<void(std::string, std::string)>& f) = 0;
  virtual void each_identity(const std::string& tenant_id, const std::function<void(std::string, std::string)>& f) = 0;
  virtual std::string ensure_tenant(const std::string& name) = 0;
  /// settings.migration_state: in-progress (unless already active).
  virtual void mark_in_progress() = 0;
  virtual void write(const std::string& tenant_id, const std::vector<const Row*>& batch, const std::string& unicode,
                     const std::string& icu) = 0;
};

/// A migration target that also answers `mep migrate status` and `activate`.
class StatusTarget : public Target {
public:
  /// settings.migration_state ("none" when unset).
  virtual std::string state() = 0;
  /// Sets settings.migration_state to active.
  virtual void activate() = 0;
  /// Rows of migration_rows by action, and the identity map's entries.
  virtual std::vector<std::pair<std::string, std::int64_t>> action_counts() = 0;
  virtual std::int64_t identity_entries() = 0;
};

/// The database of a spanner: URL. `create`: create or migrate the schema first (a run);
/// without it (a plan, status) nothing is written, and a database without mep's schema
/// gives null. Throws std::runtime_error with a readable message, RunInProgress when
/// another run holds the database (only with `create`).
std::unique_ptr<StatusTarget> open_spanner_target(const std::string& url, bool create);

const char* action_name(Row::Action a);

// ---- migrate_input.cpp: the legacy rows, from a CSV file or a table -------------------------

/// The rows of a CSV export (`path` names it in messages).
expected<Rows, std::string> read_rows(std::istream& in, const std::string& path);
expected<Rows, std::string> read_file(const std::string& path);
/// The rows of a table of legacy rows in a SQLite database (--from-table).
expected<Rows, std::string> read_table(sqlite::Db& db, const std::string& table);

// ---- migrate_targets.cpp: the databases a migration writes to ---------------------------------

bool is_spanner(const std::string& url);
bool is_postgres(const std::string& url);
/// The file of a sqlite: URL (or a plain path).
std::string db_path(const std::string& url);
bool table_exists(sqlite::Db& db, const char* name);
/// The database of `url`, its schema created first unless `dry_run` (a plan writes nothing);
/// null for a plan on a SQLite file that does not exist. Throws RunInProgress (see above).
std::unique_ptr<Target> open_target(const std::string& url, bool dry_run);

} // namespace mep::server::migration
