/* The end of an operation: what a dispatch received from peers recorded, a failure announced,
 * the sync mode's last word (flags.c), this rank's done word published and the peers woken;
 * with row checksums, every peer's verdict awaited.
 *
 * Apart from wait.c (errors, notices, liveness, waits) so that the waits depend on nothing of
 * the sync modes: flags.c uses wait.c, this file uses both. */
#include "flags.h" /* first: engine.h's Python.h precedes the standard headers */

/* After a dispatch: which of the rows it received came from peers (engine.h, peer_rows),
 * from the engine's own metadata, never from anything the caller can touch later. */
static void record_peer_rows(engine_t *g, op_t *op) {
    int reg = (int)(op->n % g->nreg);
    int64_t *runs = peer_runs_of(g, reg);
    int nruns = 0;
    g->peer_rows[reg].index1 = 0;
    for (int64_t i = 0; i < op->n_recv;) {
        /* a padded layout's empty slots (-1) hold no row: no peer pulls them */
        if (op->o_src_rank[i] == g->rank || op->o_src_rank[i] < 0) { i++; continue; }
        int64_t lo = i;
        while (i < op->n_recv && op->o_src_rank[i] != g->rank && op->o_src_rank[i] >= 0) i++;
        if (nruns == MAX_PEER_RUNS(g)) return; /* more runs than the layouts make: no record */
        runs[2 * nruns] = lo;
        runs[2 * nruns + 1] = i;
        nruns++;
    }
    g->peer_rows[reg].rows = op->n_recv;
    g->peer_rows[reg].nruns = nruns;
    g->peer_rows[reg].index1 = (uint64_t)op->n + 1;
}

/* integrity: this rank's done word is out; wait until every peer's is (a peer that found a
 * corrupt row published its failure notice before its done word), so a call one rank found
 * corrupt fails on every rank. Returns the error code, 0 if every peer checked its rows. */
static int wait_peers_checked(op_t *op) {
    engine_t *g = op->g;
    for (int q = 0; q < g->R; q++) {
        if (q == g->rank) continue;
        waiter_t w;
        waiter_init(&w);
        while (rd_word(word(g, q, g->off_done)) < op->epoch) {
            int rc = wait_step(op, &w, 0, q, "rank %d to check the rows of call %llu", q,
                               (unsigned long long)op->epoch);
            if (rc) return atomic_load(&op->err) ? atomic_load(&op->err) : rc;
        }
    }
    check_failures(op, 0);
    return atomic_load(&op->err);
}

void finish_op(op_t *op) {
    engine_t *g = op->g;
    /* A peer may have failed this call although this rank got everything it needed (it timed
     * out on a slow third rank, say): then the call failed, here too. */
    if (!atomic_load(&op->err)) check_failures(op, 0);
    int err = atomic_load(&op->err);
    if (op->kind == 0) {
        if (err) g->peer_rows[op->n % g->nreg].index1 = 0;
        else record_peer_rows(g, op);
    }
    if (err) {
        char buf[MAX_MSG];
        format_error(op, buf, sizeof buf);
        publish_failure(g, op->epoch, err == E_REMOTE ? op->remote_code : err, buf);
    }
    flag_dispatch_done(op, err);
    pub_word(word(g, g->rank, g->off_done), op->epoch);
    ring_all(g);
    if (!err && g->integrity && op->kind != 2 && (err = wait_peers_checked(op))) {
        /* a peer failed the call after this rank had finished it: no result here either */
        if (op->kind == 0) g->peer_rows[op->n % g->nreg].index1 = 0;
        char buf[MAX_MSG];
        format_error(op, buf, sizeof buf);
        publish_failure(g, op->epoch, err == E_REMOTE ? op->remote_code : err, buf);
    }
    int armed = atomic_load(&op->armed);
    if (armed) atomic_fetch_sub(sleepers(g, g->rank), (uint32_t)armed);
    /* the call's span encloses its tasks: from its entry to here (a split-phase call: to the
     * end of its second half); the ring after the cores' holds them */
    if (op->kind <= 1)
        span_rec(op, g->C, op->kind ? SK_COMBINE : SK_DISPATCH, op->start_ns, op->kind ? -1 : op->n,
                 err, 0, 0);
}
