// libFuzzer target for the config file (common/config.cpp, toml++): any text either parses
// into settings or is refused with a message that names the file; no crash, no report.
#include "fuzz_support.hpp"
#include "mep/config.hpp"

#include <cstddef>
#include <cstdint>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  auto cfg = mep::Config::parse(input, "fuzz.toml");
  if (!cfg) {
    if (cfg.error().find("fuzz.toml") == std::string::npos)
      mep::fuzz::fail("fuzz_config", "a refusal that does not name the file", input, cfg.error());
    return 0;
  }
  for (const char* key : {"socket", "control_plane", "token_file", "store", "store_token_file", "state_dir", "db"})
    (void)cfg->get(key, std::nullopt, "--x", "default");
  return 0;
}
