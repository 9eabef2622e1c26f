// Cloud Spanner's REST API (v1), as the Spanner store uses it: sessions, SQL in read-write
// and read-only transactions, commits with mutations, and schema changes (DDL) — JSON over
// the project's libcurl client. Errors are classified by their gRPC code, never by the HTTP
// status (409 is both ABORTED and ALREADY_EXISTS), and the emulator's quirks are known here:
// its NOT_FOUND arrives as HTTP 500 with code 13 ("failed to marshal error message").
#pragma once
#include "mep/expected.hpp"
#include "mep/http/client.hpp"

#include <boost/json/array.hpp>
#include <boost/json/object.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace mep::server::spanner {

/// How a call failed, by gRPC code (google.rpc.Code).
enum class Failure {
  aborted,             // 10: the transaction lost a conflict; run it again
  not_found,           // 5 (or the emulator's 500/13): the session or database is gone
  already_exists,      // 6: a unique index or key taken (at a commit)
  failed_precondition, // 9
  invalid,             // 3, 11: bad SQL, a CHECK failed, an unknown field
  unavailable,         // 14, 8: try again later
  deadline,            // 4: the server gave up; the outcome of a commit is unknown
  unauthenticated,     // 16
  permission,          // 7
  transport,           // no HTTP answer: refused, timed out, cut off (a commit's outcome unknown)
  internal,            // anything else
};

struct RpcError {
  Failure kind = Failure::internal;
  int http_status = 0; ///< 0: no answer
  int grpc_code = 0;
  std::string message;
  std::optional<std::chrono::milliseconds> retry_delay; ///< from RetryInfo, when given

  /// A short text for logs: "ABORTED (409): message".
  std::string describe() const;
};

template <class T>
using Rpc = expected<T, RpcError>;

/// Classifies an HTTP answer that is not a 2xx (or no answer at all).
RpcError classify_error(const http::ClientResponse& res);

/// Where credentials come from: a bearer token for each call, or none (the emulator).
class TokenSource {
public:
  virtual ~TokenSource() = default;
  /// The current access token (refreshed when it nears expiry); nullopt: send none. An
  /// error when no token can be had (unauthenticated).
  virtual Rpc<std::optional<std::string>> token() = 0;
};

/// The HTTP exchange (libcurl's http::Client; a fake in unit tests).
class Transport {
public:
  virtual ~Transport() = default;
  virtual http::ClientResponse perform(const http::ClientRequest& req) = 0;
};

/// Transport over http::Client.
class CurlTransport final : public Transport {
public:
  explicit CurlTransport(std::string ca_file = {}) : m_client(std::move(ca_file)) {}
  http::ClientResponse perform(const http::ClientRequest& req) override { return m_client.perform(req); }

private:
  http::Client m_client;
};

/// One database's REST calls. Thread-safe (each call is one exchange).
class Rest {
public:
  /// `endpoint`: https://spanner.googleapis.com (or the emulator's http://127.0.0.1:PORT);
  /// `database`: projects/P/instances/I/databases/D.
  Rest(std::string endpoint, std::string database, Transport& transport, TokenSource& tokens);

  const std::string& database() const { return m_database; }
  const std::string& endpoint() const { return m_endpoint; }

  Rpc<std::string> create_session();
  Rpc<void> delete_session(const std::string& session);
  /// executeSql: `body` holds sql, params, paramTypes and the transaction selector.
  Rpc<boost::json::object> execute_sql(const std::string& session, const boost::json::object& body,
                                       std::chrono::milliseconds timeout);
  /// read: `body` holds table, columns, keySet and the transaction selector (rows by key:
  /// the emulator looks listed keys up, where a query scans the whole table).
  Rpc<boost::json::object> read(const std::string& session, const boost::json::object& body,
                                std::chrono::milliseconds timeout);
  /// commit: `body` holds transactionId (or singleUseTransaction) and mutations.
  Rpc<boost::json::object> commit(const std::string& session, const boost::json::object& body,
                                  std::chrono::milliseconds timeout);
  Rpc<void> rollback(const std::string& session, const std::string& transaction_id);

  /// The database's DDL statements (getDdl).
  Rpc<std::vector<std::string>> get_ddl();
  /// Applies DDL statements (updateDdl) and waits for the long-running operation.
  Rpc<void> update_ddl(const std::vector<std::string>& statements, std::chrono::seconds timeout);

  /// Any call relative to the endpoint's /v1/ (for admin calls in tools and tests).
  Rpc<boost::json::object> call(std::string_view method, const std::string& path, const boost::json::object* body,
                                std::chrono::milliseconds timeout);

private:
  std::string m_endpoint;
  std::string m_database;
  Transport& m_transport;
  TokenSource& m_tokens;
};

// ---- values as Spanner's JSON carries them ---------------------------------------------------

/// Query parameters with their types (Spanner's `params` and `paramTypes`).
class Params {
public:
  Params& str(const std::string& name, std::string_view v);
  Params& opt_str(const std::string& name, const std::optional<std::string>& v);
  Params& int64(const std::string& name, std::int64_t v);
  Params& opt_int64(const std::string& name, const std::optional<std::int64_t>& v);
  Params& boolean(const std::string& name, bool v);
  /// A TIMESTAMP in Spanner's RFC 3339 form (as its results carry it); nullopt: NULL.
  Params& timestamp(const std::string& name, const std::optional<std::string>& v);
  Params& str_array(const std::string& name, const std::vector<std::string>& v);
  /// Adds `params` and `paramTypes` to an executeSql body.
  void add_to(boost::json::object& body) const;

private:
  boost::json::object m_params;
  boost::json::object m_types;
};

/// A mutation value: INT64 travels as a decimal string, NULL as null.
boost::json::value int64_value(std::int64_t v);
boost::json::value opt_int64_value(const std::optional<std::int64_t>& v);
boost::json::value opt_str_value(const std::optional<std::string>& v);

/// Mutations of a commit.
class Mutations {
public:
  /// insert, update, insertOrUpdate or replace of one row (`values` in `columns` order).
  Mutations& write(std::string_view op, std::string_view table, std::vector<std::string_view> columns,
                   boost::json::array values);
  /// Deletes the rows with these keys (each key: the primary key's values, in order).
  Mutations& remove(std::string_view table, std::vector<boost::json::array> keys);
  bool empty() const { return m_list.empty(); }
  const boost::json::array& list() const { return m_list; }

private:
  boost::json::array m_list;
};

/// One row of a result (a list of values) read by column index.
class Row {
public:
  explicit Row(const boost::json::array& values) : m_v(values) {}
  bool is_null(std::size_t i) const;
  std::string str(std::size_t i) const;
  std::optional<std::string> opt_str(std::size_t i) const;
  std::int64_t int64(std::size_t i) const;
  std::optional<std::int64_t> opt_int64(std::size_t i) const;
  bool boolean(std::size_t i) const;
  /// An ARRAY<STRUCT> column: its rows.
  std::vector<Row> rows(std::size_t i) const;
  /// A TIMESTAMP column, as Spanner wrote it (RFC 3339 with 0-9 fractional digits).
  std::string timestamp(std::size_t i) const { return str(i); }

private:
  const boost::json::array& m_v;
};

/// The rows of an executeSql result.
std::vector<Row> rows_of(const boost::json::object& result);

/// A Spanner TIMESTAMP (RFC 3339, 0-9 fractional digits, Z) as microseconds since the
/// epoch; nullopt when it is not one.
std::optional<std::int64_t> timestamp_micros(std::string_view ts);

} // namespace mep::server::spanner
