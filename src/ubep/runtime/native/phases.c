/* The two task graphs, ASP (UBEP's) and BSP (the baseline), each for dispatch and combine, as
 * the phase lists team.c runs: {phase, all cores (else core 0), in-process barrier after it,
 * run only if, its task span's kind (SK_OWN: the phase records finer spans itself)}. PHASE_LIST(table, split, split_fg) marks where a split-phase call hands over
 * (engine.h, phase_list_t). The phases themselves are in dispatch.c, dispatch_send.c,
 * dispatch_bsp.c and combine.c (phases.h). */
#include "phases.h" /* first: engine.h's Python.h precedes the standard headers */

/* BSP's global barriers (dispatch's two SyncAll, combine's one; the index names the barrier's
 * words), each two phases of every core: arrive, then wait for every peer's arrival */
#define GLOBAL_BARRIER(name, index)                                                          \
    static int name##_arrive(op_t *op, int core) { return barrier_arrive(op, core, index); } \
    static int name##_wait(op_t *op, int core) { return barrier_wait(op, core, index); }
GLOBAL_BARRIER(ph_b1, 1)
GLOBAL_BARRIER(ph_b2, 2)
GLOBAL_BARRIER(ph_cb, 3)
/* a barrier's two rows of a phase list */
#define SYNC_ALL(name) \
    {name##_arrive, 1, 1, NULL, SK_BARRIER}, {name##_wait, 1, 1, NULL, SK_BARRIER}

static int ph_none(op_t *op, int core) {
    (void)op;
    (void)core;
    return 0;
}

static const phase_t ASP_DISPATCH_PHASES[] = {
    {ph_d_quant, 1, 1, op_quantises, SK_QUANT},
    {ph_d_prepare, 0, 1, NULL, SK_INIT},
    {ph_d_count, 1, 0, NULL, SK_OWN}, /* no barrier: a thread goes on to its sends, others still count */
    {ph_d_send, 1, 0, NULL, SK_OWN},
    {ph_d_receive, 1, 0, NULL, SK_OWN},
    {ph_none, 0, 1, op_checks_rows, SK_OWN}, /* integrity: every core's rows are in (its barrier) */
    {ph_d_check, 1, 0, op_checks_rows, SK_CHECKSUM},
};
const phase_list_t ASP_DISPATCH = PHASE_LIST(ASP_DISPATCH_PHASES, 3, 4);

static const phase_t BSP_DISPATCH_PHASES[] = {
    {ph_d_quant, 1, 1, op_quantises, SK_QUANT}, /* quantised rows only */
    {ph_bsp_prepare, 0, 1, NULL, SK_INIT},  /* Init */
    {ph_bsp_send, 1, 1, NULL, SK_OWN},     /* Token-Sending */
    SYNC_ALL(ph_b1),    /* SyncAll */
    {ph_bsp_flags, 1, 1, NULL, SK_FLAG},    /* SendFlag & TokenCnt */
    {ph_bsp_verify, 1, 1, NULL, SK_VERIFY},   /* Verification */
    SYNC_ALL(ph_b2),    /* SyncAll */
    {ph_bsp_reorder, 1, 1, NULL, SK_OWN},  /* CalCumSum + Token-Reordering */
    {ph_bsp_dst_rows, 0, 0, NULL, SK_CUMSUM},
};
const phase_list_t BSP_DISPATCH = PHASE_LIST(BSP_DISPATCH_PHASES, 2, 6);

/* the combine's first half, the same in both graphs: expert outputs into the segment, their
 * place published (BSP then adds its barrier before the reduce) */
#define COMBINE_PUBLISH                                                                    \
    {ph_c_prepare, 0, 1, NULL, SK_INIT}, {ph_c_copy, 1, 1, NULL, SK_COPY},                \
        {ph_c_publish, 0, 1, NULL, SK_FLAG}

static const phase_t ASP_COMBINE_PHASES[] = {
    COMBINE_PUBLISH,
    {ph_c_reduce, 1, 0, NULL, SK_REDUCE},
};
const phase_list_t ASP_COMBINE = PHASE_LIST(ASP_COMBINE_PHASES, 3, 3);

static const phase_t BSP_COMBINE_PHASES[] = {
    COMBINE_PUBLISH,
    SYNC_ALL(ph_cb),
    {ph_c_reduce, 1, 0, NULL, SK_REDUCE},
};
const phase_list_t BSP_COMBINE = PHASE_LIST(BSP_COMBINE_PHASES, 3, 4);
