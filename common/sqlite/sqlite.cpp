// SQLite RAII wrappers.
#include "mep/sqlite.hpp"

#include <atomic>
#include <memory>

namespace mep::sqlite {
namespace {
std::atomic<std::int64_t> g_fail_countdown{0}; // see fault::fail_step
[[noreturn]] void fail(sqlite3* db, int rc, std::string_view what) {
  std::string msg(what);
  msg += ": ";
  msg += db ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
  throw Error(db ? sqlite3_extended_errcode(db) : rc, msg);
}
} // namespace

Stmt::Stmt(sqlite3* db, std::string_view sql) : m_db(db) {
  int rc =
      sqlite3_prepare_v3(db, sql.data(), static_cast<int>(sql.size()), SQLITE_PREPARE_PERSISTENT, &m_stmt, nullptr);
  if (rc != SQLITE_OK) fail(db, rc, "prepare");
}

Stmt::~Stmt() { sqlite3_finalize(m_stmt); }

Stmt& Stmt::bind(int i, std::int64_t v) {
  if (int rc = sqlite3_bind_int64(m_stmt, i, v); rc != SQLITE_OK) fail(m_db, rc, "bind");
  return *this;
}

Stmt& Stmt::bind(int i, std::string_view v) {
  if (int rc = sqlite3_bind_text(m_stmt, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT); rc != SQLITE_OK)
    fail(m_db, rc, "bind");
  return *this;
}

Stmt& Stmt::bind_blob(int i, const void* p, std::size_t n) {
  if (int rc = sqlite3_bind_blob(m_stmt, i, p, static_cast<int>(n), SQLITE_TRANSIENT); rc != SQLITE_OK)
    fail(m_db, rc, "bind");
  return *this;
}

Stmt& Stmt::bind_null(int i) {
  if (int rc = sqlite3_bind_null(m_stmt, i); rc != SQLITE_OK) fail(m_db, rc, "bind");
  return *this;
}

bool Stmt::step() {
  if (g_fail_countdown.load(std::memory_order_relaxed) > 0 && g_fail_countdown.fetch_sub(1) == 1)
    throw Error(SQLITE_IOERR, "step: disk I/O error (injected by a test)");
  int rc = sqlite3_step(m_stmt);
  if (rc == SQLITE_ROW) return true;
  if (rc == SQLITE_DONE) return false;
  fail(m_db, rc, "step");
}

void Stmt::run() {
  while (step()) {}
}

void Stmt::reset() {
  sqlite3_reset(m_stmt);
  sqlite3_clear_bindings(m_stmt);
}

std::string Stmt::text(int col) const {
  const auto* p = reinterpret_cast<const char*>(sqlite3_column_text(m_stmt, col));
  return p ? std::string(p, static_cast<std::size_t>(sqlite3_column_bytes(m_stmt, col))) : std::string();
}

std::string Stmt::blob(int col) const {
  const auto* p = static_cast<const char*>(sqlite3_column_blob(m_stmt, col));
  return p ? std::string(p, static_cast<std::size_t>(sqlite3_column_bytes(m_stmt, col))) : std::string();
}

std::optional<std::string> Stmt::opt_text(int col) const {
  if (is_null(col)) return std::nullopt;
  return text(col);
}

std::optional<std::int64_t> Stmt::opt_int64(int col) const {
  if (is_null(col)) return std::nullopt;
  return int64(col);
}

Db::Db(const std::string& path, Mode mode) {
  // No allocation statistics (nothing reads sqlite3_memory_used): with them on, every
  // allocation SQLite makes takes one process-wide mutex, ~4 % of the writer thread's
  // time. Only possible before SQLite initializes, so the first connection does it.
  static const bool configured = [] {
    sqlite3_config(SQLITE_CONFIG_MEMSTATUS, 0);
    return true;
  }();
  (void)configured;
  int flags = SQLITE_OPEN_NOMUTEX |
              (mode == Mode::read_only ? SQLITE_OPEN_READONLY : SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE);
  int rc = sqlite3_open_v2(path.c_str(), &m_db, flags, nullptr);
  if (rc != SQLITE_OK) {
    std::string msg = m_db ? sqlite3_errmsg(m_db) : sqlite3_errstr(rc);
    int code = m_db ? sqlite3_extended_errcode(m_db) : rc;
    sqlite3_close(m_db);
    m_db = nullptr;
    throw Error(code, "cannot open database: " + msg);
  }
  sqlite3_extended_result_codes(m_db, 1);
  sqlite3_busy_timeout(m_db, 5000);
}

Db::~Db() {
  m_cache.clear();
  sqlite3_close(m_db);
}

void Db::exec(std::string_view sql) {
  std::string s(sql);
  char* err = nullptr;
  int rc = sqlite3_exec(m_db, s.c_str(), nullptr, nullptr, &err);
  if (rc != SQLITE_OK) {
    std::string msg = err ? err : sqlite3_errstr(rc);
    sqlite3_free(err);
    throw Error(sqlite3_extended_errcode(m_db), msg);
  }
}

Stmt& Db::prepare(std::string_view sql) {
  auto it = m_cache.find(sql);
  if (it != m_cache.end()) return *it->second;
  auto stmt = std::make_unique<Stmt>(m_db, sql);
  auto& ref = *stmt;
  m_cache.emplace(std::string(sql), std::move(stmt));
  return ref;
}

void fault::fail_step(std::int64_t n) { g_fail_countdown.store(n); }
std::int64_t fault::left() { return g_fail_countdown.load(); }

bool has_column(Db& db, std::string_view table, std::string_view column) {
  Use q(db.prepare("SELECT count(*) FROM pragma_table_info(?1) WHERE name = ?2"));
  q->bind(1, table).bind(2, column);
  return q->step() && q->int64(0) > 0;
}

} // namespace mep::sqlite
