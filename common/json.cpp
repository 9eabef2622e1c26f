// Strict JSON parsing and request-object reading.
#include "mep/json.hpp"

#include "mep/uuid.hpp"

#include <boost/json/basic_parser_impl.hpp>
#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

namespace mep::json {
namespace {

// Finds a key that one object names twice. RFC 8259 leaves duplicates to the reader and
// readers disagree (Boost.JSON keeps the last, others the first), so a proxy or log may see
// another request than the server does: they are refused, as I-JSON (RFC 7493) requires.
// Keys are compared unescaped ("a" and "\u0061" are one key).
struct DuplicateKeyFinder {
  static constexpr std::size_t max_array_size = static_cast<std::size_t>(-1);
  static constexpr std::size_t max_object_size = static_cast<std::size_t>(-1);
  static constexpr std::size_t max_string_size = static_cast<std::size_t>(-1);
  static constexpr std::size_t max_key_size = static_cast<std::size_t>(-1);
  using ec_t = boost::system::error_code;
  using sv = boost::json::string_view;

  std::vector<std::vector<std::string>> objects; // the keys of each open object
  std::string key;                               // the key being read
  std::optional<std::string> duplicate;
  bool too_large = false;

  bool on_document_begin(ec_t&) { return true; }
  bool on_document_end(ec_t&) { return true; }
  bool on_array_begin(ec_t&) { return true; }
  bool on_array_end(std::size_t, ec_t&) { return true; }
  bool on_object_begin(ec_t&) {
    objects.emplace_back();
    return true;
  }
  bool on_object_end(std::size_t, ec_t&) {
    objects.pop_back();
    return true;
  }
  bool on_key_part(sv s, std::size_t, ec_t&) {
    key.append(s.data(), s.size());
    return true;
  }
  bool on_key(sv s, std::size_t, ec_t& ec) {
    key.append(s.data(), s.size());
    auto& keys = objects.back();
    if (std::find(keys.begin(), keys.end(), key) != keys.end()) {
      duplicate = std::move(key);
      ec = boost::json::error::syntax;
      return false;
    }
    keys.push_back(std::move(key));
    key.clear();
    return true;
  }
  bool on_string_part(sv, std::size_t, ec_t&) { return true; }
  bool on_string(sv, std::size_t, ec_t&) { return true; }
  bool on_number_part(sv, ec_t&) { return true; }
  bool on_int64(std::int64_t, sv, ec_t&) { return true; }
  bool on_uint64(std::uint64_t, sv, ec_t&) { return true; }
  // A number beyond a double's range reads as infinity, which JSON cannot write back: refused,
  // as I-JSON (RFC 7493 §2.2) expects. Found by tests/fuzz/fuzz_json.cpp.
  bool on_double(double d, sv, ec_t& ec) {
    if (std::isfinite(d)) return true;
    too_large = true;
    ec = boost::json::error::syntax;
    return false;
  }
  bool on_bool(bool, ec_t&) { return true; }
  bool on_null(ec_t&) { return true; }
  bool on_comment_part(sv, ec_t&) { return true; }
  bool on_comment(sv, ec_t&) { return true; }
};

} // namespace

expected<boost::json::object, Problem> parse_object(std::string_view text, std::string_view what) {
  boost::json::parse_options opts;
  opts.max_depth = 32;
  boost::system::error_code ec;
  {
    boost::json::basic_parser<DuplicateKeyFinder> finder(opts);
    finder.write_some(false, text.data(), text.size(), ec);
    if (const auto& dup = finder.handler().duplicate)
      return make_unexpected(
          Problem(Code::invalid_request, "field \"" + dup->substr(0, 64) + "\" appears twice in one object"));
    if (finder.handler().too_large)
      return make_unexpected(Problem(Code::invalid_request, "a number is too large for a 64-bit floating-point value"));
    ec.clear(); // any other error is reported by the parse below, in its words
  }
  boost::json::value v = boost::json::parse(text, ec, {}, opts);
  if (ec) return make_unexpected(Problem(Code::invalid_request, "malformed JSON: " + ec.message()));
  if (!v.is_object())
    return make_unexpected(Problem(Code::invalid_request, std::string(what) + " must be a JSON object"));
  return std::move(v.get_object());
}

namespace {
bool valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  for (std::size_t i = 0; i < n;) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 ? 2 : 0;
    if (len == 0 || c > 0xF4 || i + len > n) return false;
    for (std::size_t k = 1; k < len; ++k)
      if ((p[i + k] & 0xC0) != 0x80) return false;
    if (len == 3) {
      const unsigned v = (c & 0x0Fu) << 12 | (p[i + 1] & 0x3Fu) << 6 | (p[i + 2] & 0x3Fu);
      if (v < 0x800 || (v >= 0xD800 && v <= 0xDFFF)) return false;
    } else if (len == 4) {
      const unsigned v = (c & 0x07u) << 18 | (p[i + 1] & 0x3Fu) << 12 | (p[i + 2] & 0x3Fu) << 6 | (p[i + 3] & 0x3Fu);
      if (v < 0x10000 || v > 0x10FFFF) return false;
    }
    i += len;
  }
  return true;
}

