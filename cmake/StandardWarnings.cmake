# mep_warnings: the warning set for our own code (never applied to third-party headers).
add_library(mep_warnings INTERFACE)
target_compile_options(mep_warnings INTERFACE
  -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wcast-align -Wunused
  -Woverloaded-virtual -Wimplicit-fallthrough)
if(MEP_WERROR)
  target_compile_options(mep_warnings INTERFACE -Werror)
endif()
