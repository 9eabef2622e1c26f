#include "mep/pg.hpp"

#include <charconv>
#include <string_view>

#include <cerrno>
#include <poll.h>

namespace mep::pg {
namespace {

void ignore_notice(void*, const char*) {}

// libpq's messages run over several lines (a hint on the second); logs and the CLI keep
// one line each.
std::string first_line(const char* msg) {
  std::string s = msg ? msg : "";
  s = s.substr(0, s.find('\n'));
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

// The password of a URL as typed, and whatever a misparse may have taken for other parts:
// the text between the first ':' after "//" and the last '@' ("" without one).
std::string password_region(std::string_view url) {
  auto start = url.find("//");
  if (start == std::string_view::npos) return {};
  url.remove_prefix(start + 2);
  auto at = url.rfind('@');
  if (at == std::string_view::npos) return {};
  url = url.substr(0, at);
  auto colon = url.find(':');
  return colon == std::string_view::npos ? std::string() : std::string(url.substr(colon + 1));
}

// libpq quotes the pieces of a URL it could not use, and a password with an unencoded '/',
// '#', '?' or '@' is split into such pieces ("invalid integer value "Top" for connection
// option "port""). A quoted piece that shares three characters with the password, or is
// part of it, becomes "…".
std::string redact(std::string msg, const std::string& secret) {
  if (secret.empty()) return msg;
  auto shares = [&](std::string_view q) {
    if (q.find(secret) != std::string_view::npos) return true; // a password of one or two characters
    if (q.size() < 3) return !q.empty() && secret.find(q) != std::string::npos;
    for (std::size_t i = 0; i + 3 <= q.size(); ++i)
      if (secret.find(q.substr(i, 3)) != std::string::npos) return true;
    return false;
  };
  std::string out;
  std::size_t pos = 0;
  while (true) {
    auto open = msg.find('"', pos);
    auto close = open == std::string::npos ? open : msg.find('"', open + 1);
    if (close == std::string::npos) break;
    out.append(msg, pos, open - pos);
    std::string_view q(msg.data() + open + 1, close - open - 1);
    out += shares(q) ? std::string("\"…\"") : "\"" + std::string(q) + "\"";
    pos = close + 1;
  }
  out.append(msg, pos);
  return out;
}

} // namespace

std::int64_t Result::int64(int row, int col) const {
  const char* v = PQgetvalue(m_r, row, col);
  std::int64_t out = 0;
  auto len = static_cast<std::size_t>(PQgetlength(m_r, row, col));
  auto [p, ec] = std::from_chars(v, v + len, out);
  if (ec != std::errc() || p != v + len) throw Error("not an integer in a result column", "", false);
  return out;
}

std::int64_t Result::affected() const {
  const char* n = m_r ? PQcmdTuples(m_r) : "";
  std::int64_t out = 0;
  std::from_chars(n, n + std::char_traits<char>::length(n), out);
  return out;
}

Conn::Conn(const std::string& url, const std::vector<std::string>& set_commands) {
  // Our defaults first; the URL last, so that what it says wins (expand_dbname).
  const char* keys[] = {"connect_timeout",
                        "application_name",
                        "keepalives",
                        "keepalives_idle",
                        "keepalives_interval",
                        "keepalives_count",
                        "tcp_user_timeout",
                        "dbname",
                        nullptr};
  const char* values[] = {"3", "mep-server", "1", "5", "2", "3", "10000", url.c_str(), nullptr};
  // A URL libpq cannot parse is refused without its words: they quote the URL.
  char* parse_error = nullptr;
  if (PQconninfoOption* parsed = PQconninfoParse(url.c_str(), &parse_error)) {
    PQconninfoFree(parsed);
  } else {
    if (parse_error) PQfreemem(parse_error);
    throw Error("cannot parse the PostgreSQL URL (are special characters in the password percent-encoded?)", "", false);
  }
  m_c = PQconnectdbParams(keys, values, 1);
  if (!m_c) throw Error("out of memory connecting to PostgreSQL", "", true);
  if (PQstatus(m_c) != CONNECTION_OK) {
    std::string msg = "cannot connect to PostgreSQL: " + redact(first_line(PQerrorMessage(m_c)), password_region(url));
    PQfinish(m_c);
    m_c = nullptr;
    throw Error(msg, "", true);
  }
  PQsetNoticeProcessor(m_c, ignore_notice, nullptr);
  for (const auto& s : set_commands) exec(s);
}

bool Conn::usable() {
  if (!ok()) return false;
  pollfd p{PQsocket(m_c), POLLIN, 0};
  if (p.fd < 0) return false;
  int n = ::poll(&p, 1, 0);
  if (n == 0) return true;                         // nothing to read: as we left it
  if (n < 0 || !PQconsumeInput(m_c)) return false; // EOF or an error on the socket
  return false;                                    // unsolicited input on an idle connection
}

Conn::~Conn() {
  if (m_c) PQfinish(m_c);
}

Result Conn::check(PGresult* r, std::string_view what) {
  if (!r) throw Error(std::string(what) + ": " + first_line(PQerrorMessage(m_c)), "", true);
  auto st = PQresultStatus(r);
  if (st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK || st == PGRES_EMPTY_QUERY) return Result(r);
  const char* state = PQresultErrorField(r, PG_DIAG_SQLSTATE);
  std::string msg = std::string(what) + ": " + first_line(PQresultErrorMessage(r));
  std::string sqlstate = state ? state : "";
  PQclear(r);
  // Class 08 (connection exception), 57P01-57P03 (admin shutdown, crash shutdown, cannot
  // connect now) and a dead socket all mean: this connection is done.
  bool lost =
      !ok() || sqlstate.rfind("08", 0) == 0 || sqlstate == "57P01" || sqlstate == "57P02" || sqlstate == "57P03";
  throw Error(msg, sqlstate, lost);
}

PGresult* Conn::await(std::string_view what) {
  auto deadline = std::chrono::steady_clock::now() + m_timeout;
  PGresult* keep = nullptr; // the first error, else the last result
  auto give_up = [&](const std::string& why, bool timed_out) -> PGresult* {
    if (keep) PQclear(keep);
    m_broken = true; // the protocol state is unknown: this connection is done
    throw Error(std::string(what) + ": " + why, "", true, timed_out);
  };
  for (;;) {
    while (PQisBusy(m_c)) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0)
        return give_up("no answer from PostgreSQL within " + std::to_string(m_timeout.count()) + " ms", true);
      pollfd p{PQsocket(m_c), POLLIN, 0};
      int n = ::poll(&p, 1, static_cast<int>(std::min<long long>(left.count(), 1000)));
      if (n < 0 && errno != EINTR) return give_up("poll failed", false);
      if (n > 0 && !PQconsumeInput(m_c)) return give_up(first_line(PQerrorMessage(m_c)), false);
    }
    PGresult* r = PQgetResult(m_c);
    if (!r) break;
    if (!keep) {
      keep = r;
    } else if (PQresultStatus(keep) == PGRES_FATAL_ERROR) {
      PQclear(r); // the first error is the one to report
    } else {
      PQclear(keep);
      keep = r;
    }
  }
  return keep; // null: the connection broke (check() reports it)
}

