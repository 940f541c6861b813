/*
 * ubep native data plane (C11).
 *
 * One Engine per Buffer. It knows where every rank's shared-memory segment is mapped in this
 * process and runs a whole dispatch or combine in ONE call, with the GIL released: validation
 * and counting, the count exchange, the row copies straight from the caller's tensor into the
 * destination's receive slots, arrival detection (SW / TFF / DC / SP), metadata, and for
 * combine the one-pass float32 reduction over the expert outputs where they lie.
 *
 * Cores: an operation is a short list of phases; each phase runs on every core (or on core 0
 * only). With threads, core 0 is the calling thread and cores 1..C-1 are persistent pthreads
 * that sleep on a futex between operations; without (more cores than hardware threads), the
 * calling thread plays every core in turn, phase by phase.
 *
 * Memory model (docs/MEMORY-MODEL.md): every flag is an 8-byte word written with a C11 release
 * store after the data it announces and read with an acquire load before the data. Payload
 * copies never carry a flag. SP payload copies use whole aligned vector stores so no element
 * tears. Every wait spins briefly, then yields, then sleeps, and checks a deadline, the
 * failure notices of the peers and (every 10 ms) that the peer processes are alive.
 *
 * Layout offsets come from Python (ubep/runtime/layout.py) so there is one source of truth.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define UBEP_X86 1
#else
#define UBEP_X86 0
#endif

/* ---------------------------------------------------------------------------------------- */
/* codes shared with Python                                                                  */

enum { DT_BF16 = 0, DT_FP16 = 1, DT_FP32 = 2, DT_INT8 = 3, DT_UINT8 = 4 };
enum { SYNC_SW = 0, SYNC_TFF = 1, SYNC_DC = 2, SYNC_SP = 3 };
enum { ENG_ASP = 0, ENG_BSP = 1 };
enum { LAY_EXPERT = 0, LAY_RANK = 1 };
/* E_LOST: the ranks are out of step (a peer left this call without finishing it, called
 * another operation, or corrupt control data was found): the Buffer needs a resync. */
enum { E_OK = 0, E_BAD_INPUT = 1, E_TIMEOUT = 2, E_PEER_LOST = 3, E_REMOTE = 4, E_INTERNAL = 5,
       E_LOST = 6 };

/* control block offsets inside one inbox entry and one comb_info entry */
#define IN_COUNTS_EPOCH 0
#define IN_ROWS 8
#define IN_SUM 16
#define IN_SW_COUNT 64
#define IN_SW_EPOCH 72
#define IN_DC_COUNT 128
#define IN_DC_SUM 136
#define IN_DC_EPOCH 144
#define IN_COUNTS 192
#define CI_OFF 0
#define CI_ROWS 8
#define CI_STRIDE 16
#define CI_EPOCH 24
#define CI_INDEX 32
#define CI_SUM 40
#define CI_BYTES 64
#define FAIL_EPOCH 0
#define FAIL_LEN 8 /* u64: message length | code << 32 */
#define FAIL_MSG 16
#define FAIL_MSG_MAX 472
#define FAIL_SUM 488
#define ROUTE_NTOK 0
#define ROUTE_EPOCH 8
#define ROUTE_SUM 16
/* a progress word (entered, done, recv_ready, barrier) is followed by its complement */
#define WORD_CHECK 8
#define ROUTE_IDX 64

#define DC_GOLDEN 0x9E3779B97F4A7C15ULL
#define MAX_WHAT 160
#define MAX_MSG 512

/* ---------------------------------------------------------------------------------------- */
/* small helpers                                                                             */

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
static inline void pub_word(void *p, uint64_t v) {
    st_rlx((uint8_t *)p + WORD_CHECK, ~v);
    st_rel(p, v);
}
static inline uint64_t rd_word(const void *p) {
    uint64_t v = ld_acq(p);
    return ld_rlx((const uint8_t *)p + WORD_CHECK) == ~v ? v : 0;
}

/* Checksum of a control record (counts, combine info, routing, failure notice): a reader
 * that finds a record of its call recomputes it over the values exactly as it read them, so
 * bytes that a third party changed are an error, never data. Not cryptographic: it detects
 * corruption, a same-user process that wants to forge records can map the segment anyway. */
static inline uint64_t mix64(uint64_t h, uint64_t v) {
    h ^= v + 0x9E3779B97F4A7C15ULL + (h << 6) + (h >> 2);
    return h * 0xBF58476D1CE4E5B9ULL;
}
/* two Fletcher lanes over 32-bit words, folded at the end: ~1 ns per word */
typedef struct { uint64_t a, b, n; } fletcher_t;
static inline void fletcher_add(fletcher_t *f, const uint32_t *p, int64_t n) {
    uint64_t a = f->a, b = f->b;
    for (int64_t i = 0; i < n; i++) {
        a += p[i];
        b += a;
    }
    f->a = a;
    f->b = b;
    f->n += (uint64_t)n;
}
static inline uint64_t fletcher_end(uint64_t h, const fletcher_t *f) {
    return mix64(mix64(h, f->a), f->b + f->n);
}
static uint64_t sum_u32(uint64_t h, const uint32_t *p, int64_t n) {
    fletcher_t f = {1, 0, 0};
    fletcher_add(&f, p, n);
    return fletcher_end(h, &f);
}
static uint64_t counts_sum(uint64_t epoch, uint64_t rows, const uint32_t *cnt, int L) {
    return sum_u32(mix64(mix64(0x636F756E7473ULL, epoch), rows), cnt, L);
}
/* the routing record: topk_idx (int32) then the weights (float bits), n words each */
static uint64_t route_sum(uint64_t epoch, uint64_t ntok, const uint32_t *idx, const uint32_t *w,
                          int64_t n) {
    fletcher_t f = {1, 0, 0};
    fletcher_add(&f, idx, n);
    fletcher_add(&f, w, n);
    return fletcher_end(mix64(mix64(0x726F757465ULL, epoch), ntok), &f);
}
static inline uint64_t rotl64(uint64_t v, int r) { return (v << r) | (v >> (64 - r)); }

static long futex_wait(_Atomic uint32_t *addr, uint32_t val, const struct timespec *ts) {
    return syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, val, ts, NULL, 0);
}
static long futex_wake(_Atomic uint32_t *addr, int n) {
    return syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
}
/* the same on a word of a MAP_SHARED segment, between processes */
static long futex_wait_shared(_Atomic uint32_t *addr, uint32_t val, const struct timespec *ts) {
    return syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, val, ts, NULL, 0);
}
static long futex_wake_shared(_Atomic uint32_t *addr, int n) {
    return syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE, n, NULL, NULL, 0);
}

/* ---------------------------------------------------------------------------------------- */
/* kernels: copy, sentinel fill/check, DC row sums, float conversions, reductions             */

typedef void (*copy_fn)(uint8_t *dst, const uint8_t *src, int64_t n);

static void copy_tail(uint8_t *d, const uint8_t *s, int64_t n) {
    /* Naturally aligned power-of-two pieces, so no element of <= 8 bytes is split (dst is at
     * least element aligned and n a multiple of the element size). */
    while (n >= 8) { uint64_t v; memcpy(&v, s, 8); memcpy(d, &v, 8); d += 8; s += 8; n -= 8; }
    if (n >= 4) { uint32_t v; memcpy(&v, s, 4); memcpy(d, &v, 4); d += 4; s += 4; n -= 4; }
    if (n >= 2) { uint16_t v; memcpy(&v, s, 2); memcpy(d, &v, 2); d += 2; s += 2; n -= 2; }
    if (n) *d = *s;
}

static void copy_generic(uint8_t *d, const uint8_t *s, int64_t n) {
    /* 8-byte words: whole elements, never byte by byte (SP needs untorn elements). */
    int64_t nw = n / 8;
    for (int64_t i = 0; i < nw; i++) {
        uint64_t v;
        memcpy(&v, s + 8 * i, 8);
        memcpy(d + 8 * i, &v, 8);
    }
    copy_tail(d + 8 * nw, s + 8 * nw, n - 8 * nw);
}

#if UBEP_X86
__attribute__((target("avx2"))) static void copy_avx2(uint8_t *d, const uint8_t *s, int64_t n) {
    /* align the destination first: a vector store that splits a cache line costs ~2x */
    int64_t head = (int64_t)((32 - ((uintptr_t)d & 31)) & 31);
    if (head > n) head = n;
    if (head) {
        copy_tail(d, s, head);
        d += head;
        s += head;
        n -= head;
    }
    int64_t i = 0;
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_store_si256((__m256i *)(d + i), a);
        _mm256_store_si256((__m256i *)(d + i + 32), b);
        _mm256_store_si256((__m256i *)(d + i + 64), c);
        _mm256_store_si256((__m256i *)(d + i + 96), e);
    }
    for (; i + 32 <= n; i += 32)
        _mm256_store_si256((__m256i *)(d + i), _mm256_loadu_si256((const __m256i *)(s + i)));
    if (i + 16 <= n) {
        _mm_storeu_si128((__m128i *)(d + i), _mm_loadu_si128((const __m128i *)(s + i)));
        i += 16;
    }
    copy_tail(d + i, s + i, n - i);
}
#endif

static void copy_libc(uint8_t *d, const uint8_t *s, int64_t n) { memcpy(d, s, (size_t)n); }

static copy_fn copy_elem = copy_generic; /* element-safe copy (SP) */
static copy_fn copy_fast = copy_libc;    /* any copy followed by a fenced flag */

#if UBEP_X86
__attribute__((target("avx2"))) static void fill_avx2(uint8_t *d, int64_t n, int isz,
                                                      uint64_t pattern) {
    /* aligned whole-element stores: the region's slots are 64-byte aligned */
    __m256i v = isz == 2 ? _mm256_set1_epi16((short)pattern) : _mm256_set1_epi32((int)pattern);
    int64_t i = 0;
    for (; i + 128 <= n; i += 128) {
        _mm256_storeu_si256((__m256i *)(d + i), v);
        _mm256_storeu_si256((__m256i *)(d + i + 32), v);
        _mm256_storeu_si256((__m256i *)(d + i + 64), v);
        _mm256_storeu_si256((__m256i *)(d + i + 96), v);
    }
    for (; i + 32 <= n; i += 32) _mm256_storeu_si256((__m256i *)(d + i), v);
    if (isz == 2)
        for (; i < n; i += 2) *(uint16_t *)(d + i) = (uint16_t)pattern;
    else
        for (; i < n; i += 4) *(uint32_t *)(d + i) = (uint32_t)pattern;
}
#endif

static int fill_vector_ok = 0;

static void fill_pattern(uint8_t *d, int64_t n, int isz, uint64_t pattern) {
#if UBEP_X86
    if (fill_vector_ok && (isz == 2 || isz == 4)) {
        fill_avx2(d, n, isz, pattern);
        return;
    }
#endif
    if (isz == 2) {
        uint16_t v = (uint16_t)pattern, *p = (uint16_t *)d;
        for (int64_t i = 0; i < n / 2; i++) p[i] = v;
    } else if (isz == 4) {
        uint32_t v = (uint32_t)pattern, *p = (uint32_t *)d;
        for (int64_t i = 0; i < n / 4; i++) p[i] = v;
    } else {
        memset(d, (int)(pattern & 0xFF), (size_t)n);
    }
}

static int has_pattern2(const uint16_t *p, int64_t n, uint16_t v) {
    int any = 0;
    for (int64_t i = 0; i < n; i++) any |= (p[i] == v);
    return any;
}
static int has_pattern4(const uint32_t *p, int64_t n, uint32_t v) {
    int any = 0;
    for (int64_t i = 0; i < n; i++) any |= (p[i] == v);
    return any;
}
#if UBEP_X86
__attribute__((target("avx2"))) static int has_pattern2_avx2(const uint16_t *p, int64_t n,
                                                              uint16_t v) {
    __m256i pat = _mm256_set1_epi16((short)v), acc = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m256i a = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *)(p + i)), pat);
        __m256i b = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *)(p + i + 16)), pat);
        __m256i c = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *)(p + i + 32)), pat);
        __m256i e = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *)(p + i + 48)), pat);
        acc = _mm256_or_si256(acc, _mm256_or_si256(_mm256_or_si256(a, b), _mm256_or_si256(c, e)));
    }
    int any = !_mm256_testz_si256(acc, acc);
    for (; i < n; i++) any |= (p[i] == v);
    return any;
}
__attribute__((target("avx2"))) static int has_pattern4_avx2(const uint32_t *p, int64_t n,
                                                              uint32_t v) {
    __m256i pat = _mm256_set1_epi32((int)v), acc = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i a = _mm256_cmpeq_epi32(_mm256_loadu_si256((const __m256i *)(p + i)), pat);
        __m256i b = _mm256_cmpeq_epi32(_mm256_loadu_si256((const __m256i *)(p + i + 8)), pat);
        __m256i c = _mm256_cmpeq_epi32(_mm256_loadu_si256((const __m256i *)(p + i + 16)), pat);
        __m256i e = _mm256_cmpeq_epi32(_mm256_loadu_si256((const __m256i *)(p + i + 24)), pat);
        acc = _mm256_or_si256(acc, _mm256_or_si256(_mm256_or_si256(a, b), _mm256_or_si256(c, e)));
    }
    int any = !_mm256_testz_si256(acc, acc);
    for (; i < n; i++) any |= (p[i] == v);
    return any;
}
#endif
static int (*has2)(const uint16_t *, int64_t, uint16_t) = has_pattern2;
static int (*has4)(const uint32_t *, int64_t, uint32_t) = has_pattern4;

static int has_pattern(const uint8_t *p, int64_t nbytes, int isz, uint64_t pattern) {
    if (isz == 2) return has2((const uint16_t *)p, nbytes / 2, (uint16_t)pattern);
    if (isz == 4) return has4((const uint32_t *)p, nbytes / 4, (uint32_t)pattern);
    return 0;
}

/* DC: the words of a row are its bytes as little-endian u64, the last one zero padded
 * (docs/FORMATS.md with check_bytes=None and block_bytes a multiple of 8). For one row this
 * returns A = sum w_j and B = sum (j+1) w_j (mod 2^64), so that a batch is
 * s1 = sum A, s2 = sum (rank * W * A + B) whatever order rows are visited in. */
static void dc_row_sums(const uint8_t *p, int64_t nbytes, uint64_t *A, uint64_t *B) {
    int64_t nw = nbytes / 8, nq = nw / 4;
    uint64_t a[4] = {0, 0, 0, 0}, c[4] = {0, 0, 0, 0};
    for (int64_t q = 0; q < nq; q++) {
        uint64_t w[4];
        memcpy(w, p + 32 * q, 32);
        for (int l = 0; l < 4; l++) {
            a[l] += w[l];
            c[l] += a[l]; /* c = sum_q (nq - q) w_{4q+l} */
        }
    }
    uint64_t sa = 0, sb = 0;
    for (int l = 0; l < 4; l++) {
        uint64_t qsum = (uint64_t)nq * a[l] - c[l]; /* sum_q q w_{4q+l} */
        sa += a[l];
        sb += 4 * qsum + (uint64_t)(l + 1) * a[l];
    }
    for (int64_t j = 4 * nq; j < nw; j++) {
        uint64_t w;
        memcpy(&w, p + 8 * j, 8);
        sa += w;
        sb += (uint64_t)(j + 1) * w;
    }
    if (nbytes % 8) {
        uint64_t w = 0;
        memcpy(&w, p + 8 * nw, (size_t)(nbytes % 8));
        sa += w;
        sb += (uint64_t)(nw + 1) * w;
    }
    *A = sa;
    *B = sb;
}

static uint64_t dc_finish(uint64_t s1, uint64_t s2, uint64_t epoch) {
    uint64_t v = s1 ^ rotl64(s2, 29) ^ (epoch * DC_GOLDEN);
    return v ? v : 1;
}

/* float conversions, bit-exact with ubep.dtypes */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* Combine outputs: a NaN result is the canonical quiet NaN of the output type, whatever NaN
 * the additions propagated (IEEE 754 leaves the payload of NaN + NaN to the implementation,
 * and scalar and vector code pick differently); ubep.dtypes does the same. */
