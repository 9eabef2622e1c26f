# Third-party libraries, all from Debian 12 packages (packaging/install-deps.sh).
find_package(Threads REQUIRED)
find_package(PkgConfig REQUIRED)
find_package(ICU 72 REQUIRED COMPONENTS uc i18n)
find_package(SQLite3 REQUIRED)
find_package(OpenSSL 3 REQUIRED)
find_package(PostgreSQL REQUIRED)
find_package(CURL REQUIRED)
find_package(fmt REQUIRED)
find_package(CLI11 CONFIG REQUIRED)
find_package(Boost 1.81.0 EXACT CONFIG REQUIRED COMPONENTS json url)
if(MEP_BUILD_TESTS)
  find_package(Catch2 2 REQUIRED)
endif()
if(MEP_BUILD_BENCH)
  find_package(benchmark REQUIRED)
endif()
# tl::expected is header-only (libexpected-dev); toml++ as well (libtomlplusplus-dev).
find_path(TL_EXPECTED_INCLUDE_DIR tl/expected.hpp REQUIRED)

# The allocator of the binaries that serve (mep: server and store; mepd: the daemon and its
# embedded control plane): TCMalloc from gperftools (libgoogle-perftools-dev). A request's
# buffers are allocated on one thread and freed on another (the commit thread and the I/O
# threads); glibc's malloc returns each such block to its arena under that arena's lock,
# TCMalloc to a per-thread cache. bench/README says what it bought, measured side by side.
# (jemalloc did as well, but it cannot start under libfaketime, which the clock tests use,
# and its upstream is archived; mimalloc was slower.) AddressSanitizer, ThreadSanitizer and
# libFuzzer bring their own allocator: those builds keep it.
if(MEP_TCMALLOC AND (MEP_SANITIZE_ADDRESS OR MEP_SANITIZE_THREAD OR MEP_FUZZ))
  message(STATUS "mep: sanitizer build, TCMalloc left out (the sanitizer's allocator serves)")
  set(MEP_TCMALLOC OFF)
endif()
# mep_allocator also bounds what TCMalloc keeps in its thread caches (common/allocator.cpp
# says why): mep and mepd call mep::tune_allocator() first in main.
add_library(mep_allocator STATIC ${PROJECT_SOURCE_DIR}/common/allocator.cpp)
target_include_directories(mep_allocator PUBLIC ${PROJECT_SOURCE_DIR}/common)
target_link_libraries(mep_allocator PRIVATE mep_settings mep_warnings)
if(MEP_TCMALLOC)
  pkg_check_modules(TCMALLOC REQUIRED IMPORTED_TARGET libtcmalloc_minimal)
  target_link_libraries(mep_allocator PUBLIC PkgConfig::TCMALLOC)
  target_compile_definitions(mep_allocator PUBLIC MEP_WITH_TCMALLOC)
endif()
