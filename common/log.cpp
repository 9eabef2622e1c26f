// A tiny stderr logger.
#include "mep/log.hpp"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <mutex>
#include <string>
#include <sys/stat.h>
#include <unistd.h>

namespace mep::log {
namespace {
std::atomic<int> g_level{static_cast<int>(Level::info)};
std::mutex g_mutex;
std::string g_program = "mep";
// Lines of a service (set_program) start with the time, unless journald keeps its stderr.
std::atomic<bool> g_stamped{false};

// systemd sets JOURNAL_STREAM to "DEVICE:INODE" of the stream it connected to the journal:
// while stderr is that stream, journald stamps each line itself.
bool stderr_is_journal() {
  const char* v = std::getenv("JOURNAL_STREAM");
  struct stat st {};
  if (!v || ::fstat(STDERR_FILENO, &st) != 0) return false;
  unsigned long long dev = 0, ino = 0;
  return std::sscanf(v, "%llu:%llu", &dev, &ino) == 2 && dev == st.st_dev && ino == st.st_ino;
}
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
  const bool stamped = !stderr_is_journal();
  std::lock_guard lock(g_mutex);
  g_program = name;
  g_stamped = stamped;
}

void write(Level l, std::string_view message) {
  static constexpr const char* k_names[] = {"debug", "info", "warning", "error"};
  char stamp[32] = "";
  if (g_stamped.load(std::memory_order_relaxed)) { // RFC 3339, UTC, milliseconds
    const auto now = std::chrono::system_clock::now();
    const std::time_t secs = std::chrono::system_clock::to_time_t(now);
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
    std::tm tm{};
    ::gmtime_r(&secs, &tm);
    const std::size_t n = std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%S", &tm);
    std::snprintf(stamp + n, sizeof stamp - n, ".%03dZ ", static_cast<int>(ms));
  }
  std::lock_guard lock(g_mutex);
  std::fprintf(stderr, "%s%s: %s: %.*s\n", stamp, g_program.c_str(), k_names[static_cast<int>(l)],
               static_cast<int>(message.size()), message.data());
}

} // namespace mep::log
