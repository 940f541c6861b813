/* The ABI shared with Python: codes, the control records as structs, their checksums.
 *
 * ubep/runtime/abi.py holds the same numbers on the Python side; exports.c exports them (codes
 * as dicts, record offsets computed with offsetof) and abi.py compares them when it loads the
 * module, so a stale build fails at load with a message that says so. */
#ifndef UBEP_ABI_H
#define UBEP_ABI_H

#include <stddef.h>
#include <stdint.h>

/* Version of this ABI: bumped whenever a code, a record or a parameter changes meaning. */
#define UBEP_ABI_VERSION 4

/* codes shared with Python (the names are ubep.runtime.abi's dict keys) */
enum { DT_BF16 = 0, DT_FP16 = 1, DT_FP32 = 2, DT_INT8 = 3, DT_UINT8 = 4 };
/* dispatch quantises rows (BufferConfig.quant): none, E4M3 or INT8 values + float32 scales */
enum { QUANT_NONE = 0, QUANT_E4M3 = 1, QUANT_INT8 = 2 };
enum { SYNC_SW = 0, SYNC_TFF = 1, SYNC_DC = 2, SYNC_SP = 3 };
enum { ENG_ASP = 0, ENG_BSP = 1 };
enum { LAY_EXPERT = 0, LAY_RANK = 1, LAY_EXPERT_PADDED = 2 };
/* Error codes of error records (ubep.plane.records.ErrorRecord) and of failure notices. E_LOST: the ranks are out of step (a
 * peer left this call without finishing it, called another operation, or corrupt control data
 * was found): the Buffer needs a resync. */
enum { E_OK = 0, E_BAD_INPUT = 1, E_TIMEOUT = 2, E_PEER_LOST = 3, E_REMOTE = 4, E_INTERNAL = 5,
       E_LOST = 6 };
/* The trace slots (Engine.trace): core 0's CLOCK_MONOTONIC stamp as each phase of the last call
 * ends (ENTER: the call's native part begins). Each span between two stamps is one phase of
 * the paper's task graph; benchmarks/harness.py names them. BSP's dispatch stamps the same
 * slots at its own phase ends: SENT after Token-Sending, COUNTS_IN after the first SyncAll and
 * the verification of flags and counts, METADATA after the second SyncAll and the reordering
 * (rows and metadata together), DATA_IN once send_dst_row is known. */
enum {
    TRACE_D_ENTER = 0,      /* dispatch: the native part begins */
    TRACE_D_PREV_DONE = 1,  /* peers finished call epoch - 2 (its route area is free) */
    TRACE_D_VALIDATED = 2,  /* routing validated and counted */
    TRACE_D_PUBLISHED = 3,  /* counts and routing published */
    TRACE_D_SENT = 4,       /* rows sent */
    TRACE_D_COUNTS_IN = 5,  /* every source's counts read, receive bases known */
    TRACE_D_METADATA = 6,   /* receive metadata written */
    TRACE_D_DATA_IN = 7,    /* every row arrived */
    TRACE_C_ENTER = 8,      /* combine: the native part begins */
    TRACE_C_PREV_DONE = 9,  /* peers finished the calls whose regions this one reuses */
    TRACE_C_COPIED = 10,    /* expert outputs in this rank's segment */
    TRACE_C_PUBLISHED = 11, /* combine info published */
    TRACE_C_PEERS = 12,     /* every peer's combine info read */
    TRACE_C_REDUCED = 13,   /* outputs reduced */
    TRACE_D_NATIVE = 14,    /* dispatch: the native call entered, its arguments not yet read */
    TRACE_C_NATIVE = 15,    /* combine: the same */
    TRACE_SLOTS = 16
};

/* ---------------------------------------------------------------------------------------- */
/* Control records in a rank's segment (docs/FORMATS.md, "Control records"). ubep/runtime/
 * layout.py places them (the segment offsets are engine parameters); the offsets inside a
 * record are fixed here and in ubep/runtime/abi.py. Every record starts a 64-byte line. */

#define LINE_BYTES 64
#define HEADER_BYTES 256 /* the segment header (ubep.runtime.shm): never data */

/* A progress word (entered, done, recv_ready, a BSP barrier arrival), alone on its line: the
 * value, then its complement (sync.h: pub_word, rd_word). */
typedef struct {
    uint64_t value;
    uint64_t check; /* ~value, stored first */
} word_t;

/* The doorbell line of a rank (wait.c): an eventcount and the number of sleepers. */
typedef struct {
    uint32_t bell;
    uint8_t pad[28];
    uint32_t sleepers;
} doorbell_t;

/* One inbox entry: a source's counts for this rank in the calls of one epoch parity, with the
 * SW flag and the DC record of its rows. */
typedef struct {
    uint64_t counts_epoch;
    uint64_t rows;        /* rows the source sends here */
    uint64_t sum;         /* counts_sum(epoch, rows, counts) */
    uint8_t pad0[32];
    uint64_t signature;   /* what the source's call is (Buffer.sign): every rank's must match */
    uint64_t sw_count;    /* SW: rows written, then */
    uint64_t sw_epoch;
    uint8_t pad1[48];
    uint64_t dc_count;    /* DC: rows written, their checksum, then */
    uint64_t dc_sum;
    uint64_t dc_epoch;
    uint64_t ranks_sum;   /* ranks_sum(epoch, the rows per rank after counts[L]) */
    uint8_t pad2[32];
    uint32_t counts[];    /* [num_local_experts]: rows per local expert, then [num_ranks]: the
                           * source's rows to every rank (not only this one) */
} inbox_rec_t;

