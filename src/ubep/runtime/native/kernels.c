/* Generic kernels and their run-time selection (kernels.h). */
#include "kernels.h"

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

static void copy_libc(uint8_t *d, const uint8_t *s, int64_t n) { memcpy(d, s, (size_t)n); }

uint64_t row_sum_generic(const uint8_t *p, int64_t n) {
    uint64_t a[4] = {0, 0, 0, 0}, c[4] = {0, 0, 0, 0}, w[4];
    for (int64_t i = 0; i < n; i += 32) {
        if (n - i >= 32) {
            memcpy(w, p + i, 32);
        } else { /* the last group, zero-padded */
            memset(w, 0, sizeof w);
            memcpy(w, p + i, (size_t)(n - i));
        }
        for (int l = 0; l < 4; l++) {
            a[l] += w[l];
            c[l] += a[l];
        }
    }
    return row_fold(n, a, c);
}
row_sum_fn ROW_SUM = row_sum_generic;

copy_fn copy_elem = copy_generic; /* element-safe copy (SP) */
copy_fn copy_fast = copy_libc;    /* any copy followed by a fenced flag */

int fill_vector_ok = 0;

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

int (*has2)(const uint16_t *, int64_t, uint16_t) = has_pattern2;
int (*has4)(const uint32_t *, int64_t, uint32_t) = has_pattern4;

static void round_bf16_c(void *y, const float *acc, int64_t n) {
    round_tail(DT_BF16, y, acc, 0, n);
}
static void round_fp16_c(void *y, const float *acc, int64_t n) {
    round_tail(DT_FP16, y, acc, 0, n);
}
static void round_fp32_c(void *y, const float *acc, int64_t n) {
    round_tail(DT_FP32, y, acc, 0, n);
}

round_fn ROUND[3] = {round_bf16_c, round_fp16_c, round_fp32_c};

/* the generic kernels (no SIMD: not the host of big combines) leave `next` to the hardware */
static void reduce_bf16_c(void *y, const void *const *s, const float *w, int nt, int64_t n,
                          int wt, const void *const *next, int nnext) {
    (void)next, (void)nnext;
    reduce_tail(DT_BF16, y, s, w, nt, 0, n, wt);
}
static void reduce_fp16_c(void *y, const void *const *s, const float *w, int nt, int64_t n,
                          int wt, const void *const *next, int nnext) {
    (void)next, (void)nnext;
    reduce_tail(DT_FP16, y, s, w, nt, 0, n, wt);
}
static void reduce_fp32_c(void *y, const void *const *s, const float *w, int nt, int64_t n,
                          int wt, const void *const *next, int nnext) {
    (void)next, (void)nnext;
    reduce_tail(DT_FP32, y, s, w, nt, 0, n, wt);
}

reduce_fn REDUCE[3] = {reduce_bf16_c, reduce_fp16_c, reduce_fp32_c};

const char *kernel_set = "generic";

/* ---------------------------------------------------------------------------------------- */
/* Quantisation (kernels.h; ubep.quant is the definition) */

void quant_row_generic(const void *x, int dt, int64_t hidden, void *values, float *scales,
                       int round_scale, int is_int8) {
    quant_row_body(x, dt, hidden, values, scales, round_scale, is_int8);
}

quant_row_fn QUANT_ROW = quant_row_generic;

void quant_row_e4m3(const void *x, int x_dtype, int64_t hidden, uint8_t *values, float *scales,
                    int round_scale) {
    QUANT_ROW(x, x_dtype, hidden, values, scales, round_scale, 0);
}

void quant_row_int8(const void *x, int x_dtype, int64_t hidden, int8_t *values, float *scales,
                    int round_scale) {
    QUANT_ROW(x, x_dtype, hidden, values, scales, round_scale, 1);
}

void select_kernels(void) { select_kernels_upto(2); }

const char *select_kernels_upto(int level) {
    kernel_set = "generic";
    fill_vector_ok = 0;
    copy_elem = copy_generic;
    has2 = has_pattern2;
    has4 = has_pattern4;
    ROUND[DT_BF16] = round_bf16_c; ROUND[DT_FP16] = round_fp16_c; ROUND[DT_FP32] = round_fp32_c;
    REDUCE[DT_BF16] = reduce_bf16_c; REDUCE[DT_FP16] = reduce_fp16_c;
    REDUCE[DT_FP32] = reduce_fp32_c;
    QUANT_ROW = quant_row_generic;
    ROW_SUM = row_sum_generic;
#if UBEP_X86
    __builtin_cpu_init();
    if (level >= 1 && __builtin_cpu_supports("avx2")) {
        kernel_set = "avx2";
        fill_vector_ok = 1;
        copy_elem = copy_avx2;
        has2 = has_pattern2_avx2;
        has4 = has_pattern4_avx2;
        ROUND[DT_BF16] = round_bf16_avx2;
        ROUND[DT_FP32] = round_fp32_avx2;
        REDUCE[DT_BF16] = reduce_bf16_avx2;
        REDUCE[DT_FP32] = reduce_fp32_avx2;
        QUANT_ROW = quant_row_avx2;
        ROW_SUM = row_sum_avx2;
        if (__builtin_cpu_supports("f16c")) {
            ROUND[DT_FP16] = round_fp16_hw;
            REDUCE[DT_FP16] = reduce_fp16_hw;
        }
        if (level >= 2 && __builtin_cpu_supports("avx512f") &&
            __builtin_cpu_supports("avx512bw")) {
            kernel_set = "avx512";
            ROUND[DT_BF16] = round_bf16_avx512;
            REDUCE[DT_BF16] = reduce_bf16_avx512;
        }
    }
#else
    (void)level;
#endif
    return kernel_set;
}
