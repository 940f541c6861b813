/* AVX2 / F16C kernels: compiled with target attributes (the baseline build needs no CPU flags)
 * and installed by select_kernels() only where the CPU has them. */
#include "kernels.h"

#if UBEP_X86

#define AVX2 __attribute__((target("avx2")))
#define AVX2_F16C __attribute__((target("avx2,f16c")))

/* row_sum_generic's lanes, one ymm register each for the a and c sums */
AVX2 uint64_t row_sum_avx2(const uint8_t *p, int64_t n) {
    __m256i a = _mm256_setzero_si256(), c = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a = _mm256_add_epi64(a, _mm256_loadu_si256((const __m256i *)(p + i)));
        c = _mm256_add_epi64(c, a);
    }
    if (i < n) { /* the last group, zero-padded */
        uint8_t last[32] = {0};
        memcpy(last, p + i, (size_t)(n - i));
        a = _mm256_add_epi64(a, _mm256_loadu_si256((const __m256i *)last));
        c = _mm256_add_epi64(c, a);
    }
    uint64_t la[4], lc[4];
    _mm256_storeu_si256((__m256i *)la, a);
    _mm256_storeu_si256((__m256i *)lc, c);
    return row_fold(n, la, lc);
}

AVX2 void copy_avx2(uint8_t *d, const uint8_t *s, int64_t n) {
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

AVX2 void fill_avx2(uint8_t *d, int64_t n, int isz, uint64_t pattern) {
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

/* Sentinel scans: whether any `width`-byte element (2 or 4) of the `nbytes` bytes at p (a
 * multiple of 128) equals the element broadcast in `pat`. Four vectors per step, the hits OR-ed
 * into one accumulator tested once at the end. `width` is a constant at both call sites, so the
 * branch folds away and each wrapper compiles to the loop it had when it was written out. */
AVX2 static inline __m256i lanes_equal(const uint8_t *p, __m256i pat, int width) {
    __m256i x = _mm256_loadu_si256((const __m256i *)p);
    return width == 2 ? _mm256_cmpeq_epi16(x, pat) : _mm256_cmpeq_epi32(x, pat);
}
AVX2 static inline int any_lane_equal(const uint8_t *p, int64_t nbytes, __m256i pat, int width) {
    __m256i acc = _mm256_setzero_si256();
    for (int64_t i = 0; i < nbytes; i += 128) {
        __m256i a = lanes_equal(p + i, pat, width), b = lanes_equal(p + i + 32, pat, width);
        __m256i c = lanes_equal(p + i + 64, pat, width), e = lanes_equal(p + i + 96, pat, width);
        acc = _mm256_or_si256(acc, _mm256_or_si256(_mm256_or_si256(a, b), _mm256_or_si256(c, e)));
    }
    return !_mm256_testz_si256(acc, acc);
}
AVX2 int has_pattern2_avx2(const uint16_t *p, int64_t n, uint16_t v) {
    int64_t body = n > 0 ? n & ~(int64_t)63 : 0; /* 128 bytes per vector step */
    int any = any_lane_equal((const uint8_t *)p, body * 2, _mm256_set1_epi16((short)v), 2);
    for (int64_t i = body; i < n; i++) any |= (p[i] == v);
    return any;
}
AVX2 int has_pattern4_avx2(const uint32_t *p, int64_t n, uint32_t v) {
    int64_t body = n > 0 ? n & ~(int64_t)31 : 0;
    int any = any_lane_equal((const uint8_t *)p, body * 4, _mm256_set1_epi32((int)v), 4);
    for (int64_t i = body; i < n; i++) any |= (p[i] == v);
    return any;
}

/* ---------------------------------------------------------------------------------------- */
/* Combine's output stage: float32 sums rounded to the output type, 32 (16 for fp16) at a time.
 * The reductions below and the ROUND kernels (convert(), for tests) store through these same
 * blocks and the same scalar tail (store_f32), so what the tests check is what combine writes.
 * A NaN sum becomes the canonical quiet NaN of the output type (ubep.dtypes does the same). */

/* round to nearest even; the caller has checked there is no NaN */
AVX2 static inline __m256i f32x8_to_bf16(__m256 f) {
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF);
    __m256i u = _mm256_castps_si256(f);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, bias)), 16);
}
/* bf16 -> float32 by interleaving 16 values with zeros (a bf16 is a float32's high half): one
 * shuffle per 8 values where widening and shifting take two plus a lane extract (the reduce is
 * compute-bound where 256-bit ops issue as two halves, as on Zen 1). Per 128-bit lane, `lo`
 * holds values 0-3 and 8-11, `hi` 4-7 and 12-15: the accumulators of a 32-wide block keep that
 * order (the sums are element-wise, so the order changes no bit), and packus, which works per
 * lane, puts them back in order when they are stored (store32_bf16, `interleaved`). */
