// The data plane's request headers (SPEC §8): Fencing-Token, If-Match, If-None-Match.
// Pure functions of the header values (no HTTP library), so they are fuzzed on their own.
#pragma once
#include "mep/expected.hpp"
#include "mep/object_store.hpp"
#include "mep/problem.hpp"

#include <cstdint>
#include <string_view>
#include <vector>

namespace mep::store {

inline constexpr std::int64_t k_max_fencing_token = INT64_MAX;

/// The Fencing-Token of a write, from its header's values (one, decimal digits only,
/// 0 to 2^63-1, blanks around it allowed); 400 invalid-request otherwise.
expected<std::int64_t, Problem> parse_fencing_token(const std::vector<std::string_view>& values);

/// If-Match (quoted strong entity tags, a list, or *) and If-None-Match (only * for a write),
/// each given at most once; 400 invalid-request otherwise.
expected<Precondition, Problem> parse_preconditions(const std::vector<std::string_view>& if_match,
                                                    const std::vector<std::string_view>& if_none_match);

} // namespace mep::store
