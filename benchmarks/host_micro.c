/*
 * Host microbenchmarks for the simulator's host fabric (benchmarks/host_micro.py builds and runs
 * this). Each kernel is one memory pass the runtime's algorithm makes (docs/FORMATS.md,
 * docs/SIMULATOR.md "Host validation"), written from the format, not copied from the engine:
 *
 *   bulk    one memcpy of ROWS x TERMS x ROW_BYTES bytes, timed in every pass next to the others
 *           (the unit the others are expressed in: bench_dispatch's memcpy floor sets its scale)
 *   copy    memcpy of each row into a 64-byte aligned slot            (SW / DC / SP / reorder)
 *   tff     each row cut into 480 B pieces, each + a release-stored 8 B epoch in a 512 B block
 *   untff   the 480 B pieces of each block copied back into a row    (TFF receive / reorder)
 *   scan    every 2-byte element compared with a sentinel            (SP full check)
 *   tail    the last 32 B of each row compared with a sentinel       (SP tail check)
 *   dc      u64 word sums s1 = sum w, s2 = sum (i+1) w over each row (DC checksum)
 *   fill    each row overwritten with a 2-byte sentinel              (SP re-arm / refill)
 *   reduce  per token: y = bf16(sum_t w_t * f32(x_t)) over `terms` rows of `row_bytes`/2 bf16
 *   picks   count (token, k) picks per expert with a duplicate stamp (routing validation)
 *   out     each received row copied into a private output row        (BSP reorder)
 *   bsp_sp  out + scan + fill per row (BSP SP: verify, reorder, refill the staging slot)
 *   bsp_dc  dc + out per row (BSP DC: verify, reorder)
 *   flag    round trip of an 8-byte flag between process pairs: spin, then sched_yield
 *
 * Usage: host_micro WRITER READER ROW_BYTES ROWS PROCS MILLIS [TERMS [COPIES]]
 *        host_micro flag - 8 1 PROCS MILLIS
 * Runs PROCS processes at once in pairs (p, p^1), free-running for MILLIS ms after one warm-up:
 * each pass, process p runs WRITER into its outgoing buffer X[p] (a shared mapping, pre-faulted)
 * and then READER over its partner's X[p^1], so that, as in the runtime, a writer stores into
 * lines the other core has just read and a reader reads lines the other core has just written.
 * Every pass also times one bulk memcpy of the same bytes right after WRITER and READER. It
 * prints one line per process: the median over passes of WRITER / bulk and READER / bulk (in
 * parts per million; per pass, so that a change of load hits both sides of a ratio alike) and
 * the median ns of the bulk memcpy, then the process's CPU share: its mean wall time per pass
 * over its median pass (ppm; 1e6 = a CPU to itself, 2e6 = half of one, as four processes on
 * two CPUs get, or fewer with other load). Flag mode prints the median round trip in ns. With
 * COPIES > 1 every pass uses the next of that many copies of the buffers (the runtime alternates
 * two receive regions between calls, so a case's working set is two copies of its rows).
 * Ratios are free of time-sharing (both sides are slowed alike); the absolute scale comes from
 * a memcpy measured beside the calls being predicted. PROCS = 1 pairs p with itself.
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void *shared(size_t n) {
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) { perror("mmap"); exit(2); }
    memset(p, 1, n); /* pre-fault */
    return p;
}

static int64_t al64(int64_t v) { return (v + 63) / 64 * 64; }

static volatile uint64_t sink;
static int64_t B, N, TERMS;
static uint8_t *src, *dst, *aux;
static float *acc;
static const int64_t *idxp;

