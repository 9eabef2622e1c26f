// What mepd reads of a local client's process in /proc (daemon_handler.cpp).
#pragma once
#include <istream>
#include <string>
#include <sys/types.h>

namespace mep::daemon {

/// The mode a file the client would create itself gets: 0666 less its umask, from the text
/// of /proc/PID/status (Linux 4.7 and later). Only when that process runs as `uid`, the
/// peer's uid (SO_PEERCRED): the client may have exited and its pid be another user's
/// process by now, whose umask is not the client's. 0600 when it cannot be told.
mode_t client_file_mode(std::istream& status, uid_t uid);
/// The same, read from /proc/`pid`/status.
mode_t client_file_mode(pid_t pid, uid_t uid);

/// The file name (never the directory) of the executable `pid` runs: from /proc/PID/exe, or
/// its command name (/proc/PID/comm) when that cannot be read; empty when neither can.
std::string executable_name(pid_t pid);

/// This host's name (gethostname), read once.
const std::string& host_name();

} // namespace mep::daemon
