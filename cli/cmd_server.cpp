// `mep server`: run the control plane; `mep server audit`: list audit rows.
#include "commands.hpp"

#include "mep/config.hpp"
#include "mep/json.hpp"
#include "mep/problem.hpp"
#include "mep/server.hpp"
#include "mep/store.hpp"
#include "mep/time.hpp"

#include <boost/json.hpp>

#include <cstdio>
#include <memory>

namespace mep::cli {

std::string resolve_db_url(const std::string& flag, const GlobalOptions& g) {
  auto cfg = Config::load(g.config_file);
  if (!cfg) throw ConfigError(cfg.error());
  auto url =
      server::check_db_url(flag.empty() ? cfg->get("db", std::nullopt, "--db", server::default_db_url()).value : flag);
  if (!url) throw UsageError(url.error());
  return *url;
}

CLI::Option* add_db_option(CLI::App* cmd, std::string& url, const std::string& help) {
  return cmd->add_option("--db", url, help)
      ->envname("MEP_DB")
      ->check(CLI::Validator(
          [](std::string& in) -> std::string {
            return in.empty() ? "must not be empty (leave --db out for the default database)" : std::string();
          },
          "URL"));
}

std::unique_ptr<server::Store> open_store_or_explain(const std::string& url, const server::StoreOptions& options) {
  try {
    return server::open_store(url, options);
  } catch (const std::exception& e) {
    throw UserError(e.what());
  }
}

void register_server(CLI::App& app, GlobalOptions& g, Action& action) {
  auto opt = std::make_shared<server::ServerOptions>();
  auto* cmd = app.add_subcommand("server", "Run the control plane (the HTTP API of SPEC §6)");
  cmd->require_subcommand(0, 1);
  add_db_option(cmd, opt->db_url,
                "Database URL: sqlite:PATH, postgresql://USER@HOST:PORT/DB or "
                "spanner:projects/P/instances/I/databases/D (default "
                "sqlite:$XDG_STATE_HOME/mep/control.db)");
  auto isolation = std::make_shared<std::string>("read-committed");
  cmd->add_option("--isolation", *isolation,
                  "PostgreSQL transaction isolation: read-committed or serializable (retried on conflicts)")
      ->check(CLI::IsMember({"read-committed", "serializable"}))
      ->capture_default_str();
  cmd->add_option("--db-pool", opt->store.pool,
                  "PostgreSQL connections running lease operations (claims batched, on up to an eighth of them)")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  cmd->add_option("--listen", opt->listen, "HOST:PORT to listen on; port 0 picks a free port")->capture_default_str();
  cmd->add_option("--tls-cert", opt->tls_cert, "PEM certificate chain; enables HTTPS (TLS 1.3 only)");
  cmd->add_option("--tls-key", opt->tls_key, "PEM private key for --tls-cert");
  cmd->add_flag("--insecure-plaintext", opt->insecure_plaintext,
                "Allow plain HTTP on a non-loopback address (behind a TLS proxy)");
  cmd->add_option("--rate-limit", opt->rate_limit, "Requests per second per token; 0 turns it off")
      ->capture_default_str();
  cmd->add_option("--log-level", opt->log_level, "debug, info, warn or error")->capture_default_str();
  cmd->add_option("--threads", opt->threads, "I/O threads")->capture_default_str()->check(CLI::Range(1, 64));
  cmd->add_option("--writer-nice", opt->store.writer_nice,
                  "SQLite: nice value of the thread that commits, best effort (below 0 it needs "
                  "CAP_SYS_NICE or RLIMIT_NICE; batches of renewals alone commit at the process's); 0 leaves it")
      ->capture_default_str()
      ->check(CLI::Range(-20, 19));
  cmd->add_option("--max-hold", opt->max_hold_s,
                  "Longest a lease may be held, in seconds: renewals past it are refused (410, reason max-hold), "
                  "so a hung agent cannot keep a memory forever; a claim's max_hold_seconds may ask for less")
      ->check(CLI::Range(lease::k_min_hold_s, lease::k_max_hold_s));

  auto audit_db = std::make_shared<std::string>();
  auto audit_tenant = std::make_shared<std::string>();
  auto audit_limit = std::make_shared<std::size_t>(100);
  auto* audit = cmd->add_subcommand("audit", "List the newest audit rows (names and ids are HMAC-hashed)");
  add_db_option(audit, *audit_db, "Database URL (default as for mep server)");
  audit->add_option("--tenant", *audit_tenant, "Only this tenant");
  audit->add_option("--limit", *audit_limit, "At most this many rows")->capture_default_str();
  audit->add_flag("--json", g.json, "Print {\"events\": [...]}");
  audit->callback([=, &g, &action] {
    action = [=, &g] {
      server::StoreOptions options;
      options.create = false; // a listing makes no database
      auto store = open_store_or_explain(resolve_db_url(*audit_db, g), options);
      auto rows = store->list_audit(audit_tenant->empty() ? std::nullopt : std::optional(*audit_tenant), *audit_limit);
      if (g.json) {
        boost::json::array arr;
        for (const auto& r : rows) {
          boost::json::object o{{"event_id", r.event_id},
                                {"tenant_id", r.tenant_id},
                                {"event_type", r.event_type},
                                {"redacted_name_hash", r.redacted_name_hash},
                                {"redacted_memory_hash", r.redacted_memory_hash},
                                {"created_at", format_rfc3339_ms(r.created_at)}};
          o["fencing_token"] = r.fencing_token ? boost::json::value(*r.fencing_token) : nullptr;
          arr.emplace_back(std::move(o));
        }
        std::printf("%s\n", json::dump(boost::json::object{{"events", std::move(arr)}}).c_str());
      } else {
        std::printf("%-24s  %-22s  %-16s  %-16s  %s\n", "TIME", "EVENT", "NAME HASH", "MEMORY HASH", "TOKEN");
        for (const auto& r : rows)
          std::printf("%-24s  %-22s  %-16.16s  %-16.16s  %s\n", format_rfc3339_ms(r.created_at).c_str(),
                      r.event_type.c_str(), r.redacted_name_hash.c_str(), r.redacted_memory_hash.c_str(),
                      r.fencing_token ? std::to_string(*r.fencing_token).c_str() : "-");
      }
      return exit_code::ok;
    };
  });

  // Set after `audit` is added, which would otherwise inherit it.
  cmd->footer("Prints 'mep server listening on http://HOST:PORT' on stderr when ready.\n"
              "SIGTERM/SIGINT: stops accepting, finishes requests in flight (at most 5 s), exits 0.");

  cmd->callback([opt, isolation, cmd, &g, &action] {
    if (!cmd->get_subcommands().empty()) return;
    action = [opt, isolation, &g] {
      opt->db_url = resolve_db_url(opt->db_url, g);
      opt->store.isolation =
          *isolation == "serializable" ? server::Isolation::serializable : server::Isolation::read_committed;
      return server::run_server(*opt);
    };
  });
}

} // namespace mep::cli
