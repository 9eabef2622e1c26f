// `mep token create|list|revoke`: bearer tokens for the control plane. Tokens are shown
// once, at creation, and stored only as SHA-256. `mep token new|hash`: tokens for services
// that keep a file of accepted hashes (mep store --token-file).
#include "commands.hpp"

#include "mep/crypto.hpp"
#include "mep/json.hpp"
#include "mep/problem.hpp"
#include "mep/random.hpp"
#include "mep/store.hpp"
#include "mep/time.hpp"

#include <boost/json.hpp>

#include <cstdio>
#include <iostream>
#include <memory>

namespace mep::cli {

namespace {
// `create`: whether a missing SQLite database is made (only by `token create`).
std::unique_ptr<server::Store> open(const std::string& db, const GlobalOptions& g, bool create) {
  server::StoreOptions options;
  options.pool = 1; // one short command: one worker connection is plenty
  options.create = create;
  return open_store_or_explain(resolve_db_url(db, g), options);
}
} // namespace

void register_token(CLI::App& app, GlobalOptions& g, Action& action) {
  auto* cmd = app.add_subcommand("token", "Create, list and revoke control-plane bearer tokens");
  cmd->require_subcommand(1);

  struct CreateOpts {
    std::string db, tenant, scope = "lease";
    bool admin = false;
  };
  auto c = std::make_shared<CreateOpts>();
  auto* create = cmd->add_subcommand("create", "Create a token (and the tenant if new); prints the token once");
  add_db_option(create, c->db, "Database URL (default sqlite:$XDG_STATE_HOME/mep/control.db)");
  create->add_option("--tenant", c->tenant, "Tenant name")->required();
  create->add_option("--scope", c->scope, "lease or admin (admin includes lease)")
      ->check(CLI::IsMember({"lease", "admin"}))
      ->capture_default_str();
  create->add_flag("--admin", c->admin, "Same as --scope admin");
  create->add_flag("--json", g.json, "Print {\"tenant_id\", \"token\"}");
  create->callback([c, &g, &action] {
    action = [c, &g] {
      auto store = open(c->db, g, true);
      auto scope = c->admin || c->scope == "admin" ? server::Scope::admin : server::Scope::lease;
      auto [tenant_id, token] = store->create_token(c->tenant, scope);
      if (g.json)
        std::printf("%s\n", json::dump(boost::json::object{{"tenant_id", tenant_id}, {"token", token}}).c_str());
      else
        std::printf("%s\n", token.c_str());
      return exit_code::ok;
    };
  });

  auto list_db = std::make_shared<std::string>();
  auto list_tenant = std::make_shared<std::string>();
  auto* list = cmd->add_subcommand("list", "List tokens (ids, tenants, scopes; never the tokens)");
  add_db_option(list, *list_db, "Database URL");
  list->add_option("--tenant", *list_tenant, "Only this tenant");
  list->add_flag("--json", g.json, "JSON output");
  list->callback([=, &g, &action] {
    action = [=, &g] {
      auto store = open(*list_db, g, false);
      auto tokens = store->list_tokens(list_tenant->empty() ? std::nullopt : std::optional(*list_tenant));
      if (g.json) {
        boost::json::array arr;
        for (const auto& t : tokens) {
          boost::json::object o{{"token_id", t.token_id},
                                {"tenant_id", t.tenant_id},
                                {"tenant", t.tenant_name},
                                {"scopes", t.scopes},
                                {"created_at", format_rfc3339_ms(t.created_at)}};
          o["revoked_at"] = t.revoked_at ? boost::json::value(format_rfc3339_ms(*t.revoked_at)) : nullptr;
          arr.emplace_back(std::move(o));
        }
        std::printf("%s\n", json::dump(boost::json::object{{"tokens", std::move(arr)}}).c_str());
      } else {
        std::printf("%-36s  %-20s  %-12s  %-24s  %s\n", "TOKEN ID", "TENANT", "SCOPES", "CREATED", "REVOKED");
        for (const auto& t : tokens)
          std::printf("%-36s  %-20s  %-12s  %-24s  %s\n", t.token_id.c_str(), t.tenant_name.c_str(), t.scopes.c_str(),
                      format_rfc3339_ms(t.created_at).c_str(),
                      t.revoked_at ? format_rfc3339_ms(*t.revoked_at).c_str() : "-");
      }
      return exit_code::ok;
    };
  });

  auto* fresh = cmd->add_subcommand("new", "Print a new random bearer token (256 bits), stored nowhere");
  fresh->add_flag("--json", g.json, "Print {\"token\"}");
  fresh->callback([&g, &action] {
    action = [&g] {
      const std::string token = "mep_" + random_hex(32);
      if (g.json)
        std::printf("%s\n", json::dump(boost::json::object{{"token", token}}).c_str());
      else
        std::printf("%s\n", token.c_str());
      return exit_code::ok;
    };
  });

  auto hash_token = std::make_shared<std::string>();
  auto* hash = cmd->add_subcommand(
      "hash", "Print the SHA-256 of a token (or of each line on stdin): the lines of mep store --token-file");
  hash->add_option("token", *hash_token, "The token (default: read one per line from stdin)");
  hash->add_flag("--json", g.json, "One {\"sha256\"} per token, one per line");
  hash->callback([=, &g, &action] {
    action = [=, &g] {
      auto print = [&g](const std::string& token) {
        if (g.json)
          std::printf("%s\n", json::dump(boost::json::object{{"sha256", sha256_hex(token)}}).c_str());
        else
          std::printf("%s\n", sha256_hex(token).c_str());
      };
      if (!hash_token->empty()) {
        print(*hash_token);
        return exit_code::ok;
      }
      int n = 0;
      for (std::string line; std::getline(std::cin, line);) {
        while (!line.empty() && (line.back() == '\r' || line.back() == ' ' || line.back() == '\t')) line.pop_back();
        if (line.empty()) continue;
        print(line);
        ++n;
      }
      if (n == 0) {
        std::fprintf(stderr, "mep: no token on stdin (give one as an argument, or one per line)\n");
        return exit_code::usage;
      }
      return exit_code::ok;
    };
  });

  auto rv_db = std::make_shared<std::string>();
  auto rv_id = std::make_shared<std::string>();
  auto* revoke = cmd->add_subcommand("revoke", "Revoke a token by its id (see mep token list)");
  add_db_option(revoke, *rv_db, "Database URL");
  revoke->add_option("token_id", *rv_id, "The token id")->required();
  revoke->add_flag("--json", g.json, "Print {\"token_id\", \"revoked\": true}");
  revoke->callback([=, &g, &action] {
    action = [=, &g] {
      auto store = open(*rv_db, g, false);
      if (!store->revoke_token(*rv_id)) {
        std::fprintf(stderr, "mep: no active token with id %s\n", rv_id->c_str());
        return exit_code::other;
      }
      if (g.json) std::printf("%s\n", json::dump(boost::json::object{{"token_id", *rv_id}, {"revoked", true}}).c_str());
      return exit_code::ok;
    };
  });
}

} // namespace mep::cli
