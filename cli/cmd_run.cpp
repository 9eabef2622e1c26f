// `mep run NAME PATH -- CMD…`: run a command under a lease, like flock(1), `etcdctl lock`
// and `consul lock`, but fenced: the child runs in its own process group with the lease in
// its environment; when the lease is lost (decided on the local monotonic deadline, or on
// the daemon's `lost` event) the whole group gets SIGTERM, then SIGKILL after a grace
// that never reaches past the lease's expiry.
#include "commands.hpp"
#include "daemon_client.hpp"
#include "lease_watch.hpp"
#include "mep/utf8.hpp"

#include "mep/json.hpp"
#include "mep/problem.hpp"
#include "mep/time.hpp"

#include <boost/json.hpp>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <mutex>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

namespace mep::cli {
namespace {
using Clock = std::chrono::steady_clock;

struct RunOptions {
  std::string name, path, on_loss = "term";
  std::int64_t ttl = 30;
  std::string wait = "0";
  std::int64_t wait_s = 0;
  double grace = 5;
  bool sync_on_exit = false;
  HolderOptions holder;
  std::vector<std::string> command;
};

volatile sig_atomic_t g_child_pgid = 0;

// Signals that would end `mep run` and leave its command running unfenced: they go to the
// command's group instead.
constexpr int k_forwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGALRM};

// How long mep run waits for its release to be answered before it exits anyway: the lease is
// bound to its pid, and the daemon releases it once the process is gone.
constexpr int k_release_timeout_ms = 5000;

// The SIGKILL at the end of --grace lands this long before the lease's expiry as this
// process estimates it (the renewal it heard of was made a little before it heard of it).
constexpr auto k_kill_margin = std::chrono::milliseconds(250);

void forward_signal(int sig) {
  if (g_child_pgid > 0) ::kill(-g_child_pgid, sig);
}

// The command's group owns the terminal while it runs, so it can read from it and gets
// ^C and ^Z from it (a background group that reads from its terminal is stopped). Each
// hand-over happens only while the giver's group is the terminal's foreground group:
// `mep run … &` leaves the terminal to the shell.
void hand_terminal(int tty, pid_t from_pgrp, pid_t to_pgrp) {
  if (tty >= 0 && ::tcgetpgrp(tty) == from_pgrp) ::tcsetpgrp(tty, to_pgrp);
}

// The guard of the command's process group: its leader, a process that outlives `mep run`
// only to SIGKILL the group when `mep run` ends without a word (SIGKILL, a crash). The
// command itself dies then of PR_SET_PDEATHSIG, but what it started in the background would
// run on after the daemon released the lease: two holders of one name. The guard waits on a
// socket whose other end only `mep run` holds: a byte says stand down, end of file says kill.
// Being a member, it also keeps the group's id from being reused while it waits. Forked
// from a process with threads, it makes async-signal-safe calls only. -1 when it cannot be
// started (the command then leads its own group, unguarded); `stand_down` gets mep run's end.
pid_t start_group_guard(int& stand_down) {
  int p[2]; // a socket pair rather than a pipe: a word to a guard that died raises no SIGPIPE
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, p) != 0) return -1;
  const pid_t guard = ::fork();
  if (guard == 0) {
    ::close(p[1]); // mep run's end: held here, it would never read as closed
    ::setpgid(0, 0);
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    // What reaches the group (^C, a hang-up, mep run's forwarding) is for the command. ^Z
    // stops the guard with it: mep run learns of it from the guard when the command itself
    // cannot stop yet (a shell in vfork(2) whose child stopped before its exec).
    for (int s : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGALRM, SIGTTIN, SIGTTOU, SIGPIPE})
      ::sigaction(s, &ignore, nullptr);
    // Nothing of mep run's stays open here (a pipeline's reader would wait for it): the
    // socket becomes descriptor 3 (main() keeps 0..2 open, so it is 3 or above), standard
    // input, output and error /dev/null, and the rest closes.
    ::dup2(p[0], 3);
    const int null = ::open("/dev/null", O_RDWR);
    for (int fd = 0; fd < 3 && null >= 0; ++fd) ::dup2(null, fd);
    ::close_range(4, ~0U, 0);
    char word = 0;
    ssize_t n;
    do n = ::read(3, &word, 1);
    while (n < 0 && errno == EINTR);
    if (n != 1) ::kill(0, SIGKILL); // the whole group, this process last
    ::_exit(0);
  }
  ::close(p[0]);
  if (guard < 0) {
    ::close(p[1]);
    return -1;
  }
  ::setpgid(guard, guard); // here and in the guard: whichever runs first
  stand_down = p[1];
  return guard;
}

