// Configuration precedence: flag > MEP_* environment > config file > default.
#include "mep/config.hpp"

#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <unistd.h>

namespace fs = std::filesystem;

namespace {
fs::path temp_file(const std::string& text) {
  fs::path p = fs::temp_directory_path() / ("mep-config-test-" + std::to_string(::getpid()) + ".toml");
  std::ofstream(p) << text;
  return p;
}
} // namespace

TEST_CASE("config_precedence_flag_env_file_default", "[config]") {
  auto path = temp_file("control_plane = \"http://file:1\"\nttl = 40\n");
  auto cfg = mep::Config::load(path);
  REQUIRE(cfg);
  ::unsetenv("MEP_CONTROL_PLANE");
  auto s = cfg->get("control_plane", std::nullopt, "--control-plane", "default-url");
  REQUIRE(s.value == "http://file:1");
  REQUIRE(s.source == "file " + path.string());
  REQUIRE(cfg->get("ttl", std::nullopt, "--ttl", "30").value == "40");

  ::setenv("MEP_CONTROL_PLANE", "http://env:2", 1);
  s = cfg->get("control_plane", std::nullopt, "--control-plane", "default-url");
  REQUIRE(s.value == "http://env:2");
  REQUIRE(s.source == "env MEP_CONTROL_PLANE");

  s = cfg->get("control_plane", std::string("http://flag:3"), "--control-plane", "default-url");
  REQUIRE(s.value == "http://flag:3");
  REQUIRE(s.source == "flag --control-plane");
  ::unsetenv("MEP_CONTROL_PLANE");

  s = cfg->get("token_file", std::nullopt, "--token-file", "/x");
  REQUIRE(s.value == "/x");
  REQUIRE(s.source == "default");
  fs::remove(path);
}

TEST_CASE("config_errors_are_reported_with_the_line", "[config]") {
  auto path = temp_file("a = \"ok\"\nb = = 3\n");
  auto cfg = mep::Config::load(path);
  REQUIRE_FALSE(cfg);
  REQUIRE(cfg.error().find(":2:") != std::string::npos);
  fs::remove(path);
  REQUIRE_FALSE(mep::Config::load("/nonexistent/mep.toml"));
}

TEST_CASE("config_missing_default_file_is_fine", "[config]") {
  auto dir = fs::temp_directory_path() / ("mep-xdg-" + std::to_string(::getpid()));
  ::setenv("XDG_CONFIG_HOME", dir.c_str(), 1);
  auto cfg = mep::Config::load();
  REQUIRE(cfg);
  REQUIRE(cfg->file().empty());
  ::unsetenv("XDG_CONFIG_HOME");
}
