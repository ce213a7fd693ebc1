/* Helper threads in C that take their share of a kernel call (kernels/native.py, `share_task`).
 *
 * A helper that is a Python thread must be woken through a lock and then win Python's lock before
 * it can call the kernel: tens of microseconds, a large part of a decode step's calls, which last
 * a few hundred. These helpers never touch Python. A call is posted into a ring of slots (the task,
 * its arguments as words, its claim counters); each helper spins on the newest post for a while
 * after its last one, so a step's next call finds it awake, then sleeps on a futex. The caller runs
 * its own share at once and returns when every chunk is done (claims.h): a helper that comes late,
 * or not at all, holds up nothing.
 *
 * A slot's state word is its post's number (seq << 16), an open bit, and the count of helpers
 * inside. A helper joins only an open slot of the post it saw, by compare-and-swap on the whole
 * word, so one that wakes after its slot was reused joins nothing. The caller closes the slot when
 * its share returns, and reuses a slot only when no helper is inside, which with SLOTS slots means
 * a helper held up for SLOTS posts; the slot's words and counters stay valid for whoever is inside.
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef int64_t (*task_fn)(const int64_t *words, int64_t *counters, int64_t thread, int64_t wait);

#define SLOTS 8
#define MAX_WORDS 32
#define MAX_HELPERS 63
#define OPEN ((int64_t)1 << 15)
#define INSIDE (OPEN - 1)
#define SPIN_NS 100000 /* a helper stays awake this long after a post: longer than a step's gaps between calls */

struct slot {
    int64_t state;
    task_fn task;
    int64_t helpers; /* helpers 1 .. helpers take part */
    int64_t counters[2];
    int64_t words[MAX_WORDS];
};

