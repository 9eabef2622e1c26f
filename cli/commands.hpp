// The `mep` commands: each file registers one command (or group) on the CLI11 app.
#pragma once
#include <CLI/App.hpp>

#include <functional>
#include <string>

namespace mep::cli {

/// Options shared by every command (`mep [--socket PATH] [--json] [-v] COMMAND`).
struct GlobalOptions {
  bool json = false;
  int verbosity = 0;
  std::string socket;
  std::string config_file;
};

/// A registered command's action; returns the process exit code.
using Action = std::function<int()>;

/// The control plane's database URL for `mep server`, `mep token` and `mep migrate`:
/// `flag` (--db, which CLI11 already fills from MEP_DB), else the config file's `db`, else
/// sqlite:$XDG_STATE_HOME/mep/control.db — the order `mep config` reports. A config file
/// that cannot be read is ignored here (`mep config` reports it).
std::string resolve_db_url(const std::string& flag, const GlobalOptions& g);

/// Each register_* adds its subcommand to `app` and sets `action` when it is chosen.
void register_canonicalize(CLI::App& app, GlobalOptions& g, Action& action);
void register_server(CLI::App& app, GlobalOptions& g, Action& action);
void register_token(CLI::App& app, GlobalOptions& g, Action& action);
void register_lease_commands(CLI::App& app, GlobalOptions& g, Action& action);
void register_run(CLI::App& app, GlobalOptions& g, Action& action);
void register_migrate(CLI::App& app, GlobalOptions& g, Action& action);

} // namespace mep::cli