AVX2 static inline __m256 bf16_lo_f32(__m256i h) {
    return _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), h));
}
AVX2 static inline __m256 bf16_hi_f32(__m256i h) {
    return _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), h));
}
/* where value i of accumulator q (a0..a3, i = 0..7) belongs in the 32-wide block */
static inline int interleaved_at(int q, int i) { return (q >> 1) * 16 + (i >> 2) * 8 + (q & 1) * 4 + (i & 3); }

/* a0..a3 hold values 0-31 in order, or (`interleaved`) in bf16_lo_f32 / bf16_hi_f32's order of
 * two 16-value loads */
AVX2 static inline void store32_bf16(uint16_t *out, __m256 a0, __m256 a1, __m256 a2, __m256 a3,
                                     int interleaved) {
    __m256 un = _mm256_or_ps(
        _mm256_or_ps(_mm256_cmp_ps(a0, a0, _CMP_UNORD_Q), _mm256_cmp_ps(a1, a1, _CMP_UNORD_Q)),
        _mm256_or_ps(_mm256_cmp_ps(a2, a2, _CMP_UNORD_Q), _mm256_cmp_ps(a3, a3, _CMP_UNORD_Q)));
    if (!_mm256_testz_ps(un, un)) { /* NaN: the canonical one (scalar, rare) */
        float tmp[32];
        _mm256_storeu_ps(tmp, a0);
        _mm256_storeu_ps(tmp + 8, a1);
        _mm256_storeu_ps(tmp + 16, a2);
        _mm256_storeu_ps(tmp + 24, a3);
        for (int k = 0; k < 32; k++)
            store_f32(DT_BF16, out, interleaved ? interleaved_at(k >> 3, k & 7) : k, tmp[k]);
        return;
    }
    __m256i p0 = _mm256_packus_epi32(f32x8_to_bf16(a0), f32x8_to_bf16(a1));
    __m256i p1 = _mm256_packus_epi32(f32x8_to_bf16(a2), f32x8_to_bf16(a3));
    if (!interleaved) { /* packus works per 128-bit lane: the 64-bit quarters back into order */
        p0 = _mm256_permute4x64_epi64(p0, 0xD8);
        p1 = _mm256_permute4x64_epi64(p1, 0xD8);
    }
    _mm256_storeu_si256((__m256i *)out, p0);
    _mm256_storeu_si256((__m256i *)(out + 16), p1);
}
AVX2 static inline void store32_fp32(float *out, __m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 canon = _mm256_castsi256_ps(_mm256_set1_epi32((int)CANON_NAN_F32));
    _mm256_storeu_ps(out, _mm256_blendv_ps(a0, canon, _mm256_cmp_ps(a0, a0, _CMP_UNORD_Q)));
    _mm256_storeu_ps(out + 8, _mm256_blendv_ps(a1, canon, _mm256_cmp_ps(a1, a1, _CMP_UNORD_Q)));
    _mm256_storeu_ps(out + 16, _mm256_blendv_ps(a2, canon, _mm256_cmp_ps(a2, a2, _CMP_UNORD_Q)));
    _mm256_storeu_ps(out + 24, _mm256_blendv_ps(a3, canon, _mm256_cmp_ps(a3, a3, _CMP_UNORD_Q)));
}
AVX2_F16C static inline void store16_fp16(uint16_t *out, __m256 a0, __m256 a1) {
    const __m256i absmask = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
    __m256i nan = _mm256_or_si256(
        _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(a0), absmask), inf),
        _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(a1), absmask), inf));
    if (!_mm256_testz_si256(nan, nan)) { /* NaN: the canonical one (scalar, rare) */
        float tmp[16];
        _mm256_storeu_ps(tmp, a0);
        _mm256_storeu_ps(tmp + 8, a1);
        for (int k = 0; k < 16; k++) store_f32(DT_FP16, out, k, tmp[k]);
        return;
    }
    _mm_storeu_si128((__m128i *)out, _mm256_cvtps_ph(a0, _MM_FROUND_TO_NEAREST_INT));
    _mm_storeu_si128((__m128i *)(out + 8), _mm256_cvtps_ph(a1, _MM_FROUND_TO_NEAREST_INT));
}

