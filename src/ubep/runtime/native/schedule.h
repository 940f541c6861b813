/* The send scheduler of ubep.sched, in the native core: one rank's Plan built from its routing in
 * a few passes over the units, without Python. It reproduces ubep.sched.schedule's Plan unit for
 * unit (tests/runtime/test_runtime_schedule.py checks it against ubep.sched on random routings,
 * every policy and layout, several hop classes); ubep.sched stays the scheduler of the simulator
 * and the reference of this one. */
#ifndef UBEP_SCHEDULE_H
#define UBEP_SCHEDULE_H

#include <stdint.h>

enum { SCHED_EXPERT_CONTIGUOUS = 0, SCHED_BALANCED = 1, SCHED_HIERARCHICAL = 2 };

/* What a rank's schedule depends on besides its routing: ubep.sched.ScheduleSpec's tables. */
typedef struct {
    int policy;            /* SCHED_* */
    int expert_layout;     /* 1: a unit per (token, k); 0: per (token, destination rank) */
    int R, E, K, L, H, n;  /* ranks, experts, top-k, experts per rank, hop classes, send cores */
    const int64_t *hop;    /* [R] hop class of each destination, from this rank */
    const int64_t *issue;  /* [H] issue rank of each hop class inside a core (0 goes first) */
    const int64_t *rpos;   /* [E] remapped position of each expert (the transposition) */
} sched_spec_t;

/* Work space and the Plan's arrays, for up to `cap` units (T x K) and H x E keys. */
typedef struct {
    int64_t cap;
    int H, E, R, n;                                 /* the sizes it was allocated for */
    int64_t *token, *k, *expert, *dst, *hop, *slot; /* [cap] the Plan's units, issue order */
    int64_t *core_ptr;                              /* [n + 1] */
    int32_t *u_t, *u_k, *u_e, *u_d, *u_slot;        /* [cap] units in token order */
    int32_t *u_key, *seq;                           /* [cap] sort key; sequence -> unit */
    int64_t *key_start;                             /* [H*E + 1] */
    int64_t *run;                                   /* [max(E, R)] slot counters */
    int64_t *quota, *start;                         /* [n * H] */
} sched_work_t;

/* Allocates the work space (NULL members on failure: sched_work_ok says). */
void sched_work_init(sched_work_t *w, int64_t cap, int H, int E, int R, int n);
int sched_work_ok(const sched_work_t *w);
void sched_work_free(sched_work_t *w);

/* Checks a spec's tables (values in range, `issue` a permutation): NULL, or what is wrong. */
const char *sched_spec_check(const sched_spec_t *s);

/* Builds the Plan of `route` [T x K] (validated expert ids, -1 = none) into `w`: the units in
 * issue order grouped by core and core_ptr. Returns the number of units. */
int64_t sched_build(const sched_spec_t *s, const int32_t *route, int64_t T, sched_work_t *w);

#endif /* UBEP_SCHEDULE_H */
