/* Kernels: copy, sentinel fill/check, DC row sums, float conversions, fused reductions.
 *
 * What the copy and polling paths call per row is static inline here (so it inlines into
 * dispatch.c and dispatch_bsp.c as it did into one file); what select_kernels() swaps at load
 * time (AVX2 / F16C versions from kernels_x86.c) is called through a pointer, as before. */
#ifndef UBEP_KERNELS_H
#define UBEP_KERNELS_H

#include <stdint.h>
#include <string.h>

#include "abi.h"
#include "sync.h"

/* what the parts share stays inside the module: accessed without the GOT (-fvisibility=hidden
 * only covers definitions, not these declarations) */
#pragma GCC visibility push(hidden)

typedef void (*copy_fn)(uint8_t *dst, const uint8_t *src, int64_t n);

/* Fused combine: y[i] = round(((0 + t_0[i]) + t_1[i]) + ...) over the terms in order, where
 * t_j = fl32(w_j * src_j[i]) (weighted, expert layout) or src_j[i] (rank layout). One pass:
 * every source row is read once, the accumulators stay in registers, the output is written
 * once. Bit-exact with ubep.reference (same order, product rounded before the add). */
typedef void (*reduce_fn)(void *y, const void *const *src, const float *w, int nt, int64_t n,
                          int weighted, const void *const *next, int nnext);
/* The SIMD kernels also bring the next output row's nnext sources (`next`, none if 0) into L2
 * as they go: bytes [off, off + bytes) of each while the same bytes of this row's are summed,
 * so a row ahead of the loads. That distance covers DRAM's latency, which the hardware
 * prefetcher alone does not where rows lie apart and cross pages: a 2-rank combine of 2340
 * tokens x hidden 7168, streaming from memory, went from 7.0 to 3.8-4.0 ms with it (4 KB and
 * 8 KB ahead measured the same; 2 KB ahead into L1, no gain). */
static inline void prefetch_next(const void *const *next, int nnext, int64_t off, int bytes) {
    for (int j = 0; j < nnext; j++)
        for (int b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)next[j] + off + b, 0, 2);
}
/* The output stage of REDUCE[dt] alone: y[i] = round(acc[i]) to dt, through the very code
 * REDUCE[dt] stores with (kernels_x86.c's store blocks, round_tail / store_f32 here), so that
 * convert() tests the rounding combine does, bit for bit. */
typedef void (*round_fn)(void *y, const float *acc, int64_t n);

/* kernels.c: the generic kernels and the pointers select_kernels() sets at module load */
extern copy_fn copy_elem; /* element-safe copy (SP) */
extern copy_fn copy_fast; /* any copy followed by a fenced flag */
extern int fill_vector_ok;
extern int (*has2)(const uint16_t *, int64_t, uint16_t);
extern int (*has4)(const uint32_t *, int64_t, uint32_t);
extern round_fn ROUND[3];
extern reduce_fn REDUCE[3];
extern const char *kernel_set;
void select_kernels(void);

/* integrity="checksum": the sum of one row (docs/FORMATS.md, "Row checksums"), Fletcher's two
 * sums per lane over four lanes of 8-byte words (word i to lane i mod 4, the row zero-padded to
 * whole 32-byte groups): a_l = sum of the lane's words, c_l = sum of its running a_l (so a
 * word's place counts), folded with the length. Any one changed word changes a_l. Generic C or
 * AVX2 (one vector add pair per 32 bytes), picked by select_kernels(), the same values. */
typedef uint64_t (*row_sum_fn)(const uint8_t *p, int64_t n);
extern row_sum_fn ROW_SUM;
uint64_t row_sum_generic(const uint8_t *p, int64_t n);
static inline uint64_t row_sum(const uint8_t *p, int64_t n) { return ROW_SUM(p, n); }
static inline uint64_t row_fold(int64_t n, const uint64_t a[4], const uint64_t c[4]) {
    uint64_t h = mix64(0x726F7773756DULL, (uint64_t)n);
    for (int l = 0; l < 4; l++) h = mix64(mix64(h, a[l]), c[l]);
    return h;
}
/* the best kernel set up to `level` (0 generic, 1 AVX2, 2 AVX-512) this CPU has: its name
 * (tests run every set the CPU has; select_kernels() is the best of all) */
const char *select_kernels_upto(int level);

