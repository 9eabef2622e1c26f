#include "mep/standard_streams.hpp"

#include <cerrno>
#include <fcntl.h>

namespace mep {

bool open_standard_streams() {
  for (int fd = 0; fd < 3; ++fd)
    if (::fcntl(fd, F_GETFD) < 0 && errno == EBADF && ::open("/dev/null", O_RDWR) != fd) return false;
  return true;
}

} // namespace mep
