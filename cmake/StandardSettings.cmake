# mep_settings: language level and sanitizers, linked PRIVATE by every mep target.
add_library(mep_settings INTERFACE)
target_compile_features(mep_settings INTERFACE cxx_std_20)
set(CMAKE_CXX_EXTENSIONS OFF)

set(_mep_san "")
if(MEP_SANITIZE_ADDRESS)
  list(APPEND _mep_san address)
endif()
if(MEP_SANITIZE_UNDEFINED)
  list(APPEND _mep_san undefined)
endif()
if(MEP_SANITIZE_THREAD)
  list(APPEND _mep_san thread)
endif()
if(_mep_san)
  list(JOIN _mep_san "," _mep_san_list)
  target_compile_options(mep_settings INTERFACE -fsanitize=${_mep_san_list} -fno-omit-frame-pointer)
  target_link_options(mep_settings INTERFACE -fsanitize=${_mep_san_list})
  if(MEP_SANITIZE_UNDEFINED)
    # A finding ends the process (and fails its test) instead of a line in a log.
    target_compile_options(mep_settings INTERFACE -fno-sanitize-recover=undefined)
  endif()
endif()

# The fuzz build (tests/fuzz, clang): every mep library instrumented for libFuzzer, with
# AddressSanitizer and UndefinedBehaviorSanitizer; the targets link -fsanitize=fuzzer.
if(MEP_FUZZ)
  target_compile_options(mep_settings INTERFACE -fsanitize=fuzzer-no-link,address,undefined
                                                -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
  target_link_options(mep_settings INTERFACE -fsanitize=address,undefined)
endif()

find_program(CCACHE_EXE ccache)
if(CCACHE_EXE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(CMAKE_CXX_COMPILER_LAUNCHER "${CCACHE_EXE}")
endif()