#define CANON_NAN_BF16 0x7FC0u
#define CANON_NAN_FP16 0x7E00u
#define CANON_NAN_F32 0x7FC00000u

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return CANON_NAN_BF16;
    uint32_t bias = ((u >> 16) & 1u) + 0x7FFFu;
    return (uint16_t)((u + bias) >> 16);
}
static float fp16_to_f32_sw(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 0x1F) {
        u = sign | 0x7F800000u | (man << 13);
    } else {
        u = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint16_t f32_to_fp16_sw(float f) {
    /* round to nearest even, like numpy's float32 -> float16 cast */
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u, fexp = u & 0x7F800000u, fsig = u & 0x007FFFFFu;
    if (fexp >= 0x47800000u) { /* overflow, inf or nan */
        if (fexp == 0x7F800000u && fsig) return CANON_NAN_FP16;
        return (uint16_t)(sign + 0x7C00u);
    }
    if (fexp <= 0x38000000u) { /* subnormal or zero in half */
        if (fexp < 0x33000000u) return (uint16_t)sign;
        uint32_t e = fexp >> 23;
        fsig |= 0x00800000u;
        uint32_t shift = 113 - e; /* 14 .. 24 */
        uint32_t hsig = fsig >> (shift + 13 - 13) >> 13;
        uint32_t rem = fsig & ((1u << (shift + 13)) - 1);
        uint32_t half = 1u << (shift + 12);
        hsig = fsig >> (shift + 13);
        if (rem > half || (rem == half && (hsig & 1))) hsig++;
        return (uint16_t)(sign + hsig);
    }
    uint32_t hexp = (fexp - 0x38000000u) >> 13, hsig = fsig >> 13, rem = fsig & 0x1FFFu;
    uint32_t h = hexp + hsig;
    if (rem > 0x1000u || (rem == 0x1000u && (hsig & 1))) h++; /* may carry into exp: ok */
    return (uint16_t)(sign + h);
}

static void out_bf16(void *dst, const float *acc, int64_t n) {
    uint16_t *y = (uint16_t *)dst;
    for (int64_t i = 0; i < n; i++) y[i] = f32_to_bf16(acc[i]);
}
static inline float canon_f32(float v) {
    if (v == v) return v;
    uint32_t u = CANON_NAN_F32;
    memcpy(&v, &u, 4);
    return v;
}
static void out_f32(void *dst, const float *acc, int64_t n) {
    float *y = (float *)dst;
    for (int64_t i = 0; i < n; i++) y[i] = canon_f32(acc[i]);
}
static void out_f16sw(void *dst, const float *acc, int64_t n) {
    uint16_t *y = (uint16_t *)dst;
    for (int64_t i = 0; i < n; i++) y[i] = f32_to_fp16_sw(acc[i]);
}

#if UBEP_X86
__attribute__((target("avx2"))) static void out_bf16_avx2(void *dst, const float *acc, int64_t n) {
    uint16_t *y = (uint16_t *)dst;
    int64_t i = 0;
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF);
    const __m256i absmask = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
    for (; i + 8 <= n; i += 8) {
        __m256i u = _mm256_castps_si256(_mm256_loadu_ps(acc + i));
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, absmask), inf);
        if (!_mm256_testz_si256(nan, nan)) break; /* NaN present: scalar path below */
        __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(
                                            _mm256_and_si256(_mm256_srli_epi32(u, 16), one), bias));
        r = _mm256_srli_epi32(r, 16);
        __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
        _mm_storeu_si128((__m128i *)(y + i), _mm_packus_epi32(lo, hi));
    }
    for (; i < n; i++) y[i] = f32_to_bf16(acc[i]);
}
__attribute__((target("avx2,f16c"))) static void out_f16_hw(void *dst, const float *acc,
                                                            int64_t n) {
    uint16_t *y = (uint16_t *)dst;
    int64_t i = 0;
    const __m256i absmask = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
    for (; i + 8 <= n; i += 8) {
        __m256 f = _mm256_loadu_ps(acc + i);
        __m256i u = _mm256_castps_si256(f);
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, absmask), inf);
        if (!_mm256_testz_si256(nan, nan)) break; /* NaN: the canonical one, scalar */
        _mm_storeu_si128((__m128i *)(y + i), _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < n; i++) y[i] = f32_to_fp16_sw(acc[i]);
}
#endif

typedef void (*out_fn)(void *, const float *, int64_t);
static out_fn OUTF[3] = {out_bf16, out_f16sw, out_f32};


/* Fused combine: y[i] = round(((0 + t_0[i]) + t_1[i]) + ...) over the terms in order, where
 * t_j = fl32(w_j * src_j[i]) (weighted, expert layout) or src_j[i] (rank layout). One pass:
 * every source row is read once, the accumulators stay in registers, the output is written
 * once. Bit-exact with ubep.reference (same order, product rounded before the add). */
typedef void (*reduce_fn)(void *y, const void *const *src, const float *w, int nt, int64_t n,
                          int weighted);

static float load_f32(int dt, const void *p, int64_t i) {
    if (dt == DT_BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    if (dt == DT_FP16) return fp16_to_f32_sw(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}
static void store_f32(int dt, void *p, int64_t i, float v) {
    if (dt == DT_BF16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else if (dt == DT_FP16) ((uint16_t *)p)[i] = f32_to_fp16_sw(v);
    else ((float *)p)[i] = canon_f32(v);
}
static void reduce_tail(int dt, void *y, const void *const *src, const float *w, int nt,
                        int64_t i0, int64_t n, int weighted) {
    for (int64_t i = i0; i < n; i++) {
        float acc = 0.0f;
        for (int j = 0; j < nt; j++) {
            float v = load_f32(dt, src[j], i);
            acc = acc + (weighted ? w[j] * v : v);
        }
        store_f32(dt, y, i, acc);
    }
}
static void reduce_bf16_c(void *y, const void *const *s, const float *w, int nt, int64_t n,
                          int wt) { reduce_tail(DT_BF16, y, s, w, nt, 0, n, wt); }
static void reduce_fp16_c(void *y, const void *const *s, const float *w, int nt, int64_t n,
                          int wt) { reduce_tail(DT_FP16, y, s, w, nt, 0, n, wt); }
static void reduce_fp32_c(void *y, const void *const *s, const float *w, int nt, int64_t n,
                          int wt) { reduce_tail(DT_FP32, y, s, w, nt, 0, n, wt); }

#if UBEP_X86
__attribute__((target("avx2"))) static inline __m256 bf16x8_to_f32(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
/* round to nearest even; the caller has checked there is no NaN */
__attribute__((target("avx2"))) static inline __m256i f32x8_to_bf16(__m256 f) {
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF);
    __m256i u = _mm256_castps_si256(f);
    return _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), one), bias)),
        16);
}
__attribute__((target("avx2"))) static void reduce_bf16_avx2(void *y, const void *const *src,
                                                             const float *w, int nt, int64_t n,
                                                             int weighted) {
    uint16_t *out = (uint16_t *)y;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int j = 0; j < nt; j++) {
            const uint16_t *v = (const uint16_t *)src[j] + i;
            __m256i h0 = _mm256_loadu_si256((const __m256i *)v);
            __m256i h1 = _mm256_loadu_si256((const __m256i *)(v + 16));
            __m256 f0 = bf16x8_to_f32(_mm256_castsi256_si128(h0));
            __m256 f1 = bf16x8_to_f32(_mm256_extracti128_si256(h0, 1));
            __m256 f2 = bf16x8_to_f32(_mm256_castsi256_si128(h1));
            __m256 f3 = bf16x8_to_f32(_mm256_extracti128_si256(h1, 1));
            if (weighted) {
                __m256 ww = _mm256_set1_ps(w[j]);
                f0 = _mm256_mul_ps(ww, f0);
                f1 = _mm256_mul_ps(ww, f1);
                f2 = _mm256_mul_ps(ww, f2);
                f3 = _mm256_mul_ps(ww, f3);
            }
            a0 = _mm256_add_ps(a0, f0);
            a1 = _mm256_add_ps(a1, f1);
            a2 = _mm256_add_ps(a2, f2);
            a3 = _mm256_add_ps(a3, f3);
        }
        __m256 un = _mm256_or_ps(
            _mm256_or_ps(_mm256_cmp_ps(a0, a0, _CMP_UNORD_Q), _mm256_cmp_ps(a1, a1, _CMP_UNORD_Q)),
            _mm256_or_ps(_mm256_cmp_ps(a2, a2, _CMP_UNORD_Q), _mm256_cmp_ps(a3, a3, _CMP_UNORD_Q)));
        if (!_mm256_testz_ps(un, un)) { /* NaN: the canonical one (scalar, rare) */
            float tmp[32];
            _mm256_storeu_ps(tmp, a0);
            _mm256_storeu_ps(tmp + 8, a1);
            _mm256_storeu_ps(tmp + 16, a2);
            _mm256_storeu_ps(tmp + 24, a3);
            for (int k = 0; k < 32; k++) out[i + k] = f32_to_bf16(tmp[k]);
            continue;
        }
        /* packus works per 128-bit lane: permute the 64-bit quarters back into order */
        __m256i p0 = _mm256_permute4x64_epi64(
            _mm256_packus_epi32(f32x8_to_bf16(a0), f32x8_to_bf16(a1)), 0xD8);
        __m256i p1 = _mm256_permute4x64_epi64(
            _mm256_packus_epi32(f32x8_to_bf16(a2), f32x8_to_bf16(a3)), 0xD8);
        _mm256_storeu_si256((__m256i *)(out + i), p0);
        _mm256_storeu_si256((__m256i *)(out + i + 16), p1);
    }
    reduce_tail(DT_BF16, y, src, w, nt, i, n, weighted);
}
__attribute__((target("avx2"))) static void reduce_fp32_avx2(void *y, const void *const *src,
                                                             const float *w, int nt, int64_t n,
                                                             int weighted) {
    float *out = (float *)y;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int j = 0; j < nt; j++) {
            const float *v = (const float *)src[j] + i;
            __m256 f0 = _mm256_loadu_ps(v), f1 = _mm256_loadu_ps(v + 8);
            __m256 f2 = _mm256_loadu_ps(v + 16), f3 = _mm256_loadu_ps(v + 24);
            if (weighted) {
                __m256 ww = _mm256_set1_ps(w[j]);
                f0 = _mm256_mul_ps(ww, f0);
                f1 = _mm256_mul_ps(ww, f1);
                f2 = _mm256_mul_ps(ww, f2);
                f3 = _mm256_mul_ps(ww, f3);
            }
            a0 = _mm256_add_ps(a0, f0);
            a1 = _mm256_add_ps(a1, f1);
            a2 = _mm256_add_ps(a2, f2);
            a3 = _mm256_add_ps(a3, f3);
        }
        const __m256 canon = _mm256_castsi256_ps(_mm256_set1_epi32((int)CANON_NAN_F32));
        a0 = _mm256_blendv_ps(a0, canon, _mm256_cmp_ps(a0, a0, _CMP_UNORD_Q));
        a1 = _mm256_blendv_ps(a1, canon, _mm256_cmp_ps(a1, a1, _CMP_UNORD_Q));
        a2 = _mm256_blendv_ps(a2, canon, _mm256_cmp_ps(a2, a2, _CMP_UNORD_Q));
        a3 = _mm256_blendv_ps(a3, canon, _mm256_cmp_ps(a3, a3, _CMP_UNORD_Q));
        _mm256_storeu_ps(out + i, a0);
        _mm256_storeu_ps(out + i + 8, a1);
        _mm256_storeu_ps(out + i + 16, a2);
        _mm256_storeu_ps(out + i + 24, a3);
    }
    reduce_tail(DT_FP32, y, src, w, nt, i, n, weighted);
}
__attribute__((target("avx2,f16c"))) static void reduce_fp16_hw(void *y, const void *const *src,
                                                                const float *w, int nt, int64_t n,
                                                                int weighted) {
    uint16_t *out = (uint16_t *)y;
    const __m256i absmask = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        for (int j = 0; j < nt; j++) {
            const uint16_t *v = (const uint16_t *)src[j] + i;
            __m256 f0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)v));
            __m256 f1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + 8)));
            if (weighted) {
                __m256 ww = _mm256_set1_ps(w[j]);
                f0 = _mm256_mul_ps(ww, f0);
                f1 = _mm256_mul_ps(ww, f1);
            }
            a0 = _mm256_add_ps(a0, f0);
            a1 = _mm256_add_ps(a1, f1);
        }
        __m256i nan = _mm256_or_si256(
            _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(a0), absmask), inf),
            _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(a1), absmask), inf));
        if (!_mm256_testz_si256(nan, nan)) { /* NaN: the canonical one (scalar, rare) */
            float tmp[16];
            _mm256_storeu_ps(tmp, a0);
            _mm256_storeu_ps(tmp + 8, a1);
            for (int k = 0; k < 16; k++) out[i + k] = f32_to_fp16_sw(tmp[k]);
            continue;
        }
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(a0, _MM_FROUND_TO_NEAREST_INT));
        _mm_storeu_si128((__m128i *)(out + i + 8), _mm256_cvtps_ph(a1, _MM_FROUND_TO_NEAREST_INT));
    }
    reduce_tail(DT_FP16, y, src, w, nt, i, n, weighted);
}
#endif

static reduce_fn REDUCE[3] = {reduce_bf16_c, reduce_fp16_c, reduce_fp32_c};

static const char *kernel_set = "generic";

static void select_kernels(void) {
#if UBEP_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        kernel_set = "avx2";
        fill_vector_ok = 1;
        copy_elem = copy_avx2;
        has2 = has_pattern2_avx2;
        has4 = has_pattern4_avx2;
        OUTF[DT_BF16] = out_bf16_avx2;
        REDUCE[DT_BF16] = reduce_bf16_avx2;
        REDUCE[DT_FP32] = reduce_fp32_avx2;
        if (__builtin_cpu_supports("f16c")) {
            OUTF[DT_FP16] = out_f16_hw;
            REDUCE[DT_FP16] = reduce_fp16_hw;
        }
    }
#endif
}

/* ---------------------------------------------------------------------------------------- */
/* engine and operation state                                                                */

struct op;
typedef int (*phase_fn)(struct op *op, int core);
typedef struct {
    phase_fn fn;
    int all_cores;  /* 0: core 0 only */
    int sync_after; /* in-process barrier of this rank's cores after the phase */
} phase_t;

typedef struct engine {
    PyObject_HEAD
    /* configuration */
    int rank, R, C, E, L, K, T;
    int hidden, isz, dt, cdt, cisz;
    int sync, eng, layout, nreg, nland, threaded;
    int64_t cap_rows, cap_src_rows, row_bytes, slot_bytes, out_stride, crow_bytes;
    int64_t tff_block, tff_flag, tff_payload, tff_nblocks;
    uint64_t sentinel;
    int64_t off_fail, off_entered, off_done, off_recv_ready, off_comb_info, off_barrier;
    int64_t off_doorbell, yield_ns;
    int64_t sp_tail;       /* SP: bytes at the end of a row that are armed and polled */
    int64_t off_inbox, inbox_bytes, off_route, route_stride, route_w_off;
    int64_t off_land, land_bytes, off_out, out_bytes, off_comb, comb_bytes, seg_size;
    int64_t timeout_ns;
    uint8_t **base;
    int *pids;
    unsigned long long *starts;
    /* scratch (max sizes) */
    int64_t *cnt;          /* [E] my counts per expert */
    int64_t *units_to;     /* [R] units I send to each rank */
    int64_t *rows_to;      /* [R] rows I send to each rank */
    int32_t *u_t, *u_k, *u_e, *u_slot; /* units in per-destination buckets [R * cap_src] */
    uint64_t *stamp;       /* [E] duplicate detection: stamp[e] == token generation */
    uint64_t stamp_gen;
    int64_t *my_rank_in_batch; /* [E] first batch rank of my rows of expert e at its dst */
    _Atomic int64_t *remaining; /* [R] */
    _Atomic uint64_t *dc_s1, *dc_s2; /* [R] */
    int64_t *core_base;    /* [C][R][L] my partition start per (dst, local expert) */
    int64_t *core_ready;   /* [C][R] dst bases computed for this op (epoch) */
    int64_t *rx_base;      /* [C][R][L] receive: start of source s's rows of expert e */
    int64_t *rx_rows;      /* [C][R] receive: verified copy of each source's row count */
    uint32_t *rx_cnt;      /* [C][R][L] receive: verified copy of each source's counts */
    int64_t *tx_rows;      /* [C][R] send: verified copy of a destination's row counts */
    uint32_t *tx_cnt;      /* [C][R][L] send: verified copy of a destination's counts */
    uint32_t *route_snap;  /* [C][2 * T * K] receive: verified copy of a source's routing */
    const void **term_ptr; /* [C][max(K, R)] combine: the rows one token sums */
    float *term_w;         /* [C][max(K, R)] and their weights */
    int64_t *ci_off, *ci_rows; /* [C][R] peers' combine data */
    int32_t *e2d, *e2l;    /* [E] owner rank and local index of each expert (no division) */
    uint64_t comb_last_epoch[2];
    /* threads */
    pthread_t *threads;
    int nthreads_started;
    _Atomic uint32_t job_gen;
    _Atomic int stopping;
    struct op *job_op;
    const phase_t *job_phases;
    int job_nph;
    _Atomic uint32_t tb_count, tb_gen;
    /* BSP with SP: the staging region must hold the sentinel wherever a peer may write.
     * Consumed rows are refilled at once; a failed call can leave rows behind: then the whole
     * region is reset before its next use, once every peer is done with the failed call. */
    int land_dirty;
    uint64_t land_dirty_epoch;
    /* SP in place (rows land in recv_x): rows [0, sp_dirty[reg]) of region reg lost their
     * sentinel in its last use; the rest still hold it. Re-armed when the region is reused. */
    int64_t sp_dirty[8];
    int in_use;            /* an operation is running (re-entrancy guard) */
    int64_t trace[16];     /* core 0's phase timestamps of the last call (ns), for profiling */
} engine_t;

typedef struct op {
    engine_t *g;
    int kind; /* 0 dispatch, 1 combine */
    uint64_t epoch;
    int64_t n;    /* dispatch index (region = n % nreg) */
    int par;      /* epoch parity: which inbox / comb_info slot */
    int64_t deadline;
    /* dispatch inputs */
    const uint8_t *x;
    int64_t ntok;
    const int64_t *topk;
    const float *w;
    int have_plan, plan_cores;
    const int64_t *p_t, *p_k, *p_e, *p_d, *p_slot, *p_ptr;
    /* dispatch outputs */
    int64_t *o_idx, *o_src_rank, *o_src_tok, *o_src_k, *o_nrecv, *o_dst_row;
    float *o_w;
    int64_t n_recv;
    int published_ready;
    /* combine */
    const uint8_t *eo; int64_t eo_rows, eo_off; int zero_copy; int creg;
    const int64_t *h_idx, *h_dst_row; const float *h_w; int64_t h_ntok;
    uint8_t *y;
    _Atomic int armed; /* waits of this call that registered as sleepers on the doorbell */
    /* errors */
    _Atomic int err;
    _Atomic int abort;
    int err_core, err_peer;
    int remote_code; /* E_REMOTE: the code of the peer's notice */
    uint64_t dispatch_index; /* combine: the dispatch whose handle this call uses */
    char what[MAX_WHAT];
    char arg[64];
    char msg[MAX_MSG];
} op_t;

/* this core's verified copies of the counts (read_counts) */
#define RX_ROWS(g, core) ((g)->rx_rows + (int64_t)(core) * (g)->R)
#define RX_CNT(g, core) ((g)->rx_cnt + (int64_t)(core) * (g)->R * (g)->L)

