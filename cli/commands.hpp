// The `mep` commands: each file registers one command (or group) on the CLI11 app.
#pragma once
#include <CLI/App.hpp>

#include "mep/store.hpp"

#include <functional>
#include <memory>
#include <stdexcept>
#include <string>

namespace mep::cli {

/// Options shared by every command (`mep [--socket PATH] [--json] [-v] COMMAND`).
struct GlobalOptions {
  bool json = false;
  int verbosity = 0;
  std::string socket;
  std::string config_file;
  /// `mep run … -- CMD…`: main() parses no further than the `--` and keeps CMD… here, so
  /// that none of the command's own arguments is taken for one of mep's.
  bool run_dashes = false;
  std::vector<std::string> run_tail;
};

/// A registered command's action; returns the process exit code.
using Action = std::function<int()>;

/// A failure the user can act on (an unreachable database, a path that cannot be created):
/// `mep: <message>` on one line and exit code 1, not "internal error".
struct UserError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// A usage error found after parsing (a path mep cannot pass on): `mep: <message>` and the
/// usage status 2.
struct UsageError : UserError {
  using UserError::UserError;
};

/// A config file that cannot be read or parsed: `mep: <message>` and the usage status 2.
struct ConfigError : UsageError {
  using UsageError::UsageError;
};

/// The control-plane store at `url` (server::open_store), its failures as UserError.
std::unique_ptr<server::Store> open_store_or_explain(const std::string& url, const server::StoreOptions& options);

/// The control plane's database URL for `mep server`, `mep token` and `mep migrate`:
/// `flag` (--db, which CLI11 already fills from MEP_DB), else the config file's `db`, else
/// sqlite:$XDG_STATE_HOME/mep/control.db — the order `mep config` reports. A config file
/// that cannot be read throws ConfigError, with or without the flag.
std::string resolve_db_url(const std::string& flag, const GlobalOptions& g);

/// Adds `--db` (also from MEP_DB) to `cmd`, filling `url`. An empty value is refused: it
/// would otherwise stand for the default database, which the user did not name.
CLI::Option* add_db_option(CLI::App* cmd, std::string& url, const std::string& help);

/// Each register_* adds its subcommand to `app` and sets `action` when it is chosen.
void register_canonicalize(CLI::App& app, GlobalOptions& g, Action& action);
void register_server(CLI::App& app, GlobalOptions& g, Action& action);
void register_store(CLI::App& app, GlobalOptions& g, Action& action);
void register_token(CLI::App& app, GlobalOptions& g, Action& action);
void register_lease_commands(CLI::App& app, GlobalOptions& g, Action& action);
void register_run(CLI::App& app, GlobalOptions& g, Action& action);
void register_migrate(CLI::App& app, GlobalOptions& g, Action& action);
void register_fleet(CLI::App& app, GlobalOptions& g, Action& action);
void register_mcp(CLI::App& app, GlobalOptions& g, Action& action);

} // namespace mep::cli