// Ends the guard and reaps it: `tell` says stand down (mep run ends as it should, and what
// is left of the group is not to be killed); without it the guard was killed with its group.
void end_guard(pid_t guard, int stand_down, bool tell) {
  if (guard < 0) return;
  const char word = 'x';
  while (tell && ::send(stand_down, &word, 1, MSG_NOSIGNAL) < 0 && errno == EINTR) {}
  ::close(stand_down);
  while (::waitpid(guard, nullptr, 0) < 0 && errno == EINTR) {}
}

// Stops this process with the signal that stopped the command, so that a shell, or a mep
// run around this one (which acts only on those signals), sees the job stopped the same
// way. SIGTTOU is ignored here (for tcsetpgrp), so its default action is put back meanwhile.
void stop_like(int sig) {
  // The kernel discards those signals in an orphaned process group (no member with a
  // parent elsewhere in the session, as for a session leader): SIGSTOP stops it anyway.
  const pid_t parent = ::getppid();
  if (::getsid(parent) != ::getsid(0) || ::getpgid(parent) == ::getpgrp()) {
    ::kill(::getpid(), SIGSTOP);
    return;
  }
  struct sigaction dfl = {};
  struct sigaction old = {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(sig, &dfl, &old);
  ::kill(::getpid(), sig); // returns once continued
  ::sigaction(sig, &old, nullptr);
}

// Whether `pid` is stopped at this moment (state T in /proc): a stop reported before the
// group was continued is stale.
bool stopped_now(pid_t pid) {
  char path[32];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "r");
  if (!f) return false;
  char buf[512];
  const std::size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* close = std::strrchr(buf, ')'); // the name may hold spaces and parentheses
  return close && close[1] == ' ' && close[2] == 'T';
}

