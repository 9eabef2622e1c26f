// mep migrate's input: the legacy rows, read from a CSV export or from a table of a SQLite
// database (--from-table), strictly: a malformed row stops the run before anything is written.
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
namespace migration {

using sqlite::Db;
using sqlite::Use;

// A quoted field still open at the end of the file: it would swallow the rows after it.
struct CsvUnterminated {};

// One record, from `line` and, while a quoted field holds newlines, the lines after it
// (counted in `lineno`).
static std::vector<std::string> parse_csv_line(const std::string& line, std::istream& in, std::size_t& lineno) {
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
static expected<Rows, std::string> read_csv_records(const std::string& path, std::istream& in, std::string& line,
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

static expected<Rows, std::string> read_csv_records(const std::string& path, std::istream& in, std::string& line,
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

} // namespace migration

expected<std::size_t, std::string> read_legacy_rows(std::istream& in, const std::string& label) {
  auto rows = migration::read_rows(in, label);
  if (!rows) return make_unexpected(std::move(rows.error()));
  return rows->size();
}

} // namespace mep::server
