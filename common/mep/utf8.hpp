// UTF-8 <-> code points, strict (no overlongs, surrogates or values past U+10FFFF).
#pragma once
#include "mep/expected.hpp"

#include <cstddef>
#include <string>
#include <string_view>

namespace mep::utf8 {

/// The code points of `s`; on ill-formed input, the byte offset of the first bad sequence.
expected<std::u32string, std::size_t> decode(std::string_view s);
/// Appends the UTF-8 form of `c` (a Unicode scalar value) to `out`.
void append(std::string& out, char32_t c);
/// The UTF-8 form of `s`.
std::string encode(std::u32string_view s);

} // namespace mep::utf8
