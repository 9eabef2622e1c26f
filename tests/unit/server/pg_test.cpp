// The pure parts of the libpq layer: array literals and URL recognition.
#include "mep/pg.hpp"

#include <catch2/catch.hpp>

using namespace mep::pg;

TEST_CASE("text arrays quote every element and escape quotes and backslashes") {
  CHECK(text_array({}) == "{}");
  CHECK(text_array({"a"}) == "{\"a\"}");
  CHECK(text_array({"a", ""}) == "{\"a\",\"\"}");
  CHECK(text_array({"NULL"}) == "{\"NULL\"}"); // quoted: the text NULL, not SQL NULL
  CHECK(text_array({"x\"y", "b\\s", "c,d", "{e}"}) == "{\"x\\\"y\",\"b\\\\s\",\"c,d\",\"{e}\"}");
  CHECK(text_array({"café"}) == "{\"café\"}");
}

TEST_CASE("parameter arrays: NULL unquoted for an absent element, every other element quoted") {
  CHECK(param_array({}) == "{}");
  CHECK(param_array({std::nullopt}) == "{NULL}");
  CHECK(param_array({Param("NULL"), std::nullopt, Param("")}) == "{\"NULL\",NULL,\"\"}");
  CHECK(param_array({Param("12"), Param("t"), Param("{\"a\": \"b\\\\c\"}")}) ==
        "{\"12\",\"t\",\"{\\\"a\\\": \\\"b\\\\\\\\c\\\"}\"}");
}

TEST_CASE("integer arrays") {
  CHECK(int_array({}) == "{}");
  CHECK(int_array({1, -2, 9223372036854775807LL}) == "{1,-2,9223372036854775807}");
}

TEST_CASE("PostgreSQL URLs are recognized by scheme") {
  CHECK(is_pg_url("postgresql://u@127.0.0.1:5432/db"));
  CHECK(is_pg_url("postgres://u@h/db"));
  CHECK_FALSE(is_pg_url("sqlite:/tmp/x.db"));
  CHECK_FALSE(is_pg_url("/tmp/postgresql://x"));
  CHECK_FALSE(is_pg_url("mysql://h/db"));
}

TEST_CASE("a connection that cannot be made is an Error saying so, not a crash") {
  // Port 1 on loopback refuses at once.
  try {
    Conn c("postgresql://nobody@127.0.0.1:1/none?connect_timeout=2");
    FAIL("connected to port 1");
  } catch (const Error& e) {
    CHECK(e.connection_lost());
    CHECK_FALSE(e.retryable());
    CHECK(std::string(e.what()).find("cannot connect to PostgreSQL") != std::string::npos);
    CHECK(std::string(e.what()).find('\n') == std::string::npos); // one line for the CLI and logs
  }
}
