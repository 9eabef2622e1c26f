// JSON helpers on Boost.JSON: strict parsing and a reader that names every bad field.
#pragma once
#include "mep/expected.hpp"
#include "mep/problem.hpp"

#include <boost/json/object.hpp>
#include <boost/json/value.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace mep::json {

/// Parses `text` as one JSON object (valid UTF-8, depth ≤ 32, no trailing data).
/// Fails with `invalid-request` naming the parser's complaint; `what` names the text when
/// it is valid JSON but not an object.
expected<boost::json::object, Problem> parse_object(std::string_view text, std::string_view what = "the request body");

/// Serializes compactly; object members keep their insertion order. Invalid UTF-8 in a
/// string or key becomes U+FFFD, so the output is always valid JSON.
std::string dump(const boost::json::value& v);

/// Appends `s` to `out` as a JSON string literal (quotes included). Invalid UTF-8 is
/// replaced by U+FFFD so the output is always valid JSON.
void append_string(std::string& out, std::string_view s);

/// The canonical form used for request fingerprints: object keys sorted recursively.
std::string canonical(const boost::json::value& v);

enum class Need { required, optional };

/// Reads typed members of a request object and collects every problem (missing,
/// wrong type, out of range, unknown) so that one `400` names them all.
class ObjectReader {
public:
  explicit ObjectReader(const boost::json::object& obj) : m_obj(obj) {}

  std::optional<std::string> string(std::string_view key, Need need);
  std::optional<bool> boolean(std::string_view key, Need need);
  /// An integer in [min, max]; floats with a fraction, strings, or out-of-range values fail.
  std::optional<std::int64_t> integer(std::string_view key, Need need, std::int64_t min, std::int64_t max);
  /// A duration in seconds: a number in [0, max] (a fraction is rounded up).
  std::optional<std::int64_t> seconds(std::string_view key, Need need, std::int64_t max);
  /// A UUID string in canonical form.
  std::optional<std::string> uuid(std::string_view key, Need need);
  /// An array member (elements are checked by the caller).
  const boost::json::array* array(std::string_view key, Need need);
  /// An object member (its members are checked by the caller).
  const boost::json::object* object(std::string_view key, Need need);

  /// Records a problem found by the caller.
  void fail(std::string message) { m_errors.push_back(std::move(message)); }

  /// Ok when nothing failed and no member was left unread; else `invalid-request`
  /// whose detail lists every complaint, unknown fields by name.
  expected<void, Problem> finish();

private:
  const boost::json::value* find(std::string_view key, Need need);

  const boost::json::object& m_obj;
  std::vector<std::string> m_seen;
  std::vector<std::string> m_errors;
};

} // namespace mep::json
