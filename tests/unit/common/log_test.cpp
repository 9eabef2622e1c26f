// The logger's line format: a service's lines carry the time, unless journald keeps stderr.
#include "mep/log.hpp"

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <sys/stat.h>
#include <unistd.h>

namespace {

// What log::write puts on stderr, with stderr sent to a temporary file meanwhile.
std::string logged(mep::log::Level level, const char* message) {
  char path[] = "/tmp/mep-log-test-XXXXXX";
  const int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  std::fflush(stderr);
  const int saved = ::dup(STDERR_FILENO);
  ::dup2(fd, STDERR_FILENO);
  mep::log::write(level, message);
  std::fflush(stderr);
  ::dup2(saved, STDERR_FILENO);
  ::close(saved);
  ::close(fd);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  ::unlink(path);
  return text.str();
}
} // namespace

TEST_CASE("log: a service's lines start with the time, in UTC", "[log]") {
  ::unsetenv("JOURNAL_STREAM");
  mep::log::set_program("mep test");
  const std::string line = logged(mep::log::Level::warn, "something happened");
  CHECK(std::regex_match(
      line, std::regex(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z mep test: warning: something happened\n)")));
}

TEST_CASE("log: under journald (JOURNAL_STREAM names stderr) the journal's own stamp is enough", "[log]") {
  struct stat st {};
  REQUIRE(::fstat(STDERR_FILENO, &st) == 0);
  const std::string stream = std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
  ::setenv("JOURNAL_STREAM", stream.c_str(), 1);
  mep::log::set_program("mep test"); // decided here, against the stderr of the moment
  ::unsetenv("JOURNAL_STREAM");
  // Written to another file, but the decision stands: the service's stderr was the journal.
  CHECK(logged(mep::log::Level::info, "started") == "mep test: info: started\n");
  // Another stream named: stamped.
  ::setenv("JOURNAL_STREAM", "1:2", 1);
  mep::log::set_program("mep test");
  ::unsetenv("JOURNAL_STREAM");
  CHECK(logged(mep::log::Level::error, "x").find("Z mep test: error: x\n") != std::string::npos);
}