Result Conn::exec(const std::string& sql) {
  if (!PQsendQuery(m_c, sql.c_str())) return check(nullptr, "query failed");
  return check(await("query failed"), "query failed");
}

Result Conn::exec(const std::string& name, const std::string& sql, const std::vector<Param>& params) {
  std::vector<const char*> values;
  values.reserve(params.size());
  for (const auto& p : params) {
    // libpq takes text parameters as C strings: a NUL would cut the value short and send
    // another one. PostgreSQL text cannot hold NUL, so the value is refused as the server
    // would refuse it (character_not_in_repertoire), before anything is sent.
    if (p && p->find('\0') != std::string::npos)
      throw Error("a text parameter contains a NUL character", "22021", false);
    values.push_back(p ? p->c_str() : nullptr);
  }
  int n = static_cast<int>(values.size());
  if (name.empty()) {
    if (!PQsendQueryParams(m_c, sql.c_str(), n, nullptr, values.data(), nullptr, nullptr, 0))
      return check(nullptr, "query failed");
    return check(await("query failed"), "query failed");
  }
  if (!m_prepared.count(name)) {
    if (!PQsendPrepare(m_c, name.c_str(), sql.c_str(), n, nullptr)) return check(nullptr, "prepare failed");
    check(await("prepare failed"), "prepare failed");
    m_prepared.insert(name);
  }
  if (!PQsendQueryPrepared(m_c, name.c_str(), n, values.data(), nullptr, nullptr, 0))
    return check(nullptr, "query failed");
  return check(await("query failed"), "query failed");
}

namespace {
void quoted(std::string& out, const std::string& item) {
  out += '"';
  for (char ch : item) {
    if (ch == '"' || ch == '\\') out += '\\';
    out += ch;
  }
  out += '"';
}
} // namespace

std::string text_array(const std::vector<std::string>& items) {
  std::string out = "{";
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (i) out += ',';
    quoted(out, items[i]);
  }
  out += '}';
  return out;
}

std::string param_array(const std::vector<Param>& items) {
  std::string out = "{";
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (i) out += ',';
    if (items[i])
      quoted(out, *items[i]);
    else
      out += "NULL";
  }
  out += '}';
  return out;
}

std::string int_array(const std::vector<std::int64_t>& items) {
  std::string out = "{";
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(items[i]);
  }
  out += '}';
  return out;
}

bool is_pg_url(std::string_view url) { return url.rfind("postgres://", 0) == 0 || url.rfind("postgresql://", 0) == 0; }

} // namespace mep::pg
