/* The four sync modes, one unit (mirrors src/ubep/flags/, the reference codecs; the byte
 * formats are docs/FORMATS.md's): how each mode encodes a row, what it publishes after a
 * batch, and how a receiver knows rows have arrived.
 *
 *   SW  (flags/sw.py)  rows plain, then one flag per (source, destination): count, epoch.
 *   TFF (flags/tff.py) an epoch word per block of every row: ASP lands rows in place with the
 *                      words apart in the land region, BSP stages blocks of payload + flag.
 *   DC  (flags/dc.py)  rows plain, then the batch's count and a checksum over its rows.
 *   SP  (flags/sp.py)  regions pre-filled with a sentinel that the rows overwrite; the armed
 *                      tail of a row is written last.
 *
 * What a send or receive loop does per row is a static inline function here (a call per row
 * would cost); per batch and per call work is in flags.c. */
#ifndef UBEP_FLAGS_H
#define UBEP_FLAGS_H

#include "engine.h"

/* SP: regions hold the sentinel until rows overwrite them; they are re-armed after use, and a
 * row's polled part must not carry the pattern */
static inline int flag_sentinel(const engine_t *g) { return g->sync == SYNC_SP; }
/* DC: the sender sums every row it sends to a peer (ASP: as it sends, dc_add_row) */
static inline int flag_sums_rows(const engine_t *g) { return g->sync == SYNC_DC; }

/* TFF staged (docs/FORMATS.md; BSP): a row as blocks of tff_payload bytes, each followed by its
 * flag, the call's epoch, stored with release after the payload. */
static inline void put_tff_row(engine_t *g, uint8_t *slot, const uint8_t *src, uint64_t epoch) {
    for (int64_t b = 0; b < g->tff_nblocks; b++) {
        int64_t off = b * g->tff_payload, len = g->row_bytes - off;
        if (len > g->tff_payload) len = g->tff_payload;
        uint8_t *blk = slot + b * g->tff_block;
        copy_elem(blk, src + off, len);
        if (len < g->tff_payload) memset(blk + len, 0, (size_t)(g->tff_payload - len));
        if (g->tff_flag > 8) memset(blk + g->tff_payload + 8, 0, (size_t)(g->tff_flag - 8));
        st_rel(blk + g->tff_payload, epoch); /* the block's flag, after its payload */
    }
}
/* ASP TFF lands in place (layout.py): the row goes straight to its final place in recv_x,
 * then each block's epoch word is release-stored into the row's word slot in the land region,
 * apart from the payload, so no copy ever writes payload and flag together (docs/MEMORY-MODEL.md).
 * The row is one copy_fast (libc: fast-string stores out of cache, which beat vector stores by
 * 10-25% there), so a store fence (SFENCE + release) orders it before the words, as SW orders
 * its rows before its flag. A block's word is still stored after that block's payload; the
 * words just all follow the row's last block. */
static inline uint64_t *tff_words(engine_t *g, int rank, int reg, int64_t pos) {
    return (uint64_t *)(land(g, rank, reg) + pos * g->slot_bytes);
}
static inline void put_tff_in_place(engine_t *g, uint8_t *dst, uint64_t *words,
                                    const uint8_t *src, uint64_t epoch) {
    copy_fast(dst, src, g->row_bytes);
    store_fence();
    for (int64_t b = 0; b < g->tff_nblocks; b++) st_rel(&words[b], epoch);
}
/* words [i, end) of a run of rows' epoch words: the index of the first that is not `epoch`
 * (relaxed loads: the caller issues one acquire fence before it lets anyone read the rows) */
static inline int64_t tff_first_missing(const uint64_t *words, int64_t i, int64_t end,
                                        uint64_t epoch) {
    while (i < end && ld_rlx(&words[i]) == epoch) i++;
    return i;
}
/* the flag of block b of a TFF slot (BSP staging) */
static inline uint64_t tff_flag(engine_t *g, const uint8_t *slot, int64_t b) {
    return ld_acq(slot + b * g->tff_block + g->tff_payload);
}
/* a complete TFF row, without its flags */
static inline void get_tff_row(engine_t *g, uint8_t *dst, const uint8_t *slot) {
    for (int64_t b = 0; b < g->tff_nblocks; b++) {
        int64_t off = b * g->tff_payload, len = g->row_bytes - off;
        if (len > g->tff_payload) len = g->tff_payload;
        copy_fast(dst + off, slot + b * g->tff_block, len);
    }
}

/* SP writer: the row's body, a store fence, then its armed tail (the last sp_tail bytes). A
 * reader that finds no sentinel left in the tail has, after its acquire fence, the whole row:
 * the fence orders the body's stores before the tail's (SFENCE on x86, for the fast-string
 * stores of the libc copy the body takes, a DMB on Arm). Nobody polls the body, so any copy
 * will do there; the tail is polled, so it is copied element-safe (no element tears). With
 * sp_tail == row_bytes this is plain SP, every element armed and polled. */
