// libFuzzer target for the data plane's request headers (store/store_headers.cpp): the
// input's lines are the values of Fencing-Token, If-Match and If-None-Match (a line starting
// with "T:", "M:" or "N:"). Besides crashes and sanitizer reports it aborts when
//   - an accepted Fencing-Token is negative, or its decimal form (without the blanks and
//     leading zeros) is not what was given;
//   - an accepted If-Match lists a tag with a quote in it, or more than was given.
#include "fuzz_support.hpp"
#include "mep/store_headers.hpp"

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  constexpr const char* k_name = "fuzz_store_headers";
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  std::vector<std::string_view> tokens, if_match, if_none_match;
  for (std::size_t i = 0; i <= input.size();) {
    std::size_t nl = input.find('\n', i);
    if (nl == std::string_view::npos) nl = input.size();
    std::string_view line = input.substr(i, nl - i);
    if (line.size() >= 2 && line[1] == ':') {
      if (line[0] == 'T') tokens.push_back(line.substr(2));
      if (line[0] == 'M') if_match.push_back(line.substr(2));
      if (line[0] == 'N') if_none_match.push_back(line.substr(2));
    }
    i = nl + 1;
  }
  if (auto t = mep::store::parse_fencing_token(tokens)) {
    if (*t < 0) mep::fuzz::fail(k_name, "a negative token was accepted", input);
    std::string_view v = tokens.front();
    while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
    while (!v.empty() && (v.back() == ' ' || v.back() == '\t')) v.remove_suffix(1);
    while (v.size() > 1 && v.front() == '0') v.remove_prefix(1);
    if (std::to_string(*t) != v)
      mep::fuzz::fail(k_name, "the token read is not the token given", input, std::to_string(*t));
  } else {
    (void)t.error().to_json();
  }
  if (auto p = mep::store::parse_preconditions(if_match, if_none_match)) {
    if (p->if_match) {
      for (const auto& tag : *p->if_match)
        if (tag.find('"') != std::string::npos) mep::fuzz::fail(k_name, "an entity tag holds a quote", input, tag);
      if (!if_match.empty() && p->if_match->size() > if_match.front().size())
        mep::fuzz::fail(k_name, "more tags than characters", input);
    }
  } else {
    (void)p.error().to_json();
  }
  return 0;
}
