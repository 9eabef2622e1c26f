// libFuzzer target for the agent-name pipeline (SPEC §5): arbitrary bytes go through
// mep::canonicalize (both its ASCII fast path and its ICU path) and
// mep::username_case_mapped. Besides crashes and sanitizer reports it aborts when
//   - a valid name's canonical_name is not a fixed point: canonicalize(canonical_name)
//     must succeed with the same canonical_name and the same skeleton;
//   - the fast path and the general path (forced by asking for --explain steps) disagree
//     on the result or on the error (reason, code point, index), as canonical.cpp's
//     design notes require.
#include "mep/canonical.hpp"

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace {

// Prints the failed invariant and the input as C escapes, then aborts so that libFuzzer
// saves the input as a crash artifact.
[[noreturn]] void fail(const char* what, std::string_view input, const std::string& detail) {
  std::fprintf(stderr, "\n==fuzz_canonicalize== invariant violated: %s\n  input (%zu bytes): \"", what, input.size());
  for (unsigned char c : input) {
    if (c >= 0x20 && c < 0x7F && c != '"' && c != '\\')
      std::fputc(c, stderr);
    else
      std::fprintf(stderr, "\\x%02X", c);
  }
  std::fprintf(stderr, "\"\n  %s\n", detail.c_str());
  std::abort();
}

std::string describe(const mep::NameError& e) {
  std::string s(mep::to_string(e.reason));
  if (e.codepoint) s += " " + mep::format_codepoint(*e.codepoint);
  if (e.index) s += " at " + std::to_string(*e.index);
  return s;
}

std::string describe(const mep::CanonicalName& n) {
  std::string s = "display=\"" + n.display_name + "\" canonical=\"" + n.canonical_name + "\" skeleton=\"" + n.skeleton +
                  "\" scripts=";
  for (const auto& sc : n.scripts) s += sc + ",";
  return s;
}

using Result = mep::expected<mep::CanonicalName, mep::NameError>;

std::string describe(const Result& r) { return r ? describe(*r) : "error " + describe(r.error()); }

bool same(const Result& a, const Result& b) {
  if (a.has_value() != b.has_value()) return false;
  if (a) {
    return a->display_name == b->display_name && a->canonical_name == b->canonical_name && a->skeleton == b->skeleton &&
           a->scripts == b->scripts;
  }
  return a.error().reason == b.error().reason && a.error().codepoint == b.error().codepoint &&
         a.error().index == b.error().index;
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);

  // 1. The default path (the ASCII fast path for ASCII input) and the general path.
  const Result fast = mep::canonicalize(input);
  std::vector<mep::ExplainStep> steps;
  const Result general = mep::canonicalize(input, &steps);
  if (!same(fast, general))
    fail("fast path and general path disagree", input,
         "default: " + describe(fast) + "\n  explain: " + describe(general));

  // 2. Errors must format without trouble (the CLI prints both forms).
  if (!fast) {
    (void)fast.error().message();
    (void)fast.error().to_json();
  }

  // 3. A canonical name is its own canonical name, with the same skeleton.
  if (fast) {
    const Result again = mep::canonicalize(fast->canonical_name);
    if (!again)
      fail("canonical_name is rejected", input, "first: " + describe(*fast) + "\n  again: " + describe(again));
    if (again->canonical_name != fast->canonical_name || again->skeleton != fast->skeleton)
      fail("canonical_name is not a fixed point", input,
           "first: " + describe(*fast) + "\n  again: " + describe(*again));
  }

  // 4. The plain RFC 8265 profile: no crash, errors format.
  const auto plain = mep::username_case_mapped(input);
  if (!plain) (void)plain.error().message();
  return 0;
}
