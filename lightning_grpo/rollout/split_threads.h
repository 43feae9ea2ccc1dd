/* Splitting a kernel's columns between threads (small_matmul.c, tile_matmul.c, decode_attention.c); native_build.py
 * hashes it with them.
 *
 * The shares of a call other than the first run on worker threads kept for the life of the process (each kernel
 * library has its own), started when a call first asks for them: a decode step makes a few hundred calls of tens to
 * hundreds of microseconds each, and starting a thread for each would cost tens of microseconds (more in a virtual
 * machine, which must wake an idle core). A call uses no more threads than it has units of work. A worker waiting
 * for the next call spins for up to SPIN_NS (the next call of a decode step comes within microseconds), yielding its
 * core to any other runnable thread meanwhile, then sleeps on a condition variable. One call runs at a time; a child
 * forked from the process starts its own workers.
 */
#ifndef LIGHTNING_GRPO_SPLIT_THREADS_H
#define LIGHTNING_GRPO_SPLIT_THREADS_H

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#define MAX_THREADS 64
#ifndef SPIN_NS
#define SPIN_NS 50000
#endif

/* The work on columns begin .. end of one problem. */
typedef void (*ColumnWork)(const void *problem, int64_t begin, int64_t end);

typedef struct {
    ColumnWork work;
    const void *problem;
    int64_t begin, end;
} ColumnShare;

/* A worker's mailbox: a new ticket means a new share to run. */
typedef struct {
    atomic_ulong ticket;
    pthread_cond_t wake;
    ColumnShare share;
} Worker;

static struct {
    pthread_mutex_t call, lock; /* call: one call at a time; lock: for the condition variables */
    pthread_cond_t done;
    int workers, fork_handler;  /* workers started (worker[1 ..]); pthread_atfork registered */
    atomic_int pending;         /* shares of this call on workers not yet done */
    Worker worker[MAX_THREADS];
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void *pool_worker(void *argument) {
    Worker *self = &pool.worker[(intptr_t)argument];
    unsigned long seen = 0; /* its ticket when it was started: its first share may come before it runs */
    for (;;) {
        const int64_t until = now_ns() + SPIN_NS;
        while (atomic_load(&self->ticket) == seen && now_ns() < until) sched_yield();
        if (atomic_load(&self->ticket) == seen) {
            pthread_mutex_lock(&pool.lock);
            while (atomic_load(&self->ticket) == seen) pthread_cond_wait(&self->wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = atomic_load(&self->ticket);
        self->share.work(self->share.problem, self->share.begin, self->share.end);
        if (atomic_fetch_sub(&pool.pending, 1) == 1) {
            pthread_mutex_lock(&pool.lock);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.lock);
        }
    }
    return 0;
}

/* In a forked child: no workers (threads do not survive a fork), fresh locks. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.call, 0);
    pthread_mutex_init(&pool.lock, 0);
    pthread_cond_init(&pool.done, 0);
    pool.workers = 0;
    atomic_store(&pool.pending, 0);
}

/* Starts workers up to `wanted` (with pool.call held); returns how many there are. */
static int pool_grow(int wanted) {
    if (!pool.fork_handler) pool.fork_handler = pthread_atfork(0, 0, pool_after_fork) == 0;
    while (pool.workers < wanted) {
        const int index = pool.workers + 1;
        atomic_store(&pool.worker[index].ticket, 0);
        pthread_cond_init(&pool.worker[index].wake, 0);
        pthread_t id;
        pthread_attr_t attributes;
        pthread_attr_init(&attributes);
        pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
        const int started = pthread_create(&id, &attributes, pool_worker, (void *)(intptr_t)index) == 0;
        pthread_attr_destroy(&attributes);
        if (!started) break;
        pool.workers = index;
    }
    return pool.workers;
}

/* Share t of columns 0 .. n, `share` columns each (fewer or none at the end). */
static inline ColumnShare share_of(ColumnWork work, const void *problem, int t, int64_t share, int64_t n) {
    const int64_t begin = t * share < n ? t * share : n;
    return (ColumnShare){work, problem, begin, begin + share < n ? begin + share : n};
}

/* `work` over columns 0 .. n, split into `threads` shares of whole multiples of `unit` columns, the first on this
 * thread. Returns 0, or the number of shares no worker could be started for (they were then done here). */
static int split_columns(ColumnWork work, const void *problem, int64_t n, int64_t unit, int threads) {
    const int64_t units = (n + unit - 1) / unit; /* a thread with no whole unit would have nothing to do */
    if (threads > units) threads = (int)units;
    if (threads > MAX_THREADS - 1) threads = MAX_THREADS - 1;
    if (threads < 1) threads = 1;
    const int64_t share = ((n + threads - 1) / threads + unit - 1) / unit * unit;
    if (threads == 1 || share >= n) {
        work(problem, 0, n);
        return 0;
    }
    pthread_mutex_lock(&pool.call);
    const int started = pool_grow(threads - 1), helpers = started < threads - 1 ? started : threads - 1;
    atomic_store(&pool.pending, helpers);
    for (int t = 1; t <= helpers; ++t) {
        pool.worker[t].share = share_of(work, problem, t, share, n);
        atomic_fetch_add(&pool.worker[t].ticket, 1);
    }
    pthread_mutex_lock(&pool.lock);
    for (int t = 1; t <= helpers; ++t) pthread_cond_signal(&pool.worker[t].wake);
    pthread_mutex_unlock(&pool.lock);
    work(problem, 0, share); /* this thread's share, then those no worker was started for */
    for (int t = helpers + 1; t < threads; ++t) {
        const ColumnShare rest = share_of(work, problem, t, share, n);
        work(problem, rest.begin, rest.end);
    }
    if (atomic_load(&pool.pending) > 0) {
        const int64_t until = now_ns() + SPIN_NS;
        while (atomic_load(&pool.pending) > 0 && now_ns() < until) sched_yield();
        pthread_mutex_lock(&pool.lock);
        while (atomic_load(&pool.pending) > 0) pthread_cond_wait(&pool.done, &pool.lock);
        pthread_mutex_unlock(&pool.lock);
    }
    pthread_mutex_unlock(&pool.call);
    return threads - 1 - helpers;
}

#endif