/* ROUND[dt]: the output stage alone, over float32 values */
AVX2 void round_bf16_avx2(void *y, const float *acc, int64_t n) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        store32_bf16((uint16_t *)y + i, _mm256_loadu_ps(acc + i), _mm256_loadu_ps(acc + i + 8),
                     _mm256_loadu_ps(acc + i + 16), _mm256_loadu_ps(acc + i + 24), 0);
    round_tail(DT_BF16, y, acc, i, n);
}
AVX2 void round_fp32_avx2(void *y, const float *acc, int64_t n) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        store32_fp32((float *)y + i, _mm256_loadu_ps(acc + i), _mm256_loadu_ps(acc + i + 8),
                     _mm256_loadu_ps(acc + i + 16), _mm256_loadu_ps(acc + i + 24));
    round_tail(DT_FP32, y, acc, i, n);
}
AVX2_F16C void round_fp16_hw(void *y, const float *acc, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        store16_fp16((uint16_t *)y + i, _mm256_loadu_ps(acc + i), _mm256_loadu_ps(acc + i + 8));
    round_tail(DT_FP16, y, acc, i, n);
}

/* a_k = a_k + t_k for the four accumulators of a 32-wide block, t_k = fl32(w * f_k) when
 * weighted (the product rounded before the add: -ffp-contract=off), else f_k */
AVX2 static inline void add4(__m256 a[4], __m256 f0, __m256 f1, __m256 f2, __m256 f3,
                             int weighted, float w) {
    if (weighted) {
        __m256 ww = _mm256_set1_ps(w);
        f0 = _mm256_mul_ps(ww, f0);
        f1 = _mm256_mul_ps(ww, f1);
        f2 = _mm256_mul_ps(ww, f2);
        f3 = _mm256_mul_ps(ww, f3);
    }
    a[0] = _mm256_add_ps(a[0], f0);
    a[1] = _mm256_add_ps(a[1], f1);
    a[2] = _mm256_add_ps(a[2], f2);
    a[3] = _mm256_add_ps(a[3], f3);
}

/* REDUCE[dt]: y[i] = round(sum_j t_j[i]) (kernels.h), 32 (16) accumulators in registers.
 * The BF16 and FP32 kernels share this loop over whole 32-element blocks (returns where the
 * tail starts); `dt`, a constant once inlined, picks how a source's block is widened to four
 * float32 vectors and how the sums are stored. */
__attribute__((always_inline)) AVX2 static inline int64_t reduce32(
    int dt, void *y, const void *const *src, const float *w, int nt, int64_t n, int weighted,
    const void *const *next, int nnext) {
    const int64_t elem_bytes = dt == DT_FP32 ? 4 : 2;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                       _mm256_setzero_ps()};
        prefetch_next(next, nnext, i * elem_bytes, 32 * elem_bytes);
        for (int j = 0; j < nt; j++) {
            if (dt == DT_FP32) {
                const float *v = (const float *)src[j] + i;
                add4(a, _mm256_loadu_ps(v), _mm256_loadu_ps(v + 8), _mm256_loadu_ps(v + 16),
                     _mm256_loadu_ps(v + 24), weighted, weighted ? w[j] : 0.0f);
            } else {
                const uint16_t *v = (const uint16_t *)src[j] + i;
                __m256i h0 = _mm256_loadu_si256((const __m256i *)v);
                __m256i h1 = _mm256_loadu_si256((const __m256i *)(v + 16));
                add4(a, bf16_lo_f32(h0), bf16_hi_f32(h0), bf16_lo_f32(h1), bf16_hi_f32(h1),
                     weighted, weighted ? w[j] : 0.0f);
            }
        }
        if (dt == DT_FP32)
            store32_fp32((float *)y + i, a[0], a[1], a[2], a[3]);
        else
            store32_bf16((uint16_t *)y + i, a[0], a[1], a[2], a[3], 1);
    }
    return i;
}
AVX2 void reduce_bf16_avx2(void *y, const void *const *src, const float *w, int nt, int64_t n,
                           int weighted, const void *const *next, int nnext) {
    int64_t i = reduce32(DT_BF16, y, src, w, nt, n, weighted, next, nnext);
    reduce_tail(DT_BF16, y, src, w, nt, i, n, weighted);
}
AVX2 void reduce_fp32_avx2(void *y, const void *const *src, const float *w, int nt, int64_t n,
                           int weighted, const void *const *next, int nnext) {
    int64_t i = reduce32(DT_FP32, y, src, w, nt, n, weighted, next, nnext);
    reduce_tail(DT_FP32, y, src, w, nt, i, n, weighted);
}
AVX2_F16C void reduce_fp16_hw(void *y, const void *const *src, const float *w, int nt, int64_t n,
                              int weighted, const void *const *next, int nnext) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        if (i % 32 == 0) prefetch_next(next, nnext, i * 2, 64);
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
        store16_fp16((uint16_t *)y + i, a0, a1);
    }
    reduce_tail(DT_FP16, y, src, w, nt, i, n, weighted);
}

