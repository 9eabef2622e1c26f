// Expected failures as values: tl::expected<T, Problem> throughout mep.
#pragma once
#include <tl/expected.hpp>

namespace mep {
using tl::expected;
using tl::make_unexpected;
using tl::unexpected;
} // namespace mep