/* Where a rank's expert outputs for combine lie (one per epoch parity). */
typedef struct {
    uint64_t off;         /* offset in the owner's segment */
    uint64_t rows;
    uint64_t stride;      /* bytes per row */
    uint64_t epoch;
    uint64_t dispatch_index; /* the dispatch whose handle the owner combines */
    uint64_t sum;         /* comb_info_sum(epoch, off, rows, stride, dispatch_index) */
    uint8_t pad[16];
} comb_info_rec_t;

/* A failure notice (one per epoch parity). */
#define FAIL_MSG_MAX 472
typedef struct {
    uint64_t epoch;
    uint64_t lencode;     /* message length | code << 32 */
    uint8_t msg[FAIL_MSG_MAX];
    uint64_t sum;         /* notice_sum(epoch, lencode, msg) */
    uint8_t pad[16];
} fail_rec_t;

/* The routing of one dispatch (per dispatch index mod num_regions), read by the receivers for
 * their metadata: topk_idx as int32 here, the weights (f32) at route_w_off (layout.py). */
typedef struct {
    uint64_t ntok;
    uint64_t epoch;
    uint64_t sum;         /* route_sum(epoch, ntok, idx, weights) */
    uint8_t pad[40];
    int32_t idx[];        /* [ntok * num_topk] */
} route_rec_t;

#define ABI_OFFSET(rec, field, at) \
    _Static_assert(offsetof(rec, field) == (at), #rec "." #field " moved")
ABI_OFFSET(word_t, check, 8);
ABI_OFFSET(doorbell_t, sleepers, 32);
ABI_OFFSET(inbox_rec_t, counts_epoch, 0);
ABI_OFFSET(inbox_rec_t, rows, 8);
ABI_OFFSET(inbox_rec_t, sum, 16);
ABI_OFFSET(inbox_rec_t, signature, 56);
ABI_OFFSET(inbox_rec_t, sw_count, 64);
ABI_OFFSET(inbox_rec_t, sw_epoch, 72);
ABI_OFFSET(inbox_rec_t, dc_count, 128);
ABI_OFFSET(inbox_rec_t, dc_sum, 136);
ABI_OFFSET(inbox_rec_t, dc_epoch, 144);
ABI_OFFSET(inbox_rec_t, ranks_sum, 152);
ABI_OFFSET(inbox_rec_t, counts, 192);
ABI_OFFSET(comb_info_rec_t, off, 0);
ABI_OFFSET(comb_info_rec_t, rows, 8);
ABI_OFFSET(comb_info_rec_t, stride, 16);
ABI_OFFSET(comb_info_rec_t, epoch, 24);
ABI_OFFSET(comb_info_rec_t, dispatch_index, 32);
ABI_OFFSET(comb_info_rec_t, sum, 40);
ABI_OFFSET(fail_rec_t, epoch, 0);
ABI_OFFSET(fail_rec_t, lencode, 8);
ABI_OFFSET(fail_rec_t, msg, 16);
ABI_OFFSET(fail_rec_t, sum, 488);
ABI_OFFSET(route_rec_t, ntok, 0);
ABI_OFFSET(route_rec_t, epoch, 8);
ABI_OFFSET(route_rec_t, sum, 16);
ABI_OFFSET(route_rec_t, idx, 64);
_Static_assert(2 * sizeof(word_t) <= LINE_BYTES && sizeof(doorbell_t) <= LINE_BYTES, "a line");
_Static_assert(sizeof(comb_info_rec_t) == 64, "comb_info_rec_t is one line");
_Static_assert(sizeof(fail_rec_t) == 512, "fail_rec_t is 8 lines");
_Static_assert(sizeof(inbox_rec_t) == 192 && sizeof(route_rec_t) == 64, "record headers");

/* Checksum of a control record (counts, combine info, routing, failure notice): a reader
 * that finds a record of its call recomputes it over the values exactly as it read them, so
 * bytes that a third party changed are an error, never data. Not cryptographic: it detects
 * corruption, a same-user process that wants to forge records can map the segment anyway. */
static inline uint64_t mix64(uint64_t h, uint64_t v) {
    h ^= v + 0x9E3779B97F4A7C15ULL + (h << 6) + (h >> 2);
    return h * 0xBF58476D1CE4E5B9ULL;
}
/* Two Fletcher lanes over 32-bit words, folded at the end: a_i = a_{i-1} + p_i and
 * b_i = b_{i-1} + a_i (mod 2^64). Computed in closed form, b += n a + sum_i (n - i) p_i over
 * the n words (0-based i): the same values, without the chain from one word to the next, so
 * the loop vectorises (a routing record of 128 tokens x top-8 is 2048 words per source). */
typedef struct { uint64_t a, b, n; } fletcher_t;
static inline void fletcher_add(fletcher_t *f, const uint32_t *p, int64_t n) {
    uint64_t s = 0, ws = 0;
    for (int64_t i = 0; i < n; i++) {
        s += p[i];
        ws += (uint64_t)p[i] * (uint64_t)(n - i);
    }
    f->b += (uint64_t)n * f->a + ws;
    f->a += s;
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
/* a source's rows to every rank (the [R] words after a count record's counts) */
static inline uint64_t ranks_sum(uint64_t epoch, const uint32_t *rows, int R) {
    return sum_u32(mix64(0x72616E6B73ULL, epoch), rows, R);
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

/* integrity="checksum": what a row's sender stores (docs/FORMATS.md, "Row checksums"): the
 * row's sum (row_sum, kernels.h) bound to the call and the row's position, so a stale row
 * (another call's, with that call's checksum) or a row in the wrong place fails too */
static inline uint64_t row_check(uint64_t sum, uint64_t epoch, int64_t pos) {
    return mix64(mix64(sum ^ 0x726F77ULL, epoch), (uint64_t)pos);
}

#endif /* UBEP_ABI_H */
