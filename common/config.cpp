// Layered configuration with a TOML file read by toml++.
#include "mep/config.hpp"

#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>

#define TOML_EXCEPTIONS 0
#include <toml++/toml.h>

namespace mep {
namespace {

std::filesystem::path env_path(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? std::filesystem::path(v) : std::filesystem::path();
}

std::optional<std::string> read_whole(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::filesystem::path home() {
  auto h = env_path("HOME");
  return h.empty() ? std::filesystem::path("/") : h;
}

} // namespace

std::filesystem::path xdg_config_home() {
  auto p = env_path("XDG_CONFIG_HOME");
  return p.empty() ? home() / ".config" : p;
}

std::filesystem::path xdg_state_home() {
  auto p = env_path("XDG_STATE_HOME");
  return p.empty() ? home() / ".local" / "state" : p;
}

std::filesystem::path xdg_runtime_dir() { return env_path("XDG_RUNTIME_DIR"); }

expected<Config, std::string> Config::load(const std::filesystem::path& file) {
  Config cfg; // none: the defaults
  // --config, else $MEP_CONFIG (both must exist), else the default file (may be missing).
  std::filesystem::path path = file.empty() ? env_path("MEP_CONFIG") : file;
  const bool explicit_file = !path.empty();
  if (!explicit_file) path = xdg_config_home() / "mep" / "config.toml";
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    if (explicit_file) return make_unexpected("config file " + path.string() + " does not exist");
    return cfg;
  }
  if (!std::filesystem::is_regular_file(path, ec))
    return make_unexpected("config file " + path.string() + " is not a regular file");
  auto text = read_whole(path);
  if (!text) return make_unexpected("config file " + path.string() + " cannot be read");
  auto parsed = parse(*text, path.string());
  if (!parsed) return parsed;
  parsed->m_file = path;
  return parsed;
}

expected<Config, std::string> Config::parse(std::string_view text, const std::string& label) {
  Config cfg;
  toml::parse_result result = toml::parse(text, label);
  if (!result) {
    const auto& err = result.error();
    std::ostringstream msg;
    msg << "config file " << label << ":" << err.source().begin.line << ": " << err.description();
    return make_unexpected(msg.str());
  }
  for (auto&& [key, node] : result.table()) {
    std::string value;
    if (auto s = node.value<std::string>()) value = *s;
    else if (auto i = node.value<std::int64_t>()) value = std::to_string(*i);
    else if (auto b = node.value<bool>()) value = *b ? "true" : "false";
    else return make_unexpected("config file " + label + ": key \"" + std::string(key.str()) +
                                "\" must be a string, integer or boolean");
    cfg.m_values.emplace(std::string(key.str()), std::move(value));
  }
  return cfg;
}

Setting Config::get(std::string_view key, const std::optional<std::string>& flag,
                    std::string_view flag_name, std::string_view fallback) const {
  if (flag) return {*flag, "flag " + std::string(flag_name)};
  std::string env = "MEP_";
  for (char c : key) env.push_back(c >= 'a' && c <= 'z' ? static_cast<char>(c - 32) : c);
  if (const char* v = std::getenv(env.c_str()); v && *v) return {v, "env " + env};
  if (auto it = m_values.find(key); it != m_values.end())
    return {it->second, "file " + m_file.string()};
  return {std::string(fallback), "default"};
}

} // namespace mep
