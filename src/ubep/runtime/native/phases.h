/* The phases of the two task graphs (phases.c lists them), by the file that holds them. */
#ifndef UBEP_PHASES_H
#define UBEP_PHASES_H

#include "engine.h"

/* every phase has phase_fn's type (engine.h): the function type, to declare them by */
typedef int phase_body(op_t *op, int core);

/* dispatch.c: quantised rows (op->quant: a first phase, every core its share of the tokens),
 * ASP's receive */
phase_body ph_d_quant, ph_d_receive, ph_d_check;
int op_quantises(const op_t *op);
int op_checks_rows(const op_t *op);

/* dispatch_send.c: ASP's prepare, count tasks and sends */
phase_body ph_d_prepare, ph_d_count, ph_d_send;

/* dispatch_bsp.c */
phase_body ph_bsp_prepare, ph_bsp_send, ph_bsp_flags, ph_bsp_verify, ph_bsp_reorder,
    ph_bsp_dst_rows;

/* combine.c */
phase_body ph_c_prepare, ph_c_copy, ph_c_publish, ph_c_reduce;

#endif /* UBEP_PHASES_H */