static void k_copy(void) {
    int64_t s = al64(B);
    for (int64_t r = 0; r < N; r++) memcpy(dst + r * s, src + r * B, (size_t)B);
}
static void k_bulk(void) { memcpy(dst, src, (size_t)(N * (TERMS > 1 ? TERMS : 1) * B)); }
static void k_tff(void) {
    int64_t nb = (B + 479) / 480;
    for (int64_t r = 0; r < N; r++) {
        uint8_t *slot = dst + r * nb * 512;
        for (int64_t b = 0; b < nb; b++) {
            int64_t off = b * 480, len = B - off > 480 ? 480 : B - off;
            memcpy(slot + b * 512, src + r * B + off, (size_t)len);
            if (len < 480) memset(slot + b * 512 + len, 0, (size_t)(480 - len));
            memset(slot + b * 512 + 488, 0, 24);
            atomic_store_explicit((_Atomic uint64_t *)(slot + b * 512 + 480), (uint64_t)r + 1,
                                  memory_order_release);
        }
    }
}
static void k_untff(void) {
    int64_t nb = (B + 479) / 480;
    for (int64_t r = 0; r < N; r++) {
        const uint8_t *slot = dst + r * nb * 512;
        for (int64_t b = 0; b < nb; b++) {
            int64_t off = b * 480, len = B - off > 480 ? 480 : B - off;
            if (atomic_load_explicit((_Atomic uint64_t *)(slot + b * 512 + 480),
                                     memory_order_acquire) == 0) sink++;
            memcpy(aux + r * al64(B) + off, slot + b * 512, (size_t)len);
        }
    }
}
static void k_scan(void) {
    int64_t s = al64(B), any = 0;
    for (int64_t r = 0; r < N; r++) {
        const uint16_t *p = (const uint16_t *)(dst + r * s);
        int a = 0;
        for (int64_t i = 0; i < B / 2; i++) a |= (p[i] == 0x7FA5);
        any += a;
    }
    sink += (uint64_t)any;
}
static void k_tail(void) {
    int64_t s = al64(B), any = 0;
    for (int64_t r = 0; r < N; r++) {
        const uint16_t *p = (const uint16_t *)(dst + r * s + B - 32);
        int a = 0;
        for (int i = 0; i < 16; i++) a |= (p[i] == 0x7FA5);
        any += a;
    }
    sink += (uint64_t)any;
}
static void k_dc(void) {
    int64_t s = al64(B);
    uint64_t s1 = 0, s2 = 0;
    for (int64_t r = 0; r < N; r++) {
        const uint8_t *p = dst + r * s;
        for (int64_t j = 0; j < B / 8; j++) {
            uint64_t w;
            memcpy(&w, p + 8 * j, 8);
            s1 += w;
            s2 += (uint64_t)(j + 1) * w;
        }
    }
    sink += s1 ^ s2;
}
static void k_fill(void) {
    int64_t s = al64(B);
    for (int64_t r = 0; r < N; r++) {
        uint16_t *p = (uint16_t *)(dst + r * s);
        for (int64_t i = 0; i < B / 2; i++) p[i] = 0x7FA5;
    }
}
static inline float bf(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t tobf(float f) {
    uint32_t u;
    if (f != f) return 0x7FC0;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
static void k_reduce(void) {
    /* N tokens; token t reads TERMS rows of the pool (src, N * TERMS rows) and writes one */
    int64_t h = B / 2;
    for (int64_t t = 0; t < N; t++) {
        for (int64_t i = 0; i < h; i++) acc[i] = 0.0f;
        for (int64_t k = 0; k < TERMS; k++) {
            const uint16_t *x = (const uint16_t *)(src + (t * TERMS + k) * B);
            float w = 0.125f * (float)(k + 1);
            for (int64_t i = 0; i < h; i++) acc[i] += w * bf(x[i]);
        }
        uint16_t *y = (uint16_t *)(dst + t * al64(B));
        for (int64_t i = 0; i < h; i++) y[i] = tobf(acc[i]);
    }
}
static void k_picks(void) {
    /* N tokens x TERMS picks over 64 experts (the routing in aux), stamp-checked */
    static int64_t cnt[64];
    static uint64_t stamp[64], gen;
    const int64_t *idx = idxp;
    memset(cnt, 0, sizeof cnt);
    for (int64_t t = 0; t < N; t++) {
        gen++;
        for (int64_t k = 0; k < TERMS; k++) {
            int64_t e = idx[t * TERMS + k];
            if (stamp[e] == gen) sink++;
            stamp[e] = gen;
            cnt[e]++;
        }
    }
    sink += (uint64_t)cnt[3];
}

static void k_out(void) {
    int64_t s = al64(B);
    for (int64_t r = 0; r < N; r++) memcpy(aux + r * s, dst + r * s, (size_t)B);
}
static void k_bsp_sp(void) { k_scan(); k_out(); k_fill(); }
static void k_bsp_dc(void) { k_dc(); k_out(); }

typedef void (*kern_t)(void);

static int cmp64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static void spin_barrier(_Atomic int64_t *cnt, int64_t target) {
    atomic_fetch_add(cnt, 1);
    int spins = 0;
    while (atomic_load(cnt) < target)
        if (++spins > 200) { sched_yield(); spins = 0; }
}

/* flag ping-pong between process 2i and 2i+1: one-way latency = round trip / 2 */
static int64_t flag_run(_Atomic uint64_t *words, int me, int64_t millis) {
    _Atomic uint64_t *mine = words + 8 * me, *peer = words + 8 * (me ^ 1);
    int64_t samples[65536], n = 0, stop = now_ns() + millis * 1000000LL;
    uint64_t v = 0;
    for (;;) {
        int64_t t0 = now_ns();
        if (me & 1) {
            while (atomic_load_explicit(peer, memory_order_acquire) <= v) {
                for (int s = 0; s < 64 && atomic_load_explicit(peer, memory_order_acquire) <= v; s++);
                if (atomic_load_explicit(peer, memory_order_acquire) <= v) sched_yield();
            }
            v = atomic_load(peer);
            if (v == UINT64_MAX) break;
            atomic_store_explicit(mine, v, memory_order_release);
        } else {
            uint64_t next = v + 1;
            int done = now_ns() > stop || n == 65536;
            atomic_store_explicit(mine, done ? UINT64_MAX : next, memory_order_release);
            if (done) break;
            while (atomic_load_explicit(peer, memory_order_acquire) < next) {
                for (int s = 0; s < 64 && atomic_load_explicit(peer, memory_order_acquire) < next; s++);
                if (atomic_load_explicit(peer, memory_order_acquire) < next) sched_yield();
            }
            v = next;
            samples[n++] = now_ns() - t0;
        }
    }
    if (!n) return -1;
    qsort(samples, (size_t)n, sizeof(int64_t), cmp64);
    return samples[n / 2];
}

static kern_t find(const char *name) {
    struct { const char *name; kern_t fn; } table[] = {
        {"bulk", k_bulk}, {"copy", k_copy}, {"tff", k_tff}, {"untff", k_untff}, {"scan", k_scan},
        {"tail", k_tail}, {"dc", k_dc}, {"fill", k_fill}, {"reduce", k_reduce},
        {"picks", k_picks}, {"out", k_out}, {"bsp_sp", k_bsp_sp}, {"bsp_dc", k_bsp_dc},
    };
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (!strcmp(name, table[i].name)) return table[i].fn;
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s WRITER READER ROW_BYTES ROWS PROCS MILLIS [TERMS]\n", argv[0]);
        return 2;
    }
    B = atoll(argv[3]);
    N = atoll(argv[4]);
    int procs = atoi(argv[5]);
    int64_t millis = atoll(argv[6]);
    TERMS = argc > 7 ? atoll(argv[7]) : 1;
    int64_t copies = argc > 8 ? atoll(argv[8]) : 1;
    int is_flag = !strcmp(argv[1], "flag");
    kern_t wr = is_flag ? NULL : find(argv[1]);
    kern_t rd = is_flag ? NULL : find(argv[2]);
    if (!is_flag && ((!wr && strcmp(argv[1], "-")) || (!rd && strcmp(argv[2], "-")))) {
        fprintf(stderr, "unknown kernel %s / %s\n", argv[1], argv[2]);
        return 2;
    }
    if (is_flag && procs % 2) { fprintf(stderr, "flag needs an even PROCS\n"); return 2; }
    _Atomic int64_t *ctl = shared(4096);
    int64_t *out = (int64_t *)((uint8_t *)ctl + 64);
    _Atomic uint64_t *words = is_flag ? shared((size_t)procs * 64 + 64) : NULL;
    if (words) memset((void *)words, 0, (size_t)procs * 64 + 64);
    int64_t slot = ((B + 479) / 480) * 512;
    if (slot < al64(B)) slot = al64(B);
    size_t xbytes = (size_t)N * (size_t)(TERMS > 1 ? TERMS : 1) * (size_t)slot + 64;
    size_t pool = (size_t)(N * (TERMS > 1 ? TERMS : 1)) * (size_t)al64(B);
    if (copies < 1) copies = 1;
    if (copies > 256) copies = 256;
    uint8_t *xall = is_flag ? NULL : shared(xbytes * (size_t)procs * (size_t)copies);
    for (int p = 0; p < procs; p++) {
        if (fork() == 0) {
            if (is_flag) {
                spin_barrier(ctl, procs);
                out[4 * p] = flag_run(words, p, millis);
                out[4 * p + 1] = out[4 * p + 2] = out[4 * p + 3] = 0;
                _exit(0);
            }
            uint8_t *src_all = shared(pool * (size_t)copies + 64);
            src = src_all;
            aux = shared((size_t)N * (size_t)al64(B) + (size_t)N * (size_t)TERMS * 8 + 64);
            acc = malloc(sizeof(float) * (size_t)(B / 2 + 8));
            for (size_t i = 0; i < pool * (size_t)copies; i++) src[i] = (uint8_t)(i * 131 + 7);
            int64_t *idx = (int64_t *)(aux + (size_t)N * (size_t)al64(B));
            for (int64_t i = 0; i < N * TERMS; i++) idx[i] = (i * 37 + i / TERMS) % 64;
            idxp = idx;
            size_t stride = xbytes * (size_t)procs;
            uint8_t *mine0 = xall + xbytes * (size_t)p;
            uint8_t *theirs0 = xall + xbytes * (size_t)(procs > 1 ? (p ^ 1) : p);
            uint8_t *mine = mine0, *theirs = theirs0;
            /* readers of TFF blocks / reduce inputs need blocks / rows written in that format */
            dst = mine;
            if (!strcmp(argv[2], "untff")) k_tff();
            static int64_t rw[100000], rr[100000], bb[100000];
            int64_t n = 0, stop, t_all = 0;
            for (int warm = 1; warm >= 0; warm--) {
                spin_barrier(ctl, procs * (2 - warm));
                stop = now_ns() + (warm ? 0 : millis * 1000000LL);
                n = 0;
                t_all = now_ns();
                int64_t c = 0;
                do {
                    c = (c + 1) % copies;
                    mine = mine0 + stride * (size_t)c;
                    theirs = theirs0 + stride * (size_t)((c + copies - 1) % copies);
                    src = src_all + pool * (size_t)c;
                    int64_t t0 = now_ns();
                    if (wr) { dst = mine; wr(); }
                    int64_t t1 = now_ns();
                    if (rd) {
                        if (rd == k_reduce) { uint8_t *s0 = src; src = theirs; dst = aux; rd(); src = s0; }
                        else { dst = theirs; rd(); }
                    }
                    int64_t t2 = now_ns();
                    dst = mine;
                    k_bulk();
                    int64_t t3 = now_ns();
                    /* per pass, relative to the bulk memcpy timed next to it (ppm) */
                    rw[n] = (t1 - t0) * 1000000 / (t3 - t2 > 0 ? t3 - t2 : 1);
                    rr[n] = (t2 - t1) * 1000000 / (t3 - t2 > 0 ? t3 - t2 : 1);
                    bb[n] = t3 - t2;
                    n++;
                } while (now_ns() < stop && n < 100000);
                t_all = now_ns() - t_all;
            }
            qsort(rw, (size_t)n, sizeof(int64_t), cmp64);
            qsort(rr, (size_t)n, sizeof(int64_t), cmp64);
            qsort(bb, (size_t)n, sizeof(int64_t), cmp64);
            /* CPU share: the wall time of a whole pass on average over the median pass time
             * measured without interruption (ppm; 1e6 = the process had a CPU to itself) */
            int64_t med_pass = 0;
            {
                /* reconstruct the median pass from the medians: bulk + writer + reader */
                med_pass = bb[n / 2] + (rw[n / 2] + rr[n / 2]) * bb[n / 2] / 1000000;
            }
            out[4 * p] = rw[n / 2];
            out[4 * p + 1] = rr[n / 2];
            out[4 * p + 2] = bb[n / 2];
            out[4 * p + 3] = med_pass > 0 ? (t_all / n) * 1000000 / med_pass : 0;
            _exit(0);
        }
    }
    for (int p = 0; p < procs; p++) wait(NULL);
    for (int p = 0; p < procs; p++)
        printf("%lld %lld %lld %lld\n", (long long)out[4 * p], (long long)out[4 * p + 1],
               (long long)out[4 * p + 2], (long long)out[4 * p + 3]);
    return 0;
}