static struct slot slots[SLOTS];
static int64_t posted;       /* the newest post's number */
static int32_t post_signal;  /* the futex sleeping helpers wait on: changes with every post */
static int32_t sleepers;
static int64_t started;
static int64_t joins; /* calls helpers have joined, all told */
static int64_t held; /* while set, helpers join no call (the tests' stand-in for a helper whose core is busy) */
static pthread_mutex_t caller = PTHREAD_MUTEX_INITIALIZER; /* one call posts at a time */
static pthread_mutex_t starting = PTHREAD_MUTEX_INITIALIZER;

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void pause_briefly(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* The number of a post newer than `seen`: spinning for SPIN_NS, then asleep until one comes. */
static int64_t next_post(int64_t seen)
{
    const int64_t until = now_ns() + SPIN_NS;
    for (int spins = 0;; spins++) {
        const int64_t newest = __atomic_load_n(&posted, __ATOMIC_ACQUIRE);
        if (newest != seen)
            return newest;
        if ((spins & 63) == 0 && now_ns() > until)
            break;
        /* Now and then the core goes to whatever else waits for it (the api, the scheduler): a
         * helper that waits for work must not hold them up for a whole time slice. */
        if ((spins & 255) == 255)
            sched_yield();
        else
            pause_briefly();
    }
    for (;;) {
        const int32_t signal = __atomic_load_n(&post_signal, __ATOMIC_SEQ_CST);
        __atomic_fetch_add(&sleepers, 1, __ATOMIC_SEQ_CST);
        const int64_t newest = __atomic_load_n(&posted, __ATOMIC_SEQ_CST);
        if (newest == seen)
            syscall(SYS_futex, &post_signal, FUTEX_WAIT_PRIVATE, signal, NULL, NULL, 0);
        __atomic_fetch_sub(&sleepers, 1, __ATOMIC_SEQ_CST);
        if (newest != seen)
            return newest;
        const int64_t after = __atomic_load_n(&posted, __ATOMIC_ACQUIRE);
        if (after != seen)
            return after;
    }
}

static void *help(void *argument)
{
    const int64_t index = (int64_t)(intptr_t)argument;
    int64_t seen = __atomic_load_n(&posted, __ATOMIC_ACQUIRE);
    for (;;) {
        seen = next_post(seen);
        struct slot *slot = &slots[seen % SLOTS];
        int64_t state = __atomic_load_n(&slot->state, __ATOMIC_ACQUIRE);
        int joined = 0;
        while (!__atomic_load_n(&held, __ATOMIC_ACQUIRE) && (state >> 16) == seen && (state & OPEN) && !joined)
            joined = __atomic_compare_exchange_n(&slot->state, &state, state + 1, 0, __ATOMIC_ACQUIRE,
                                                 __ATOMIC_ACQUIRE);
        if (!joined)
            continue;
        __atomic_fetch_add(&joins, 1, __ATOMIC_RELAXED);
        if (index <= slot->helpers)
            slot->task(slot->words, slot->counters, index, 0);
        __atomic_fetch_sub(&slot->state, 1, __ATOMIC_RELEASE);
    }
    return NULL;
}

/* Starts helpers until there are `count` (at most MAX_HELPERS); returns how many there are. */
int64_t pool_start(int64_t count)
{
    pthread_mutex_lock(&starting);
    count = count < MAX_HELPERS ? count : MAX_HELPERS;
    while (started < count) {
        pthread_t thread;
        pthread_attr_t attributes;
        pthread_attr_init(&attributes);
        pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attributes, help, (void *)(intptr_t)(started + 1));
        pthread_attr_destroy(&attributes);
        if (failed)
            break;
        __atomic_store_n(&started, started + 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&starting);
    return __atomic_load_n(&started, __ATOMIC_ACQUIRE);
}

/* How many calls helpers have joined since the process started (each helper's joins count). */
int64_t pool_joins(void) { return __atomic_load_n(&joins, __ATOMIC_RELAXED); }

/* While `on`, helpers join no call, as though their cores were busy with other work. */
void pool_hold(int64_t on) { __atomic_store_n(&held, on, __ATOMIC_RELEASE); }

/* task(words, counters, thread, wait) on this thread (thread 0, waiting for every chunk) and on
 * helpers 1 .. count - 1; the result of this thread's. A call made while another thread's is posted
 * runs alone. */
int64_t pool_share(task_fn task, const int64_t *words, int64_t word_count, int64_t count)
{
    if (word_count > MAX_WORDS)
        return -1;
    int64_t alone[2] = {0, 0};
    if (count <= 1 || __atomic_load_n(&started, __ATOMIC_ACQUIRE) == 0 || pthread_mutex_trylock(&caller) != 0)
        return task(words, alone, 0, 1);
    const int64_t seq = __atomic_load_n(&posted, __ATOMIC_RELAXED) + 1;
    struct slot *slot = &slots[seq % SLOTS];
    for (int spins = 0; __atomic_load_n(&slot->state, __ATOMIC_ACQUIRE) & INSIDE; spins++) {
        if (spins >= 4096)
            sched_yield();
        else
            pause_briefly();
    }
    slot->task = task;
    slot->helpers = count - 1;
    slot->counters[0] = slot->counters[1] = 0;
    memcpy(slot->words, words, (size_t)word_count * sizeof *words);
    __atomic_store_n(&slot->state, (seq << 16) | OPEN, __ATOMIC_RELEASE);
    __atomic_store_n(&posted, seq, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&post_signal, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&sleepers, __ATOMIC_SEQ_CST) > 0)
        syscall(SYS_futex, &post_signal, FUTEX_WAKE_PRIVATE, MAX_HELPERS, NULL, NULL, 0);
    const int64_t result = task(slot->words, slot->counters, 0, 1);
    __atomic_fetch_and(&slot->state, ~OPEN, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&caller);
    return result;
}

/* The calls of `plan` one after another, each as pool_share makes it: a call is its task, its thread
 * count, its word count and its words, and the next follows its last word. Returns 0, or the number
 * (from 1) of the first call whose result was not 0, after which none runs. */
int64_t pool_replay(const int64_t *plan, int64_t length)
{
    int64_t number = 1;
    for (int64_t at = 0; at + 3 <= length; number++) {
        const int64_t word_count = plan[at + 2];
        if (pool_share((task_fn)(intptr_t)plan[at], plan + at + 3, word_count, plan[at + 1]) != 0)
            return number;
        at += 3 + word_count;
    }
    return 0;
}

/* The argument types of these functions, as kernels/native.py checks them before any call: p a
 * pointer, i an int64_t, f a float; after the colon the result (v: none). */
const char *pool_start_signature(void) { return "i:i"; }
const char *pool_share_signature(void) { return "ppii:i"; }
const char *pool_replay_signature(void) { return "pi:i"; }
const char *pool_hold_signature(void) { return "i:v"; }
const char *pool_joins_signature(void) { return ":i"; }
