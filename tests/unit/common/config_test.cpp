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

// toml++ 3.3.0 hits undefined behaviour on non-ASCII in some places, so Config::parse hands
// it ASCII only (inputs from tests/fuzz/fuzz_config.cpp and marzer/tomlplusplus #190, #295).
TEST_CASE("config_hands_toml++_ascii_only", "[config]") {
  auto bad = mep::Config::parse("socket = \"/run/mep/mepd.sock\"\ncontrol_psock\xcc\x8czv/mep\"\n", "f.toml");
  REQUIRE_FALSE(bad);
  REQUIRE(bad.error() == "config file f.toml:2: a non-ASCII character outside a quoted string or a comment");
  REQUIRE_FALSE(mep::Config::parse("\xcc\xaa", "f.toml"));
  REQUIRE_FALSE(mep::Config::parse("socket =2122222222;\"\xd1\x92un\n", "f.toml")); // toml++ reads past ';'
  REQUIRE(mep::Config::parse("a = \"\xff\"\n", "f.toml").error() == "config file f.toml:1: invalid UTF-8 in a string");
  REQUIRE(mep::Config::parse("a = \"\xed\xa0\x80\"\n", "f.toml").error() == // a UTF-16 surrogate
          "config file f.toml:1: invalid UTF-8 in a string");
  REQUIRE_FALSE(mep::Config::parse("a = \"\\\xc3\xa9\"\n", "f.toml"));        // backslash-é is no escape
  auto ml = mep::Config::parse("s = \"\"\"\\\n  \xc2\xa7\"\"\"\n", "f.toml"); // #190's input
  REQUIRE(ml);
  REQUIRE(ml->get("s", std::nullopt, "--s", "").value == "\xc2\xa7");

  // Non-ASCII where TOML allows it parses as before: in strings of all four kinds and in
  // comments; a literal string keeps its backslashes and quotes.
  auto ok = mep::Config::parse("\xEF\xBB\xBF# Überschrift: agents of ħ\n"
                               "a = \"/home/zoë/mep\"\n"
                               "b = '/home/文/mep'\n"
                               "c = \"\"\"ﬁ\nß\"\"\"\n"
                               "d = '''π'''\n"
                               "e = \"\"\"x\\\n  y § \"\"\"\"\n"
                               "f = \"q\\\"é\"  # ü\n"
                               "g = 'C:\\n\"𝄞'\n"
                               "h = '''a\\\"'''''\n",
                               "f.toml");
  REQUIRE(ok);
  REQUIRE(ok->get("a", std::nullopt, "--a", "").value == "/home/zoë/mep");
  REQUIRE(ok->get("b", std::nullopt, "--b", "").value == "/home/文/mep");
  REQUIRE(ok->get("c", std::nullopt, "--c", "").value == "ﬁ\nß");
  REQUIRE(ok->get("d", std::nullopt, "--d", "").value == "π");
  REQUIRE(ok->get("e", std::nullopt, "--e", "").value == "xy § \"");
  REQUIRE(ok->get("f", std::nullopt, "--f", "").value == "q\"é");
  REQUIRE(ok->get("g", std::nullopt, "--g", "").value == "C:\\n\"𝄞");
  REQUIRE(ok->get("h", std::nullopt, "--h", "").value == "a\\\"''");

  // Errors keep their line numbers.
  REQUIRE(mep::Config::parse("a = 1\n\nb = 'x\n", "f.toml").error().find("f.toml:3:") != std::string::npos);
  REQUIRE(mep::Config::parse("a = \"é\"\nb = = 1\n", "f.toml").error().find("f.toml:2:") != std::string::npos);
}

TEST_CASE("config_floats_are_refused_not_converted", "[config]") {
  // toml++'s value<int64_t>() on 2.2e43 is undefined behaviour; Config reads by type.
  for (const char* text : {"ttl = 2.2e43\n", "ttl = 40.0\n", "ttl = nan\n"}) {
    INFO(text);
    auto cfg = mep::Config::parse(text, "f.toml");
    REQUIRE_FALSE(cfg);
    REQUIRE(cfg.error() == "config file f.toml: key \"ttl\" must be a string, integer or boolean");
  }
  auto cfg = mep::Config::parse("ttl = 40\nflag = true\n", "f.toml");
  REQUIRE(cfg);
  REQUIRE(cfg->get("ttl", std::nullopt, "--ttl", "").value == "40");
  REQUIRE(cfg->get("flag", std::nullopt, "--flag", "").value == "true");
}