/* addresses */
static inline uint8_t *ctrl(engine_t *g, int rank, int64_t off) { return g->base[rank] + off; }
static inline uint8_t *inbox(engine_t *g, int dst, int src, int par) {
    return g->base[dst] + g->off_inbox + ((int64_t)src * 2 + par) * g->inbox_bytes;
}
static inline uint8_t *comb_info(engine_t *g, int rank, int par) {
    return g->base[rank] + g->off_comb_info + (int64_t)par * CI_BYTES;
}
static inline uint8_t *route(engine_t *g, int rank, int slot) {
    return g->base[rank] + g->off_route + (int64_t)slot * g->route_stride;
}
static inline uint8_t *land(engine_t *g, int rank, int reg) {
    /* nland is 1 (a separate land region, reused every call) or nreg (land == out) */
    return g->base[rank] + g->off_land + (int64_t)(reg % g->nland) * g->land_bytes;
}
static inline uint8_t *outreg(engine_t *g, int rank, int reg) {
    return g->base[rank] + g->off_out + (int64_t)reg * g->out_bytes;
}
static inline int land_is_out(engine_t *g) {
    /* ASP with SW, DC or SP: senders write the final position in recv_x itself (one copy) */
    return g->eng == ENG_ASP && g->sync != SYNC_TFF;
}

/* ---------------------------------------------------------------------------------------- */
/* errors, liveness, waits                                                                   */

static int op_error(op_t *op, int code, int core, int peer, const char *fmt, ...) {
    int expected = 0;
    if (atomic_compare_exchange_strong(&op->err, &expected, code)) {
        op->err_core = core;
        op->err_peer = peer;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(op->what, sizeof op->what, fmt, ap);
        va_end(ap);
    }
    atomic_store(&op->abort, 1);
    return code;
}

/* bad input: `value` names the offending value, the format the problem */
static int bad_input(op_t *op, const char *arg, const char *value, const char *fmt, ...) {
    int expected = 0;
    if (atomic_compare_exchange_strong(&op->err, &expected, E_BAD_INPUT)) {
        op->err_core = 0;
        op->err_peer = op->g->rank;
        snprintf(op->arg, sizeof op->arg, "%s", arg);
        snprintf(op->msg, sizeof op->msg, "%s", value);
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(op->what, sizeof op->what, fmt, ap);
        va_end(ap);
    }
    atomic_store(&op->abort, 1);
    return E_BAD_INPUT;
}

static int process_alive(int pid, unsigned long long start) {
    if (kill(pid, 0) != 0 && errno == ESRCH) return 0;
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT ? 0 : 1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 1;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ') return 1;
    p += 2;
    if (*p == 'Z' || *p == 'X') return 0; /* exited, not yet reaped */
    if (!start) return 1;
    /* field 3 is the state; the start time is field 22 */
    for (int field = 3; field < 22 && p; field++) {
        p = strchr(p, ' ');
        if (p) p++;
    }
    if (!p) return 1;
    return strtoull(p, NULL, 10) == start;
}

typedef struct {
    int64_t start, next_live;
    uint32_t iter, seq;
    int armed;
} waiter_t;

static inline void waiter_init(waiter_t *w) {
    w->start = 0;
    w->next_live = 0;
    w->iter = 0;
    w->armed = 0;
}

/* Doorbells (an eventcount per rank): a waiter that has yielded for yield_ns registers as a
 * sleeper and blocks in the kernel on its rank's doorbell word; every publication another rank
 * may wait for rings the doorbell of the ranks concerned, and makes the wake system call only
 * if someone sleeps there. Oversubscribed ranks then stop taking CPU time from the ranks they
 * wait for. Layout of the doorbell line: [doorbell u32][pad][sleepers u32 at +32]. */
static inline _Atomic uint32_t *doorbell(engine_t *g, int rank) {
    return (_Atomic uint32_t *)(g->base[rank] + g->off_doorbell);
}
static inline _Atomic uint32_t *sleepers(engine_t *g, int rank) {
    return (_Atomic uint32_t *)(g->base[rank] + g->off_doorbell + 32);
}
static inline void ring(engine_t *g, int d) {
    if (d == g->rank) return;
    atomic_fetch_add_explicit(doorbell(g, d), 1, memory_order_seq_cst);
    if (atomic_load_explicit(sleepers(g, d), memory_order_seq_cst))
        futex_wake_shared(doorbell(g, d), INT32_MAX);
}
static inline void ring_all(engine_t *g) {
    for (int q = 0; q < g->R; q++) ring(g, q);
}

static inline uint8_t *fail_block(engine_t *g, int rank, uint64_t epoch) {
    /* two notices, by epoch parity: a peer at most one call ahead never overwrites the one
     * for the call this rank is still in */
    return g->base[rank] + g->off_fail + (int64_t)(epoch & 1) * 512;
}

static uint64_t notice_sum(uint64_t epoch, uint64_t lencode, const uint8_t *msg, uint32_t len) {
    uint64_t h = mix64(mix64(0x6E6F74696365ULL, epoch), lencode);
    for (uint32_t i = 0; i < len; i++) h = mix64(h, msg[i]);
    return h;
}

static int check_liveness(op_t *op, int core, const char *what, int peer);

/* Peer q's failure notice for this call, if it published one: returns its code and copies
 * the message; 0 if there is none; -1 for a notice whose checksum does not hold. */
static int read_notice(engine_t *g, int q, uint64_t epoch, char *msg, size_t cap) {
    const uint8_t *f = fail_block(g, q, epoch);
    if (ld_acq(f + FAIL_EPOCH) != epoch) return 0;
    uint64_t lencode = ld_rlx(f + FAIL_LEN);
    uint32_t len = (uint32_t)lencode, code = (uint32_t)(lencode >> 32);
    uint8_t buf[FAIL_MSG_MAX];
    if (len > FAIL_MSG_MAX || code < E_BAD_INPUT || code > E_LOST) {
        snprintf(msg, cap, "corrupt failure notice of rank %d", q);
        return -1;
    }
    memcpy(buf, f + FAIL_MSG, len);
    if (ld_rlx(f + FAIL_SUM) != notice_sum(epoch, lencode, buf, len)) {
        snprintf(msg, cap, "corrupt failure notice of rank %d", q);
        return -1;
    }
    size_t n = len < cap - 1 ? len : cap - 1;
    memcpy(msg, buf, n);
    msg[n] = 0;
    return (int)code;
}

static int check_failures(op_t *op, int core) {
    engine_t *g = op->g;
    if (op->kind == 2) return 0;
    for (int q = 0; q < g->R; q++) {
        if (q == g->rank) continue;
        char msg[MAX_MSG];
        int code = read_notice(g, q, op->epoch, msg, sizeof msg);
        if (!code) continue;
        if (code < 0) return op_error(op, E_LOST, core, q, "%s in call %llu", msg,
                                      (unsigned long long)op->epoch);
        /* a failure caused by a dead rank is reported as that (PeerLostError everywhere) */
        if (check_liveness(op, core, "a peer that failed this call", -1)) return E_PEER_LOST;
        int expected = 0;
        if (atomic_compare_exchange_strong(&op->err, &expected, E_REMOTE)) {
            op->err_core = core;
            op->err_peer = q;
            op->remote_code = code;
            snprintf(op->msg, sizeof op->msg, "%s", msg);
            snprintf(op->what, sizeof op->what, "failure notice of rank %d", q);
        }
        atomic_store(&op->abort, 1);
        return E_REMOTE;
    }
    return 0;
}

/* Every peer that has not finished this call must be alive (not only the one awaited: a core
 * waiting for rank 1 must still see rank 2 die). A rank that finished the call and exited is
 * not lost for it. `peer` only names the awaited rank in messages. */
static int check_liveness(op_t *op, int core, const char *what, int peer) {
    engine_t *g = op->g;
    (void)peer;
    for (int q = 0; q < g->R; q++) {
        if (q == g->rank || rd_word(ctrl(g, q, g->off_done)) >= op->epoch) continue;
        if (!process_alive(g->pids[q], g->starts[q]))
            return op_error(op, E_PEER_LOST, core, q, "rank %d (pid %d) died while rank %d core %d "
                            "waited for %s", q, g->pids[q], g->rank, core, what);
    }
    return 0;
}

/* A peer that entered this call for another operation (dispatch here, combine there): the
 * programs are out of step, waiting would only end at the deadline. */
static int check_kinds(op_t *op, int core) {
    engine_t *g = op->g;
    static const char *names[] = {"dispatch", "combine", "wait"};
    if (op->kind == 2) return 0;
    for (int q = 0; q < g->R; q++) {
        if (q == g->rank) continue;
        uint64_t e = rd_word(ctrl(g, q, g->off_entered));
        if (e >> 2 == op->epoch && (int)(e & 3) != op->kind)
            return op_error(op, E_LOST, core, q, "rank %d called %s where rank %d called %s "
                            "(call %llu): every rank must make the same calls in the same order",
                            q, names[(e & 3) % 3], g->rank, names[op->kind],
                            (unsigned long long)op->epoch);
    }
    return 0;
}

/* One step of a wait whose condition was just found false. Returns 0 to check again. The
 * description (printf-style) is only formatted if the wait fails. */
