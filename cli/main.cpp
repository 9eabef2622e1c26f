// mep: the command-line interface (SPEC §7). One file per command; this file wires them.
#include "commands.hpp"

#include "mep/allocator.hpp"
#include "mep/problem.hpp"
#include "mep/standard_streams.hpp"

#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

#ifndef MEP_VERSION
#define MEP_VERSION "0.0.0"
#endif

int main(int argc, char** argv) {
  if (!mep::open_standard_streams()) return 1;
  mep::tune_allocator(); // before the server and the store allocate
  using namespace mep::cli;
  // 1. Declare the global options and every command.
  CLI::App app{"mep: globally unique agent names and fenced leases on .uai memory files", "mep"};
  app.set_version_flag("--version", std::string("mep ") + MEP_VERSION);
  app.require_subcommand(1);
  app.fallthrough(true); // global options (--json, --socket, -v) may follow the command
  GlobalOptions g;
  app.add_flag("--json", g.json, "Print one JSON document on stdout, for machines");
  app.add_flag("-v,--verbose", g.verbosity, "More output on stderr (repeat for more)");
  app.add_option("--socket", g.socket,
                 "Path of the mepd socket (default: $MEP_SOCKET, "
                 "$XDG_RUNTIME_DIR/mep/mepd.sock, /run/mep/mepd.sock)");
  app.add_option("--config", g.config_file, "Config file (default ~/.config/mep/config.toml)");
  app.footer("Exit status: 0 ok, 1 other error, 2 usage, 3 held/locked, 4 lost/stale/expired, 5 unavailable\n"
             "(mepd not running), 6 invalid name, 7 auth. 'man mep' has the details.");
  Action action;
  register_canonicalize(app, g, action);
  register_server(app, g, action);
  register_store(app, g, action);
  register_token(app, g, action);
  register_lease_commands(app, g, action);
  register_run(app, g, action);
  register_migrate(app, g, action);
  register_fleet(app, g, action);
  register_mcp(app, g, action);

  // 2. Parse; usage errors exit 2 with one line on stderr. What follows `mep run`'s `--`
  //    is the command's, and is not parsed at all.
  int parsed = argc;
  int run = 1; // the command: the first argument that is not a global option
  while (run < argc) {
    std::string_view a = argv[run];
    if (a == "--socket" || a == "--config")
      run += 2;
    else if (a == "--json" || a == "--verbose" ||
             (a.size() > 1 && a[0] == '-' && a.find_first_not_of('v', 1) == a.npos) || a.rfind("--socket=", 0) == 0 ||
             a.rfind("--config=", 0) == 0)
      ++run;
    else
      break;
  }
  if (run < argc && argv[run][0] != '-') {
    // CLI11 would say "A subcommand is required" for a command it does not know.
    const std::string_view word = argv[run];
    const auto known = app.get_subcommands([&](CLI::App* sub) { return sub->get_name() == word; });
    if (known.empty()) {
      std::fprintf(stderr, "mep: unknown command '%s'\nRun 'mep --help' for the commands.\n", argv[run]);
      return mep::exit_code::usage;
    }
  }
  if (run < argc && std::string_view(argv[run]) == "run") {
    for (int i = run + 1; i < argc; ++i) {
      if (std::string_view(argv[i]) != "--") continue;
      g.run_dashes = true;
      g.run_tail.assign(argv + i + 1, argv + argc);
      parsed = i;
      break;
    }
  }
  try {
    app.parse(parsed, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "mep: %s\nRun 'mep --help' for usage.\n", e.what());
    return mep::exit_code::usage;
  }

  // 3. Run the chosen command; anything unexpected is a bug reported on one line.
  try {
    return action ? action() : mep::exit_code::usage;
  } catch (const mep::cli::UsageError& e) {
    std::fprintf(stderr, "mep: %s\n", e.what());
    return mep::exit_code::usage;
  } catch (const mep::cli::UserError& e) {
    std::fprintf(stderr, "mep: %s\n", e.what());
    return mep::exit_code::other;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mep: internal error: %s\n", e.what());
    return mep::exit_code::other;
  }
}
