// Preloaded into mepd by test_daemon.py (LD_PRELOAD): every listen(2) on a Unix socket
// first sleeps MEP_TEST_LISTEN_DELAY_MS milliseconds, so that the moment between bind and
// listen lasts long enough for a test to look at the socket's path in it.
#include <dlfcn.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdlib>
#include <thread>

extern "C" int listen(int fd, int backlog) noexcept {
  using Listen = int (*)(int, int);
  static const auto real = reinterpret_cast<Listen>(::dlsym(RTLD_NEXT, "listen"));
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  const char* delay = std::getenv("MEP_TEST_LISTEN_DELAY_MS");
  if (delay && ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0 && addr.ss_family == AF_UNIX)
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(delay)));
  return real ? real(fd, backlog) : -1;
}
