// Layered configuration with a TOML file read by toml++.
#include "mep/config.hpp"

#include <cstdio>
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

namespace {

// toml++ 3.3.0, the version Debian 12 ships, reaches __builtin_unreachable() -- undefined
// behaviour -- when it tests some non-ASCII code points for whitespace (marzer/tomlplusplus
// #190 and #295, fixed upstream in 2026 by PR #305), and its tokenizer can meet them in
// many places once the input is malformed. So toml++ only ever sees ASCII: this rewrites
// every non-ASCII character inside a string as a \uXXXX escape (a literal string becomes
// the equivalent basic string), blanks it in a comment, and refuses it anywhere else,
// where TOML allows none. Lines keep their numbers, so toml++'s errors still point right.
// If this scan misjudges where a string starts (it is simpler than toml++), the result is
// still pure ASCII and toml++ reports the error. Found by tests/fuzz/fuzz_config.cpp.
expected<std::string, std::string> ascii_toml(std::string_view t) {
  if (t.substr(0, 3) == "\xEF\xBB\xBF") t.remove_prefix(3); // a UTF-8 byte order mark
  std::string out;
  out.reserve(t.size() + t.size() / 4);
  std::size_t line = 1;
  auto at = [&](std::size_t i) { return i < t.size() ? t[i] : '\0'; };
  auto err = [&](const std::string& what) { return make_unexpected(std::to_string(line) + ": " + what); };
  // Decodes the UTF-8 sequence at i (its first byte >= 0x80); 0 when malformed.
  auto decode = [&](std::size_t i, std::size_t& len) -> char32_t {
    const auto b0 = static_cast<unsigned char>(t[i]);
    len = b0 >= 0xF0 ? 4 : b0 >= 0xE0 ? 3 : b0 >= 0xC0 ? 2 : 0;
    if (len == 0 || b0 > 0xF4 || i + len > t.size()) return 0;
    char32_t cp = b0 & (0x7F >> len);
    for (std::size_t k = 1; k < len; ++k) {
      const auto b = static_cast<unsigned char>(t[i + k]);
      if ((b & 0xC0) != 0x80) return 0;
      cp = (cp << 6) | (b & 0x3F);
    }
    const char32_t min[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    return cp;
  };
  std::size_t i = 0;
  while (i < t.size()) {
    const char c = t[i];
    if (c == '\n') {
      ++line;
      out += c;
      ++i;
    } else if (c == '#') {
      for (; i < t.size() && t[i] != '\n'; ++i) out += static_cast<unsigned char>(t[i]) >= 0x80 ? ' ' : t[i];
    } else if (c == '"' || c == '\'') {
      const bool literal = c == '\'';
      const bool multi = at(i + 1) == c && at(i + 2) == c;
      const std::size_t quotes = multi ? 3 : 1;
      out.append(quotes, '"');
      i += quotes;
      while (i < t.size()) {
        const char d = t[i];
        if (d == '\n') {
          ++line;
          if (!multi) break; // an unterminated string: toml++ reports it
        }
        if (d == c && (!multi || (at(i + 1) == c && at(i + 2) == c))) {
          // Up to two more quotes close a multi-line string ("""a"""" holds a"): content.
          std::size_t extra = 0;
          while (multi && extra < 2 && at(i + 3 + extra) == c) ++extra;
          out.append(extra, literal ? '\'' : '"');
          out.append(quotes, '"');
          i += quotes + extra;
          break;
        }
        if (static_cast<unsigned char>(d) >= 0x80) {
          std::size_t len = 0;
          const char32_t cp = decode(i, len);
          if (cp == 0) return err("invalid UTF-8 in a string");
          char buf[16];
          std::snprintf(buf, sizeof buf, cp > 0xFFFF ? "\\U%08X" : "\\u%04X", static_cast<unsigned>(cp));
          out += buf;
          i += len;
          continue;
        }
        if (!literal && d == '\\' && static_cast<unsigned char>(at(i + 1)) >= 0x80)
          return err("a backslash in a string must not be followed by a non-ASCII character");
        if (literal && (d == '\\' || d == '"')) out += '\\';
        out += d;
        if (!literal && d == '\\' && i + 1 < t.size() && t[i + 1] != '\n' &&
            static_cast<unsigned char>(t[i + 1]) < 0x80) {
          out += t[i + 1]; // an escaped character, e.g. \" (a backslash-newline is handled above)
          ++i;
        }
        ++i;
      }
    } else if (static_cast<unsigned char>(c) >= 0x80) {
      return err("a non-ASCII character outside a quoted string or a comment");
    } else {
      out += c;
      ++i;
    }
  }
  return out;
}

} // namespace

expected<Config, std::string> Config::parse(std::string_view text, const std::string& label) {
  Config cfg;
  auto ascii = ascii_toml(text);
  if (!ascii) return make_unexpected("config file " + label + ":" + ascii.error());
  toml::parse_result result = toml::parse(*ascii, label);
  if (!result) {
    const auto& err = result.error();
    std::ostringstream msg;
    msg << "config file " << label << ":" << err.source().begin.line << ": " << err.description();
    return make_unexpected(msg.str());
  }
  for (auto&& [key, node] : result.table()) {
    std::string value;
    // By type, not node.value<T>(): that converts a float to an integer, with undefined
    // behaviour when it does not fit (toml++ 3.3.0; found by tests/fuzz/fuzz_config.cpp).
    if (const auto* s = node.as_string())
      value = s->get();
    else if (const auto* i = node.as_integer())
      value = std::to_string(i->get());
    else if (const auto* b = node.as_boolean())
      value = b->get() ? "true" : "false";
    else
      return make_unexpected("config file " + label + ": key \"" + std::string(key.str()) +
                             "\" must be a string, integer or boolean");
    cfg.m_values.emplace(std::string(key.str()), std::move(value));
  }
  return cfg;
}

Setting Config::get(std::string_view key, const std::optional<std::string>& flag, std::string_view flag_name,
                    std::string_view fallback) const {
  if (flag) return {*flag, "flag " + std::string(flag_name)};
  std::string env = "MEP_";
  for (char c : key) env.push_back(c >= 'a' && c <= 'z' ? static_cast<char>(c - 32) : c);
  if (const char* v = std::getenv(env.c_str()); v && *v) return {v, "env " + env};
  if (auto it = m_values.find(key); it != m_values.end()) return {it->second, "file " + m_file.string()};
  return {std::string(fallback), "default"};
}

} // namespace mep
