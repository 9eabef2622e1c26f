// `mep migrate plan|run|activate|status` (SPEC §10).
#include "commands.hpp"

#include "mep/migrate.hpp"
#include "mep/store.hpp"

#include <memory>

namespace mep::cli {

void register_migrate(CLI::App& app, GlobalOptions& g, Action& action) {
  auto* cmd = app.add_subcommand("migrate", "Bring legacy agent names and memories under the new rules");
  cmd->require_subcommand(1);
  auto add_common = [&](CLI::App* sub, server::MigrateOptions& o) {
    add_db_option(sub, o.db_url, "Control-plane database (default sqlite:$XDG_STATE_HOME/mep/control.db)");
    auto* in = sub->add_option("--input", o.input_file,
                               "Legacy rows as JSON Lines or CSV: legacy_id, display_name, "
                               "created_at, legacy_memory_ref[, memory_instance_id]");
    auto* tab = sub->add_option("--from-table", o.from_table, "Read the same columns from this table of the database");
    in->excludes(tab);
    sub->add_option("--report", o.report_file, "Write one JSON line per legacy row to FILE");
    sub->add_option("--tenant", o.tenant, "Tenant that owns the migrated memories")->capture_default_str();
  };
  auto plan = std::make_shared<server::MigrateOptions>();
  auto* p = cmd->add_subcommand("plan", "Dry run: compute and print the report, write nothing");
  add_common(p, *plan);
  p->callback([plan, &g, &action] {
    action = [plan, &g] {
      plan->dry_run = true;
      plan->json = g.json;
      plan->db_url = resolve_db_url(plan->db_url, g);
      return server::migrate_run(*plan);
    };
  });
  auto run = std::make_shared<server::MigrateOptions>();
  auto* r = cmd->add_subcommand("run", "Migrate (resumable and idempotent: a second run changes nothing)");
  add_common(r, *run);
  r->add_option("--batch", run->batch, "Rows per transaction")->capture_default_str()->check(CLI::PositiveNumber);
  r->callback([run, &g, &action] {
    action = [run, &g] {
      run->json = g.json;
      run->db_url = resolve_db_url(run->db_url, g);
      return server::migrate_run(*run);
    };
  });
  auto act_db = std::make_shared<std::string>();
  auto* a =
      cmd->add_subcommand("activate", "Open the lease endpoints (they answer 503 while a migration is in progress)");
  add_db_option(a, *act_db, "Control-plane database");
  a->callback([act_db, &g, &action] {
    action = [act_db, &g] { return server::migrate_activate(resolve_db_url(*act_db, g), g.json); };
  });
  auto st_db = std::make_shared<std::string>();
  auto* s = cmd->add_subcommand("status", "Counts of migrated rows, identity-map size and the enforcement flag");
  add_db_option(s, *st_db, "Control-plane database");
  s->callback([st_db, &g, &action] {
    action = [st_db, &g] { return server::migrate_status(resolve_db_url(*st_db, g), g.json); };
  });
}

} // namespace mep::cli
