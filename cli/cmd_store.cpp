// `mep store`: run the reference fenced object store (SPEC §8).
#include "commands.hpp"

#include "mep/store_server.hpp"

namespace mep::cli {

void register_store(CLI::App& app, GlobalOptions&, Action& action) {
  auto opt = std::make_shared<store::StoreServerOptions>();
  auto* cmd = app.add_subcommand("store", "Run the data plane: a fenced object store for .uai snapshots");
  cmd->add_option("--listen", opt->listen, "HOST:PORT to listen on; port 0 picks a free port")->capture_default_str();
  cmd->add_option("--dir", opt->dir, "Data directory (default $XDG_STATE_HOME/mep/store)");
  cmd->add_option("--token-file", opt->token_file,
                  "Accepted bearer tokens: one SHA-256 (hex) per line, made with 'mep token hash'");
  cmd->add_flag("--strict", opt->strict,
                "Check every request with the control plane (fence/verify with the writer's own token)");
  cmd->add_option("--control-plane", opt->control_plane, "URL of the mep server that --strict asks");
  cmd->add_option("--ca-file", opt->ca_file,
                  "PEM certificates to trust for an https:// --control-plane, instead of the system's (a private CA)");
  cmd->add_option("--max-object-size", opt->max_object_size, "Largest object in bytes (1024, 64MiB, 1GiB…)")
      ->transform(CLI::AsSizeValue(false))
      ->default_str("1GiB");
  cmd->add_option("--tls-cert", opt->tls_cert, "PEM certificate chain; enables HTTPS (TLS 1.3 only)");
  cmd->add_option("--tls-key", opt->tls_key, "PEM private key for --tls-cert");
  cmd->add_flag("--insecure-plaintext", opt->insecure_plaintext,
                "Allow plain HTTP on a non-loopback address (behind a TLS proxy)");
  cmd->add_option("--log-level", opt->log_level, "debug, info, warn or error")->capture_default_str();
  cmd->add_option("--threads", opt->threads, "I/O threads")->capture_default_str()->check(CLI::Range(1, 64));
  cmd->footer("Prints 'mep store listening on http://HOST:PORT' on stderr when ready.\n"
              "SIGTERM/SIGINT: stops accepting, finishes requests in flight (at most 30 s), exits 0.");
  cmd->callback([opt, &action] { action = [opt] { return store::run_store(*opt); }; });
}

} // namespace mep::cli
