// Reading a JSON answer into a typed result: typed members, the first complaint remembered,
// and one Problem for the whole object (`done`). Shared by the lease types' wire module and
// mepd's socket API (common/daemon_api). Answers are read leniently: members a type does not
// know are ignored, so a newer peer can add some; each member it needs must be there with its
// type.
#pragma once
#include "mep/expected.hpp"
#include "mep/problem.hpp"
#include "mep/time.hpp"

#include <boost/json/array.hpp>
#include <boost/json/object.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace mep::lease {

// Reads typed members and remembers the first complaint.
class Fields {
public:
  explicit Fields(const boost::json::object& o) : m_o(o) {}

  std::string str(std::string_view key) {
    auto* v = m_o.if_contains(key);
    if (v && v->is_string()) return std::string(v->get_string());
    complain(key, "a string");
    return {};
  }
  std::optional<std::string> opt_str(std::string_view key) {
    auto* v = m_o.if_contains(key);
    if (!v || v->is_null()) return std::nullopt;
    if (v->is_string()) return std::string(v->get_string());
    complain(key, "a string or null");
    return std::nullopt;
  }
  std::int64_t int64(std::string_view key) {
    auto* v = m_o.if_contains(key);
    if (v && v->is_int64()) return v->get_int64();
    if (v && v->is_uint64() && v->get_uint64() <= static_cast<std::uint64_t>(INT64_MAX))
      return static_cast<std::int64_t>(v->get_uint64());
    complain(key, "an integer");
    return 0;
  }
  std::optional<std::int64_t> opt_int64(std::string_view key) {
    auto* v = m_o.if_contains(key);
    if (!v || v->is_null()) return std::nullopt;
    return int64(key);
  }
  UnixMs time(std::string_view key) {
    auto s = str(key);
    if (!m_error.empty()) return 0;
    auto t = parse_rfc3339(s);
    if (!t) complain(key, "an RFC 3339 time");
    return t.value_or(0);
  }
  std::optional<UnixMs> opt_time(std::string_view key) {
    auto* v = m_o.if_contains(key);
    if (!v || v->is_null()) return std::nullopt;
    return time(key);
  }
  const boost::json::object* object(std::string_view key) {
    auto* v = m_o.if_contains(key);
    if (v && v->is_object()) return &v->get_object();
    complain(key, "an object");
    return nullptr;
  }
  const boost::json::array* array(std::string_view key) {
    auto* v = m_o.if_contains(key);
    if (v && v->is_array()) return &v->get_array();
    complain(key, "an array");
    return nullptr;
  }
  void complain(std::string_view key, std::string_view want) {
    if (m_error.empty()) m_error = "member \"" + std::string(key) + "\" should be " + std::string(want);
  }
  void complain(std::string message) {
    if (m_error.empty()) m_error = std::move(message);
  }
  template <class T>
  expected<T, Problem> done(T value) {
    if (m_error.empty()) return value;
    return make_unexpected(Problem(Code::invalid_request, "unexpected answer: " + m_error));
  }

private:
  const boost::json::object& m_o;
  std::string m_error;
};

} // namespace mep::lease
