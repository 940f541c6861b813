/* Memory ordering and sleeping: acquire/release words, fences, progress words, futexes.
 *
 * Every flag is an 8-byte word written with a C11 release store after the data it announces and
 * read with an acquire load before the data (docs/MEMORY-MODEL.md). */
#ifndef UBEP_SYNC_H
#define UBEP_SYNC_H

#include <linux/futex.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define UBEP_X86 1
#else
#define UBEP_X86 0
#endif

#include "abi.h"

static inline uint64_t ld_acq(const void *p) {
    return atomic_load_explicit((_Atomic uint64_t *)p, memory_order_acquire);
}
static inline uint64_t ld_rlx(const void *p) {
    return atomic_load_explicit((_Atomic uint64_t *)p, memory_order_relaxed);
}
static inline void st_rel(void *p, uint64_t v) {
    atomic_store_explicit((_Atomic uint64_t *)p, v, memory_order_release);
}
static inline void st_rlx(void *p, uint64_t v) {
    atomic_store_explicit((_Atomic uint64_t *)p, v, memory_order_relaxed);
}
static inline void store_fence(void) {
    /* Order every earlier store, including any non-temporal or fast-string store a libc copy
     * may have used, before the flag that follows. */
#if UBEP_X86
    _mm_sfence();
#endif
    atomic_thread_fence(memory_order_release);
}
static inline void cpu_relax(void) {
#if UBEP_X86
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}
static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Progress words that peers compare with >= (entered, done, recv_ready, barrier arrivals) are
 * stored with their complement in the next word, complement first: a word whose complement does
 * not match reads as 0 ("nothing yet"). Only a writer that knows the value makes the pair
 * match, so random bytes written into a live segment never pass a >= test. */
static inline void pub_word(word_t *w, uint64_t v) {
    st_rlx(&w->check, ~v);
    st_rel(&w->value, v);
}
static inline uint64_t rd_word(const word_t *w) {
    uint64_t v = ld_acq(&w->value);
    return ld_rlx(&w->check) == ~v ? v : 0;
}

static inline long futex_wait(_Atomic uint32_t *addr, uint32_t val, const struct timespec *ts) {
    return syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, val, ts, NULL, 0);
}
static inline long futex_wake(_Atomic uint32_t *addr, int n) {
    return syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
}
/* the same on a word of a MAP_SHARED segment, between processes */
static inline long futex_wait_shared(_Atomic uint32_t *addr, uint32_t val,
                                     const struct timespec *ts) {
    return syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, val, ts, NULL, 0);
}
static inline long futex_wake_shared(_Atomic uint32_t *addr, int n) {
    return syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE, n, NULL, NULL, 0);
}

#endif /* UBEP_SYNC_H */
