/* The ABI shared with Python: codes, control-record offsets and the records' checksums.
 *
 * ubep/runtime/abi.py holds the same numbers on the Python side; the module exports them (see
 * module.c) and abi.py checks them when it loads the module, so a stale build is an error. */
#ifndef UBEP_ABI_H
#define UBEP_ABI_H

#include <stdint.h>

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
static inline uint64_t sum_u32(uint64_t h, const uint32_t *p, int64_t n) {
    fletcher_t f = {1, 0, 0};
    fletcher_add(&f, p, n);
    return fletcher_end(h, &f);
}
static inline uint64_t counts_sum(uint64_t epoch, uint64_t rows, const uint32_t *cnt, int L) {
    return sum_u32(mix64(mix64(0x636F756E7473ULL, epoch), rows), cnt, L);
}
/* the routing record: topk_idx (int32) then the weights (float bits), n words each */
static inline uint64_t route_sum(uint64_t epoch, uint64_t ntok, const uint32_t *idx,
                                 const uint32_t *w, int64_t n) {
    fletcher_t f = {1, 0, 0};
    fletcher_add(&f, idx, n);
    fletcher_add(&f, w, n);
    return fletcher_end(mix64(mix64(0x726F757465ULL, epoch), ntok), &f);
}

static inline uint64_t notice_sum(uint64_t epoch, uint64_t lencode, const uint8_t *msg,
                                  uint32_t len) {
    uint64_t h = mix64(mix64(0x6E6F74696365ULL, epoch), lencode);
    for (uint32_t i = 0; i < len; i++) h = mix64(h, msg[i]);
    return h;
}

static inline uint64_t comb_info_sum(uint64_t epoch, uint64_t off, uint64_t rows, uint64_t stride,
                                     uint64_t index) {
    return mix64(mix64(mix64(mix64(mix64(0x636F6D62ULL, epoch), off), rows), stride), index);
}

#endif /* UBEP_ABI_H */
