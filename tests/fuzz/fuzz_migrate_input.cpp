// libFuzzer target for `mep migrate`'s input readers (server/migrate_input.cpp): JSON Lines or
// CSV with a header, quoted fields spanning lines included. Any input is read into rows or
// refused with a message naming the input; no crash, no report, no hang.
#include "fuzz_support.hpp"
#include "mep/migrate.hpp"

#include <cstddef>
#include <cstdint>
#include <sstream>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::istringstream in(text);
  auto rows = mep::server::read_legacy_rows(in, "legacy-input");
  if (!rows && rows.error().find("legacy-input") == std::string::npos &&
      rows.error().find("column") == std::string::npos)
    mep::fuzz::fail("fuzz_migrate_input", "a refusal that names neither the input nor a column", text, rows.error());
  return 0;
}
