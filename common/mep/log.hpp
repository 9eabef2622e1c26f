// Logging to stderr, one line per event, journald-friendly (no colours, no timestamps
// when running under systemd, which adds its own). Never log tokens, paths or file bytes.
#pragma once
#include <fmt/format.h>

#include <string_view>

namespace mep::log {

enum class Level { debug = 0, info = 1, warn = 2, error = 3 };

/// Sets the threshold; messages below it are dropped.
void set_level(Level l);
/// Parses "debug|info|warn|error"; false when unknown.
bool parse_level(std::string_view text, Level& out);
bool enabled(Level l);
/// Writes one line `<program>: <level>: <message>` atomically.
void write(Level l, std::string_view message);
/// The program name prefix ("mep server", "mepd").
void set_program(std::string_view name);

template <typename... Args>
void debug(fmt::format_string<Args...> f, Args&&... args) {
  if (enabled(Level::debug)) write(Level::debug, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void info(fmt::format_string<Args...> f, Args&&... args) {
  if (enabled(Level::info)) write(Level::info, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void warn(fmt::format_string<Args...> f, Args&&... args) {
  if (enabled(Level::warn)) write(Level::warn, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void error(fmt::format_string<Args...> f, Args&&... args) {
  if (enabled(Level::error)) write(Level::error, fmt::format(f, std::forward<Args>(args)...));
}

} // namespace mep::log