int run(const RunOptions& o, const GlobalOptions& g) {
  std::string socket = resolve_socket(g.socket, g.config_file);
  LeaseWatch watch(o.ttl);

  // 1. Listen for events first, so no `lost` can slip between the grant and the watch.
  //    When the stream ends while the command runs (mepd restarted: it re-adopts the
  //    lease), it is opened again; until renewals are heard of again, the local deadline
  //    stands.
  EventFollower events(socket, [&watch](const std::string& line) { watch.on_event(line); });
  events.wait_connected();

  // 2. Claim, bound to this process: if `mep run` dies, mepd releases the lease.
  std::string abs = path_argument(o.path);
  daemon_api::AttachBody body;
  body.name = o.name;
  body.path = abs;
  body.ttl_s = o.ttl;
  o.holder.add_to(body);
  // The holder's executable is the command's, not mep's (mepd would read this process's).
  if (const std::string& cmd0 = o.command.front(); !cmd0.empty()) {
    const auto slash = cmd0.rfind('/');
    std::string exe = slash == std::string::npos ? cmd0 : cmd0.substr(slash + 1);
    if (!exe.empty() && exe.size() <= lease::k_max_holder_text && utf8::decode(exe)) body.exe = std::move(exe);
  }
  auto sent = Clock::now();
  DaemonReply r = attach(socket, std::move(body), o.wait_s);
  if (!r.ok()) {
    events.stop();
    return report_problem(r, socket, g.json);
  }
  auto lease = r.json();
  // After a wait the grant is no earlier than the request plus the daemon's
  // granted_after_ms: the local deadline counts from there.
  if (auto* after = lease.if_contains("granted_after_ms"); after && after->is_int64() && after->get_int64() > 0)
    sent += std::chrono::milliseconds(after->get_int64());
  auto field = [&](std::string_view k) {
    auto* x = lease.if_contains(k);
    if (!x) return std::string();
    return x->is_string()  ? std::string(x->get_string())
           : x->is_int64() ? std::to_string(x->get_int64())
                           : std::string();
  };
  watch.attached(field("canonical_name"), field("lease_id"), sent);

  // 3. Start the command in its own process group with the lease in its environment.
  ::setenv("MEP_CANONICAL_NAME", field("canonical_name").c_str(), 1);
  ::setenv("MEP_MEMORY_INSTANCE_ID", field("memory_instance_id").c_str(), 1);
  ::setenv("MEP_FENCING_TOKEN", field("fencing_token").c_str(), 1);
  ::setenv("MEP_LEASE_ID", field("lease_id").c_str(), 1);
  ::setenv("MEP_LEASE_EXPIRES_AT", field("expires_at").c_str(), 1);
  if (g.verbosity > 0)
    std::fprintf(stderr, "mep: holding %s (token %s); running %s\n", field("canonical_name").c_str(),
                 field("fencing_token").c_str(), o.command.front().c_str());
  std::vector<char*> argv;
  for (const auto& a : o.command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  // The terminal, on whichever standard stream has it: `echo x | mep run …` in the
  // foreground still hands it to the command (its ^Z, its reads of /dev/tty).
  int tty = -1;
  for (int fd : {STDIN_FILENO, STDOUT_FILENO, STDERR_FILENO})
    if (tty < 0 && ::isatty(fd)) tty = fd;
  const pid_t own_pgrp = ::getpgrp(), parent = ::getpid();
  // Signals the caller ignored (nohup) stay ignored, here and in the command; the others
  // are forwarded to the command's group.
  std::vector<int> forward;
  for (int s : k_forwarded) {
    struct sigaction cur {};
    ::sigaction(s, nullptr, &cur);
    if (cur.sa_handler != SIG_IGN) forward.push_back(s);
  }
  struct sigaction ttou {};
  ::sigaction(SIGTTOU, nullptr, &ttou);
  const bool ttou_ignored = ttou.sa_handler == SIG_IGN;
  std::signal(SIGTTOU, SIG_IGN); // tcsetpgrp from a background group, and stderr under `stty tostop`
  // Signals to forward wait until the handler knows where to: one that arrives as the
  // command starts is forwarded, not taken by this process's default action.
  sigset_t forwarded, unblocked;
  sigemptyset(&forwarded);
  for (int s : forward) sigaddset(&forwarded, s);
  ::sigprocmask(SIG_BLOCK, &forwarded, &unblocked);
  // The command runs in a group of its own, led by its guard (when one could be started).
  int stand_down = -1;
  const pid_t guard = start_group_guard(stand_down);
  if (guard < 0)
    std::fprintf(stderr,
                 "mep: warning: cannot start the guard of the command's process group (%s): if mep run is "
                 "killed outright, what the command started in the background outlives the lease\n",
                 std::strerror(errno));
  pid_t child = ::fork();
  if (child == 0) {
    const pid_t group = guard > 0 ? guard : ::getpid();
    ::setpgid(0, group);
    hand_terminal(tty, own_pgrp, group); // here and in the parent: whichever runs first
    for (int s : forward) std::signal(s, SIG_DFL);
    if (!ttou_ignored) std::signal(SIGTTOU, SIG_DFL);
    ::sigprocmask(SIG_SETMASK, &unblocked, nullptr);
    // If `mep run` is killed outright the daemon releases the lease: the command must not
    // run on without it.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) _exit(137);
    ::execvp(argv[0], argv.data());
    const int err = errno;
    std::fprintf(stderr, "mep: cannot run %s: %s\n", argv[0], std::strerror(err));
    _exit(err == ENOENT ? 127 : 126); // as a shell: not found, or found but not runnable
  }
  if (child < 0) {
    const int err = errno;
    ::sigprocmask(SIG_SETMASK, &unblocked, nullptr);
    std::fprintf(stderr, "mep: cannot start %s: %s\n", argv[0], std::strerror(err));
    end_guard(guard, stand_down, true);
    daemon_request(socket, daemon_api::target(daemon_api::Endpoint::detach),
                   json::dump(boost::json::object{{"name", field("canonical_name")}}), k_release_timeout_ms);
    events.stop();
    return exit_code::other;
  }
  const pid_t group = guard > 0 ? guard : child;
  ::setpgid(child, group);
  hand_terminal(tty, own_pgrp, group);
  g_child_pgid = group;
  struct sigaction sa {};
  sa.sa_handler = forward_signal;
  sigemptyset(&sa.sa_mask);
  for (int s : forward) ::sigaction(s, &sa, nullptr);
  ::sigprocmask(SIG_SETMASK, &unblocked, nullptr);

  // 4. Wait for the child; act on loss.
  int status = 0;
  bool lost = false;
  bool kill_pending = false;
  Clock::time_point kill_at = Clock::now();
  // ^Z (or a read from the terminal in the background): stop with the command, so the shell
  // sees the job stopped, and carry on where the shell's fg or bg puts us.
  auto stop_with_the_command = [&](int sig) {
    hand_terminal(tty, group, own_pgrp);
    stop_like(sig);
    // Continued. The renewals mepd made meanwhile wait on the event stream: they are heard
    // before the command goes on and the deadline is judged, or a stop longer than the TTL
    // would read as a loss.
    events.catch_up();
    hand_terminal(tty, own_pgrp, group);
    ::kill(-group, SIGCONT);
  };
  for (;;) {
    pid_t w = ::waitpid(child, &status, WNOHANG | WUNTRACED);
    if (w == child && WIFSTOPPED(status)) {
      const int sig = WSTOPSIG(status);
      if ((sig == SIGTSTP || sig == SIGTTIN || sig == SIGTTOU) && stopped_now(child)) stop_with_the_command(sig);
      continue;
    }
    // The guard's stop: reported, never reaped here (WSTOPPED only), so its id keeps the
    // group's from being reused until end_guard().
    siginfo_t info{};
    if (w != child && guard > 0 && ::waitid(P_PID, static_cast<id_t>(guard), &info, WSTOPPED | WNOHANG) == 0 &&
        info.si_pid == guard && info.si_code == CLD_STOPPED && info.si_status == SIGTSTP && stopped_now(guard)) {
      stop_with_the_command(SIGTSTP);
      continue;
    }
    if (w == child) break;
    auto now = Clock::now();
    const LeaseWatch::State state = watch.state(now);
    if (!lost && state.lost) {
      lost = true;
      std::fprintf(stderr, "mep: lease on %s lost (%s)\n", field("canonical_name").c_str(), state.lost_reason.c_str());
      if (o.on_loss == "kill") {
        ::kill(-group, SIGKILL);
      } else if (o.on_loss == "term") {
        ::kill(-group, SIGTERM);
        ::kill(-group, SIGCONT); // a stopped process acts on SIGTERM only once it runs
        // Bounded before the cast (inf or 1e308 would overflow it): the expiry caps it anyway.
        auto grace = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(std::min(o.grace, 1e6)));
        kill_at = std::min(now + grace, std::max(now, state.expiry - k_kill_margin));
        kill_pending = true;
      }
    }
    if (kill_pending && now >= kill_at) {
      ::kill(-group, SIGKILL);
      kill_pending = false;
    }
    auto nap = std::chrono::duration_cast<Clock::duration>(std::chrono::milliseconds(20));
    if (kill_pending) nap = std::min(nap, std::max(Clock::duration::zero(), kill_at - now));
    std::this_thread::sleep_for(nap);
  }
  g_child_pgid = 0;
  hand_terminal(tty, group, own_pgrp);
  // What is left of the group (a process the command started in the background) would
  // run on without the lease: it ends before the release.
  // The guard goes with it (reaped only then: its id keeps the group's from being reused).
  const bool leave_the_rest = o.on_loss == "ignore";
  if (!leave_the_rest) ::kill(-group, SIGKILL);
  end_guard(guard, stand_down, leave_the_rest);

  // 5. With --sync-on-exit, upload the memory under the lease's token while it is still held.
  const bool was_lost = lost || watch.state().lost; // before our own release emits `released`
  int sync_status = exit_code::ok;
  if (o.sync_on_exit && !was_lost) {
    DaemonReply synced = daemon_request(socket, daemon_api::target(daemon_api::Endpoint::sync),
                                        json::dump(boost::json::object{{"name", field("canonical_name")}}));
    if (!synced.ok()) {
      std::fprintf(stderr, "mep: the memory was not synced:\n");
      sync_status = report_problem(synced, socket, g.json);
    }
  }
  // 6. Release (unless lost) and exit with the command's status (a failed sync's when the
  //    command succeeded), or 4 after a loss. The lease is bound to this process, so a daemon
  //    that does not answer soon (stopped, overloaded) releases it when this process is gone:
  //    the command's status is not held back for a minute.
  if (!was_lost) {
    auto released =
        daemon_request(socket, daemon_api::target(daemon_api::Endpoint::detach),
                       json::dump(boost::json::object{{"name", field("canonical_name")}}), k_release_timeout_ms);
    // The command's status stands; the release that the control plane did not confirm is said.
    if (auto refused = unconfirmed_release(released)) warn_unconfirmed_release(field("canonical_name"), *refused);
  }
  events.stop();
  if (was_lost) return exit_code::lost;
  if (WIFEXITED(status)) return WEXITSTATUS(status) == 0 ? sync_status : WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return exit_code::other;
}

} // namespace