/* ---------------------------------------------------------------------------------------- */
/* AVX-512 versions of the BF16 reduction and rounding (decode-sized combines are bound by this
 * arithmetic, not by memory): the same integer rounding and the same float32 operations in the
 * same order as the AVX2 blocks above, 16 lanes wide, so every kernel set gives the same bits.
 * A 32-element block of BF16 is widened with one unpack per half (the low / high four words of
 * each 128-bit lane, shifted into the high half of a float32), and narrowed back with one
 * saturating pack per lane, which undoes the unpacks' order exactly: 2 + 1 instructions per 32
 * elements instead of 4 + 4 for widen-all-then-narrow. Each element keeps its own lane through
 * the sums, so the order of the elements inside the registers changes nothing else. */
#define AVX512 __attribute__((target("avx512f,avx512bw")))

/* the original index of lane j of the "lo" (0) or "hi" (1) half of a 32-element block */
static inline int unpacked_index(int half, int j) { return (j / 4) * 8 + half * 4 + j % 4; }

/* round to nearest even, as f32x8_to_bf16, into the low 16 bits of each 32-bit lane (no NaN) */
AVX512 static inline __m512i rne_bf16(__m512 f) {
    const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF);
    __m512i u = _mm512_castps_si512(f);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, bias)), 16);
}
/* 32 outputs from the sums of the lo and hi halves of a block */
AVX512 static inline void store32_bf16_512(uint16_t *out, __m512 lo, __m512 hi) {
    if (_mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q)) {
        float tmp[2][16]; /* NaN: the canonical one (scalar, rare) */
        _mm512_storeu_ps(tmp[0], lo);
        _mm512_storeu_ps(tmp[1], hi);
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 16; j++) store_f32(DT_BF16, out, unpacked_index(h, j), tmp[h][j]);
        return;
    }
    _mm512_storeu_si512((void *)out, _mm512_packus_epi32(rne_bf16(lo), rne_bf16(hi)));
}
AVX512 void round_bf16_avx512(void *y, const float *acc, int64_t n) {
    /* the sums in the unpacked order, so that convert() tests the very store combine uses */
    const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25,
                                             26, 27);
    const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(4));
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512 a0 = _mm512_loadu_ps(acc + i), a1 = _mm512_loadu_ps(acc + i + 16);
        store32_bf16_512((uint16_t *)y + i, _mm512_permutex2var_ps(a0, lo_idx, a1),
                         _mm512_permutex2var_ps(a0, hi_idx, a1));
    }
    round_tail(DT_BF16, y, acc, i, n);
}
AVX512 void reduce_bf16_avx512(void *y, const void *const *src, const float *w, int nt,
                               int64_t n, int weighted, const void *const *next, int nnext) {
    const __m512i zero = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        prefetch_next(next, nnext, i * 2, 128);
        /* a[0], a[1]: lo and hi halves of elements i..i+31; a[2], a[3]: of i+32..i+63 */
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                       _mm512_setzero_ps()};
        for (int j = 0; j < nt; j++) {
            const uint16_t *v = (const uint16_t *)src[j] + i;
            __m512i h0 = _mm512_loadu_si512((const void *)v);
            __m512i h1 = _mm512_loadu_si512((const void *)(v + 32));
            __m512 f[4] = {_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, h0)),
                           _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, h0)),
                           _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, h1)),
                           _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, h1))};
            if (weighted) { /* t = fl32(w * f), rounded before the add (-ffp-contract=off) */
                __m512 ww = _mm512_set1_ps(w[j]);
                for (int k = 0; k < 4; k++) f[k] = _mm512_mul_ps(ww, f[k]);
            }
            for (int k = 0; k < 4; k++) a[k] = _mm512_add_ps(a[k], f[k]);
        }
        store32_bf16_512((uint16_t *)y + i, a[0], a[1]);
        store32_bf16_512((uint16_t *)y + i + 32, a[2], a[3]);
    }
    reduce_tail(DT_BF16, y, src, w, nt, i, n, weighted);
}

/* The quantiser's row loop compiled for AVX2: the same source as the generic one
 * (kernels.h), vectorised by the compiler (vdivps, per-lane vpsrlvd for the rounding). */
AVX2 void quant_row_avx2(const void *x, int dt, int64_t hidden, void *values, float *scales,
                         int round_scale, int is_int8) {
    quant_row_body(x, dt, hidden, values, scales, round_scale, is_int8);
}

#endif /* UBEP_X86 */
