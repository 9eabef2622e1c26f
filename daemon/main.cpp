// mepd: the host daemon (SPEC §7). Local agents attach over a Unix socket; the daemon
// claims and renews their leases against the control plane (remote, or embedded).
#include "mep/allocator.hpp"
#include "mep/config.hpp"
#include "mep/control_plane.hpp"
#include "mep/data_plane.hpp"
#include "mep/http/client.hpp"
#include "mep/http/edge.hpp"
#include "mep/keeper.hpp"
#include "mep/local_server.hpp"
#include "mep/log.hpp"
#include "mep/peer.hpp"
#include "mep/problem.hpp"
#include "mep/standard_streams.hpp"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <functional>
#include <sys/file.h>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>

namespace fs = std::filesystem;

namespace {

std::string default_socket() {
  if (auto rt = mep::xdg_runtime_dir(); !rt.empty()) return (rt / "mep" / "mepd.sock").string();
  return "/run/mep/mepd.sock";
}

// The state directory: created 0700 when missing. One that exists is used as it is (its mode
// is its owner's business: --state-dir may name any directory) unless others may write in
// it, where they could plant the daemon's databases.
void prepare_state_dir(const fs::path& state) {
  struct stat st {};
  if (::stat(state.c_str(), &st) != 0) {
    if (errno != ENOENT)
      throw std::runtime_error(fmt::format("cannot use {}: {}", state.string(), std::strerror(errno)));
    std::error_code ec;
    fs::create_directories(state, ec);
    if (ec) throw std::runtime_error(fmt::format("cannot create {}: {}", state.string(), ec.message()));
    ::chmod(state.c_str(), 0700);
    return;
  }
  if (!S_ISDIR(st.st_mode)) throw std::runtime_error(fmt::format("{} is not a directory", state.string()));
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0)
    throw std::runtime_error(fmt::format("the state directory {} is writable by others (mode {:04o}); give mepd "
                                         "a directory of its own (it creates a missing one 0700)",
                                         state.string(), st.st_mode & 07777));
}

// One daemon per state directory: a second one would re-adopt and renew the first one's
// leases, and share its databases. The lock lasts as long as the process (the descriptor
// stays open; the kernel drops the lock however the process ends).
void lock_state_dir(const fs::path& state) {
  const fs::path lock = state / "mepd.lock";
  int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) throw std::runtime_error(fmt::format("cannot open {}: {}", lock.string(), std::strerror(errno)));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK)
      throw std::runtime_error(fmt::format("another mepd is running with the state directory {}", state.string()));
    throw std::runtime_error(fmt::format("cannot lock {}: {}", lock.string(), std::strerror(errno)));
  }
}

// The first line of a token file.
std::string read_token(const std::string& file) {
  std::ifstream in(file);
  if (!in) throw std::runtime_error("cannot read the token file " + file);
  std::string token;
  std::getline(in, token);
  while (!token.empty() && (token.back() == '\r' || token.back() == ' ')) token.pop_back();
  return token;
}

std::string default_state_dir() {
  if (::getuid() == 0 && !std::getenv("XDG_STATE_HOME")) return "/var/lib/mep";
  return (mep::xdg_state_home() / "mep" / "mepd").string();
}

// The socket systemd passed (LISTEN_FDS), or -1.
int inherited_socket() {
  const char* pid = std::getenv("LISTEN_PID");
  const char* fds = std::getenv("LISTEN_FDS");
  if (!pid || !fds || std::atol(pid) != static_cast<long>(::getpid()) || std::atoi(fds) < 1) return -1;
  return 3;
}

} // namespace

