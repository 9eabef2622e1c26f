// A thin RAII layer over the SQLite C API: connections, prepared statements, errors.
#pragma once
#include <sqlite3.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <memory>
#include <unordered_map>

namespace mep::sqlite {

/// A SQLite failure; `code` is the extended result code (SQLITE_BUSY, SQLITE_FULL, …).
class Error : public std::runtime_error {
public:
  Error(int code, const std::string& what) : std::runtime_error(what), m_code(code) {}
  int code() const { return m_code; }

private:
  int m_code;
};

class Db;

/// A prepared statement bound to one connection. Reset after every use by its owner.
class Stmt {
public:
  Stmt(sqlite3* db, std::string_view sql);
  ~Stmt();
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;

  Stmt& bind(int i, std::int64_t v);
  Stmt& bind(int i, std::string_view v);
  Stmt& bind(int i, const std::string& v) { return bind(i, std::string_view(v)); }
  Stmt& bind(int i, const char* v) { return bind(i, std::string_view(v)); }
  Stmt& bind(int i, int v) { return bind(i, static_cast<std::int64_t>(v)); }
  Stmt& bind_blob(int i, const void* p, std::size_t n);
  Stmt& bind_null(int i);
  Stmt& bind(int i, const std::optional<std::string>& v) { return v ? bind(i, std::string_view(*v)) : bind_null(i); }
  Stmt& bind(int i, const std::optional<std::int64_t>& v) { return v ? bind(i, *v) : bind_null(i); }

  /// Steps once: true when a row is available, false when done. Throws Error.
  bool step();
  /// Steps to completion (for statements without rows).
  void run();
  void reset();

  std::int64_t int64(int col) const { return sqlite3_column_int64(m_stmt, col); }
  bool is_null(int col) const { return sqlite3_column_type(m_stmt, col) == SQLITE_NULL; }
  std::string text(int col) const;
  /// The bytes of a BLOB (or TEXT) column; empty for NULL.
  std::string blob(int col) const;
  std::optional<std::string> opt_text(int col) const;
  std::optional<std::int64_t> opt_int64(int col) const;

private:
  sqlite3* m_db;
  sqlite3_stmt* m_stmt = nullptr;
};

/// Resets a statement when the scope ends, so a cached statement is always reusable.
class Use {
public:
  explicit Use(Stmt& s) : m_s(s) {}
  ~Use() { m_s.reset(); }
  Stmt* operator->() { return &m_s; }
  Stmt& operator*() { return m_s; }

private:
  Stmt& m_s;
};

enum class Mode { read_write_create, read_only };

/// One connection with a cache of prepared statements keyed by their SQL text.
class Db {
public:
  Db(const std::string& path, Mode mode);
  ~Db();
  Db(const Db&) = delete;
  Db& operator=(const Db&) = delete;

  /// Runs one or more statements without results.
  void exec(std::string_view sql);
  /// The cached prepared statement for `sql` (prepared on first use).
  Stmt& prepare(std::string_view sql);
  /// Number of rows changed by the last statement.
  int changes() const { return sqlite3_changes(m_db); }
  /// Rows changed by every INSERT, UPDATE and DELETE since the connection opened.
  std::int64_t total_changes() const { return sqlite3_total_changes64(m_db); }
  sqlite3* handle() { return m_db; }

private:
  sqlite3* m_db = nullptr;
  // Looked up by the SQL text without copying it (heterogeneous lookup).
  struct Hash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, std::unique_ptr<Stmt>, Hash, std::equal_to<>> m_cache;
};

/// Runs `fn` between `begin` (BEGIN, BEGIN IMMEDIATE) and COMMIT; on an exception rolls back
/// (best effort) and rethrows.
template <class F>
void in_transaction(Db& db, std::string_view begin, F&& fn) {
  db.exec(begin);
  try {
    fn();
    db.exec("COMMIT");
  } catch (...) {
    try {
      db.exec("ROLLBACK");
    } catch (...) {}
    throw;
  }
}

/// Fault injection for tests (Beast's fail_count): the `n`th Stmt::step from now, on any
/// connection of the process, throws Error(SQLITE_IOERR) without running; 0 disarms it.
namespace fault {
void fail_step(std::int64_t n);
/// Steps left before the injected failure (0: it happened, or none is armed).
std::int64_t left();
} // namespace fault

/// True when `table` has a column named `column`.
bool has_column(Db& db, std::string_view table, std::string_view column);

} // namespace mep::sqlite
