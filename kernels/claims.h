/* A kernel call shared by threads that claim its chunks one at a time (kernels/native.py, `share`).
 *
 * counters[0] is the next chunk to claim and counters[1] the number finished, both zero when the
 * call starts. The calling thread claims chunks as its helpers do, so a helper that starts late,
 * or not at all because its core is busy with other work, leaves more chunks to the caller rather
 * than holding it up; the caller then waits only for chunks a helper has claimed and not yet
 * finished. A helper that arrives after the last chunk was claimed touches nothing. A thread may claim
 * its next chunk as its current one nears its end (next_chunk_first), so one held up holds two at most. */
#ifndef PAGEDSERVE_CLAIMS_H
#define PAGEDSERVE_CLAIMS_H

#include <sched.h>
#include <stdint.h>

static inline int64_t claim_chunk(int64_t *counters)
{
    return __atomic_fetch_add(&counters[0], 1, __ATOMIC_RELAXED);
}

/* Release: the chunk's writes are seen by whoever sees it counted. */
static inline void finish_chunk(int64_t *counters)
{
    __atomic_fetch_add(&counters[1], 1, __ATOMIC_RELEASE);
}

/* Claims a thread's next chunk early, into *next, while the last panels of its current chunk (of units_per_chunk
 * panels, unit_chunks to a block of rows) can still ask for the first panels of it; returns that first panel, or
 * `count` (past the last) where every chunk is claimed. */
static inline int64_t next_chunk_first(int64_t *counters, int64_t *next, int64_t chunks, int64_t unit_chunks,
                                       int64_t units_per_chunk, int64_t count)
{
    *next = claim_chunk(counters);
    return *next < chunks ? *next % unit_chunks * units_per_chunk : count;
}

/* The panel `distance` after panel p in this thread's order: in its chunk, which ends before `last`, or else in
 * the next chunk it claimed, whose first panel is next_first (`count` or past where there is none). */
static inline int64_t panel_after(int64_t p, int64_t distance, int64_t last, int64_t next_first)
{
    return p + distance < last ? p + distance : next_first + p + distance - last;
}

/* For the caller: until every chunk is finished. Spins briefly (a helper's chunk ends within
 * microseconds), then yields the core, as the helper it waits for may need it. */
static inline void wait_for_chunks(int64_t *counters, int64_t chunks)
{
    for (int spins = 0; __atomic_load_n(&counters[1], __ATOMIC_ACQUIRE) < chunks; spins++) {
        if (spins >= 4096)
            sched_yield();
#if defined(__x86_64__) || defined(__i386__)
        else
            __builtin_ia32_pause();
#endif
    }
}

/* A float among a task's words: helper_pool.c hands a kernel its arguments as 64-bit words, a float as its bits. */
static inline float float_of_bits(int64_t word)
{
    const uint32_t bits = (uint32_t)word;
    float value;
    __builtin_memcpy(&value, &bits, sizeof value);
    return value;
}

#endif
