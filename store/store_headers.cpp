// The data plane's request headers (see store_headers.hpp).
#include "mep/store_headers.hpp"

#include <string>

namespace mep::store {

// The Fencing-Token header: one, decimal digits only, 0 … 2^63−1.
expected<std::int64_t, Problem> parse_fencing_token(const std::vector<std::string_view>& values) {
  if (values.empty())
    return make_unexpected(Problem(Code::invalid_request, "a PUT needs a Fencing-Token header (the lease's token)"));
  if (values.size() > 1) return make_unexpected(Problem(Code::invalid_request, "more than one Fencing-Token header"));
  std::string_view v = values.front();
  while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
  while (!v.empty() && (v.back() == ' ' || v.back() == '\t')) v.remove_suffix(1);
  if (v.empty() || v.size() > 19 || v.find_first_not_of("0123456789") != std::string_view::npos)
    return make_unexpected(Problem(Code::invalid_request, "Fencing-Token must be a decimal integer from 0 to 2^63-1"));
  unsigned long long n = std::stoull(std::string(v));
  if (n > static_cast<unsigned long long>(k_max_fencing_token))
    return make_unexpected(Problem(Code::invalid_request, "Fencing-Token must be a decimal integer from 0 to 2^63-1"));
  return static_cast<std::int64_t>(n);
}

expected<Precondition, Problem> parse_preconditions(const std::vector<std::string_view>& if_match,
                                                    const std::vector<std::string_view>& if_none_match) {
  Precondition pre;
  if (if_match.size() > 1 || if_none_match.size() > 1)
    return make_unexpected(Problem(Code::invalid_request, "If-Match and If-None-Match may be given once each"));
  if (!if_match.empty()) {
    std::string_view v = if_match.front();
    std::vector<std::string> tags;
    bool any = false;
    while (!v.empty()) {
      while (!v.empty() && (v.front() == ' ' || v.front() == ',' || v.front() == '\t')) v.remove_prefix(1);
      if (v.empty()) break;
      if (v.front() == '*') {
        any = true;
        v.remove_prefix(1);
        continue;
      }
      if (v.front() != '"')
        return make_unexpected(Problem(Code::invalid_request, "If-Match must list quoted entity tags (\"…\") or be *"));
      auto close = v.find('"', 1);
      if (close > 200) // npos too: not closed within 200 bytes
        return make_unexpected(Problem(Code::invalid_request, "If-Match: an entity tag is not closed"));
      tags.emplace_back(v.substr(1, close - 1));
      v.remove_prefix(close + 1);
    }
    if (!any && tags.empty()) return make_unexpected(Problem(Code::invalid_request, "If-Match is empty"));
    pre.if_match = any ? std::vector<std::string>{} : std::move(tags);
  }
  if (!if_none_match.empty()) {
    std::string_view v = if_none_match.front();
    if (v != "*") return make_unexpected(Problem(Code::invalid_request, "a PUT takes only If-None-Match: *"));
    pre.if_none_match_any = true;
  }
  return pre;
}

} // namespace mep::store
