/* The two task graphs, ASP (UBEP's) and BSP (the baseline), each for dispatch and combine, as
 * the phase lists team.c runs: {phase, all cores (else core 0), in-process barrier after it,
 * run only if, its task span's kind (SK_OWN: the phase records finer spans itself)}. PHASE_LIST(table, split, split_fg) marks where a split-phase call hands over
 * (engine.h, phase_list_t). The phases themselves are in dispatch.c, dispatch_send.c,
 * dispatch_bsp.c and combine.c (phases.h). */
#include "phases.h" /* first: engine.h's Python.h precedes the standard headers */

/* BSP's global barriers: dispatch's two SyncAll, combine's one (the barrier index) */
static int ph_b1_arrive(op_t *op, int core) { return barrier_arrive(op, core, 1); }
static int ph_b1_wait(op_t *op, int core) { return barrier_wait(op, core, 1); }
static int ph_b2_arrive(op_t *op, int core) { return barrier_arrive(op, core, 2); }
static int ph_b2_wait(op_t *op, int core) { return barrier_wait(op, core, 2); }
static int ph_cb_arrive(op_t *op, int core) { return barrier_arrive(op, core, 3); }
static int ph_cb_wait(op_t *op, int core) { return barrier_wait(op, core, 3); }

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
    {ph_b1_arrive, 1, 1, NULL, SK_BARRIER},    /* SyncAll */
    {ph_b1_wait, 1, 1, NULL, SK_BARRIER},
    {ph_bsp_flags, 1, 1, NULL, SK_FLAG},    /* SendFlag & TokenCnt */
    {ph_bsp_verify, 1, 1, NULL, SK_VERIFY},   /* Verification */
    {ph_b2_arrive, 1, 1, NULL, SK_BARRIER},    /* SyncAll */
    {ph_b2_wait, 1, 1, NULL, SK_BARRIER},
    {ph_bsp_reorder, 1, 1, NULL, SK_OWN},  /* CalCumSum + Token-Reordering */
    {ph_bsp_dst_rows, 0, 0, NULL, SK_CUMSUM},
};
const phase_list_t BSP_DISPATCH = PHASE_LIST(BSP_DISPATCH_PHASES, 2, 6);

static const phase_t ASP_COMBINE_PHASES[] = {
    {ph_c_prepare, 0, 1, NULL, SK_INIT},
    {ph_c_copy, 1, 1, NULL, SK_COPY},
    {ph_c_publish, 0, 1, NULL, SK_FLAG},
    {ph_c_reduce, 1, 0, NULL, SK_REDUCE},
};
const phase_list_t ASP_COMBINE = PHASE_LIST(ASP_COMBINE_PHASES, 3, 3);

static const phase_t BSP_COMBINE_PHASES[] = {
    {ph_c_prepare, 0, 1, NULL, SK_INIT},
    {ph_c_copy, 1, 1, NULL, SK_COPY},
    {ph_c_publish, 0, 1, NULL, SK_FLAG},
    {ph_cb_arrive, 1, 1, NULL, SK_BARRIER},
    {ph_cb_wait, 1, 1, NULL, SK_BARRIER},
    {ph_c_reduce, 1, 0, NULL, SK_REDUCE},
};
const phase_list_t BSP_COMBINE = PHASE_LIST(BSP_COMBINE_PHASES, 3, 4);