void dump_repaired(const boost::json::value& v, std::string& out) {
  if (v.is_object()) {
    out.push_back('{');
    bool first = true;
    for (const auto& kv : v.get_object()) {
      if (!first) out.push_back(',');
      first = false;
      append_string(out, kv.key());
      out.push_back(':');
      dump_repaired(kv.value(), out);
    }
    out.push_back('}');
  } else if (v.is_array()) {
    out.push_back('[');
    bool first = true;
    for (const auto& e : v.get_array()) {
      if (!first) out.push_back(',');
      first = false;
      dump_repaired(e, out);
    }
    out.push_back(']');
  } else if (v.is_string()) {
    append_string(out, v.get_string());
  } else {
    out += boost::json::serialize(v);
  }
}
} // namespace

std::string dump(const boost::json::value& v) {
  // Strings may hold bytes from a query string, a header or a path that are not UTF-8
  // (a problem's detail quotes them); Boost.JSON would copy them as they are, and the
  // result would not be JSON. Found by tests/fuzz/fuzz_http_request.cpp.
  std::string out = boost::json::serialize(v);
  if (valid_utf8(out)) return out;
  out.clear();
  dump_repaired(v, out);
  return out;
}

void append_string(std::string& out, std::string_view s) {
  static constexpr char hex[] = "0123456789abcdef";
  out.push_back('"');
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  for (std::size_t i = 0; i < n;) {
    unsigned char c = p[i];
    if (c >= 0x20 && c < 0x80 && c != '"' && c != '\\') {
      out.push_back(static_cast<char>(c));
      ++i;
      continue;
    }
    if (c < 0x80) {
      switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        out += "\\u00";
        out.push_back(hex[c >> 4]);
        out.push_back(hex[c & 0xF]);
      }
      ++i;
      continue;
    }
    // Multi-byte: copy a well-formed sequence as is, else emit U+FFFD for one byte.
    std::size_t len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 0;
    bool ok = len > 0 && i + len <= n && c >= 0xC2 && c <= 0xF4;
    for (std::size_t k = 1; ok && k < len; ++k) ok = (p[i + k] & 0xC0) == 0x80;
    if (ok && len == 3) {
      unsigned v = (c & 0x0Fu) << 12 | (p[i + 1] & 0x3Fu) << 6 | (p[i + 2] & 0x3Fu);
      ok = v >= 0x800 && (v < 0xD800 || v > 0xDFFF);
    } else if (ok && len == 4) {
      unsigned v = (c & 0x07u) << 18 | (p[i + 1] & 0x3Fu) << 12 | (p[i + 2] & 0x3Fu) << 6 | (p[i + 3] & 0x3Fu);
      ok = v >= 0x10000 && v <= 0x10FFFF;
    }
    if (ok) {
      out.append(s.data() + i, len);
      i += len;
    } else {
      out += "\xEF\xBF\xBD";
      ++i;
    }
  }
  out.push_back('"');
}

namespace {
void canonical_into(const boost::json::value& v, std::string& out) {
  if (v.is_object()) {
    const auto& o = v.get_object();
    std::vector<const boost::json::key_value_pair*> members;
    members.reserve(o.size());
    for (const auto& kv : o) members.push_back(&kv);
    std::sort(members.begin(), members.end(), [](auto* a, auto* b) { return a->key() < b->key(); });
    out.push_back('{');
    bool first = true;
    for (auto* kv : members) {
      if (!first) out.push_back(',');
      first = false;
      out += boost::json::serialize(boost::json::value(kv->key()));
      out.push_back(':');
      canonical_into(kv->value(), out);
    }
    out.push_back('}');
  } else if (v.is_array()) {
    out.push_back('[');
    bool first = true;
    for (const auto& e : v.get_array()) {
      if (!first) out.push_back(',');
      first = false;
      canonical_into(e, out);
    }
    out.push_back(']');
  } else {
    out += boost::json::serialize(v);
  }
}
} // namespace

std::string canonical(const boost::json::value& v) {
  std::string out;
  canonical_into(v, out);
  return out;
}

const boost::json::value* ObjectReader::find(std::string_view key, Need need) {
  m_seen.emplace_back(key);
  const boost::json::value* v = m_obj.if_contains(key);
  if (!v || (v->is_null() && need == Need::optional)) {
    if (need == Need::required) m_errors.push_back("missing field \"" + std::string(key) + "\"");
    return nullptr;
  }
  return v;
}