static int wait_step(op_t *op, waiter_t *w, int core, int peer, const char *fmt, ...) {
    if (atomic_load_explicit(&op->abort, memory_order_relaxed)) return -1;
    uint32_t it = ++w->iter;
    if (it < 32) {
        cpu_relax();
        return 0;
    }
    int rc = check_failures(op, core);
    if (rc) return rc;
    int64_t t = now_ns();
    if (!w->start) {
        w->start = t;
        w->next_live = t + 10000000LL;
    }
    int timed_out = t >= op->deadline, check_live = t >= w->next_live;
    if (timed_out || check_live) {
        char what[MAX_WHAT];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(what, sizeof what, fmt, ap);
        va_end(ap);
        if (timed_out)
            return op_error(op, E_TIMEOUT, core, peer, "rank %d core %d timed out after %.3g s "
                            "waiting for %s (epoch %llu)", op->g->rank, core,
                            (double)op->g->timeout_ns / 1e9, what,
                            (unsigned long long)op->epoch);
        w->next_live = t + 10000000LL;
        rc = check_liveness(op, core, what, peer);
        if (!rc) rc = check_kinds(op, core);
        if (rc) return rc;
    }
    engine_t *g = op->g;
    if (t - w->start < g->yield_ns) {
        sched_yield();
        return 0;
    }
    if (!w->armed) {
        /* register, then let the caller check its condition once more before sleeping (a
         * publication after this point changes the doorbell and cancels the sleep) */
        atomic_fetch_add_explicit(sleepers(g, g->rank), 1, memory_order_seq_cst);
        atomic_fetch_add(&op->armed, 1);
        w->seq = atomic_load_explicit(doorbell(g, g->rank), memory_order_seq_cst);
        w->armed = 1;
        return 0;
    }
    int64_t left = op->deadline - t, nap = left < 10000000LL ? left : 10000000LL;
    if (nap < 1000) nap = 1000;
    struct timespec ts = {0, (long)nap}; /* wakes for deadline and liveness checks too */
    futex_wait_shared(doorbell(g, g->rank), w->seq, &ts);
    w->seq = atomic_load_explicit(doorbell(g, g->rank), memory_order_seq_cst);
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* team: in-process barrier, worker threads, phase runner                                    */

static void team_barrier(engine_t *g) {
    if (g->C == 1 || !g->threaded) return;
    uint32_t gen = atomic_load(&g->tb_gen);
    if (atomic_fetch_add(&g->tb_count, 1) == (uint32_t)g->C - 1) {
        atomic_store(&g->tb_count, 0);
        atomic_fetch_add(&g->tb_gen, 1);
        futex_wake(&g->tb_gen, INT32_MAX);
        return;
    }
    for (int i = 0; atomic_load(&g->tb_gen) == gen; i++) {
        if (i < 64) cpu_relax();
        else if (i < 2000) sched_yield();
        else {
            struct timespec ts = {0, 1000000};
            futex_wait(&g->tb_gen, gen, &ts);
        }
    }
}

static void run_phases_core(op_t *op, const phase_t *ph, int nph, int core) {
    for (int p = 0; p < nph; p++) {
        if (!atomic_load(&op->abort) && (ph[p].all_cores || core == 0)) ph[p].fn(op, core);
        if (ph[p].sync_after) team_barrier(op->g);
    }
}

static void *worker_main(void *arg) {
    engine_t *g = ((void **)arg)[0];
    int core = (int)(intptr_t)((void **)arg)[1];
    free(arg);
    uint32_t seen = 0;
    for (;;) {
        for (int i = 0; atomic_load(&g->job_gen) == seen; i++) {
            if (i < 200) cpu_relax();
            else if (i < 400) sched_yield();
            else futex_wait(&g->job_gen, seen, NULL);
        }
        seen = atomic_load(&g->job_gen);
        if (atomic_load(&g->stopping)) break;
        run_phases_core(g->job_op, g->job_phases, g->job_nph, core);
        team_barrier(g); /* completion */
    }
    return NULL;
}

static int start_threads(engine_t *g) {
    if (!g->threaded || g->C == 1 || g->nthreads_started) return 0;
    g->threads = calloc((size_t)g->C, sizeof(pthread_t));
    if (!g->threads) return -1;
    for (int c = 1; c < g->C; c++) {
        void **arg = malloc(2 * sizeof(void *));
        if (!arg) return -1;
        arg[0] = g;
        arg[1] = (void *)(intptr_t)c;
        if (pthread_create(&g->threads[c], NULL, worker_main, arg) != 0) {
            free(arg);
            return -1;
        }
        g->nthreads_started = c;
    }
    return 0;
}

static void run_op(op_t *op, const phase_t *ph, int nph) {
    engine_t *g = op->g;
    if (g->C == 1) {
        run_phases_core(op, ph, nph, 0);
    } else if (g->threaded) {
        g->job_op = op;
        g->job_phases = ph;
        g->job_nph = nph;
        atomic_fetch_add(&g->job_gen, 1);
        futex_wake(&g->job_gen, INT32_MAX);
        run_phases_core(op, ph, nph, 0);
        team_barrier(g);
    } else {
        /* more cores than hardware threads: the calling thread plays every core, phase by
         * phase (phases never wait on another core of the same rank) */
        for (int p = 0; p < nph; p++)
            for (int c = 0; c < (ph[p].all_cores ? g->C : 1); c++)
                if (!atomic_load(&op->abort)) ph[p].fn(op, c);
    }
}

/* ---------------------------------------------------------------------------------------- */
static int peers_done_geq(engine_t *g, uint64_t epoch) {
    for (int q = 0; q < g->R; q++)
        if (q != g->rank && rd_word(ctrl(g, q, g->off_done)) < epoch) return 0;
    return 1;
}

static void reset_land(engine_t *g) {
    for (int reg = 0; reg < g->nland; reg++) {
        uint8_t *b = land(g, g->rank, reg);
        for (int64_t r = 0; r < g->cap_rows; r++)
            fill_pattern(b + r * g->slot_bytes, g->row_bytes, g->isz, g->sentinel);
    }
}

/* SP: make the land region whole again after a failed call, before peers may write it */
static int ensure_clean(op_t *op) {
    engine_t *g = op->g;
    if (!g->land_dirty) return 0;
    waiter_t w;
    waiter_init(&w);
    while (!peers_done_geq(g, g->land_dirty_epoch)) {
        int rc = wait_step(op, &w, 0, -1, "peers to finish the failed call %llu",
                           (unsigned long long)g->land_dirty_epoch);
        if (rc) return rc;
    }
    reset_land(g);
    g->land_dirty = 0;
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* dispatch                                                                                  */

static int wait_peers_done(op_t *op, uint64_t epoch, int core) {
    engine_t *g = op->g;
    if (epoch == 0) return 0;
    for (int q = 0; q < g->R; q++) {
        if (q == g->rank) continue;
        waiter_t w;
        waiter_init(&w);
        while (rd_word(ctrl(g, q, g->off_done)) < epoch) {
            int rc = wait_step(op, &w, core, q, "a peer to finish the call before the last");
            if (rc) return rc;
        }
    }
    return 0;
}

static int bad_expert(op_t *op, int64_t t, int k, int64_t e, int dup) {
    char v[32];
    snprintf(v, sizeof v, "%lld", (long long)e);
    if (dup)
        return bad_input(op, "topk_idx", v, "row %lld names this expert twice", (long long)t);
    return bad_input(op, "topk_idx", v, "expert id at [%lld, %d] out of range [-1, %d) "
                     "(num_experts)", (long long)t, k, op->g->E);
}

/* One pass over topk_idx: validate it (range, duplicates), count per expert and per
 * destination, put every send unit into its destination's bucket (ascending token; the bucket
 * of the i-th destination in send order r+1, r+2, ..., r starts at i * cap_src_rows), copy the
 * routing into this rank's own route area (int32), and check the SP sentinel. Nothing a peer
 * can see is written here. */
static int dispatch_validate(op_t *op) {
    engine_t *g = op->g;
    const int K = g->K, E = g->E, L = g->L, R = g->R, r = g->rank;
    const int64_t T = op->ntok, cap = g->cap_src_rows;
    const int expert = g->layout == LAY_EXPERT, sp = g->sync == SYNC_SP;
    int64_t *restrict cnt = g->cnt, *restrict units_to = g->units_to;
    int64_t *restrict rows_to = g->rows_to;
    const int32_t *restrict e2d = g->e2d;
    int32_t *restrict ut = g->u_t, *restrict uk = g->u_k, *restrict ue = g->u_e;
    int32_t *restrict us = g->u_slot;
    uint64_t *restrict stamp = g->stamp;
    uint64_t gen = g->stamp_gen;
    int32_t *restrict ridx = (int32_t *)(route(g, r, (int)(op->n % g->nreg)) + ROUTE_IDX);
    const int64_t *restrict topk = op->topk;
    int64_t bstart[64];
    for (int d = 0; d < R; d++) bstart[d] = (int64_t)((d - r - 1 + 2 * R) % R) * cap;
    memset(cnt, 0, sizeof(int64_t) * (size_t)E);
    memset(units_to, 0, sizeof(int64_t) * (size_t)R);
    memset(rows_to, 0, sizeof(int64_t) * (size_t)R);
    for (int64_t t = 0; t < T; t++) {
        const int64_t *row = topk + t * K;
        uint64_t seen_dst = 0; /* R <= 64 enforced at init */
        gen++;
        for (int k = 0; k < K; k++) {
            int64_t e = row[k];
            ridx[t * K + k] = (int32_t)e;
            if (e < 0) {
                if (e != -1) { g->stamp_gen = gen; return bad_expert(op, t, k, e, 0); }
                continue;
            }
            if (e >= E) { g->stamp_gen = gen; return bad_expert(op, t, k, e, 0); }
            if (stamp[e] == gen) { g->stamp_gen = gen; return bad_expert(op, t, k, e, 1); }
            stamp[e] = gen;
            int d = e2d[e];
            int first = !(seen_dst >> d & 1);
            if (expert || first) {
                int64_t u = bstart[d] + units_to[d];
                ut[u] = (int32_t)t;
                uk[u] = k;
                ue[u] = (int32_t)e;
                us[u] = (int32_t)(expert ? cnt[e] : rows_to[d]);
                units_to[d]++;
            }
            cnt[e]++;
            if (first) {
                seen_dst |= 1ULL << d;
                rows_to[d]++;
            }
        }
        if (sp && seen_dst &&
            has_pattern(op->x + t * g->row_bytes, g->row_bytes, g->isz, g->sentinel)) {
            char v[32];
            snprintf(v, sizeof v, "row %lld", (long long)t);
            g->stamp_gen = gen;
            return bad_input(op, "x", v, "contains the SP sentinel bit pattern 0x%llx, which SP "
                             "cannot carry: use sync='tff' or sync='dc'",
                             (unsigned long long)g->sentinel);
        }
    }
    g->stamp_gen = gen;
    if (expert)
        for (int d = 0; d < R; d++) rows_to[d] = units_to[d];
    /* my first batch rank per expert at its destination (position order = expert, token) */
    for (int d = 0; d < R; d++) {
        int64_t acc = 0;
        for (int el = 0; el < L; el++) {
            g->my_rank_in_batch[d * L + el] = acc;
            acc += cnt[d * L + el];
        }
    }
    return 0;
}

/* bucket of the i-th destination in send order */
static inline int64_t bucket_start(engine_t *g, int i) { return (int64_t)i * g->cap_src_rows; }

/* SP writer: the row's body, a release fence, then its armed tail (the last sp_tail bytes).
 * A reader that finds no sentinel left in the tail has, after its acquire fence, the whole
 * row: the fence orders the body's stores before the tail's (on x86 it only stops the compiler,
 * TSO keeps store order; on Arm it is a DMB). Element-safe copies: no element tears. With
 * sp_tail == row_bytes this is plain SP, every element armed and polled. */
static void put_sp_row(engine_t *g, uint8_t *slot, const uint8_t *src) {
    int64_t body = g->row_bytes - g->sp_tail;
    if (body > 0) {
        copy_elem(slot, src, body);
        atomic_thread_fence(memory_order_release);
    }
    copy_elem(slot + body, src + body, g->sp_tail);
}

/* SP: put the sentinel back into the armed part of rows [0, n) of a land region */
static void sp_rearm(engine_t *g, uint8_t *base, int64_t n) {
    if (g->sp_tail == g->row_bytes) {
        fill_pattern(base, n * g->slot_bytes, g->isz, g->sentinel);
        return;
    }
    for (int64_t r = 0; r < n; r++)
        fill_pattern(base + r * g->slot_bytes + g->row_bytes - g->sp_tail, g->sp_tail, g->isz,
                     g->sentinel);
}

/* publish my routing (for receivers' metadata), my readiness and my counts */
static int dispatch_publish(op_t *op) {
    engine_t *g = op->g;
    const int K = g->K, L = g->L, R = g->R;
    int reg = (int)(op->n % g->nreg);
    int rc;
    if (g->sync == SYNC_SP && (rc = ensure_clean(op))) return rc;
    uint8_t *rt = route(g, g->rank, reg); /* topk_idx was copied by dispatch_validate */
    float *rw = (float *)(rt + g->route_w_off);
    memcpy(rw, op->w, sizeof(float) * (size_t)(op->ntok * K));
    st_rlx(rt + ROUTE_NTOK, (uint64_t)op->ntok);
    st_rlx(rt + ROUTE_SUM, route_sum(op->epoch, (uint64_t)op->ntok,
                                     (const uint32_t *)(rt + ROUTE_IDX), (const uint32_t *)rw,
                                     op->ntok * K));
    st_rlx(rt + ROUTE_EPOCH, op->epoch);
    if (g->sync == SYNC_SP && land_is_out(g) && g->sp_dirty[reg]) {
        /* SP in place: the region's last use left data where peers may write now; the user's
         * view of it has expired (recv_x lives until the second dispatch after it) */
        sp_rearm(g, land(g, g->rank, reg), g->sp_dirty[reg]);
        g->sp_dirty[reg] = 0;
    }
    pub_word(ctrl(g, g->rank, g->off_recv_ready), op->epoch);
    op->published_ready = 1;
    if (g->eng == ENG_BSP) {
        ring_all(g);
        return 0; /* BSP sends counts after its first barrier */
    }
    for (int i = 0; i < R; i++) {
        int d = (g->rank + 1 + i) % R;
        uint8_t *ib = inbox(g, d, g->rank, op->par);
        uint32_t *c = (uint32_t *)(ib + IN_COUNTS);
        for (int el = 0; el < L; el++) c[el] = (uint32_t)g->cnt[d * L + el];
        st_rlx(ib + IN_ROWS, (uint64_t)g->rows_to[d]);
        st_rlx(ib + IN_SUM, counts_sum(op->epoch, (uint64_t)g->rows_to[d], c, L));
        st_rel(ib + IN_COUNTS_EPOCH, op->epoch);
    }
    ring_all(g); /* every sender to every rank reads these counts */
    return 0;
}

static void reset_send_state(op_t *op);

#define TRACE(g, core, i) do { if ((core) == 0) (g)->trace[i] = now_ns(); } while (0)

static int ph_d_prepare(op_t *op, int core) {
    (void)core;
    TRACE(op->g, core, 0);
    /* the route area validation writes was read by peers two calls ago: wait for them first */
    pub_word(ctrl(op->g, op->g->rank, op->g->off_entered), op->epoch << 2 | (uint64_t)op->kind);
    int rc = wait_peers_done(op, op->epoch >= 2 ? op->epoch - 2 : 0, 0);
    if (rc) return rc;
    TRACE(op->g, core, 1);
    if ((rc = dispatch_validate(op))) return rc;
    TRACE(op->g, core, 2);
    reset_send_state(op);
    rc = dispatch_publish(op);
    TRACE(op->g, core, 3);
    return rc;
}

/* Destination d has published readiness and every source has published counts to d: 1;
 * not yet: 0; d has published readiness for a later call, so it left this one without the
 * rows this rank still has for it: -1 (see dst_gone). Readiness must be this call's exactly:
 * rows of this call must never land in a region a later call has armed. */
static int dst_ready(op_t *op, int d) {
    engine_t *g = op->g;
    uint64_t ready = rd_word(ctrl(g, d, g->off_recv_ready));
    if (ready != op->epoch) return ready > op->epoch ? -1 : 0;
    for (int s = 0; s < g->R; s++)
        if (ld_acq(inbox(g, d, s, op->par) + IN_COUNTS_EPOCH) != op->epoch) return 0;
    return 1;
}

/* d moved past this call while this rank still had rows for it: d failed the call (its
 * notice says why) or the ranks are out of step. */
static int dst_gone(op_t *op, int core, int d) {
    int rc = check_failures(op, core);
    if (rc) return rc;
    return op_error(op, E_LOST, core, d, "rank %d moved past call %llu while rank %d still had "
                    "rows for it", d, (unsigned long long)op->epoch, op->g->rank);
}

/* Source s's count record for destination d in this call (its epoch word was seen), copied
 * out and verified: rows, and counts[L] per local expert of d. Callers use the copy only, so
 * bytes changed after the check cannot reach the data path. */
static int read_counts(op_t *op, int core, int d, int s, int64_t *rows, uint32_t *cnt) {
    engine_t *g = op->g;
    const uint8_t *ib = inbox(g, d, s, op->par);
    uint64_t r = ld_rlx(ib + IN_ROWS), sum = ld_rlx(ib + IN_SUM);
    memcpy(cnt, ib + IN_COUNTS, sizeof(uint32_t) * (size_t)g->L);
    if (sum != counts_sum(op->epoch, r, cnt, g->L))
        return op_error(op, E_LOST, core, s, "corrupt count record of rank %d for rank %d in "
                        "call %llu", s, d, (unsigned long long)op->epoch);
    if (r > (uint64_t)g->cap_src_rows)
        return op_error(op, E_INTERNAL, core, s, "rank %d published %llu rows for rank %d, more "
                        "than the %lld a source can send", s, (unsigned long long)r, d,
                        (long long)g->cap_src_rows);
    for (int el = 0; el < g->L; el++)
        if (cnt[el] > (uint32_t)g->T)
            return op_error(op, E_INTERNAL, core, s, "rank %d published count %u for an expert, "
                            "more than max_tokens_per_rank", s, cnt[el]);
    *rows = (int64_t)r;
    return 0;
}

/* For the expert layout: out[el] = start of my rows of local expert el in d's region.
 * For the rank layout: out[0] = start of my rows. Peer counts are verified and bounded. */
static int compute_bases(op_t *op, int core, int d, int src, int64_t *out) {
    engine_t *g = op->g;
    const int L = g->L, R = g->R;
    int64_t *rows = g->tx_rows + (int64_t)core * R;
    uint32_t *cnt = g->tx_cnt + (int64_t)core * R * L;
    for (int s = 0; s < R; s++) {
        int rc = read_counts(op, core, d, s, &rows[s], cnt + (int64_t)s * L);
        if (rc) return rc;
    }
    int64_t total = 0;
    if (g->layout == LAY_RANK) {
        int64_t before = 0;
        for (int s = 0; s < R; s++) {
            if (s < src) before += rows[s];
            total += rows[s];
        }
        out[0] = before;
    } else {
        for (int el = 0; el < L; el++) {
            int64_t tot = 0, before = 0;
            for (int s = 0; s < R; s++) {
                uint32_t c = cnt[(int64_t)s * L + el];
                if (s < src) before += c;
                tot += c;
            }
            out[el] = total + before;
            total += tot;
        }
    }
    if (total > g->cap_rows)
        return op_error(op, E_INTERNAL, core, d, "counts for rank %d add up to %lld rows, more "
                        "than the buffer's %lld", d, (long long)total, (long long)g->cap_rows);
    return 0;
}

static int wait_dst(op_t *op, int core, int d) {
    waiter_t w;
    waiter_init(&w);
    int ready;
    while ((ready = dst_ready(op, d)) != 1) {
        if (ready < 0) return dst_gone(op, core, d);
        int rc = wait_step(op, &w, core, d, "receive readiness and counts of rank %d", d);
        if (rc) return rc;
    }
    return 0;
}

/* write one row to its slot in destination d (encoded for the sync mode) */
static void put_row(op_t *op, int d, int64_t pos, const uint8_t *src) {
    engine_t *g = op->g;
    int reg = (int)(op->n % g->nreg);
    if (g->eng == ENG_ASP && d == g->rank) { /* own rows: nobody polls them */
        copy_fast(outreg(g, d, reg) + pos * g->out_stride, src, g->row_bytes);
        return;
    }
    uint8_t *slot = land(g, d, reg) + pos * g->slot_bytes;
    if (g->sync == SYNC_TFF) {
        for (int64_t b = 0; b < g->tff_nblocks; b++) {
            int64_t off = b * g->tff_payload, len = g->row_bytes - off;
            if (len > g->tff_payload) len = g->tff_payload;
            uint8_t *blk = slot + b * g->tff_block;
            copy_elem(blk, src + off, len);
            if (len < g->tff_payload) memset(blk + len, 0, (size_t)(g->tff_payload - len));
            if (g->tff_flag > 8) memset(blk + g->tff_payload + 8, 0, (size_t)(g->tff_flag - 8));
            st_rel(blk + g->tff_payload, op->epoch); /* the block's flag, after its payload */
        }
    } else if (g->sync == SYNC_SP) {
        put_sp_row(g, slot, src);
    } else {
        copy_fast(slot, src, g->row_bytes);
    }
}

/* the last unit to d is written: publish the per-(source, destination) flag of SW / DC */
static void finish_dst(op_t *op, int d) {
    engine_t *g = op->g;
    if (d == g->rank || g->eng == ENG_BSP) return;
    if (g->sync == SYNC_SP || g->sync == SYNC_TFF) { /* data-as-flag: nothing to publish */
        ring(g, d);
        return;
    }
    uint8_t *ib = inbox(g, d, g->rank, op->par);
    if (g->sync == SYNC_SW) {
        store_fence();
        st_rlx(ib + IN_SW_COUNT, (uint64_t)g->rows_to[d]);
        st_rel(ib + IN_SW_EPOCH, op->epoch);
    } else if (g->sync == SYNC_DC) {
        store_fence();
        uint64_t sum = dc_finish(atomic_load(&g->dc_s1[d]), atomic_load(&g->dc_s2[d]), op->epoch);
        st_rlx(ib + IN_DC_COUNT, (uint64_t)g->rows_to[d]);
        st_rlx(ib + IN_DC_SUM, sum);
        st_rel(ib + IN_DC_EPOCH, op->epoch);
    }
    ring(g, d);
}

static inline int64_t unit_pos(engine_t *g, const int64_t *bases, int e, int64_t slot) {
    return g->layout == LAY_EXPERT ? bases[g->e2l[e]] + slot : bases[0] + slot;
}

static void send_unit(op_t *op, int core, int64_t t, int k, int e, int d, int64_t slot,
                      const int64_t *bases) {
    engine_t *g = op->g;
    int64_t pos = unit_pos(g, bases, e, slot);
    const uint8_t *src = op->x + t * g->row_bytes;
    put_row(op, d, pos, src);
    if (g->layout == LAY_EXPERT) op->o_dst_row[t * g->K + k] = pos;
    else op->o_dst_row[t * g->R + d] = pos;
    if (g->sync == SYNC_DC && g->eng == ENG_ASP && d != g->rank) {
        uint64_t A, B;
        int64_t W = (g->row_bytes + 7) / 8;
        int64_t brank = g->layout == LAY_EXPERT ? g->my_rank_in_batch[e] + slot : slot;
        dc_row_sums(src, g->row_bytes, &A, &B);
        if (g->C > 1) {
            atomic_fetch_add(&g->dc_s1[d], A);
            atomic_fetch_add(&g->dc_s2[d], (uint64_t)brank * (uint64_t)W * A + B);
        } else {
            g->dc_s1[d] += A;
            g->dc_s2[d] += (uint64_t)brank * (uint64_t)W * A + B;
        }
    }
    (void)core;
}

static void unit_done(op_t *op, int d) {
    engine_t *g = op->g;
    if (g->C > 1) {
        if (atomic_fetch_sub(&g->remaining[d], 1) == 1) finish_dst(op, d);
    } else if (--g->remaining[d] == 0) {
        finish_dst(op, d);
    }
}

static void reset_send_state(op_t *op) {
    engine_t *g = op->g;
    for (int d = 0; d < g->R; d++) {
        atomic_store(&g->remaining[d], g->units_to[d]);
        atomic_store(&g->dc_s1[d], 0);
        atomic_store(&g->dc_s2[d], 0);
        g->core_ready[d] = 0;
    }
    for (int64_t i = 0; i < op->ntok * (g->layout == LAY_EXPERT ? g->K : g->R); i++)
        op->o_dst_row[i] = -1;
}

/* ASP send, no plan (one send core): destinations whose counts are in go first */
static int send_canonical(op_t *op, int core) {
    engine_t *g = op->g;
    const int R = g->R;
    int64_t *bases = g->core_base + (int64_t)core * R * g->L;
    int pending[64], np = 0;
    /* index into the send order; a destination this rank sends nothing learns that from the
     * counts, so it is not waited for (it may well have finished the call already) */
    for (int i = 0; i < R; i++)
        if (g->units_to[(g->rank + 1 + i) % R]) pending[np++] = i;
    waiter_t w;
    waiter_init(&w);
    while (np) {
        int progressed = 0;
        for (int j = 0; j < np;) {
            int i = pending[j], d = (g->rank + 1 + i) % R;
            int ready = dst_ready(op, d);
            if (ready < 0) return dst_gone(op, core, d);
            if (!ready) { j++; continue; }
            int rc = compute_bases(op, core, d, g->rank, bases);
            if (rc) return rc;
            for (int64_t u = bucket_start(g, i), end = u + g->units_to[d]; u < end; u++)
                send_unit(op, core, g->u_t[u], g->u_k[u], g->u_e[u], d, g->u_slot[u], bases);
            finish_dst(op, d);
            pending[j] = pending[--np];
            progressed = 1;
            waiter_init(&w);
        }
        if (!progressed && np) {
            int d = (g->rank + 1 + pending[0]) % R;
            int rc = wait_step(op, &w, core, d, "receive readiness and counts of rank %d", d);
            if (rc) return rc;
        }
    }
    return 0;
}

/* ASP send by the Plan from ubep.sched: plan core j runs on thread j % C, in plan order */
static int send_planned(op_t *op, int core) {
    engine_t *g = op->g;
    const int R = g->R, L = g->L;
    int64_t *bases = g->core_base + (int64_t)core * R * L;
    int64_t *ready = g->core_ready + (int64_t)core * R;
    for (int d = 0; d < R; d++) ready[d] = 0;
    for (int j = core; j < op->plan_cores; j += g->C) {
        for (int64_t u = op->p_ptr[j]; u < op->p_ptr[j + 1]; u++) {
            int d = (int)op->p_d[u];
            if (!ready[d]) {
                int rc = wait_dst(op, core, d);
                if (!rc) rc = compute_bases(op, core, d, g->rank, bases + (int64_t)d * L);
                if (rc) return rc;
                ready[d] = 1;
            }
            send_unit(op, core, op->p_t[u], (int)op->p_k[u], (int)op->p_e[u], d, op->p_slot[u],
                      bases + (int64_t)d * L);
            unit_done(op, d);
        }
    }
    return 0;
}

static int ph_d_send(op_t *op, int core) {
    int rc = op->have_plan ? send_planned(op, core) : core == 0 ? send_canonical(op, core) : 0;
    TRACE(op->g, core, 4);
    return rc;
}

/* receiver: wait for the counts of every source, copy and verify them (this core reads only its
 * copy from here on), then compute where each source's rows of each local expert start
 * (rx_base[s][el]) */
static int recv_bases(op_t *op, int core, int64_t *rx_base, int64_t *n_out) {
    engine_t *g = op->g;
    const int R = g->R, L = g->L;
    int64_t *rows = RX_ROWS(g, core);
    uint32_t *cnt = RX_CNT(g, core);
    for (int s = 0; s < R; s++) {
        waiter_t w;
        waiter_init(&w);
        while (ld_acq(inbox(g, g->rank, s, op->par) + IN_COUNTS_EPOCH) != op->epoch) {
            int rc = wait_step(op, &w, core, s, "the counts of rank %d", s);
            if (rc) return rc;
        }
        int rc = read_counts(op, core, g->rank, s, &rows[s], cnt + (int64_t)s * L);
        if (rc) return rc;
    }
    int64_t pos = 0;
    if (g->layout == LAY_RANK) {
        for (int s = 0; s < R; s++) {
            rx_base[s * L] = pos;
            pos += rows[s];
        }
    } else {
        for (int el = 0; el < L; el++) {
            for (int s = 0; s < R; s++) {
                rx_base[s * L + el] = pos;
                pos += cnt[(int64_t)s * L + el];
            }
        }
    }
    if (pos > g->cap_rows)
        return op_error(op, E_INTERNAL, core, -1, "%lld rows announced, capacity %lld",
                        (long long)pos, (long long)g->cap_rows);
    *n_out = pos;
    return 0;
}

/* rows of source s in my region, in position order: calls the body with POS (the row's
 * position) and RANK (its rank in the source's batch). Reads this core's verified copy of the
 * counts (recv_bases), whose total recv_bases bounded by cap_rows. */
#define FOR_SOURCE_ROWS(g, core, s, rx_base, POS, RANK, ...)                               \
    do {                                                                                   \
        int64_t RANK = 0;                                                                  \
        if ((g)->layout == LAY_RANK) {                                                     \
            int64_t n_ = RX_ROWS(g, core)[s];                                              \
            for (int64_t POS = (rx_base)[(s) * (g)->L]; RANK < n_; POS++, RANK++) {        \
                __VA_ARGS__                                                                \
            }                                                                              \
        } else {                                                                           \
            for (int el_ = 0; el_ < (g)->L; el_++) {                                       \
                int64_t c_ = RX_CNT(g, core)[(int64_t)(s) * (g)->L + el_];                 \
                int64_t p0_ = (rx_base)[(s) * (g)->L + el_];                               \
                for (int64_t POS = p0_; POS < p0_ + c_; POS++, RANK++) {                   \
                    __VA_ARGS__                                                            \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
    } while (0)

/* Source s's routing of this call (topk_idx as int32, then weights as float bits), copied into
 * this core's scratch and verified. */
static int read_route(op_t *op, int core, int s, uint64_t *ntok_out, const int32_t **idx,
                      const float **wt) {
    engine_t *g = op->g;
    const int64_t K = g->K;
    const uint8_t *rt = route(g, s, (int)(op->n % g->nreg));
    uint64_t ntok = ld_rlx(rt + ROUTE_NTOK), sum = ld_rlx(rt + ROUTE_SUM);
    if (ntok > (uint64_t)g->T || ld_rlx(rt + ROUTE_EPOCH) != op->epoch)
        return op_error(op, E_LOST, core, s, "rank %d's routing is not for call %llu", s,
                        (unsigned long long)op->epoch);
    int64_t n = (int64_t)ntok * K;
    uint32_t *snap = g->route_snap + (int64_t)core * 2 * g->T * K;
    memcpy(snap, rt + ROUTE_IDX, sizeof(uint32_t) * (size_t)n);
    memcpy(snap + n, rt + g->route_w_off, sizeof(uint32_t) * (size_t)n);
    if (sum != route_sum(op->epoch, ntok, snap, snap + n, n))
        return op_error(op, E_LOST, core, s, "corrupt routing record of rank %d in call %llu", s,
                        (unsigned long long)op->epoch);
    *ntok_out = ntok;
    *idx = (const int32_t *)snap;
    *wt = (const float *)(snap + n);
    return 0;
}

/* fill the metadata of source s's rows from its published routing */
static int recv_metadata(op_t *op, int core, int s, const int64_t *rx_base) {
    engine_t *g = op->g;
    const int K = g->K, L = g->L, r = g->rank;
    uint64_t ntok = 0;
    const int32_t *idx = NULL;
    const float *wt = NULL;
    int rc = read_route(op, core, s, &ntok, &idx, &wt);
    if (rc) return rc;
    const int64_t lo = (int64_t)r * L, hi = lo + L;
    const uint32_t *cnt = RX_CNT(g, core) + (int64_t)s * L;
    if (g->layout == LAY_EXPERT) {
        /* cursor[el]: next row of expert el; cursor[L + el]: end of the rows the counts give
         * it. A row beyond its expert's count is refused before it is written. */
        int64_t cur[2048];
        int64_t *cursor = L <= 1024 ? cur : malloc(sizeof(int64_t) * 2 * (size_t)L);
        if (!cursor) return op_error(op, E_INTERNAL, core, -1, "out of memory");
        for (int el = 0; el < L; el++) {
            cursor[el] = rx_base[s * L + el];
            cursor[L + el] = cursor[el] + cnt[el];
        }
        for (int64_t t = 0; t < (int64_t)ntok; t++) {
            for (int k = 0; k < K; k++) {
                int64_t e = idx[t * K + k];
                if (e < lo || e >= hi) continue;
                int64_t p = cursor[e - lo]++;
                if (p >= cursor[L + e - lo]) {
                    if (cursor != cur) free(cursor);
                    return op_error(op, E_INTERNAL, core, s, "rank %d's routing disagrees with "
                                    "its counts", s);
                }
                op->o_src_rank[p] = s;
                op->o_src_tok[p] = t;
                op->o_src_k[p] = k;
                op->o_idx[p] = e;
                op->o_w[p] = wt[t * K + k];
            }
        }
        int bad = 0;
        for (int el = 0; el < L; el++)
            if (cursor[el] != cursor[L + el]) bad = 1;
        if (cursor != cur) free(cursor);
        if (bad) return op_error(op, E_INTERNAL, core, s, "rank %d's routing disagrees with its "
                                 "counts", s);
    } else {
        int64_t p = rx_base[s * L], end = p + RX_ROWS(g, core)[s];
        for (int64_t t = 0; t < (int64_t)ntok; t++) {
            int first = -1;
            for (int k = 0; k < K; k++) {
                int64_t e = idx[t * K + k];
                if (e >= lo && e < hi) { first = k; break; }
            }
            if (first < 0) continue;
            if (p >= end) return op_error(op, E_INTERNAL, core, s, "rank %d's routing disagrees "
                                          "with its row count", s);
            op->o_src_rank[p] = s;
            op->o_src_tok[p] = t;
            op->o_src_k[p] = first;
            for (int k = 0; k < K; k++) {
                int64_t e = idx[t * K + k];
                int here = e >= lo && e < hi;
                op->o_idx[p * K + k] = here ? e - lo : -1;
                op->o_w[p * K + k] = here ? wt[t * K + k] : 0.0f;
            }
            p++;
        }
        if (p != end) return op_error(op, E_INTERNAL, core, s, "rank %d's routing disagrees "
                                      "with its row count", s);
    }
    return 0;
}

/* How far a source's rows have been consumed, in position (= batch rank) order. */
typedef struct {
    int el;        /* local expert (expert layout); 0 for the rank layout */
    int64_t off;   /* rows done inside that expert's block from this source */
    int64_t rank;  /* rows done in total */
} rx_cursor_t;

/* Consume whatever has landed from source s without blocking: returns 1 when all its rows are
 * complete (decoded into out for TFF), 0 when some are still missing, -1 on error (recorded). */
static int recv_progress(op_t *op, int core, int s, const int64_t *rx_base, uint8_t *land_base,
                         uint8_t *out_base, rx_cursor_t *c) {
    engine_t *g = op->g;
    uint8_t *ib = inbox(g, g->rank, s, op->par);
    int64_t expect = RX_ROWS(g, core)[s];
    if (g->sync == SYNC_SW) {
        if (ld_acq(ib + IN_SW_EPOCH) != op->epoch) return 0;
        if ((int64_t)ld_rlx(ib + IN_SW_COUNT) != expect)
            return op_error(op, E_INTERNAL, core, s, "SW flag of rank %d announces %llu rows, "
                            "counts said %lld", s, (unsigned long long)ld_rlx(ib + IN_SW_COUNT),
                            (long long)expect), -1;
        return 1;
    }
    if (g->sync == SYNC_DC) {
        if (ld_acq(ib + IN_DC_EPOCH) != op->epoch) return 0;
        int64_t W = (g->row_bytes + 7) / 8;
        uint64_t s1 = 0, s2 = 0;
        FOR_SOURCE_ROWS(g, core, s, rx_base, pos, rank_, {
            uint64_t A, B;
            dc_row_sums(land_base + pos * g->slot_bytes, g->row_bytes, &A, &B);
            s1 += A;
            s2 += (uint64_t)rank_ * (uint64_t)W * A + B;
        });
        /* a mismatch means rows of this epoch are still landing (or a stale batch): retry */
        return (int64_t)ld_rlx(ib + IN_DC_COUNT) == expect &&
               ld_rlx(ib + IN_DC_SUM) == dc_finish(s1, s2, op->epoch);
    }
    const int expert = g->layout == LAY_EXPERT;
    const int nblocks = expert ? g->L : 1;
    const uint32_t *cnt = RX_CNT(g, core) + (int64_t)s * g->L;
    for (; c->el < nblocks; c->el++, c->off = 0) {
        int64_t n = expert ? (int64_t)cnt[c->el] : expect;
        int64_t p0 = rx_base[s * g->L + (expert ? c->el : 0)];
        for (; c->off < n; c->off++, c->rank++) {
            int64_t pos = p0 + c->off;
            const uint8_t *slot = land_base + pos * g->slot_bytes;
            if (g->sync == SYNC_SP) {
                int64_t body = g->row_bytes - g->sp_tail;
                if (has_pattern(slot + body, g->sp_tail, g->isz, g->sentinel)) return 0;
                continue; /* in place: the row is recv_x already */
            }
            for (int64_t b = 0; b < g->tff_nblocks; b++) /* TFF: the whole row, then copy */
                if (ld_acq(slot + b * g->tff_block + g->tff_payload) != op->epoch) return 0;
            uint8_t *dst = out_base + pos * g->out_stride;
            for (int64_t b = 0; b < g->tff_nblocks; b++) {
                int64_t off = b * g->tff_payload, len = g->row_bytes - off;
                if (len > g->tff_payload) len = g->tff_payload;
                copy_fast(dst + off, slot + b * g->tff_block, len);
            }
        }
    }
    atomic_thread_fence(memory_order_acquire);
    return 1;
}

/* ASP receive of this core's sources: consume whichever source has data, in arrival order */
static int recv_sources(op_t *op, int core, const int64_t *rx_base, int reg) {
    engine_t *g = op->g;
    int src[64], n = 0;
    rx_cursor_t cur[64];
    for (int s = core; s < g->R; s += g->C) {
        if (s == g->rank || RX_ROWS(g, core)[s] == 0) continue;
        src[n] = s;
        cur[n].el = 0;
        cur[n].off = cur[n].rank = 0;
        n++;
    }
    uint8_t *land_base = land(g, g->rank, reg), *out_base = outreg(g, g->rank, reg);
    waiter_t w;
    waiter_init(&w);
    while (n) {
        int completed = 0;
        for (int i = 0; i < n;) {
            int rc = recv_progress(op, core, src[i], rx_base, land_base, out_base, &cur[i]);
            if (rc < 0) return -1;
            if (rc == 1) {
                src[i] = src[n - 1];
                cur[i] = cur[n - 1];
                n--;
                completed = 1;
                continue;
            }
            i++;
        }
        if (!n) break;
        /* Rows trickling in do not restart the spin/yield budget: once it is spent, this core
         * sleeps until a source rings at the end of its batch. With a core per rank that is
         * rarely reached; oversubscribed, polling row by row would take the CPU from the very
         * ranks still writing (the wait then degrades to SW's one wake-up per source). */
        if (completed) {
            waiter_init(&w);
            continue;
        }
        int rc = wait_step(op, &w, core, src[0], "%s rows from rank %d (row %lld of its batch)",
                 g->sync == SYNC_SP ? "SP" : g->sync == SYNC_TFF ? "TFF" : g->sync == SYNC_SW
                 ? "the SW flag of" : "a DC batch matching its checksum of", src[0],
                 (long long)cur[0].rank);
        if (rc) return rc;
    }
    return 0;
}

/* o_nrecv = [num_recv_tokens_per_expert (L) | rows received from each source rank (R)] */
static void recv_counts_out(op_t *op, int core) {
    engine_t *g = op->g;
    const uint32_t *cnt = RX_CNT(g, core);
    for (int el = 0; el < g->L; el++) {
        int64_t tot = 0;
        for (int s = 0; s < g->R; s++) tot += cnt[(int64_t)s * g->L + el];
        op->o_nrecv[el] = tot;
    }
    for (int s = 0; s < g->R; s++) op->o_nrecv[g->L + s] = RX_ROWS(g, core)[s];
}

static int ph_d_receive(op_t *op, int core) {
    engine_t *g = op->g;
    const int R = g->R, L = g->L;
    int64_t *rx_base = g->rx_base + (int64_t)core * R * L;
    int64_t n = 0;
    int rc = recv_bases(op, core, rx_base, &n);
    if (rc) return rc;
    TRACE(g, core, 5);
    int reg = (int)(op->n % g->nreg);
    if (core == 0) {
        op->n_recv = n;
        recv_counts_out(op, core);
    }
    for (int s = core; s < R; s += g->C) {
        if ((rc = recv_metadata(op, core, s, rx_base))) return rc;
    }
    TRACE(g, core, 6);
    rc = recv_sources(op, core, rx_base, reg);
    TRACE(g, core, 7);
    return rc;
}

/* --- BSP dispatch: real global barriers between the phases ------------------------------- */

static int barrier_arrive(op_t *op, int core, int phase) {
    engine_t *g = op->g;
    store_fence();
    pub_word(ctrl(g, g->rank, g->off_barrier) + (int64_t)core * 64,
             op->epoch * 4 + (uint64_t)phase);
    ring_all(g);
    return 0;
}
/* Arrival words only grow, so a peer already in a later call passes the test too: that is
 * right if it completed this call, wrong if it failed it (its arrival belongs to another call),
 * so such a peer's failure notice for this call is checked. */
static int barrier_wait(op_t *op, int core, int phase) {
    engine_t *g = op->g;
    uint64_t target = op->epoch * 4 + (uint64_t)phase, next_call = (op->epoch + 1) * 4;
    for (int q = 0; q < g->R; q++) {
        for (int c = 0; c < g->C; c++) {
            waiter_t w;
            waiter_init(&w);
            uint64_t v;
            while ((v = rd_word(ctrl(g, q, g->off_barrier) + (int64_t)c * 64)) < target) {
                int rc = wait_step(op, &w, core, q, "global barrier %d (rank %d core %d)", phase, q, c);
                if (rc) return rc;
            }
            if (v >= next_call) {
                int rc = check_failures(op, core);
                if (rc) return rc;
            }
        }
    }
    return 0;
}
static int ph_b1_arrive(op_t *op, int core) { return barrier_arrive(op, core, 1); }
static int ph_b1_wait(op_t *op, int core) { return barrier_wait(op, core, 1); }
static int ph_b2_arrive(op_t *op, int core) { return barrier_arrive(op, core, 2); }
static int ph_b2_wait(op_t *op, int core) { return barrier_wait(op, core, 2); }

/* Token-Sending: rows go to the destination's staging partition of this source, at the slot
 * the sender computes alone (regions partitioned by (source, expert)). Work is split across
 * cores by unit index; the destination's readiness (its staging area is clean) is checked. */
static int ph_bsp_send(op_t *op, int core) {
    engine_t *g = op->g;
    const int R = g->R, L = g->L;
    int64_t *ready = g->core_ready + (int64_t)core * R;
    for (int d = 0; d < R; d++) ready[d] = 0;
    int reg = (int)(op->n % g->nreg);
    for (int i = 0; i < R; i++) {
      int d = (g->rank + 1 + i) % R;
      int64_t n = g->units_to[d], b = bucket_start(g, i);
      for (int64_t u = b + n * core / g->C; u < b + n * (core + 1) / g->C; u++) {
        if (!ready[d]) {
            waiter_t w;
            waiter_init(&w);
            uint64_t at;
            while ((at = rd_word(ctrl(g, d, g->off_recv_ready))) != op->epoch) {
                if (at > op->epoch) return dst_gone(op, core, d);
                int rc = wait_step(op, &w, core, d, "staging area of rank %d", d);
                if (rc) return rc;
            }
            ready[d] = 1;
        }
        int64_t slot = g->layout == LAY_EXPERT ? g->my_rank_in_batch[g->u_e[u]] + g->u_slot[u]
                                               : g->u_slot[u];
        int64_t pos = (int64_t)g->rank * g->cap_src_rows + slot;
        const uint8_t *src = op->x + (int64_t)g->u_t[u] * g->row_bytes;
        uint8_t *slotp = land(g, d, reg) + pos * g->slot_bytes;
        if (g->sync == SYNC_TFF) {
            for (int64_t b = 0; b < g->tff_nblocks; b++) {
                int64_t off = b * g->tff_payload, len = g->row_bytes - off;
                if (len > g->tff_payload) len = g->tff_payload;
                uint8_t *blk = slotp + b * g->tff_block;
                copy_elem(blk, src + off, len);
                if (len < g->tff_payload) memset(blk + len, 0, (size_t)(g->tff_payload - len));
                if (g->tff_flag > 8) memset(blk + g->tff_payload + 8, 0, (size_t)(g->tff_flag - 8));
                st_rel(blk + g->tff_payload, op->epoch);
            }
        } else if (g->sync == SYNC_SP) {
            copy_elem(slotp, src, g->row_bytes);
        } else {
            copy_fast(slotp, src, g->row_bytes);
        }
        (void)L;
      }
    }
    return 0;
}

/* SendFlag & TokenCnt: counts, SW flag, DC checksum (over the staged rows, slot order) */
static int ph_bsp_flags(op_t *op, int core) {
    engine_t *g = op->g;
    const int R = g->R, L = g->L;
    int reg = (int)(op->n % g->nreg);
    for (int d = core; d < R; d += g->C) {
        uint8_t *ib = inbox(g, d, g->rank, op->par);
        uint32_t *c = (uint32_t *)(ib + IN_COUNTS);
        for (int el = 0; el < L; el++) c[el] = (uint32_t)g->cnt[d * L + el];
        st_rlx(ib + IN_ROWS, (uint64_t)g->rows_to[d]);
        st_rlx(ib + IN_SUM, counts_sum(op->epoch, (uint64_t)g->rows_to[d], c, L));
        if (g->sync == SYNC_SW) {
            st_rlx(ib + IN_SW_COUNT, (uint64_t)g->rows_to[d]);
            st_rel(ib + IN_SW_EPOCH, op->epoch);
        } else if (g->sync == SYNC_DC) {
            uint64_t s1 = 0, s2 = 0;
            int64_t W = (g->row_bytes + 7) / 8;
            uint8_t *part = land(g, d, reg) + (int64_t)g->rank * g->cap_src_rows * g->slot_bytes;
            for (int64_t i = 0; i < g->rows_to[d]; i++) {
                uint64_t A, B;
                dc_row_sums(part + i * g->slot_bytes, g->row_bytes, &A, &B);
                s1 += A;
                s2 += (uint64_t)i * (uint64_t)W * A + B;
            }
            st_rlx(ib + IN_DC_COUNT, (uint64_t)g->rows_to[d]);
            st_rlx(ib + IN_DC_SUM, dc_finish(s1, s2, op->epoch));
            st_rel(ib + IN_DC_EPOCH, op->epoch);
        }
        st_rel(ib + IN_COUNTS_EPOCH, op->epoch);
        ring(g, d);
    }
    return 0;
}

/* Verification: every core polls a subset of the sources' flags / data */
static int ph_bsp_verify(op_t *op, int core) {
    engine_t *g = op->g;
    const int R = g->R;
    int reg = (int)(op->n % g->nreg);
    for (int s = core; s < R; s += g->C) {
        uint8_t *ib = inbox(g, g->rank, s, op->par);
        waiter_t w;
        waiter_init(&w);
        while (ld_acq(ib + IN_COUNTS_EPOCH) != op->epoch) {
            int rc = wait_step(op, &w, core, s, "the flag and counts of rank %d", s);
            if (rc) return rc;
        }
        int64_t n;
        int rc = read_counts(op, core, g->rank, s, &n, RX_CNT(g, core) + (int64_t)s * g->L);
        if (rc) return rc;
        uint8_t *part = land(g, g->rank, reg) + (int64_t)s * g->cap_src_rows * g->slot_bytes;
        int ok = 1;
        if (g->sync == SYNC_SW) {
            ok = ld_acq(ib + IN_SW_EPOCH) == op->epoch && (int64_t)ld_rlx(ib + IN_SW_COUNT) == n;
        } else if (g->sync == SYNC_DC) {
            uint64_t s1 = 0, s2 = 0;
            int64_t W = (g->row_bytes + 7) / 8;
            for (int64_t i = 0; i < n; i++) {
                uint64_t A, B;
                dc_row_sums(part + i * g->slot_bytes, g->row_bytes, &A, &B);
                s1 += A;
                s2 += (uint64_t)i * (uint64_t)W * A + B;
            }
            ok = ld_acq(ib + IN_DC_EPOCH) == op->epoch && (int64_t)ld_rlx(ib + IN_DC_COUNT) == n &&
                 ld_rlx(ib + IN_DC_SUM) == dc_finish(s1, s2, op->epoch);
        } else if (g->sync == SYNC_SP) {
            for (int64_t i = 0; i < n && ok; i++)
                ok = !has_pattern(part + i * g->slot_bytes, g->row_bytes, g->isz, g->sentinel);
        } else {
            for (int64_t i = 0; i < n && ok; i++)
                for (int64_t b = 0; b < g->tff_nblocks && ok; b++)
                    ok = ld_acq(part + i * g->slot_bytes + b * g->tff_block + g->tff_payload) ==
                         op->epoch;
        }
        if (!ok)
            return op_error(op, E_INTERNAL, core, s, "verification of rank %d's rows failed after "
                            "the barrier", s);
    }
    return 0;
}

/* CalCumSum + Token-Reordering: copy staged rows to their final position, fill metadata */
static int ph_bsp_reorder(op_t *op, int core) {
    engine_t *g = op->g;
    const int R = g->R, L = g->L;
    int64_t *rx_base = g->rx_base + (int64_t)core * R * L;
    int64_t n = 0;
    int rc = recv_bases(op, core, rx_base, &n);
    if (rc) return rc;
    int reg = (int)(op->n % g->nreg);
    if (core == 0) {
        op->n_recv = n;
        recv_counts_out(op, core);
    }
    uint8_t *stage = land(g, g->rank, reg), *out = outreg(g, g->rank, reg);
    for (int s = core; s < R; s += g->C) {
        if ((rc = recv_metadata(op, core, s, rx_base))) return rc;
        uint8_t *part = stage + (int64_t)s * g->cap_src_rows * g->slot_bytes;
        FOR_SOURCE_ROWS(g, core, s, rx_base, pos, rank_, {
            const uint8_t *slot = part + rank_ * g->slot_bytes;
            uint8_t *dst = out + pos * g->out_stride;
            if (g->sync == SYNC_TFF) {
                for (int64_t b = 0; b < g->tff_nblocks; b++) {
                    int64_t off = b * g->tff_payload, len = g->row_bytes - off;
                    if (len > g->tff_payload) len = g->tff_payload;
                    copy_fast(dst + off, slot + b * g->tff_block, len);
                }
            } else {
                copy_fast(dst, slot, g->row_bytes);
                if (g->sync == SYNC_SP)  /* consumed: refill for the next call */
                    fill_pattern((uint8_t *)slot, g->row_bytes, g->isz, g->sentinel);
            }
        });
    }
    return 0;
}

/* send_dst_row of the BSP path: final positions, computed once the counts are known */
static int ph_bsp_dst_rows(op_t *op, int core) {
    engine_t *g = op->g;
    const int R = g->R, L = g->L;
    int64_t *bases = g->core_base + (int64_t)core * R * L;
    for (int d = 0; d < R; d++) {
        int rc = compute_bases(op, core, d, g->rank, bases + (int64_t)d * L);
        if (rc) return rc;
    }
    for (int i = 0; i < R; i++) {
        int d = (g->rank + 1 + i) % R;
        for (int64_t u = bucket_start(g, i), end = u + g->units_to[d]; u < end; u++) {
            int64_t pos = unit_pos(g, bases + (int64_t)d * L, g->u_e[u], g->u_slot[u]);
            if (g->layout == LAY_EXPERT) op->o_dst_row[(int64_t)g->u_t[u] * g->K + g->u_k[u]] = pos;
            else op->o_dst_row[(int64_t)g->u_t[u] * g->R + d] = pos;
        }
    }
    return 0;
}

static int ph_bsp_prepare(op_t *op, int core) {
    (void)core;
    pub_word(ctrl(op->g, op->g->rank, op->g->off_entered), op->epoch << 2 | (uint64_t)op->kind);
    int rc = wait_peers_done(op, op->epoch >= 2 ? op->epoch - 2 : 0, 0);
    if (rc) return rc;
    if ((rc = dispatch_validate(op))) return rc;
    reset_send_state(op);
    return dispatch_publish(op);
}

static const phase_t ASP_DISPATCH[] = {
    {ph_d_prepare, 0, 1},
    {ph_d_send, 1, 0},
    {ph_d_receive, 1, 0},
};
static const phase_t BSP_DISPATCH[] = {
    {ph_bsp_prepare, 0, 1},  /* Init */
    {ph_bsp_send, 1, 1},     /* Token-Sending */
    {ph_b1_arrive, 1, 1},    /* SyncAll */
    {ph_b1_wait, 1, 1},
    {ph_bsp_flags, 1, 1},    /* SendFlag & TokenCnt */
    {ph_bsp_verify, 1, 1},   /* Verification */
    {ph_b2_arrive, 1, 1},    /* SyncAll */
    {ph_b2_wait, 1, 1},
    {ph_bsp_reorder, 1, 1},  /* CalCumSum + Token-Reordering */
    {ph_bsp_dst_rows, 0, 0},
};

/* ---------------------------------------------------------------------------------------- */
/* combine                                                                                   */

static int ph_c_prepare(op_t *op, int core) {
    engine_t *g = op->g;
    (void)core;
    pub_word(ctrl(g, g->rank, g->off_entered), op->epoch << 2 | (uint64_t)op->kind);
    int rc = wait_peers_done(op, op->epoch >= 2 ? op->epoch - 2 : 0, 0);
    if (rc) return rc;
    if (!op->zero_copy) {
        /* the region's previous readers must be done before it is overwritten */
        if ((rc = wait_peers_done(op, g->comb_last_epoch[op->creg], 0))) return rc;
        g->comb_last_epoch[op->creg] = op->epoch;
    }
    return 0;
}

static int ph_c_copy(op_t *op, int core) {
    engine_t *g = op->g;
    if (op->zero_copy) return 0;
    int64_t lo = op->eo_rows * core / g->C, hi = op->eo_rows * (core + 1) / g->C;
    uint8_t *dst = g->base[g->rank] + op->eo_off;
    if (lo < hi)
        copy_fast(dst + lo * g->crow_bytes, op->eo + lo * g->crow_bytes, (hi - lo) * g->crow_bytes);
    return 0;
}

static uint64_t comb_info_sum(uint64_t epoch, uint64_t off, uint64_t rows, uint64_t stride,
                              uint64_t index) {
    return mix64(mix64(mix64(mix64(mix64(0x636F6D62ULL, epoch), off), rows), stride), index);
}

static int ph_c_publish(op_t *op, int core) {
    engine_t *g = op->g;
    (void)core;
    uint8_t *ci = comb_info(g, g->rank, op->par);
    store_fence();
    st_rlx(ci + CI_OFF, (uint64_t)op->eo_off);
    st_rlx(ci + CI_ROWS, (uint64_t)op->eo_rows);
    st_rlx(ci + CI_STRIDE, (uint64_t)g->crow_bytes);
    st_rlx(ci + CI_INDEX, op->dispatch_index);
    st_rlx(ci + CI_SUM, comb_info_sum(op->epoch, (uint64_t)op->eo_off, (uint64_t)op->eo_rows,
                                      (uint64_t)g->crow_bytes, op->dispatch_index));
    st_rel(ci + CI_EPOCH, op->epoch);
    ring_all(g);
    for (int c = 0; c < 2; c++) {
        int64_t lo = g->off_comb + c * g->comb_bytes;
        if (op->eo_off >= lo && op->eo_off < lo + g->comb_bytes) g->comb_last_epoch[c] = op->epoch;
    }
    return 0;
}

static int ph_cb_arrive(op_t *op, int core) { return barrier_arrive(op, core, 3); }
static int ph_cb_wait(op_t *op, int core) { return barrier_wait(op, core, 3); }

static int ph_c_reduce(op_t *op, int core) {
    engine_t *g = op->g;
    const int R = g->R, K = g->K, L = g->L;
    int64_t *coff = g->ci_off + (int64_t)core * R, *crows = g->ci_rows + (int64_t)core * R;
    /* every peer's expert outputs: wait for them (ASP) / verify them (BSP) */
    for (int q = 0; q < R; q++) {
        uint8_t *ci = comb_info(g, q, op->par);
        waiter_t w;
        waiter_init(&w);
        while (ld_acq(ci + CI_EPOCH) != op->epoch) {
            if (g->eng == ENG_BSP) {
                /* past the barrier without its outputs: q failed this call (notice) or the
                 * ranks are out of step */
                int rc = check_failures(op, core);
                if (rc) return rc;
                return op_error(op, E_LOST, core, q, "rank %d's expert outputs missing after "
                                "the barrier of call %llu", q, (unsigned long long)op->epoch);
            }
            int rc = wait_step(op, &w, core, q, "the expert outputs of rank %d", q);
            if (rc) return rc;
        }
        uint64_t off = ld_rlx(ci + CI_OFF), rows = ld_rlx(ci + CI_ROWS);
        uint64_t stride = ld_rlx(ci + CI_STRIDE), index = ld_rlx(ci + CI_INDEX);
        if (ld_rlx(ci + CI_SUM) != comb_info_sum(op->epoch, off, rows, stride, index))
            return op_error(op, E_LOST, core, q, "corrupt combine record of rank %d in call %llu",
                            q, (unsigned long long)op->epoch);
        if (index != op->dispatch_index) {
            char v[48];
            snprintf(v, sizeof v, "dispatch %llu", (unsigned long long)op->dispatch_index);
            return bad_input(op, "handle", v, "ranks combine different dispatches (rank %d "
                             "passed the handle of dispatch %llu): every rank must pass the "
                             "handle of the same dispatch", q, (unsigned long long)index);
        }
        if (stride != (uint64_t)g->crow_bytes || rows > (uint64_t)g->cap_rows ||
            off < 256 || off + rows * stride > (uint64_t)g->seg_size)
            return op_error(op, E_INTERNAL, core, q, "rank %d published expert outputs outside "
                            "its segment", q);
        coff[q] = (int64_t)off;
        crows[q] = (int64_t)rows;
    }
    const int cd = g->cdt;
    const int maxt = K > R ? K : R;
    const void **tp = g->term_ptr + (int64_t)core * maxt;
    float *tw = g->term_w + (int64_t)core * maxt;
    int64_t lo = op->h_ntok * core / g->C, hi = op->h_ntok * (core + 1) / g->C;
    for (int64_t t = lo; t < hi; t++) {
        int nt = 0;
        if (g->layout == LAY_EXPERT) {
            for (int k = 0; k < K; k++) {
                int64_t e = op->h_idx[t * K + k];
                if (e < 0) continue;
                if (e >= g->E)
                    return op_error(op, E_INTERNAL, core, -1, "handle names expert %lld",
                                    (long long)e);
                int d = g->e2d[e];
                int64_t pos = op->h_dst_row[t * K + k];
                if (pos < 0 || pos >= crows[d])
                    return op_error(op, E_INTERNAL, core, d, "handle row %lld outside rank %d's "
                                    "%lld expert outputs", (long long)pos, d, (long long)crows[d]);
                tp[nt] = g->base[d] + coff[d] + pos * g->crow_bytes;
                tw[nt++] = op->h_w[t * K + k];
            }
        } else {
            for (int d = 0; d < R; d++) {
                int64_t pos = op->h_dst_row[t * R + d];
                if (pos < 0) continue;
                if (pos >= crows[d])
                    return op_error(op, E_INTERNAL, core, d, "handle row %lld outside rank %d's "
                                    "%lld expert outputs", (long long)pos, d, (long long)crows[d]);
                tp[nt] = g->base[d] + coff[d] + pos * g->crow_bytes;
                tw[nt++] = 1.0f;
            }
        }
        REDUCE[cd](op->y + t * (int64_t)g->hidden * g->cisz, tp, tw, nt, g->hidden,
                   g->layout == LAY_EXPERT);
    }
    (void)L;
    return 0;
}

static const phase_t ASP_COMBINE[] = {
    {ph_c_prepare, 0, 1},
    {ph_c_copy, 1, 1},
    {ph_c_publish, 0, 1},
    {ph_c_reduce, 1, 0},
};
static const phase_t BSP_COMBINE[] = {
    {ph_c_prepare, 0, 1},
    {ph_c_copy, 1, 1},
    {ph_c_publish, 0, 1},
    {ph_cb_arrive, 1, 1},
    {ph_cb_wait, 1, 1},
    {ph_c_reduce, 1, 0},
};

/* ---------------------------------------------------------------------------------------- */
/* end of an operation: progress word, failure notice, SP reset scheduling                   */

/* "call `epoch` failed here, for reason `code`" (E_BAD_INPUT: rejected before anything of
 * the call reached a peer, so the ranks stay in step; any other code: they may not be) */
static void publish_failure(engine_t *g, uint64_t epoch, int code, const char *msg) {
    uint8_t *f = fail_block(g, g->rank, epoch);
    size_t len = strlen(msg);
    if (len > FAIL_MSG_MAX) len = FAIL_MSG_MAX;
    uint64_t lencode = (uint64_t)len | (uint64_t)(uint32_t)code << 32;
    memcpy(f + FAIL_MSG, msg, len);
    st_rlx(f + FAIL_LEN, lencode);
    st_rlx(f + FAIL_SUM, notice_sum(epoch, lencode, f + FAIL_MSG, (uint32_t)len));
    st_rel(f + FAIL_EPOCH, epoch);
    ring_all(g);
}

/* a message cut at the end of its buffer (a notice has room for FAIL_MSG_MAX bytes anyway) */
__attribute__((format(printf, 3, 4))) static void say(char *buf, size_t n, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, n, fmt, ap);
    va_end(ap);
}

static void format_error(op_t *op, char *buf, size_t n) {
    switch (atomic_load(&op->err)) {
    case E_BAD_INPUT:
        say(buf, n, "rank %d: bad input: %s=%s: %s", op->g->rank, op->arg, op->msg, op->what);
        break;
    case E_REMOTE:
        say(buf, n, "rank %d saw rank %d fail: %s", op->g->rank, op->err_peer, op->msg);
        break;
    default: say(buf, n, "%s", op->what); break;
    }
}

static void finish_op(op_t *op) {
    engine_t *g = op->g;
    /* A peer may have failed this call although this rank got everything it needed (it timed
     * out on a slow third rank, say): then the call failed, here too. */
    if (!atomic_load(&op->err)) check_failures(op, 0);
    int err = atomic_load(&op->err);
    if (err) {
        char buf[MAX_MSG];
        format_error(op, buf, sizeof buf);
        publish_failure(g, op->epoch, err == E_REMOTE ? op->remote_code : err, buf);
    }
    if (op->kind == 0 && g->sync == SYNC_SP && land_is_out(g) && op->published_ready) {
        /* rows [0, n_recv) now hold data; after a failure, any row a peer may have reached */
        int64_t *dirty = &g->sp_dirty[op->n % g->nreg];
        int64_t used = err ? g->cap_rows : op->n_recv;
        if (used > *dirty) *dirty = used;
    } else if (op->kind == 0 && g->sync == SYNC_SP && err && op->published_ready) {
        /* peers may have written rows this call never consumed: reset all before reuse */
        g->land_dirty = 1;
        g->land_dirty_epoch = op->epoch;
    }
    pub_word(ctrl(g, g->rank, g->off_done), op->epoch);
    ring_all(g);
    int armed = atomic_load(&op->armed);
    if (armed) atomic_fetch_sub(sleepers(g, g->rank), (uint32_t)armed);
}

static PyObject *error_tuple(op_t *op) {
    int err = atomic_load(&op->err);
    char buf[MAX_MSG];
    format_error(op, buf, sizeof buf);
    /* E_REMOTE: the notice's code in the core slot; the message as bytes (a peer wrote it) */
    const char *msg = err == E_REMOTE || err == E_BAD_INPUT ? op->msg : buf;
    return Py_BuildValue("(iiisy#y#)", err, op->err_peer,
                         err == E_REMOTE ? op->remote_code : op->err_core, op->arg, op->what,
                         (Py_ssize_t)strlen(op->what), msg, (Py_ssize_t)strlen(msg));
}

/* ---------------------------------------------------------------------------------------- */
/* Python type                                                                               */

static int get_i64(PyObject *d, const char *key, int64_t *out) {
    PyObject *v = PyDict_GetItemString(d, key);
    if (!v) {
        PyErr_Format(PyExc_KeyError, "engine parameter %s missing", key);
        return -1;
    }
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    *out = x;
    return 0;
}

static void engine_free_scratch(engine_t *g) {
    free(g->base); free(g->pids); free(g->starts);
    free(g->cnt); free(g->units_to); free(g->rows_to);
    free(g->u_t); free(g->u_k); free(g->u_e); free(g->u_slot); free(g->stamp);
    free(g->my_rank_in_batch); free((void *)g->remaining); free((void *)g->dc_s1);
    free((void *)g->dc_s2); free(g->core_base); free(g->core_ready); free(g->rx_base);
    free(g->rx_rows); free(g->rx_cnt); free(g->tx_rows); free(g->tx_cnt);
    free(g->route_snap); free(g->ci_off); free(g->ci_rows);
    free(g->threads); free(g->e2d); free(g->e2l);
    free((void *)g->term_ptr); free(g->term_w);
    g->base = NULL;
}

static void engine_stop(engine_t *g) {
    atomic_store(&g->stopping, 1);
    if (g->nthreads_started) {
        atomic_fetch_add(&g->job_gen, 1);
        futex_wake(&g->job_gen, INT32_MAX);
        for (int c = 1; c <= g->nthreads_started; c++) pthread_join(g->threads[c], NULL);
        g->nthreads_started = 0;
    }
}

static void engine_dealloc(engine_t *g) {
    Py_BEGIN_ALLOW_THREADS
    engine_stop(g);
    Py_END_ALLOW_THREADS
    engine_free_scratch(g);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

static int engine_init(engine_t *g, PyObject *args, PyObject *kwds) {
    PyObject *p, *bases, *pids, *starts;
    (void)kwds;
    if (!PyArg_ParseTuple(args, "O!OOO", &PyDict_Type, &p, &bases, &pids, &starts)) return -1;
    int64_t v[64];
    static const char *keys[] = {
        "rank", "num_ranks", "num_cores", "num_experts", "num_local_experts", "num_topk",
        "max_tokens", "hidden", "itemsize", "dtype", "combine_dtype", "combine_itemsize",
        "sync", "engine", "layout", "num_regions", "num_land_regions", "threaded", "cap_rows", "cap_src_rows",
        "row_bytes", "slot_bytes", "out_stride", "combine_row_bytes", "tff_block_bytes",
        "tff_flag_bytes", "sentinel", "off_fail", "off_entered", "off_done", "off_recv_ready",
        "off_comb_info", "off_barrier", "off_inbox", "inbox_bytes", "off_route", "route_stride",
        "route_w_off", "off_land", "land_bytes", "off_out", "out_bytes", "off_comb", "comb_bytes",
        "seg_size", "timeout_ns", "off_doorbell", "yield_ns", "sp_check_bytes", NULL};
    int nk = 0;
    for (; keys[nk]; nk++)
        if (get_i64(p, keys[nk], &v[nk])) return -1;
    int i = 0;
    g->rank = (int)v[i++]; g->R = (int)v[i++]; g->C = (int)v[i++]; g->E = (int)v[i++];
    g->L = (int)v[i++]; g->K = (int)v[i++]; g->T = (int)v[i++]; g->hidden = (int)v[i++];
    g->isz = (int)v[i++]; g->dt = (int)v[i++]; g->cdt = (int)v[i++]; g->cisz = (int)v[i++];
    g->sync = (int)v[i++]; g->eng = (int)v[i++]; g->layout = (int)v[i++]; g->nreg = (int)v[i++];
    g->nland = (int)v[i++];
    g->threaded = (int)v[i++]; g->cap_rows = v[i++]; g->cap_src_rows = v[i++];
    g->row_bytes = v[i++]; g->slot_bytes = v[i++]; g->out_stride = v[i++];
    g->crow_bytes = v[i++]; g->tff_block = v[i++]; g->tff_flag = v[i++];
    g->sentinel = (uint64_t)v[i++]; g->off_fail = v[i++]; g->off_entered = v[i++];
    g->off_done = v[i++]; g->off_recv_ready = v[i++]; g->off_comb_info = v[i++];
    g->off_barrier = v[i++]; g->off_inbox = v[i++]; g->inbox_bytes = v[i++];
    g->off_route = v[i++]; g->route_stride = v[i++]; g->route_w_off = v[i++];
    g->off_land = v[i++]; g->land_bytes = v[i++]; g->off_out = v[i++]; g->out_bytes = v[i++];
    g->off_comb = v[i++]; g->comb_bytes = v[i++]; g->seg_size = v[i++]; g->timeout_ns = v[i++];
    g->off_doorbell = v[i++]; g->yield_ns = v[i++]; g->sp_tail = v[i++];
    /* 0 (or a whole row or more): every element of the row is armed and polled */
    if (g->sp_tail <= 0 || g->sp_tail >= g->row_bytes) g->sp_tail = g->row_bytes;
    if (g->isz > 1) g->sp_tail -= g->sp_tail % g->isz;
    if (g->R < 1 || g->R > 64 || g->C < 1 || g->C > 256 || g->L < 1 || g->K < 1 ||
        g->cdt < 0 || g->cdt > 2 || g->rank < 0 || g->rank >= g->R || g->nreg < 1 ||
        g->nreg > 8 || (g->nland != 1 && g->nland != g->nreg)) {
        PyErr_SetString(PyExc_ValueError, "engine: parameters out of range (num_ranks <= 64)");
        return -1;
    }
    g->tff_payload = g->tff_block - g->tff_flag;
    g->tff_nblocks = g->tff_payload > 0 ? (g->row_bytes + g->tff_payload - 1) / g->tff_payload : 0;
    if (!PySequence_Check(bases) || PySequence_Size(bases) != g->R || PySequence_Size(pids) != g->R ||
        PySequence_Size(starts) != g->R) {
        PyErr_SetString(PyExc_ValueError, "engine: bases/pids/starts need one entry per rank");
        return -1;
    }
    const int R = g->R, C = g->C, L = g->L, E = g->E;
    g->base = calloc((size_t)R, sizeof(uint8_t *));
    g->pids = calloc((size_t)R, sizeof(int));
    g->starts = calloc((size_t)R, sizeof(unsigned long long));
    g->cnt = calloc((size_t)E, sizeof(int64_t));
    g->units_to = calloc((size_t)R, sizeof(int64_t));
    g->rows_to = calloc((size_t)R, sizeof(int64_t));
    const int64_t UB = (int64_t)R * g->cap_src_rows + 1;
    g->u_t = calloc((size_t)UB, 4); g->u_k = calloc((size_t)UB, 4);
    g->u_e = calloc((size_t)UB, 4); g->u_slot = calloc((size_t)UB, 4);
    g->stamp = calloc((size_t)E, sizeof(uint64_t));
    g->my_rank_in_batch = calloc((size_t)E, sizeof(int64_t));
    g->remaining = calloc((size_t)R, sizeof(int64_t));
    g->dc_s1 = calloc((size_t)R, sizeof(uint64_t));
    g->dc_s2 = calloc((size_t)R, sizeof(uint64_t));
    int64_t big = (int64_t)R * L > E ? (int64_t)R * L : E;
    g->core_base = calloc((size_t)(C * big + R), sizeof(int64_t));
    g->core_ready = calloc((size_t)C * R, sizeof(int64_t));
    g->rx_base = calloc((size_t)(C * big + R), sizeof(int64_t));
    g->rx_rows = calloc((size_t)C * R, sizeof(int64_t));
    g->rx_cnt = calloc((size_t)C * R * L, sizeof(uint32_t));
    g->tx_rows = calloc((size_t)C * R, sizeof(int64_t));
    g->tx_cnt = calloc((size_t)C * R * L, sizeof(uint32_t));
    g->route_snap = calloc((size_t)C * 2 * (size_t)(g->T * g->K) + 1, sizeof(uint32_t));
    g->ci_off = calloc((size_t)C * R, 8); g->ci_rows = calloc((size_t)C * R, 8);
    g->e2d = calloc((size_t)E, sizeof(int32_t)); g->e2l = calloc((size_t)E, sizeof(int32_t));
    int maxt = g->K > R ? g->K : R;
    g->term_ptr = calloc((size_t)C * maxt, sizeof(void *));
    g->term_w = calloc((size_t)C * maxt, sizeof(float));
    if (g->e2d && g->e2l)
        for (int e = 0; e < E; e++) { g->e2d[e] = e / L; g->e2l[e] = e % L; }
    if (!g->base || !g->pids || !g->starts || !g->cnt || !g->u_t || !g->u_k || !g->u_e ||
        !g->stamp || !g->u_slot || !g->core_base || !g->rx_base ||
        !g->ci_off || !g->rx_rows || !g->rx_cnt || !g->tx_rows || !g->tx_cnt ||
        !g->route_snap ||
        !g->e2d || !g->e2l || !g->term_ptr || !g->term_w) {
        PyErr_NoMemory();
        return -1;
    }
    for (int r = 0; r < R; r++) {
        PyObject *b = PySequence_GetItem(bases, r), *pi = PySequence_GetItem(pids, r),
                 *st = PySequence_GetItem(starts, r);
        if (!b || !pi || !st) { Py_XDECREF(b); Py_XDECREF(pi); Py_XDECREF(st); return -1; }
        g->base[r] = (uint8_t *)PyLong_AsVoidPtr(b);
        g->pids[r] = (int)PyLong_AsLong(pi);
        g->starts[r] = PyLong_AsUnsignedLongLong(st);
        Py_DECREF(b); Py_DECREF(pi); Py_DECREF(st);
        if (PyErr_Occurred()) return -1;
    }
    if (start_threads(g)) {
        PyErr_SetString(PyExc_OSError, "engine: could not start worker threads");
        return -1;
    }
    return 0;
}

typedef struct {
    Py_buffer b;
    int held;
} pbuf_t;

static int get_buf(PyObject *o, pbuf_t *pb, int writable, const char *name, int64_t min_bytes) {
    pb->held = 0;
    if (PyObject_GetBuffer(o, &pb->b, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous%s buffer", name,
                     writable ? " writable" : "");
        return -1;
    }
    pb->held = 1;
    if (pb->b.len < min_bytes) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, needs %lld", name, pb->b.len,
                     (long long)min_bytes);
        return -1;
    }
    return 0;
}
static void rel_bufs(pbuf_t *b, int n) {
    for (int i = 0; i < n; i++)
        if (b[i].held) PyBuffer_Release(&b[i].b);
}

static void op_init(op_t *op, engine_t *g, int kind, uint64_t epoch) {
    memset(op, 0, sizeof *op);
    op->g = g;
    op->kind = kind;
    op->epoch = epoch;
    op->par = (int)(epoch & 1);
    op->deadline = now_ns() + g->timeout_ns;
    op->err_peer = -1;
}

/* dispatch(x, topk_idx, topk_weights, epoch, n, o_idx, o_w, o_src_rank, o_src_tok, o_src_k,
 *          o_nrecv, o_dst_row, plan) -> int n_recv | error tuple */
static PyObject *engine_dispatch(engine_t *g, PyObject *args) {
    PyObject *ox, *oidx, *ow, *o1, *o2, *o3, *o4, *o5, *o6, *o7, *plan;
    unsigned long long epoch;
    long long n, ntok;
    if (!PyArg_ParseTuple(args, "OOOLKLOOOOOOOO", &ox, &oidx, &ow, &ntok, &epoch, &n, &o1, &o2, &o3,
                          &o4, &o5, &o6, &o7, &plan))
        return NULL;
    if (g->in_use) {
        PyErr_SetString(PyExc_RuntimeError, "engine: another call is in progress on this buffer");
        return NULL;
    }
    const int K = g->K;
    pbuf_t b[16];
    memset(b, 0, sizeof b);
    int64_t nrows = g->cap_rows;
    int64_t dst_w = g->layout == LAY_EXPERT ? K : g->R;
    int64_t meta_w = g->layout == LAY_EXPERT ? 1 : K;
    if (ntok < 0 || ntok > g->T) {
        PyErr_SetString(PyExc_ValueError, "engine: num_tokens out of range");
        return NULL;
    }
    if (get_buf(ox, &b[0], 0, "x", ntok * g->row_bytes) ||
        get_buf(oidx, &b[1], 0, "topk_idx", ntok * K * 8) ||
        get_buf(ow, &b[2], 0, "topk_weights", ntok * K * 4) ||
        get_buf(o1, &b[3], 1, "recv_topk_idx", nrows * meta_w * 8) ||
        get_buf(o2, &b[4], 1, "recv_topk_weights", nrows * meta_w * 4) ||
        get_buf(o3, &b[5], 1, "recv_src_rank", nrows * 8) ||
        get_buf(o4, &b[6], 1, "recv_src_token", nrows * 8) ||
        get_buf(o5, &b[7], 1, "recv_src_k", nrows * 8) ||
        get_buf(o6, &b[8], 1, "num_recv_tokens_per_expert", (g->L + g->R) * 8) ||
        get_buf(o7, &b[9], 1, "send_dst_row", ntok * dst_w * 8)) {
        rel_bufs(b, 16);
        return NULL;
    }
    op_t *op = calloc(1, sizeof(op_t));
    if (!op) { rel_bufs(b, 16); return PyErr_NoMemory(); }
    op_init(op, g, 0, epoch);
    op->n = n;
    op->x = b[0].b.buf; op->ntok = ntok; op->topk = b[1].b.buf; op->w = b[2].b.buf;
    op->o_idx = b[3].b.buf; op->o_w = b[4].b.buf; op->o_src_rank = b[5].b.buf;
    op->o_src_tok = b[6].b.buf; op->o_src_k = b[7].b.buf; op->o_nrecv = b[8].b.buf;
    op->o_dst_row = b[9].b.buf;
    if (plan != Py_None) {
        PyObject *pt, *pk, *pe, *pd, *ps, *pp;
        int pc;
        if (!PyArg_ParseTuple(plan, "OOOOOOi", &pt, &pk, &pe, &pd, &ps, &pp, &pc)) {
            rel_bufs(b, 16); free(op); return NULL;
        }
        if (get_buf(pp, &b[10], 0, "plan.core_ptr", (int64_t)(pc + 1) * 8)) {
            rel_bufs(b, 16); free(op); return NULL;
        }
        int64_t nu = ((const int64_t *)b[10].b.buf)[pc];
        if (nu < 0 || nu > ntok * K ||
            get_buf(pt, &b[11], 0, "plan.send_token", nu * 8) ||
            get_buf(pk, &b[12], 0, "plan.send_k", nu * 8) ||
            get_buf(pe, &b[13], 0, "plan.send_expert", nu * 8)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "plan: bad unit count");
            rel_bufs(b, 16); free(op); return NULL;
        }
        if (get_buf(pd, &b[14], 0, "plan.send_dst_rank", nu * 8) ||
            get_buf(ps, &b[15], 0, "plan.send_slot", nu * 8)) {
            rel_bufs(b, 16); free(op); return NULL;
        }
        const int64_t *pdst = b[14].b.buf, *pexp = b[13].b.buf;
        for (int64_t u = 0; u < nu; u++)
            if (pdst[u] < 0 || pdst[u] >= g->R || pexp[u] < 0 || pexp[u] >= g->E) {
                rel_bufs(b, 16); free(op);
                PyErr_SetString(PyExc_ValueError, "plan: destination or expert out of range");
                return NULL;
            }
        op->have_plan = 1; op->plan_cores = pc;
        op->p_ptr = b[10].b.buf; op->p_t = b[11].b.buf; op->p_k = b[12].b.buf;
        op->p_e = b[13].b.buf; op->p_d = b[14].b.buf; op->p_slot = b[15].b.buf;
    }
    g->in_use = 1;
    int64_t n_recv;
    Py_BEGIN_ALLOW_THREADS
    if (g->eng == ENG_ASP)
        run_op(op, ASP_DISPATCH, (int)(sizeof ASP_DISPATCH / sizeof ASP_DISPATCH[0]));
    else
        run_op(op, BSP_DISPATCH, (int)(sizeof BSP_DISPATCH / sizeof BSP_DISPATCH[0]));
    finish_op(op);
    n_recv = op->n_recv;
    Py_END_ALLOW_THREADS
    g->in_use = 0;
    rel_bufs(b, 16);
    PyObject *res = atomic_load(&op->err) ? error_tuple(op) : PyLong_FromLongLong(n_recv);
    free(op);
    return res;
}

/* combine(expert_out, rows, topk_idx, topk_weights, send_dst_row, ntok, epoch, creg, y,
 *         dispatch_index) -> 0 | error tuple; every rank must name the same dispatch */
static PyObject *engine_combine(engine_t *g, PyObject *args) {
    PyObject *oeo, *oidx, *ow, *odr, *oy;
    long long rows, ntok;
    unsigned long long epoch;
    int creg;
    unsigned long long index;
    if (!PyArg_ParseTuple(args, "OLOOOLKiOK", &oeo, &rows, &oidx, &ow, &odr, &ntok, &epoch, &creg,
                          &oy, &index))
        return NULL;
    if (g->in_use) {
        PyErr_SetString(PyExc_RuntimeError, "engine: another call is in progress on this buffer");
        return NULL;
    }
    const int K = g->K;
    int64_t dst_w = g->layout == LAY_EXPERT ? K : g->R;
    pbuf_t b[5];
    memset(b, 0, sizeof b);
    if (rows < 0 || rows > g->cap_rows || ntok < 0 || ntok > g->T || creg < 0 || creg > 1) {
        PyErr_SetString(PyExc_ValueError, "engine: combine sizes out of range");
        return NULL;
    }
    if (get_buf(oeo, &b[0], 0, "expert_out", rows * g->crow_bytes) ||
        get_buf(oidx, &b[1], 0, "handle.topk_idx", ntok * K * 8) ||
        get_buf(ow, &b[2], 0, "handle.topk_weights", ntok * K * 4) ||
        get_buf(odr, &b[3], 0, "handle.send_dst_row", ntok * dst_w * 8) ||
        get_buf(oy, &b[4], 1, "y", ntok * g->hidden * g->cisz)) {
        rel_bufs(b, 5);
        return NULL;
    }
    op_t *op = calloc(1, sizeof(op_t));
    if (!op) { rel_bufs(b, 5); return PyErr_NoMemory(); }
    op_init(op, g, 1, epoch);
    op->dispatch_index = index;
    op->eo = b[0].b.buf;
    op->eo_rows = rows;
    op->creg = creg;
    uintptr_t mine = (uintptr_t)g->base[g->rank], at = (uintptr_t)op->eo;
    if (at >= mine + 256 && at + (uint64_t)rows * g->crow_bytes <= mine + (uint64_t)g->seg_size) {
        op->zero_copy = 1; /* the expert outputs already live in this rank's segment */
        op->eo_off = (int64_t)(at - mine);
    } else {
        op->eo_off = g->off_comb + (int64_t)creg * g->comb_bytes;
    }
    op->h_idx = b[1].b.buf; op->h_w = b[2].b.buf; op->h_dst_row = b[3].b.buf; op->h_ntok = ntok;
    op->y = b[4].b.buf;
    g->in_use = 1;
    Py_BEGIN_ALLOW_THREADS
    if (g->eng == ENG_ASP) run_op(op, ASP_COMBINE, (int)(sizeof ASP_COMBINE / sizeof ASP_COMBINE[0]));
    else run_op(op, BSP_COMBINE, (int)(sizeof BSP_COMBINE / sizeof BSP_COMBINE[0]));
    finish_op(op);
    Py_END_ALLOW_THREADS
    g->in_use = 0;
    rel_bufs(b, 5);
    PyObject *res = atomic_load(&op->err) ? error_tuple(op) : PyLong_FromLong(op->zero_copy);
    free(op);
    return res;
}

/* fail(epoch, code, message, finished, timeout_s) -> 0 | error tuple: publish "call `epoch`
 * failed here" for a call rejected before the native code ran (finished=1: this rank is done
 * with it), or, finished=0, tell peers ahead of time that the next call cannot run here (a
 * Buffer that lost step). The notice slot of `epoch` last held the notice of `epoch - 2`: it
 * is written only once every peer has finished that call, waiting at most timeout_s (0: do not
 * wait; then nothing is published and the result is 1). */
static PyObject *engine_fail(engine_t *g, PyObject *args) {
    unsigned long long epoch;
    int code, finished;
    const char *msg;
    double timeout;
    if (!PyArg_ParseTuple(args, "Kisid", &epoch, &code, &msg, &finished, &timeout)) return NULL;
    if (code < E_BAD_INPUT || code > E_LOST) {
        PyErr_SetString(PyExc_ValueError, "engine.fail: code out of range");
        return NULL;
    }
    op_t *op = calloc(1, sizeof(op_t));
    if (!op) return PyErr_NoMemory();
    op_init(op, g, 2, epoch);
    op->deadline = now_ns() + (int64_t)(timeout * 1e9);
    int rc = 0;
    uint64_t credit = epoch >= 2 ? epoch - 2 : 0;
    Py_BEGIN_ALLOW_THREADS
    if (timeout > 0) {
        rc = wait_peers_done(op, credit, 0);
    } else if (!peers_done_geq(g, credit)) {
        rc = -1;
    }
    if (!rc) {
        publish_failure(g, epoch, code, msg);
        if (finished) {
            pub_word(ctrl(g, g->rank, g->off_done), epoch);
            ring_all(g);
        }
    }
    int armed = atomic_load(&op->armed);
    if (armed) atomic_fetch_sub(sleepers(g, g->rank), (uint32_t)armed);
    Py_END_ALLOW_THREADS
    PyObject *res = rc > 0 ? error_tuple(op) : PyLong_FromLong(rc ? 1 : 0);
    free(op);
    return res;
}

/* resync(base_epoch): forget every call before `base_epoch` (local; Buffer.resync runs it on
 * every rank between two group-wide exchanges, so no peer is inside a call and nobody writes
 * this segment meanwhile). Control records of this rank's segment are cleared, progress words
 * say "finished everything before base_epoch", SP regions are re-armed. */
static PyObject *engine_resync(engine_t *g, PyObject *args) {
    unsigned long long base;
    if (!PyArg_ParseTuple(args, "K", &base)) return NULL;
    if (base < 2) {
        PyErr_SetString(PyExc_ValueError, "engine.resync: base_epoch must be >= 2");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    uint8_t *me = g->base[g->rank];
    memset(me + g->off_fail, 0, 2 * 512);
    memset(me + g->off_comb_info, 0, 2 * CI_BYTES);
    memset(me + g->off_barrier, 0, (size_t)g->C * 64);
    memset(me + g->off_inbox, 0, (size_t)(g->R * 2 * g->inbox_bytes));
    for (int reg = 0; reg < g->nreg; reg++) memset(route(g, g->rank, reg), 0, ROUTE_IDX);
    pub_word(ctrl(g, g->rank, g->off_entered), (base - 1) << 2);
    pub_word(ctrl(g, g->rank, g->off_done), base - 1);
    pub_word(ctrl(g, g->rank, g->off_recv_ready), 0);
    atomic_store(sleepers(g, g->rank), 0);
    if (g->sync == SYNC_SP) reset_land(g);
    g->land_dirty = 0;
    memset(g->sp_dirty, 0, sizeof g->sp_dirty);
    g->comb_last_epoch[0] = g->comb_last_epoch[1] = 0;
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* wait_done(epoch, timeout_s) -> 0 | error tuple: every peer has finished call `epoch` */
static PyObject *engine_wait_done(engine_t *g, PyObject *args) {
    unsigned long long epoch;
    double timeout;
    if (!PyArg_ParseTuple(args, "Kd", &epoch, &timeout)) return NULL;
    op_t *op = calloc(1, sizeof(op_t));
    if (!op) return PyErr_NoMemory();
    op_init(op, g, 2, epoch); /* kind 2: waits ignore failure notices */
    op->deadline = now_ns() + (int64_t)(timeout * 1e9);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = wait_peers_done(op, epoch, 0);
    int armed = atomic_load(&op->armed);
    if (armed) atomic_fetch_sub(sleepers(g, g->rank), (uint32_t)armed);
    Py_END_ALLOW_THREADS
    PyObject *res = rc ? error_tuple(op) : PyLong_FromLong(0);
    free(op);
    return res;
}

/* reset_all(): fill the SP land region(s) with the sentinel (construction) */
static PyObject *engine_reset_all(engine_t *g, PyObject *noargs) {
    (void)noargs;
    if (g->sync != SYNC_SP) Py_RETURN_NONE;
    Py_BEGIN_ALLOW_THREADS
    reset_land(g);
    g->land_dirty = 0;
    memset(g->sp_dirty, 0, sizeof g->sp_dirty);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *engine_trace(engine_t *g, PyObject *noargs) {
    (void)noargs;
    PyObject *t = PyTuple_New(16);
    if (!t) return NULL;
    for (int i = 0; i < 16; i++) PyTuple_SET_ITEM(t, i, PyLong_FromLongLong(g->trace[i]));
    return t;
}

static PyObject *engine_comb_last_epoch(engine_t *g, PyObject *args) {
    int c;
    if (!PyArg_ParseTuple(args, "i", &c)) return NULL;
    if (c < 0 || c > 1) { PyErr_SetString(PyExc_ValueError, "region"); return NULL; }
    return PyLong_FromUnsignedLongLong(g->comb_last_epoch[c]);
}

static PyObject *engine_close(engine_t *g, PyObject *noargs) {
    (void)noargs;
    Py_BEGIN_ALLOW_THREADS
    engine_stop(g);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef engine_methods[] = {
    {"dispatch", (PyCFunction)engine_dispatch, METH_VARARGS, "one dispatch (see _native.c)"},
    {"combine", (PyCFunction)engine_combine, METH_VARARGS, "one combine (see _native.c)"},
    {"fail", (PyCFunction)engine_fail, METH_VARARGS, "publish a failure notice"},
    {"resync", (PyCFunction)engine_resync, METH_VARARGS, "forget every call before an epoch"},
    {"wait_done", (PyCFunction)engine_wait_done, METH_VARARGS, "wait for peers' progress"},
    {"reset_all", (PyCFunction)engine_reset_all, METH_NOARGS, "SP: fill regions with sentinel"},
    {"comb_last_epoch", (PyCFunction)engine_comb_last_epoch, METH_VARARGS,
     "epoch of the last combine that used combine region c"},
    {"close", (PyCFunction)engine_close, METH_NOARGS, "stop worker threads"},
    {"trace", (PyCFunction)engine_trace, METH_NOARGS,
     "core 0's phase timestamps (CLOCK_MONOTONIC ns) of the last dispatch, for profiling"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ubep.runtime._native.Engine",
    .tp_basicsize = sizeof(engine_t),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)engine_init,
    .tp_dealloc = (destructor)engine_dealloc,
    .tp_methods = engine_methods,
    .tp_doc = "Native dispatch/combine engine of one Buffer.",
};

/* module-level helpers for benchmarks and tests */
static PyObject *mod_copy(PyObject *self, PyObject *args) {
    PyObject *od, *os;
    int which = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "OO|i", &od, &os, &which)) return NULL;
    pbuf_t b[2];
    memset(b, 0, sizeof b);
    if (get_buf(od, &b[0], 1, "dst", 0) || get_buf(os, &b[1], 0, "src", 0)) {
        rel_bufs(b, 2);
        return NULL;
    }
    int64_t n = b[0].b.len < b[1].b.len ? b[0].b.len : b[1].b.len;
    Py_BEGIN_ALLOW_THREADS
    (which ? copy_elem : copy_fast)(b[0].b.buf, b[1].b.buf, n);
    Py_END_ALLOW_THREADS
    rel_bufs(b, 2);
    Py_RETURN_NONE;
}

static PyObject *mod_dc_checksum(PyObject *self, PyObject *args) {
    PyObject *o;
    long long row_bytes;
    unsigned long long epoch;
    (void)self;
    if (!PyArg_ParseTuple(args, "OLK", &o, &row_bytes, &epoch)) return NULL;
    pbuf_t b;
    if (get_buf(o, &b, 0, "rows", 0)) { rel_bufs(&b, 1); return NULL; }
    if (row_bytes < 1 || b.b.len % row_bytes) {
        rel_bufs(&b, 1);
        PyErr_SetString(PyExc_ValueError, "rows: length must be a multiple of row_bytes");
        return NULL;
    }
    uint64_t s1 = 0, s2 = 0, W = (uint64_t)(row_bytes + 7) / 8;
    for (int64_t i = 0; i < b.b.len / row_bytes; i++) {
        uint64_t A, B;
        dc_row_sums((const uint8_t *)b.b.buf + i * row_bytes, row_bytes, &A, &B);
        s1 += A;
        s2 += (uint64_t)i * W * A + B;
    }
    rel_bufs(&b, 1);
    return PyLong_FromUnsignedLongLong(dc_finish(s1, s2, epoch));
}

static PyObject *mod_convert(PyObject *self, PyObject *args) {
    /* convert(acc_f32, out, dtype): the native float32 -> dtype rounding, for tests */
    PyObject *oa, *oo;
    int dt;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOi", &oa, &oo, &dt)) return NULL;
    if (dt < 0 || dt > 2) { PyErr_SetString(PyExc_ValueError, "dtype code"); return NULL; }
    pbuf_t b[2];
    memset(b, 0, sizeof b);
    if (get_buf(oa, &b[0], 0, "acc", 0) || get_buf(oo, &b[1], 1, "out", 0)) {
        rel_bufs(b, 2);
        return NULL;
    }
    int64_t n = b[0].b.len / 4;
    int osz = dt == DT_FP32 ? 4 : 2;
    if (b[1].b.len < n * osz) { rel_bufs(b, 2); PyErr_SetString(PyExc_ValueError, "out"); return NULL; }
    OUTF[dt](b[1].b.buf, b[0].b.buf, n);
    rel_bufs(b, 2);
    Py_RETURN_NONE;
}

/* Checksums of the control records, for tests that forge records a peer could write
 * (the bounds checks behind the checksums must hold on their own). */
static PyObject *mod_counts_sum(PyObject *self, PyObject *args) {
    unsigned long long epoch, rows;
    PyObject *oc;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKO", &epoch, &rows, &oc)) return NULL;
    pbuf_t b;
    if (get_buf(oc, &b, 0, "counts", 0)) { rel_bufs(&b, 1); return NULL; }
    uint64_t s = counts_sum(epoch, rows, b.b.buf, (int)(b.b.len / 4));
    rel_bufs(&b, 1);
    return PyLong_FromUnsignedLongLong(s);
}

static PyObject *mod_route_sum(PyObject *self, PyObject *args) {
    unsigned long long epoch, ntok;
    PyObject *oi, *ow;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKOO", &epoch, &ntok, &oi, &ow)) return NULL;
    pbuf_t b[2];
    memset(b, 0, sizeof b);
    if (get_buf(oi, &b[0], 0, "idx", 0) || get_buf(ow, &b[1], 0, "weights", b[0].b.len)) {
        rel_bufs(b, 2);
        return NULL;
    }
    uint64_t s = route_sum(epoch, ntok, b[0].b.buf, b[1].b.buf, b[0].b.len / 4);
    rel_bufs(b, 2);
    return PyLong_FromUnsignedLongLong(s);
}

static PyObject *mod_comb_info_sum(PyObject *self, PyObject *args) {
    unsigned long long epoch, off, rows, stride, index;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKKK", &epoch, &off, &rows, &stride, &index)) return NULL;
    return PyLong_FromUnsignedLongLong(comb_info_sum(epoch, off, rows, stride, index));
}

static PyMethodDef module_methods[] = {
    {"counts_sum", mod_counts_sum, METH_VARARGS, "counts_sum(epoch, rows, counts_u32)"},
    {"route_sum", mod_route_sum, METH_VARARGS, "route_sum(epoch, ntok, idx_i32, weights_f32)"},
    {"comb_info_sum", mod_comb_info_sum, METH_VARARGS,
     "comb_info_sum(epoch, offset, rows, stride, dispatch_index)"},
    {"copy", mod_copy, METH_VARARGS, "copy(dst, src, element_safe=0): the data plane's copy"},
    {"dc_checksum", mod_dc_checksum, METH_VARARGS, "dc_checksum(rows, row_bytes, epoch)"},
    {"convert", mod_convert, METH_VARARGS, "convert(acc_f32, out, dtype_code)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "_native", "ubep native data plane (C11).", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    select_kernels();
    if (PyType_Ready(&EngineType) < 0) return NULL;
    PyObject *m = PyModule_Create(&native_module);
    if (!m) return NULL;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0) {
        Py_DECREF(&EngineType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "ABI", 1);
    PyModule_AddStringConstant(m, "KERNELS", kernel_set);
    return m;
}
