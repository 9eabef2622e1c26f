// The one Catch2 main shared by mep's unit-test executables.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