#if UBEP_X86
/* kernels_x86.c: compiled with target attributes, called only where the CPU has them */
void copy_avx2(uint8_t *d, const uint8_t *s, int64_t n);
uint64_t row_sum_avx2(const uint8_t *p, int64_t n);
void fill_avx2(uint8_t *d, int64_t n, int isz, uint64_t pattern);
int has_pattern2_avx2(const uint16_t *p, int64_t n, uint16_t v);
int has_pattern4_avx2(const uint32_t *p, int64_t n, uint32_t v);
void round_bf16_avx2(void *y, const float *acc, int64_t n);
void round_fp32_avx2(void *y, const float *acc, int64_t n);
void round_fp16_hw(void *y, const float *acc, int64_t n);
void reduce_bf16_avx2(void *y, const void *const *src, const float *w, int nt, int64_t n,
                      int weighted, const void *const *next, int nnext);
void reduce_fp32_avx2(void *y, const void *const *src, const float *w, int nt, int64_t n,
                      int weighted, const void *const *next, int nnext);
void reduce_fp16_hw(void *y, const void *const *src, const float *w, int nt, int64_t n,
                    int weighted, const void *const *next, int nnext);
void round_bf16_avx512(void *y, const float *acc, int64_t n);
void reduce_bf16_avx512(void *y, const void *const *src, const float *w, int nt, int64_t n,
                        int weighted, const void *const *next, int nnext);
#endif

static inline void copy_tail(uint8_t *d, const uint8_t *s, int64_t n) {
    /* Naturally aligned power-of-two pieces, so no element of <= 8 bytes is split (dst is at
     * least element aligned and n a multiple of the element size). */
    while (n >= 8) { uint64_t v; memcpy(&v, s, 8); memcpy(d, &v, 8); d += 8; s += 8; n -= 8; }
    if (n >= 4) { uint32_t v; memcpy(&v, s, 4); memcpy(d, &v, 4); d += 4; s += 4; n -= 4; }
    if (n >= 2) { uint16_t v; memcpy(&v, s, 2); memcpy(d, &v, 2); d += 2; s += 2; n -= 2; }
    if (n) *d = *s;
}

