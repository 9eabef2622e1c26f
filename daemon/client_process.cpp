// What mepd reads of a local client's process, and of its host, for the holder of a lease
// (see client_process.hpp).
#include "mep/client_process.hpp"

#include <climits>
#include <fstream>
#include <string>
#include <unistd.h>

namespace mep::daemon {

std::string executable_name(pid_t pid) {
  if (pid <= 0) return {};
  const std::string proc = "/proc/" + std::to_string(pid);
  char buf[PATH_MAX];
  const ssize_t n = ::readlink((proc + "/exe").c_str(), buf, sizeof buf - 1);
  if (n > 0) {
    std::string path(buf, static_cast<std::size_t>(n));
    // An executable replaced since it was started reads "… (deleted)".
    if (constexpr std::string_view deleted = " (deleted)"; path.ends_with(deleted))
      path.resize(path.size() - deleted.size());
    const auto slash = path.rfind('/');
    std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
    if (!name.empty()) return name;
  }
  // Another user's process (a personal daemon cannot read its exe link): its command name.
  std::ifstream comm(proc + "/comm");
  std::string name;
  std::getline(comm, name);
  return name.find('/') == std::string::npos ? name : std::string();
}

const std::string& host_name() {
  static const std::string name = [] {
    char buf[HOST_NAME_MAX + 1] = {};
    if (::gethostname(buf, sizeof buf - 1) != 0) return std::string();
    return std::string(buf);
  }();
  return name;
}

} // namespace mep::daemon
