// What the allocator of the binaries that serve (mep, mepd) keeps for itself.
#pragma once
#include <cstddef>

namespace mep {

/// The bound tune_allocator() puts on the bytes TCMalloc keeps in its per-thread caches,
/// all threads together (its own default is 32 MiB).
inline constexpr std::size_t k_thread_cache_bytes = 2u << 20;

/// Called first in main by mep and mepd. With TCMalloc: bounds its per-thread caches to
/// k_thread_cache_bytes, unless TCMALLOC_MAX_TOTAL_THREAD_CACHE_BYTES is set (the
/// operator's choice stands). Without TCMalloc (a sanitizer build, -DMEP_TCMALLOC=OFF):
/// nothing. Returns whether TCMalloc is the allocator.
bool tune_allocator() noexcept;

/// For a thread that may now idle a while (a worker of a pool, between jobs): what its
/// cache holds goes back to the allocator's shared lists. The bound above does not take
/// a thread's cache below TCMalloc's floor: mepd holding 10,000 leases had 18.1 MiB in
/// the caches of its 71 threads (64 of them workers) and 8.7 MiB in use. Without
/// TCMalloc: nothing.
void release_thread_cache() noexcept;

/// For a process whose load has just ended: the free pages the allocator keeps (its page
/// heap) go back to the system. After 64 agents attached and detached at once, mepd's page
/// heap held 8.2 MiB it no longer used. It walks the heap: call it when going idle, not per
/// request. Without TCMalloc: nothing.
void release_free_memory() noexcept;

} // namespace mep
