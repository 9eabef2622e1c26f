// Configuration: command-line flags > MEP_* environment variables > config file > default.
#pragma once
#include "mep/expected.hpp"

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>

namespace mep {

/// One effective setting and where it came from ("flag --db", "env MEP_DB",
/// "file /home/u/.config/mep/config.toml", "default").
struct Setting {
  std::string value;
  std::string source;
};

/// The layered configuration. Keys are snake_case (`control_plane`); the environment
/// variable is `MEP_` + the key upper-cased (`MEP_CONTROL_PLANE`); the file is TOML with
/// the same keys at top level.
class Config {
public:
  /// Loads `file`, else `$MEP_CONFIG`, else the default file (`$XDG_CONFIG_HOME/mep/config.toml`,
  /// else `~/.config/mep/config.toml`). A missing default file is not an error; a missing
  /// explicit file or a malformed one is (the message says which line).
  static expected<Config, std::string> load(const std::filesystem::path& file = {});
  /// Parses TOML text (`label` names it in messages); the same rules as load().
  static expected<Config, std::string> parse(std::string_view text, const std::string& label);

  /// The effective value of `key`.
  Setting get(std::string_view key, const std::optional<std::string>& flag, std::string_view flag_name,
              std::string_view fallback) const;

  /// The file that was read (empty when none).
  const std::filesystem::path& file() const { return m_file; }

private:
  std::filesystem::path m_file;
  std::map<std::string, std::string, std::less<>> m_values;
};

/// `$XDG_CONFIG_HOME`, else `$HOME/.config`.
std::filesystem::path xdg_config_home();
/// `$XDG_STATE_HOME`, else `$HOME/.local/state`.
std::filesystem::path xdg_state_home();
/// `$XDG_RUNTIME_DIR`, or empty when unset.
std::filesystem::path xdg_runtime_dir();

} // namespace mep
