// Why bound TCMalloc's thread caches: a server's memory should fall back when its load
// does. TCMalloc keeps what a thread frees in that thread's cache, up to 32 MiB for all
// threads by default, and those blocks then fill its transfer and central free lists as
// well. After bench_server's cells (64 clients at a time), before any lease was held, the
// server's statistics read 18.7 MiB in use by the program and 22.5 MiB in free lists
// (9.0 in thread caches); with the caches bounded at 2 MiB, 4.9 MiB in free lists, and
// RSS holding 100,000 renewed leases fell from 63.9 to 46.2 MiB. Alternating runs of both
// showed no cost in speed (bench/README.md has the figures).
#include "mep/allocator.hpp"

#ifdef MEP_WITH_TCMALLOC
#include <gperftools/malloc_extension_c.h>
#endif

#include <cstdlib>

namespace mep {

bool tune_allocator() noexcept {
#ifdef MEP_WITH_TCMALLOC
  if (!std::getenv("TCMALLOC_MAX_TOTAL_THREAD_CACHE_BYTES"))
    MallocExtension_SetNumericProperty("tcmalloc.max_total_thread_cache_bytes", k_thread_cache_bytes);
  return true;
#else
  return false;
#endif
}

void release_thread_cache() noexcept {
#ifdef MEP_WITH_TCMALLOC
  MallocExtension_MarkThreadTemporarilyIdle();
#endif
}

void release_free_memory() noexcept {
#ifdef MEP_WITH_TCMALLOC
  MallocExtension_ReleaseFreeMemory();
#endif
}

} // namespace mep