void register_run(CLI::App& app, GlobalOptions& g, Action& action) {
  auto o = std::make_shared<RunOptions>();
  auto* cmd = app.add_subcommand("run", "Run CMD while holding the lease on NAME for PATH (like flock(1))");
  cmd->add_option("name", o->name, "Agent name")->required();
  cmd->add_option("path", o->path, "The .uai memory file")->required();
  cmd->add_option("--ttl", o->ttl, "Lease TTL in seconds (5-300)")->capture_default_str();
  cmd->add_option("--on-loss", o->on_loss,
                  "When the lease is lost: term (SIGTERM, then SIGKILL after --grace), kill, ignore")
      ->check(CLI::IsMember({"term", "kill", "ignore"}))
      ->capture_default_str();
  cmd->add_option("--wait", o->wait,
                  "Seconds to wait for a held name or memory, first come first served (0: fail at once; inf: until "
                  "interrupted); exit 3 if it stays held")
      ->check(CLI::Validator(
          [](std::string& in) -> std::string {
            return parse_wait(in) ? std::string() : "must be a number of seconds or inf (got " + in + ")";
          },
          "SECONDS|inf"))
      ->capture_default_str();
  add_holder_options(cmd, o->holder);
  cmd->add_flag("--sync-on-exit", o->sync_on_exit,
                "When the command exits, upload the memory to the data plane (mep sync) before the release");
  cmd->add_option("--grace", o->grace, "Seconds between SIGTERM and SIGKILL (never past the lease's expiry)")
      ->check(CLI::Validator(
          [](std::string& in) -> std::string {
            char* end = nullptr;
            const double d = std::strtod(in.c_str(), &end);
            if (end == in.c_str() || *end != '\0' || !(d >= 0))
              return "must be a number of seconds, 0 or more (got " + in + ")";
            return {};
          },
          "SECONDS"))
      ->capture_default_str();
  // The command is what follows NAME and PATH: after `--`, or from the first argument that
  // is not one of run's options (`mep run NAME PATH sh -c 'echo hi'`), like flock(1).
  // Its own copies of the global options, since an argument run does not know is the
  // command's and is not handed up to mep.
  cmd->prefix_command();
  cmd->fallthrough(false);
  cmd->add_flag("--json", g.json, "Print one JSON document on stdout, for machines");
  cmd->add_flag("-v,--verbose", g.verbosity, "More output on stderr (repeat for more)");
  cmd->add_option("--socket", g.socket, "Path of the mepd socket");
  cmd->add_option("--config", g.config_file, "Config file");
  cmd->footer("The command: mep run [OPTIONS] NAME PATH [--] CMD [ARG...]; mep reads no option after CMD.\n"
              "Exit status: the command's (128+N after signal N), 4 when the lease was lost, else as 'mep --help'.\n"
              "The command sees MEP_CANONICAL_NAME, MEP_MEMORY_INSTANCE_ID, MEP_FENCING_TOKEN, MEP_LEASE_ID,\n"
              "MEP_LEASE_EXPIRES_AT. SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2 and SIGALRM are\n"
              "forwarded to its process group; it owns the terminal while it runs.");
  cmd->callback([o, cmd, &g, &action] {
    o->command = cmd->remaining();
    if (g.run_dashes) {
      if (!o->command.empty()) o->command.push_back("--"); // the command's own `--`
      o->command.insert(o->command.end(), g.run_tail.begin(), g.run_tail.end());
    }
    if (o->command.empty()) throw CLI::RequiredError("a command to run (mep run NAME PATH -- CMD [ARG...])");
    o->wait_s = parse_wait(o->wait).value_or(0);
    action = [o, &g] { return run(*o, g); };
  });
}

} // namespace mep::cli
