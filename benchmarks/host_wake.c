/*
 * A wait that outlasts its yield window, as the engine's doorbells run it (engine.h ring, wait.c
 * wait_step): the simulator's host model prices it from this (ubep.sim.host_sched.Doorbells,
 * benchmarks/host_micro.py Micro.wake_ns builds and runs it next to host_micro).
 *
 * Process 1 registers as a sleeper on a doorbell word (sleepers + 1, the bell read) and sleeps
 * in the kernel on it; process 0, once 1 has slept DELAY_US, publishes a word and rings: the bell
 * + 1, then, since a sleeper is registered, the futex wake system call. Then the same ring while
 * 1 stays registered but spins (a rank that slept once in a call stays registered until the call
 * ends, finish.c: every ring to it makes the system call). Per round: the waker's ring with a
 * sleeper asleep, the sleeper's wake-up (from the publication to it running again,
 * CLOCK_MONOTONIC across the two processes) and the ring of a registered peer that is awake.
 *
 * Usage: host_wake MILLIS [DELAY_US]   (default 200)
 * Prints the three medians over rounds, ns: RING_SLEEP WAKE RING_ARMED.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sync.h" /* the engine's now_ns, cpu_relax and futex calls */

static int cmp64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

typedef struct {
    _Atomic uint32_t bell, sleepers;
    _Atomic int64_t round, armed, awake, t_pub, lat;
} wake_ctl_t;
static void wake_run(wake_ctl_t *w, int me, int64_t millis, int64_t delay_us, int64_t *out) {
    static int64_t ring_sleep[20000], wake[20000], ring_armed[20000];
    int64_t n = 0, stop = now_ns() + millis * 1000000LL;
    for (int64_t r = 1;; r++) {
        if (me == 1) {
            int64_t at;
            while ((at = atomic_load(&w->round)) < r)
                if (at < 0) return;
            if (at < 0) return;
            atomic_fetch_add(&w->sleepers, 1);
            uint32_t seq = atomic_load(&w->bell);
            atomic_store(&w->armed, r);
            while (!atomic_load(&w->t_pub)) { /* published before the bell moves */
                struct timespec ts = {0, 10000000L};
                syscall(SYS_futex, (uint32_t *)&w->bell, FUTEX_WAIT, seq, &ts, NULL, 0);
                seq = atomic_load(&w->bell);
            }
            atomic_store(&w->lat, now_ns() - atomic_load(&w->t_pub));
            atomic_store(&w->awake, r);
            /* registered, awake: the waker's second ring finds no one asleep */
            while (atomic_load(&w->armed) != -r) cpu_relax();
            atomic_fetch_sub(&w->sleepers, 1);
            atomic_store(&w->armed, 0);
            continue;
        }
        if (now_ns() > stop || n == 20000) { atomic_store(&w->round, -1); break; }
        atomic_store(&w->t_pub, 0);
        atomic_store(&w->round, r);
        while (atomic_load(&w->armed) != r) cpu_relax();
        int64_t until = now_ns() + delay_us * 1000; /* the sleeper goes to sleep meanwhile */
        while (now_ns() < until) cpu_relax();
        int64_t t0 = now_ns();
        atomic_store(&w->t_pub, t0);
        atomic_fetch_add(&w->bell, 1);
        if (atomic_load(&w->sleepers))
            syscall(SYS_futex, (uint32_t *)&w->bell, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
        int64_t t1 = now_ns();
        while (atomic_load(&w->awake) != r) cpu_relax();
        int64_t t2 = now_ns();
        atomic_fetch_add(&w->bell, 1);
        if (atomic_load(&w->sleepers))
            syscall(SYS_futex, (uint32_t *)&w->bell, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
        int64_t t3 = now_ns();
        ring_sleep[n] = t1 - t0;
        wake[n] = atomic_load(&w->lat);
        ring_armed[n] = t3 - t2;
        n++;
        atomic_store(&w->armed, -r);
        while (atomic_load(&w->armed) != 0) cpu_relax();
    }
    if (!n) return;
    qsort(ring_sleep, (size_t)n, sizeof(int64_t), cmp64);
    qsort(wake, (size_t)n, sizeof(int64_t), cmp64);
    qsort(ring_armed, (size_t)n, sizeof(int64_t), cmp64);
    out[0] = ring_sleep[n / 2];
    out[1] = wake[n / 2];
    out[2] = ring_armed[n / 2];
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MILLIS [DELAY_US]\n", argv[0]);
        return 2;
    }
    int64_t millis = atoll(argv[1]), delay_us = argc > 2 ? atoll(argv[2]) : 200;
    if (millis < 1 || delay_us < 0) {
        fprintf(stderr, "MILLIS must be >= 1 and DELAY_US >= 0\n");
        return 2;
    }
    void *mem = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) { perror("mmap"); return 2; }
    memset(mem, 0, 4096);
    wake_ctl_t *wc = mem;
    int64_t *out = (int64_t *)((uint8_t *)mem + 1024);
    for (int p = 0; p < 2; p++)
        if (fork() == 0) {
            wake_run(wc, p, millis, delay_us, out);
            _exit(0);
        }
    for (int p = 0; p < 2; p++) wait(NULL);
    if (!out[1]) { fprintf(stderr, "no round completed\n"); return 1; }
    printf("%lld %lld %lld\n", (long long)out[0], (long long)out[1], (long long)out[2]);
    return 0;
}
