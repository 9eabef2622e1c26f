// What every mep fuzz target shares: a failed invariant prints the input as C escapes and
// aborts, so that libFuzzer keeps the input as a crash artifact.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

namespace mep::fuzz {

[[noreturn]] inline void fail(const char* target, const char* what, std::string_view input,
                              const std::string& detail = {}) {
  std::fprintf(stderr, "\n==%s== invariant violated: %s\n  input (%zu bytes): \"", target, what, input.size());
  for (unsigned char c : input) {
    if (c >= 0x20 && c < 0x7F && c != '"' && c != '\\')
      std::fputc(c, stderr);
    else
      std::fprintf(stderr, "\\x%02X", c);
  }
  std::fprintf(stderr, "\"\n  %s\n", detail.c_str());
  std::abort();
}

} // namespace mep::fuzz
