/* The phases of the two task graphs (phases.c lists them), by the file that holds them. */
#ifndef UBEP_PHASES_H
#define UBEP_PHASES_H

#include "engine.h"

/* dispatch.c: quantised rows (op->quant: a first phase, every core its share of the tokens),
 * ASP's receive */
int ph_d_quant(op_t *op, int core);
int op_quantises(const op_t *op);
int ph_d_receive(op_t *op, int core);
int ph_d_check(op_t *op, int core);
int op_checks_rows(const op_t *op);

/* dispatch_send.c: ASP's prepare, count tasks and sends */
int ph_d_prepare(op_t *op, int core);
int ph_d_count(op_t *op, int core);
int ph_d_send(op_t *op, int core);

/* dispatch_bsp.c */
int ph_bsp_prepare(op_t *op, int core);
int ph_bsp_send(op_t *op, int core);
int ph_bsp_flags(op_t *op, int core);
int ph_bsp_verify(op_t *op, int core);
int ph_bsp_reorder(op_t *op, int core);
int ph_bsp_dst_rows(op_t *op, int core);

/* combine.c */
int ph_c_prepare(op_t *op, int core);
int ph_c_copy(op_t *op, int core);
int ph_c_publish(op_t *op, int core);
int ph_c_reduce(op_t *op, int core);

#endif /* UBEP_PHASES_H */
