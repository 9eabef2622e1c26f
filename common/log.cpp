// A tiny stderr logger.
#include "mep/log.hpp"

#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>

namespace mep::log {
namespace {
std::atomic<int> g_level{static_cast<int>(Level::info)};
std::mutex g_mutex;
std::string g_program = "mep";
} // namespace

void set_level(Level l) { g_level = static_cast<int>(l); }

bool parse_level(std::string_view text, Level& out) {
  if (text == "debug")
    out = Level::debug;
  else if (text == "info")
    out = Level::info;
  else if (text == "warn" || text == "warning")
    out = Level::warn;
  else if (text == "error")
    out = Level::error;
  else
    return false;
  return true;
}

bool enabled(Level l) { return static_cast<int>(l) >= g_level.load(std::memory_order_relaxed); }

void set_program(std::string_view name) {
  std::lock_guard lock(g_mutex);
  g_program = name;
}

void write(Level l, std::string_view message) {
  static constexpr const char* k_names[] = {"debug", "info", "warning", "error"};
  std::lock_guard lock(g_mutex);
  std::fprintf(stderr, "%s: %s: %.*s\n", g_program.c_str(), k_names[static_cast<int>(l)],
               static_cast<int>(message.size()), message.data());
}

} // namespace mep::log
