// A thin RAII layer over libpq: one connection, results that free themselves, errors that
// carry their SQLSTATE and say whether the connection was lost. Blocking calls only; the
// PostgreSQL store gives each of its threads its own connection.
#pragma once
#include <libpq-fe.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace mep::pg {

/// A failed call. `sqlstate` is empty when the server sent none (connection trouble).
class Error : public std::runtime_error {
public:
  Error(const std::string& what, std::string sqlstate, bool connection_lost, bool timed_out = false)
      : std::runtime_error(what), m_sqlstate(std::move(sqlstate)), m_lost(connection_lost), m_timed_out(timed_out) {}
  const std::string& sqlstate() const { return m_sqlstate; }
  /// The connection is unusable; the outcome of the call is unknown.
  bool connection_lost() const { return m_lost; }
  /// 40001 serialization_failure or 40P01 deadlock_detected: rolled back, safe to retry.
  bool retryable() const { return m_sqlstate == "40001" || m_sqlstate == "40P01"; }
  /// No answer within the connection's timeout (the connection was given up).
  bool timed_out() const { return m_timed_out; }

private:
  std::string m_sqlstate;
  bool m_lost;
  bool m_timed_out;
};

/// A query result (owns the PGresult).
class Result {
public:
  Result() = default;
  explicit Result(PGresult* r) : m_r(r) {}
  Result(Result&& o) noexcept : m_r(o.m_r) { o.m_r = nullptr; }
  Result& operator=(Result&& o) noexcept {
    if (this != &o) {
      if (m_r) PQclear(m_r);
      m_r = o.m_r;
      o.m_r = nullptr;
    }
    return *this;
  }
  Result(const Result&) = delete;
  Result& operator=(const Result&) = delete;
  ~Result() {
    if (m_r) PQclear(m_r);
  }

  int rows() const { return m_r ? PQntuples(m_r) : 0; }
  bool is_null(int row, int col) const { return PQgetisnull(m_r, row, col) != 0; }
  std::string text(int row, int col) const {
    return std::string(PQgetvalue(m_r, row, col), static_cast<std::size_t>(PQgetlength(m_r, row, col)));
  }
  std::optional<std::string> opt_text(int row, int col) const {
    if (is_null(row, col)) return std::nullopt;
    return text(row, col);
  }
  std::int64_t int64(int row, int col) const;
  std::optional<std::int64_t> opt_int64(int row, int col) const {
    if (is_null(row, col)) return std::nullopt;
    return int64(row, col);
  }
  /// Rows affected by INSERT/UPDATE/DELETE.
  std::int64_t affected() const;

private:
  PGresult* m_r = nullptr;
};

/// A query parameter in text format; nullopt is SQL NULL.
using Param = std::optional<std::string>;

/// One libpq connection.
class Conn {
public:
  /// Connects to `url` (a postgresql:// URL or a conninfo string). Throws Error.
  /// `options` are extra "key=value" settings applied with SET after connecting.
  explicit Conn(const std::string& url, const std::vector<std::string>& set_commands = {});
  ~Conn();
  Conn(const Conn&) = delete;
  Conn& operator=(const Conn&) = delete;

  bool ok() const { return !m_broken && PQstatus(m_c) == CONNECTION_OK; }
  /// The libpq connection, for LISTEN (PQsocket, PQconsumeInput, PQnotifies).
  PGconn* raw() { return m_c; }
  /// How long a call may wait for its answer; beyond it the connection is given up and the
  /// call fails with Error::timed_out(). A database that stops answering (a frozen process,
  /// a partition that drops packets) then costs a request this long, not forever.
  void set_timeout(std::chrono::milliseconds t) { m_timeout = t; }
  std::chrono::milliseconds timeout() const { return m_timeout; }
  /// For a connection that sat idle: false when it is broken or the server has spoken
  /// since (an idle connection only hears a goodbye, e.g. FATAL 57P01 on shutdown). Checked
  /// before sending, so a request never goes out on a connection known to be dead.
  bool usable();

  /// Runs one or more statements without parameters (simple query protocol).
  Result exec(const std::string& sql);
  /// Runs `sql` with parameters; prepared once per connection under `name` when `name` is
  /// not empty. A parameter holding a NUL throws Error 22021 and sends nothing.
  Result exec(const std::string& name, const std::string& sql, const std::vector<Param>& params);

private:
  Result check(PGresult* r, std::string_view what);
  /// Collects the answer to what was just sent (PQsend*), waiting at most m_timeout.
  PGresult* await(std::string_view what);

  PGconn* m_c = nullptr;
  bool m_broken = false;
  std::chrono::milliseconds m_timeout{15000};
  std::set<std::string> m_prepared;
};

/// A PostgreSQL array literal of texts ({"a","b\"c"}), for a text[] parameter.
std::string text_array(const std::vector<std::string>& items);
/// A PostgreSQL array literal of parameters, NULL for an absent one ({"a",NULL}): any
/// element type that reads from text (text[], bigint[], boolean[]).
std::string param_array(const std::vector<Param>& items);
/// A PostgreSQL array literal of integers ({1,2,3}).
std::string int_array(const std::vector<std::int64_t>& items);

/// True when `url` names a PostgreSQL database (postgres:// or postgresql://).
bool is_pg_url(std::string_view url);

} // namespace mep::pg