static inline void put_sp_row(engine_t *g, uint8_t *slot, const uint8_t *src) {
    int64_t body = g->row_bytes - g->sp_tail;
    if (body > 0) {
        copy_fast(slot, src, body);
        store_fence();
    }
    copy_elem(slot + body, src + body, g->sp_tail);
}


/* ASP: one row to position pos of destination d's region reg, encoded for the mode */
static inline void flag_put_row(engine_t *g, int d, int reg, int64_t pos, const uint8_t *src,
                                uint64_t epoch) {
    /* the row's checksum first: every mode's flag follows it behind a store fence */
    if (g->integrity) st_rlx(&rsum_rows(g, d, reg)[pos],
                             row_check(row_sum(src, g->row_bytes), epoch, pos));
    if (g->sync == SYNC_TFF) {
        put_tff_in_place(g, outreg(g, d, reg) + pos * g->out_stride, tff_words(g, d, reg, pos),
                         src, epoch);
        return;
    }
    uint8_t *slot = land(g, d, reg) + pos * g->slot_bytes;
    if (g->sync == SYNC_SP) {
        put_sp_row(g, slot, src);
    } else {
        copy_fast(slot, src, g->row_bytes);
    }
}

/* BSP: one row into its staging slot */
static inline void flag_put_staged(engine_t *g, uint8_t *slot, const uint8_t *src,
                                   uint64_t epoch) {
    if (g->sync == SYNC_TFF) {
        put_tff_row(g, slot, src, epoch);
    } else if (g->sync == SYNC_SP) {
        copy_elem(slot, src, g->row_bytes);
    } else {
        copy_fast(slot, src, g->row_bytes);
    }
}

/* BSP: a verified staged row to its final place (SP: the slot, consumed, is re-armed) */
static inline void flag_unstage(engine_t *g, uint8_t *dst, uint8_t *slot) {
    if (g->sync == SYNC_TFF) {
        get_tff_row(g, dst, slot);
    } else {
        copy_fast(dst, slot, g->row_bytes);
        if (g->sync == SYNC_SP) fill_pattern(slot, g->row_bytes, g->isz, g->sentinel);
    }
}

/* DC: the row sums of the token a send loop summed last. A token's rows to one destination
 * follow each other in its bucket (expert layout: up to top-k of them, the same bytes), so its
 * sums are computed once, not once per row. */
typedef struct {
    int64_t t;
    uint64_t A, B;
} dc_memo_t;
#define DC_MEMO_INIT {-1, 0, 0}

/* DC: add row `src` of token t, rank brank in its batch to d, to the batch's running sums */
static inline void dc_add_row(engine_t *g, dc_memo_t *memo, int64_t t, const uint8_t *src,
                              int d, int64_t brank) {
    int64_t W = (g->row_bytes + 7) / 8;
    if (memo->t != t) {
        dc_row_sums(src, g->row_bytes, &memo->A, &memo->B);
        memo->t = t;
    }
    uint64_t A = memo->A, B = memo->B;
    if (g->C > 1) {
        atomic_fetch_add(&g->dc_s1[d], A);
        atomic_fetch_add(&g->dc_s2[d], (uint64_t)brank * (uint64_t)W * A + B);
    } else {
        g->dc_s1[d] += A;
        g->dc_s2[d] += (uint64_t)brank * (uint64_t)W * A + B;
    }
}

/* How far a source's rows have been consumed, in position (= batch rank) order. */
typedef struct {
    int el;        /* local expert (expert layout); 0 for the rank layout */
    int64_t off;   /* rows done inside that expert's block from this source */
    int64_t rank;  /* rows done in total */
} rx_cursor_t;

/* flags.c: per batch and per call */
void reset_land(engine_t *g);
int ensure_clean(op_t *op);
/* SP in place: re-arm what the region's last use left before peers write it again */
void flag_rearm_used(engine_t *g, int reg);
/* ASP: the last row to d is written: publish d's flag record (SW, DC) and ring d */
void flag_publish_batch(op_t *op, int d);
/* BSP: the flag record over the rows staged at d (SW, DC; TFF and SP: nothing) */
void flag_publish_staged(op_t *op, int d, const uint8_t *part);
/* BSP, after the barrier: the n rows source s staged at `part` are whole (1) or not (0) */
int flag_verify_staged(op_t *op, int s, const uint8_t *part, int64_t n);
/* ASP: consume whatever has landed from source s without blocking: 1 when all its rows are
 * in, 0 when some are still missing, -1 on error (recorded) */
int flag_arrived(op_t *op, int core, int s, const int64_t *rx_base, const uint8_t *land_base,
                 rx_cursor_t *c);
/* what an ASP receiver waits for, for its timeout message */
const char *flag_awaited(const engine_t *g);
/* the end of a dispatch (finish_op): SP records which rows of the region need re-arming */
void flag_dispatch_done(op_t *op, int err);

#endif /* UBEP_FLAGS_H */
