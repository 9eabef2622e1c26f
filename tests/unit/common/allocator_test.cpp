#include "mep/allocator.hpp"

#include <catch2/catch.hpp>

#include <cstdlib>
#include <memory>
#include <vector>

#ifdef MEP_WITH_TCMALLOC
#include <gperftools/malloc_extension_c.h>

namespace {
std::size_t thread_cache_bound() {
  std::size_t v = 0;
  REQUIRE(MallocExtension_GetNumericProperty("tcmalloc.max_total_thread_cache_bytes", &v));
  return v;
}
} // namespace

TEST_CASE("tune_allocator bounds TCMalloc's thread caches") {
  ::unsetenv("TCMALLOC_MAX_TOTAL_THREAD_CACHE_BYTES");
  REQUIRE(MallocExtension_SetNumericProperty("tcmalloc.max_total_thread_cache_bytes", 32u << 20));
  REQUIRE(mep::tune_allocator());
  CHECK(thread_cache_bound() == mep::k_thread_cache_bytes);
}

TEST_CASE("tune_allocator leaves the bound an operator set in the environment") {
  // TCMalloc read the variable when it started; what matters is that tune_allocator does
  // not overwrite it afterwards.
  ::setenv("TCMALLOC_MAX_TOTAL_THREAD_CACHE_BYTES", "8388608", 1);
  REQUIRE(MallocExtension_SetNumericProperty("tcmalloc.max_total_thread_cache_bytes", 8u << 20));
  REQUIRE(mep::tune_allocator());
  CHECK(thread_cache_bound() == (8u << 20));
  ::unsetenv("TCMALLOC_MAX_TOTAL_THREAD_CACHE_BYTES");
}
TEST_CASE("release_thread_cache empties the calling thread's cache") {
  {
    std::vector<std::unique_ptr<char[]>> blocks; // freed below: left in this thread's cache
    for (int i = 0; i < 2000; ++i) blocks.emplace_back(new char[64 + (i % 16) * 32]);
  }
  const std::size_t before = MallocExtension_GetThreadCacheSize();
  REQUIRE(before > 64 * 1024);
  mep::release_thread_cache();
  CHECK(MallocExtension_GetThreadCacheSize() < before / 8);
}

TEST_CASE("release_free_memory returns the page heap's free pages to the system") {
  {
    std::vector<std::unique_ptr<char[]>> blocks; // large blocks come from the page heap
    for (int i = 0; i < 64; ++i) blocks.emplace_back(new char[1u << 20]);
    for (auto& b : blocks) b[0] = 1;
  }
  std::size_t free_before = 0, free_after = 0;
  REQUIRE(MallocExtension_GetNumericProperty("tcmalloc.pageheap_free_bytes", &free_before));
  REQUIRE(free_before >= (32u << 20));
  mep::release_free_memory();
  REQUIRE(MallocExtension_GetNumericProperty("tcmalloc.pageheap_free_bytes", &free_after));
  CHECK(free_after < free_before / 8);
}
#else
TEST_CASE("tune_allocator is a no-op without TCMalloc") {
  WARN("built without TCMalloc (a sanitizer or -DMEP_TCMALLOC=OFF build): only the no-op is checked");
  CHECK_FALSE(mep::tune_allocator());
}
#endif