static inline void fill_pattern(uint8_t *d, int64_t n, int isz, uint64_t pattern) {
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

static inline int has_pattern(const uint8_t *p, int64_t nbytes, int isz, uint64_t pattern) {
    if (isz == 2) return has2((const uint16_t *)p, nbytes / 2, (uint16_t)pattern);
    if (isz == 4) return has4((const uint32_t *)p, nbytes / 4, (uint32_t)pattern);
    return 0;
}

/* DC: the words of a row are its bytes as little-endian u64, the last one zero padded
 * (docs/FORMATS.md with check_bytes=None and block_bytes a multiple of 8). For one row this
 * returns A = sum w_j and B = sum (j+1) w_j (mod 2^64), so that a batch is
 * s1 = sum A, s2 = sum (rank * W * A + B) whatever order rows are visited in. */
static inline void dc_row_sums(const uint8_t *p, int64_t nbytes, uint64_t *A, uint64_t *B) {
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

#define DC_GOLDEN 0x9E3779B97F4A7C15ULL
static inline uint64_t rotl64(uint64_t v, int r) { return (v << r) | (v >> (64 - r)); }
static inline uint64_t dc_finish(uint64_t s1, uint64_t s2, uint64_t epoch) {
    uint64_t v = s1 ^ rotl64(s2, 29) ^ (epoch * DC_GOLDEN);
    return v ? v : 1;
}

/* DC checksum of n rows of row_bytes each, stride bytes apart, the i-th with batch rank i */
static inline uint64_t dc_batch_sum(const uint8_t *rows, int64_t stride, int64_t n,
                                    int64_t row_bytes, uint64_t epoch) {
    uint64_t s1 = 0, s2 = 0, W = (uint64_t)(row_bytes + 7) / 8;
    for (int64_t i = 0; i < n; i++) {
        uint64_t A, B;
        dc_row_sums(rows + i * stride, row_bytes, &A, &B);
        s1 += A;
        s2 += (uint64_t)i * W * A + B;
    }
    return dc_finish(s1, s2, epoch);
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
static inline float fp16_to_f32_sw(uint16_t h) {
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
static inline uint16_t f32_to_fp16_sw(float f) {
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

static inline float canon_f32(float v) {
    if (v == v) return v;
    uint32_t u = CANON_NAN_F32;
    memcpy(&v, &u, 4);
    return v;
}

static inline float load_f32(int dt, const void *p, int64_t i) {
    if (dt == DT_BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    if (dt == DT_FP16) return fp16_to_f32_sw(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}
static inline void store_f32(int dt, void *p, int64_t i, float v) {
    if (dt == DT_BF16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else if (dt == DT_FP16) ((uint16_t *)p)[i] = f32_to_fp16_sw(v);
    else ((float *)p)[i] = canon_f32(v);
}
static inline void reduce_tail(int dt, void *y, const void *const *src, const float *w, int nt,
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
static inline void round_tail(int dt, void *y, const float *acc, int64_t i0, int64_t n) {
    for (int64_t i = i0; i < n; i++) store_f32(dt, y, i, acc[i]);
}

/* Quantisation, bit-exact with ubep.quant (its docstring states the rules; docs/FORMATS.md the
 * row format): one float32 scale per QUANT_BLOCK channels, values = x / scale (a float32
 * division, never a multiply by the reciprocal, which rounds twice) converted below. The
 * conversions are integer arithmetic on the float32 bits, so they depend neither on compiler
 * FP8 support nor on the FPU rounding mode. */
#define QUANT_BLOCK 128
#define E4M3_NAN 0x7Fu
#define E4M3_MAX_BITS 0x43E00000u     /* 448.0f */
#define INT8_MAX_BITS 0x42FE0000u     /* 127.0f */
#define QUANT_AMAX_FLOOR 0x1.a36e2ep-14f /* np.float32(1e-4), DeepEP's kFP8Margin */

/* The helpers below are branch-free (selects, no early return) so that the per-block loops
 * vectorise: kernels.c compiles them for the baseline, kernels_x86.c for AVX2 (per-lane
 * shifts), from this one source. */

/* m / 2^shift rounded to nearest, ties to even (m < 2^24, 1 <= shift <= 25): add half an
 * ulp less one, plus the kept lsb, then truncate (the bias form vectorises; ubep.quant spells
 * out rem > half or a tie with an odd lsb, and the tests compare the two) */
static inline uint32_t round_shift(uint32_t m, uint32_t shift) {
    return (m + ((1u << (shift - 1u)) - 1u) + ((m >> shift) & 1u)) >> shift;
}

/* float32 -> float8_e4m3fn bits: round to nearest even; finite values above 448 and +-inf
 * saturate to +-448 (0x7E / 0xFE, CUDA's __NV_SATFINITE); every NaN gives 0x7F. */
static inline uint8_t f32_to_e4m3(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 24) & 0x80u, mag = u & 0x7FFFFFFFu;
    /* saturating before rounding = after (448 is representable, rounding is monotone), and
     * the rounding below cannot carry into 0x7F */
    uint32_t sat = mag < E4M3_MAX_BITS ? mag : E4M3_MAX_BITS;
    /* normal result (>= 2^-6): rebias the exponent 127 -> 7 and round off 20 mantissa bits */
    uint32_t t = sat - (120u << 23);
    uint32_t normal = (t + 0x7FFFFu + ((t >> 20) & 1u)) >> 20;
    /* subnormal result: the value in units of 2^-9 rounded; exponents <= 116 give 0 */
    uint32_t e = sat >> 23;
    uint32_t sub = round_shift((sat & 0x7FFFFFu) | 0x800000u, e <= 116u ? 25u : 141u - e);
    uint32_t code = (sat >= 0x3C800000u ? normal : sub) | sign;
    return (uint8_t)(mag > 0x7F800000u ? E4M3_NAN : code);
}

/* float32 -> int8: round to nearest even, clamp to [-127, 127], NaN gives 0 */
static inline int8_t f32_to_int8(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t mag = u & 0x7FFFFFFFu;
    uint32_t sat = mag < INT8_MAX_BITS ? mag : INT8_MAX_BITS;
    uint32_t e = sat >> 23; /* |f| = (hidden bit | mantissa) * 2^(e - 150); e <= 125: < 0.5 */
    int32_t q = (int32_t)round_shift((sat & 0x7FFFFFu) | 0x800000u, e <= 125u ? 25u : 150u - e);
    q = (u >> 31) ? -q : q;
    return (int8_t)(mag > 0x7F800000u ? 0 : q);
}

static inline void quant_load_block(const void *x, int dt, int64_t off, float *buf) {
    /* the dtype switch sits outside the loops, so each loop is one conversion */
    if (dt == DT_BF16) {
        const uint16_t *p = (const uint16_t *)x + off;
        for (int i = 0; i < QUANT_BLOCK; i++) buf[i] = bf16_to_f32(p[i]);
    } else if (dt == DT_FP16) {
        const uint16_t *p = (const uint16_t *)x + off;
        for (int i = 0; i < QUANT_BLOCK; i++) buf[i] = fp16_to_f32_sw(p[i]);
    } else {
        memcpy(buf, (const float *)x + off, sizeof(float) * QUANT_BLOCK);
    }
}

/* max |x| of a block as float32 bits: for non-negative floats the integer order is the float
 * order and every NaN is above inf, so a NaN anywhere makes the result NaN (ubep.quant rule 2) */
static inline uint32_t quant_amax_bits(const float *buf) {
    uint32_t amax = 0;
    for (int i = 0; i < QUANT_BLOCK; i++) {
        uint32_t u;
        memcpy(&u, &buf[i], 4);
        u &= 0x7FFFFFFFu;
        amax = u > amax ? u : amax;
    }
    return amax;
}

static inline float quant_scale(uint32_t amax_bits, float qmax, int round_scale) {
    float s;
    if (amax_bits > 0x7F800000u) { /* NaN block: the canonical quiet NaN */
        uint32_t nan = CANON_NAN_F32;
        memcpy(&s, &nan, 4);
        return s;
    }
    float amax;
    memcpy(&amax, &amax_bits, 4);
    s = (amax > QUANT_AMAX_FLOOR ? amax : QUANT_AMAX_FLOOR) / qmax;
    if (round_scale) { /* UE8M0: the smallest power of two >= s (inf stays inf) */
        uint32_t u;
        memcpy(&u, &s, 4);
        if ((u & 0x7F800000u) != 0x7F800000u && (u & 0x7FFFFFu))
            u = (u & 0x7F800000u) + 0x800000u;
        memcpy(&s, &u, 4);
    }
    return s;
}

/* The row loop, one source for the generic and the AVX2 build (quant_row_fn); always inlined,
 * since a call would run it with the caller's baseline target, not vectorised */
__attribute__((always_inline)) static inline void quant_row_body(const void *x, int dt, int64_t hidden, void *values,
                                  float *scales, int round_scale, int is_int8) {
    float buf[QUANT_BLOCK];
    for (int64_t b = 0; b < hidden / QUANT_BLOCK; b++) {
        int64_t off = b * QUANT_BLOCK;
        quant_load_block(x, dt, off, buf);
        float s = quant_scale(quant_amax_bits(buf), is_int8 ? 127.0f : 448.0f, round_scale);
        scales[b] = s;
        if (is_int8) {
            int8_t *v = (int8_t *)values + off;
            for (int i = 0; i < QUANT_BLOCK; i++) v[i] = f32_to_int8(buf[i] / s);
        } else {
            uint8_t *v = (uint8_t *)values + off;
            for (int i = 0; i < QUANT_BLOCK; i++) v[i] = f32_to_e4m3(buf[i] / s);
        }
    }
}

typedef void (*quant_row_fn)(const void *x, int dt, int64_t hidden, void *values, float *scales,
                             int round_scale, int is_int8);
extern quant_row_fn QUANT_ROW; /* quant_row_body: generic or AVX2 (select_kernels) */
void quant_row_generic(const void *x, int dt, int64_t hidden, void *values, float *scales,
                       int round_scale, int is_int8);
#if UBEP_X86
void quant_row_avx2(const void *x, int dt, int64_t hidden, void *values, float *scales,
                    int round_scale, int is_int8);
#endif

/* One token row: hidden (a multiple of QUANT_BLOCK) elements of x (DT_BF16, DT_FP16 or
 * DT_FP32) -> values[hidden] and scales[hidden / QUANT_BLOCK], reading x once. */
void quant_row_e4m3(const void *x, int x_dtype, int64_t hidden, uint8_t *values, float *scales,
                    int round_scale);
void quant_row_int8(const void *x, int x_dtype, int64_t hidden, int8_t *values, float *scales,
                    int round_scale);

#pragma GCC visibility pop

#endif /* UBEP_KERNELS_H */
