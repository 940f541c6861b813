/* The cores of one rank: an operation is a short list of phases; each phase runs on every core
 * (or on core 0 only). With threads, core 0 is the calling thread and cores 1..C-1 are
 * persistent pthreads that spin, yield, then sleep on a futex between operations; without (more
 * cores than hardware threads), the calling thread plays every core in turn, phase by phase. */
#include "engine.h" /* first: Python.h precedes the standard headers */

#include <sched.h>
#include <stdlib.h>

static void team_barrier(engine_t *g) {
    if (g->C == 1 || !g->threaded) return;
    uint32_t gen = atomic_load(&g->tb_gen);
    if (atomic_fetch_add(&g->tb_count, 1) == (uint32_t)g->C - 1) {
        atomic_store(&g->tb_count, 0);
        atomic_fetch_add(&g->tb_gen, 1);
        futex_wake(&g->tb_gen, INT32_MAX);
        return;
    }
    for (int i = 0; atomic_load(&g->tb_gen) == gen; i++) {
        if (i < 64) cpu_relax();
        else if (i < 2000) sched_yield();
        else {
            struct timespec ts = {0, 1000000};
            futex_wait(&g->tb_gen, gen, &ts);
        }
    }
}

void maybe_poke(op_t *op, int phase) {
    engine_t *g = op->g;
    if (!g->poke.armed || g->poke.kind != op->kind || g->poke.phase != phase) return;
    g->poke.armed = 0;
    memcpy(g->base[g->poke.rank] + g->poke.off, g->poke.data, (size_t)g->poke.len);
    atomic_thread_fence(memory_order_seq_cst);
}

/* one phase on one core: a task span of its kind when tracing is on (phases of kind SK_OWN
 * record their own tasks) */
static void run_phase(op_t *op, const phase_t *ph, int core) {
    if (__builtin_expect(!op->g->trace_on, 1) || ph->kind == SK_OWN) {
        ph->fn(op, core);
        return;
    }
    int64_t t0 = now_ns();
    ph->fn(op, core);
    span_rec(op, core, ph->kind, t0, -1, -1, 0, 0);
}

static void run_phases_core(op_t *op, const phase_t *ph, int first, int nph, int core) {
    for (int p = first; p < nph; p++) {
        if (core == 0) maybe_poke(op, p);
        if (ph[p].when && !ph[p].when(op)) continue; /* the same on every core */
        if (!atomic_load(&op->abort) && (ph[p].all_cores || core == 0)) run_phase(op, &ph[p], core);
        if (ph[p].sync_after) team_barrier(op->g);
    }
}

static void *worker_main(void *arg) {
    engine_t *g = ((void **)arg)[0];
    int core = (int)(intptr_t)((void **)arg)[1];
    free(arg);
    uint32_t seen = 0;
    for (;;) {
        for (int i = 0; atomic_load(&g->job_gen) == seen; i++) {
            if (i < 200) cpu_relax();
            else if (i < 400) sched_yield();
            else futex_wait(&g->job_gen, seen, NULL);
        }
        seen = atomic_load(&g->job_gen);
        if (atomic_load(&g->stopping)) break;
        run_phases_core(g->job_op, g->job_phases->phase, g->job_first, g->job_end, core);
        team_barrier(g); /* completion */
    }
    return NULL;
}

int start_threads(engine_t *g) {
    if (!g->threaded || g->C == 1 || g->nthreads_started) return 0;
    g->threads = calloc((size_t)g->C, sizeof(pthread_t));
    if (!g->threads) return -1;
    for (int c = 1; c < g->C; c++) {
        void **arg = malloc(2 * sizeof(void *));
        if (!arg) return -1;
        arg[0] = g;
        arg[1] = (void *)(intptr_t)c;
        if (pthread_create(&g->threads[c], NULL, worker_main, arg) != 0) {
            free(arg);
            return -1;
        }
        g->nthreads_started = c;
    }
    return 0;
}

/* phases [first, end) of an operation: all of them, or one half of a split-phase call (its
 * completion barrier orders the halves: every core finished the first before the second runs) */
void run_op(op_t *op, const phase_list_t *phases, int first, int end) {
    engine_t *g = op->g;
    const phase_t *ph = phases->phase;
    if (g->C == 1) {
        run_phases_core(op, ph, first, end, 0);
    } else if (g->threaded) {
        g->job_op = op;
        g->job_phases = phases;
        g->job_first = first;
        g->job_end = end;
        atomic_fetch_add(&g->job_gen, 1);
        futex_wake(&g->job_gen, INT32_MAX);
        run_phases_core(op, ph, first, end, 0);
        team_barrier(g);
    } else {
        /* more cores than hardware threads: the calling thread plays every core, phase by
         * phase (phases never wait on another core of the same rank) */
        for (int p = first; p < end; p++)
            for (int c = (maybe_poke(op, p), 0); c < (ph[p].all_cores ? g->C : 1) && (!ph[p].when || ph[p].when(op));
                 c++)
                if (!atomic_load(&op->abort)) run_phase(op, &ph[p], c);
    }
}

/* The background core: runs the second halves of split-phase calls (sends, waits, receive,
 * the end of the operation) while the caller's thread goes back to Python, one at a time. */
static void *bg_main(void *arg) {
    engine_t *g = arg;
    uint32_t seen = 0;
    for (;;) {
        while (atomic_load(&g->bg_gen) == seen && !atomic_load(&g->stopping))
            futex_wait(&g->bg_gen, seen, NULL);
        if (atomic_load(&g->stopping)) break;
        seen = atomic_load(&g->bg_gen);
        op_t *op = g->bg_op;
        run_op(op, g->bg_phases, g->bg_phases->split, g->bg_phases->num_phases);
        finish_op(op);
        atomic_store(g->bg_done, 1);
        futex_wake(g->bg_done, INT32_MAX);
        atomic_store(&g->bg_idle, 1);
        futex_wake(&g->bg_idle, INT32_MAX);
    }
    return NULL;
}

int bg_start(engine_t *g, op_t *op, const phase_list_t *phases, _Atomic uint32_t *done) {
    if (!g->bg_started) {
        atomic_store(&g->bg_idle, 1);
        if (pthread_create(&g->bg_thread, NULL, bg_main, g) != 0) return -1;
        g->bg_started = 1;
    }
    g->bg_op = op;
    g->bg_phases = phases;
    g->bg_done = done;
    atomic_store(&g->bg_idle, 0);
    atomic_fetch_add(&g->bg_gen, 1);
    futex_wake(&g->bg_gen, INT32_MAX);
    return 0;
}

/* Every wait of the background call has a deadline, so this ends. */
void bg_quiesce(engine_t *g) {
    if (!g->bg_started) return;
    while (!atomic_load(&g->bg_idle)) {
        struct timespec ts = {0, 1000000};
        futex_wait(&g->bg_idle, 0, &ts);
    }
}

void engine_stop(engine_t *g) {
    if (g->bg_started) {
        bg_quiesce(g);
        atomic_store(&g->stopping, 1);
        atomic_fetch_add(&g->bg_gen, 1);
        futex_wake(&g->bg_gen, INT32_MAX);
        pthread_join(g->bg_thread, NULL);
        g->bg_started = 0;
    }
    atomic_store(&g->stopping, 1);
    if (g->nthreads_started) {
        atomic_fetch_add(&g->job_gen, 1);
        futex_wake(&g->job_gen, INT32_MAX);
        for (int c = 1; c <= g->nthreads_started; c++) pthread_join(g->threads[c], NULL);
        g->nthreads_started = 0;
    }
}