std::optional<std::string> ObjectReader::string(std::string_view key, Need need) {
  const auto* v = find(key, need);
  if (!v) return std::nullopt;
  if (!v->is_string()) {
    m_errors.push_back("field \"" + std::string(key) + "\" must be a string");
    return std::nullopt;
  }
  return std::string(v->get_string());
}

std::optional<bool> ObjectReader::boolean(std::string_view key, Need need) {
  const auto* v = find(key, need);
  if (!v) return std::nullopt;
  if (!v->is_bool()) {
    m_errors.push_back("field \"" + std::string(key) + "\" must be true or false");
    return std::nullopt;
  }
  return v->get_bool();
}

std::optional<std::int64_t> ObjectReader::seconds(std::string_view key, Need need, std::int64_t max) {
  const auto* v = find(key, need);
  if (!v) return std::nullopt;
  double d = -1;
  if (v->is_int64())
    d = static_cast<double>(v->get_int64());
  else if (v->is_uint64())
    d = static_cast<double>(v->get_uint64());
  else if (v->is_double())
    d = v->get_double();
  if (!(d >= 0) || d > static_cast<double>(max)) {
    m_errors.push_back("field \"" + std::string(key) + "\" must be a number of seconds between 0 and " +
                       std::to_string(max));
    return std::nullopt;
  }
  return static_cast<std::int64_t>(std::ceil(d));
}

std::optional<std::int64_t> ObjectReader::integer(std::string_view key, Need need, std::int64_t min, std::int64_t max) {
  const auto* v = find(key, need);
  if (!v) return std::nullopt;
  std::optional<std::int64_t> value;
  if (v->is_int64()) {
    value = v->get_int64();
  } else if (v->is_uint64()) {
    value = std::nullopt; // larger than any int64 range we accept
  } else if (v->is_double()) {
    double d = v->get_double();
    if (std::isfinite(d) && std::floor(d) != d) {
      m_errors.push_back("field \"" + std::string(key) + "\" must be an integer");
      return std::nullopt;
    }
    if (std::isfinite(d) && d >= -9.0e18 && d <= 9.0e18) value = static_cast<std::int64_t>(d);
  } else {
    m_errors.push_back("field \"" + std::string(key) + "\" must be an integer");
    return std::nullopt;
  }
  if (!value || *value < min || *value > max) {
    m_errors.push_back("field \"" + std::string(key) + "\" must be an integer between " + std::to_string(min) +
                       " and " + std::to_string(max));
    return std::nullopt;
  }
  return value;
}

std::optional<std::string> ObjectReader::uuid(std::string_view key, Need need) {
  auto s = string(key, need);
  if (!s) return std::nullopt;
  auto u = Uuid::parse(*s);
  if (!u) {
    m_errors.push_back("field \"" + std::string(key) + "\" must be a UUID");
    return std::nullopt;
  }
  return u->to_string();
}

const boost::json::array* ObjectReader::array(std::string_view key, Need need) {
  const auto* v = find(key, need);
  if (!v) return nullptr;
  if (!v->is_array()) {
    m_errors.push_back("field \"" + std::string(key) + "\" must be an array");
    return nullptr;
  }
  return &v->get_array();
}

const boost::json::object* ObjectReader::object(std::string_view key, Need need) {
  const auto* v = find(key, need);
  if (!v) return nullptr;
  if (!v->is_object()) {
    m_errors.push_back("field \"" + std::string(key) + "\" must be an object");
    return nullptr;
  }
  return &v->get_object();
}

expected<void, Problem> ObjectReader::finish() {
  std::vector<std::string> unknown;
  for (const auto& kv : m_obj)
    if (std::find(m_seen.begin(), m_seen.end(), kv.key()) == m_seen.end()) unknown.emplace_back(kv.key());
  if (!unknown.empty()) {
    std::string msg = unknown.size() == 1 ? "unknown field " : "unknown fields ";
    for (std::size_t i = 0; i < unknown.size(); ++i) {
      if (i) msg += ", ";
      msg += boost::json::serialize(boost::json::value(unknown[i]));
    }
    m_errors.push_back(msg);
  }
  if (m_errors.empty()) return {};
  std::string detail;
  for (std::size_t i = 0; i < m_errors.size(); ++i) {
    if (i) detail += "; ";
    detail += m_errors[i];
  }
  Problem p(Code::invalid_request, detail);
  if (!unknown.empty()) {
    boost::json::array names;
    for (auto& u : unknown) names.emplace_back(u);
    p.extensions["unknown_fields"] = std::move(names);
  }
  return make_unexpected(std::move(p));
}

} // namespace mep::json