int main(int argc, char** argv) {
  if (!mep::open_standard_streams()) return 1; // before any descriptor is opened
  mep::tune_allocator();
  mep::log::set_program("mepd");
  mep::http::raise_open_files_limit(); // one descriptor per agent connection
  // 1. Options: flags > MEP_* environment > ~/.config/mep/config.toml > defaults.
  CLI::App app{"mepd: the mep host daemon. Local agents attach over a Unix socket.", "mepd"};
  std::optional<std::string> socket, state_dir, control_plane, token_file, config_file, store, store_token_file,
      ca_file;
  std::string log_level = "info";
  bool system = false;
  bool anonymous_holder = false;
  app.add_option("--socket", socket,
                 "Socket path (default $MEP_SOCKET, $XDG_RUNTIME_DIR/mep/mepd.sock, /run/mep/mepd.sock; "
                 "with --system /run/mep/mepd.sock)");
  app.add_option("--state-dir", state_dir,
                 "State directory (default $XDG_STATE_HOME/mep/mepd; with --system /var/lib/mep/mepd)");
  app.add_flag("--system", system,
               "One daemon for a shared host: serves root and the members of the group mep (socket 0660), each "
               "seeing only the leases it attached, and touches files only with the asking user's rights "
               "(needs root, or CAP_SETUID and CAP_SETGID)");
  app.add_option("--control-plane", control_plane,
                 "URL of a mep server (https://…, or http:// on loopback); none: embedded control plane");
  app.add_option("--token-file", token_file, "File holding the bearer token for --control-plane (or MEP_TOKEN)");
  app.add_option("--store", store,
                 "URL of a data plane (mep store: https://…, or http:// on loopback); its fence is advanced "
                 "before every token is handed out, and sync/fetch use it");
  app.add_option("--store-token-file", store_token_file,
                 "File holding the bearer token for --store (default: the control plane's token)");
  app.add_option("--ca-file", ca_file,
                 "PEM certificates to trust for https:// --control-plane and --store, instead of the system's "
                 "(a private CA)");
  app.add_flag("--anonymous-holder", anonymous_holder,
               "Tell the control plane nothing of who holds a lease: no host name, pid, executable name or labels "
               "(also MEP_ANONYMOUS_HOLDER=1, config anonymous_holder = true)");
  app.add_option("--config", config_file, "Config file");
  app.add_option("--log-level", log_level, "debug, info, warn or error")->capture_default_str();
  app.set_version_flag("--version", "mepd " MEP_VERSION);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "mepd: %s\nRun 'mepd --help' for usage.\n", e.what());
    return mep::exit_code::usage;
  }
  mep::log::Level level;
  if (!mep::log::parse_level(log_level, level)) {
    mep::log::error("--log-level must be debug, info, warn or error");
    return mep::exit_code::usage;
  }
  mep::log::set_level(level);
  auto cfg = mep::Config::load(config_file.value_or(""));
  if (!cfg) {
    mep::log::error("{}", cfg.error());
    return mep::exit_code::usage;
  }
  std::string sock = cfg->get("socket", socket, "--socket", system ? "/run/mep/mepd.sock" : default_socket()).value;
  std::string state =
      cfg->get("state_dir", state_dir, "--state-dir", system ? "/var/lib/mep/mepd" : default_state_dir()).value;
  if (system) {
    // Fail closed: a system daemon that could not take a user's rights would act with its own.
    if (auto why = mep::daemon::check_can_act_as_peers()) {
      mep::log::error("--system: cannot act with another user's rights ({}); run mepd as root, or give it "
                      "CAP_SETUID and CAP_SETGID (AmbientCapabilities= in its unit)",
                      *why);
      return mep::exit_code::other;
    }
  }
  if (state.empty() || sock.empty()) {
    mep::log::error("{} must not be empty", state.empty() ? "--state-dir" : "--socket");
    return mep::exit_code::usage;
  }
  std::string cp_url = cfg->get("control_plane", control_plane, "--control-plane", "").value;
  std::string tok_file = cfg->get("token_file", token_file, "--token-file", "").value;
  std::string store_url = cfg->get("store", store, "--store", "").value;
  std::string store_tok_file = cfg->get("store_token_file", store_token_file, "--store-token-file", "").value;
  std::string ca = cfg->get("ca_file", ca_file, "--ca-file", "").value;
  const std::string anonymous =
      cfg->get("anonymous_holder", anonymous_holder ? std::optional<std::string>("true") : std::nullopt,
               "--anonymous-holder", "false")
          .value;
  if (anonymous != "true" && anonymous != "false" && anonymous != "1" && anonymous != "0") {
    mep::log::error("anonymous_holder must be true or false (got \"{}\")", anonymous);
    return mep::exit_code::usage;
  }

  // 2. The remote planes, built from the option values before anything is touched: a bad URL,
  //    an unreadable token file or a missing token is a usage error (2), as for mep server.
  std::unique_ptr<mep::daemon::ControlPlane> cp;
  std::unique_ptr<mep::daemon::DataPlane> dp;
  try {
    if (!ca.empty()) mep::http::checked_ca_file(ca, "--ca-file");
    std::string token;
    if (!cp_url.empty()) {
      if (!tok_file.empty())
        token = read_token(tok_file);
      else if (const char* t = std::getenv("MEP_TOKEN"))
        token = t;
      cp = mep::daemon::make_remote_control_plane(cp_url, token, ca);
    }
    //    The data plane, when there is one: its own token, else the control plane's.
    if (!store_url.empty()) {
      std::string store_token = !store_tok_file.empty() ? read_token(store_tok_file) : token;
      if (store_token.empty())
        throw std::runtime_error(
            "--store needs --store-token-file (the embedded control plane has no token a store accepts)");
      dp = mep::daemon::make_remote_data_plane(store_url, store_token, ca);
    }
  } catch (const std::exception& e) {
    mep::log::error("{}", e.what());
    return mep::exit_code::usage;
  }

  try {
    // 3. State directory (made 0700 when missing), and the embedded control plane when there
    //    is no remote one.
    prepare_state_dir(state);
    lock_state_dir(state);
    if (!cp) cp = mep::daemon::make_embedded_control_plane(state);
    std::string describe = cp->describe();
    if (dp) describe += ", data plane: " + dp->url();

    // 4. The keeper re-adopts leases and resends claim intents, then the socket opens.
    std::signal(SIGPIPE, SIG_IGN);
    //    The socket is bound first: a daemon that cannot have it touches no lease.
    //    The keeper outlives the io_context: event streams still open unsubscribe from it
    //    when the io_context is destroyed.
    mep::daemon::Keeper keeper(state, std::move(cp), std::move(dp));
    keeper.set_anonymous_holder(anonymous == "true" || anonymous == "1");
    boost::asio::io_context ioc(1);
    mep::daemon::LocalServer server(ioc, keeper, sock, inherited_socket(), system);
    keeper.start();
    server.start();

    // 5. SIGTERM/SIGINT: stop serving and exit 0 without releasing (a quick restart
    //    re-adopts the leases; `mep release` is the way to give one up).
    //    SIGHUP (the terminal mepd was started from closed, or a reload) changes nothing:
    //    there is nothing to reload, and dying would leave the socket behind.
    boost::asio::signal_set signals(ioc, SIGINT, SIGTERM, SIGHUP);
    std::function<void(boost::system::error_code, int)> on_signal = [&](boost::system::error_code e, int sig) {
      if (e) return;
      if (sig == SIGHUP) {
        mep::log::info("SIGHUP: nothing to reload; still serving");
        return signals.async_wait(on_signal);
      }
      mep::log::info("signal {}: stopping (leases stay held until their TTL)", sig);
      server.stop();
      ioc.stop();
    };
    signals.async_wait(on_signal);
    mep::log::info("listening on {}{} (control plane: {})", sock, system ? " for the group mep (system mode)" : "",
                   describe);
    mep::http::run_io_thread(ioc);
  } catch (const std::exception& e) {
    mep::log::error("{}", e.what());
    return mep::exit_code::other;
  }
  return mep::exit_code::ok;
}
