/* Errors, failure notices, liveness and waits (the end of an operation is finish.c's).
 *
 * Every wait spins briefly, then yields, then sleeps on its rank's doorbell, and checks a
 * deadline, the failure notices of the peers and (every 10 ms) that the peer processes are
 * alive. Nothing here knows the sync modes (flags.c waits through this file). */
#include "engine.h" /* first: Python.h precedes the standard headers */

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The first error of an operation wins: its code, core, peer and description (and, for bad
 * input, the argument and value); every core is told to abort. Returns `code`. */
static int claim_error(op_t *op, int code, int core, int peer, const char *arg,
                       const char *value, const char *fmt, va_list ap)
    __attribute__((format(printf, 7, 0)));
static int claim_error(op_t *op, int code, int core, int peer, const char *arg,
                       const char *value, const char *fmt, va_list ap) {
    int expected = 0;
    if (atomic_compare_exchange_strong(&op->err, &expected, code)) {
        op->err_core = core;
        op->err_peer = peer;
        if (arg) {
            snprintf(op->arg, sizeof op->arg, "%s", arg);
            snprintf(op->msg, sizeof op->msg, "%s", value);
        }
        vsnprintf(op->what, sizeof op->what, fmt, ap);
    }
    atomic_store(&op->abort, 1);
    return code;
}

int op_error(op_t *op, int code, int core, int peer, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    claim_error(op, code, core, peer, NULL, NULL, fmt, ap);
    va_end(ap);
    return code;
}

/* bad input: `value` names the offending value, the format the problem */
int bad_input(op_t *op, const char *arg, const char *value, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    claim_error(op, E_BAD_INPUT, 0, op->g->rank, arg, value, fmt, ap);
    va_end(ap);
    return E_BAD_INPUT;
}

static int process_alive(int pid, unsigned long long start) {
    if (kill(pid, 0) != 0 && errno == ESRCH) return 0;
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT ? 0 : 1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 1;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ') return 1;
    p += 2;
    if (*p == 'Z' || *p == 'X') return 0; /* exited, not yet reaped */
    if (!start) return 1;
    /* field 3 is the state; the start time is field 22 */
    for (int field = 3; field < 22 && p; field++) {
        p = strchr(p, ' ');
        if (p) p++;
    }
    if (!p) return 1;
    return strtoull(p, NULL, 10) == start;
}

static int check_liveness(op_t *op, int core, const char *what);

/* Peer q's failure notice for this call, if it published one: returns its code and copies
 * the message; 0 if there is none; -1 for a notice whose checksum does not hold. */
static int read_notice(engine_t *g, int q, uint64_t epoch, char *msg, size_t cap) {
    const fail_rec_t *f = fail_block(g, q, epoch);
    if (ld_acq(&f->epoch) != epoch) return 0;
    uint64_t lencode = ld_rlx(&f->lencode);
    uint32_t len = (uint32_t)lencode, code = (uint32_t)(lencode >> 32);
    uint8_t buf[FAIL_MSG_MAX];
    if (len > FAIL_MSG_MAX || code < E_BAD_INPUT || code > E_LOST) {
        snprintf(msg, cap, "corrupt failure notice of rank %d", q);
        return -1;
    }
    memcpy(buf, f->msg, len);
    if (ld_rlx(&f->sum) != notice_sum(epoch, lencode, buf, len)) {
        snprintf(msg, cap, "corrupt failure notice of rank %d", q);
        return -1;
    }
    size_t n = len < cap - 1 ? len : cap - 1;
    memcpy(msg, buf, n);
    msg[n] = 0;
    return (int)code;
}

int check_failures(op_t *op, int core) {
    engine_t *g = op->g;
    if (op->kind == 2) return 0;
    for (int q = 0; q < g->R; q++) {
        if (q == g->rank) continue;
        char msg[MAX_MSG];
        int code = read_notice(g, q, op->epoch, msg, sizeof msg);
        if (!code) continue;
        if (code < 0) return op_error(op, E_LOST, core, q, "%s in call %llu", msg,
                                      (unsigned long long)op->epoch);
        /* a failure caused by a dead rank is reported as that (PeerLostError everywhere) */
        if (check_liveness(op, core, "a peer that failed this call")) return E_PEER_LOST;
        int expected = 0;
        if (atomic_compare_exchange_strong(&op->err, &expected, E_REMOTE)) {
            op->err_core = core;
            op->err_peer = q;
            op->remote_code = code;
            snprintf(op->msg, sizeof op->msg, "%s", msg);
            snprintf(op->what, sizeof op->what, "failure notice of rank %d", q);
        }
        atomic_store(&op->abort, 1);
        return E_REMOTE;
    }
    return 0;
}

/* Every peer that has not finished this call must be alive (not only the one awaited: a core
 * waiting for rank 1 must still see rank 2 die). A rank that finished the call and exited is
 * not lost for it. `what` (the awaited thing, naming its rank) goes into the message. */
static int check_liveness(op_t *op, int core, const char *what) {
    engine_t *g = op->g;
    for (int q = 0; q < g->R; q++) {
        if (q == g->rank || rd_word(word(g, q, g->off_done)) >= op->epoch) continue;
        if (!process_alive(g->pids[q], g->starts[q]))
            return op_error(op, E_PEER_LOST, core, q, "rank %d (pid %d) died while rank %d core %d "
                            "waited for %s", q, g->pids[q], g->rank, core, what);
    }
    return 0;
}

/* A peer that entered this call for another operation (dispatch here, combine there): the
 * programs are out of step, waiting would only end at the deadline. */
static int check_kinds(op_t *op, int core) {
    engine_t *g = op->g;
    static const char *names[] = {"dispatch", "combine", "wait"};
    if (op->kind == 2) return 0;
    for (int q = 0; q < g->R; q++) {
        if (q == g->rank) continue;
        uint64_t e = rd_word(word(g, q, g->off_entered));
        if (e >> 2 == op->epoch && (int)(e & 3) != op->kind)
            return op_error(op, E_LOST, core, q, "rank %d called %s where rank %d called %s "
                            "(call %llu): every rank must make the same calls in the same order",
                            q, names[(e & 3) % 3], g->rank, names[op->kind],
                            (unsigned long long)op->epoch);
    }
    return 0;
}

/* One step of a wait whose condition was just found false. Returns 0 to check again. The
 * description (printf-style) is only formatted if the wait fails. */
int wait_step(op_t *op, waiter_t *w, int core, int peer, const char *fmt, ...) {
    if (atomic_load_explicit(&op->abort, memory_order_relaxed)) return -1;
    const int patient = atomic_load_explicit(&op->patient, memory_order_relaxed);
    uint32_t it = ++w->iter;
    if (it < (patient ? 2u : 32u)) {
        cpu_relax();
        return 0;
    }
    int rc = check_failures(op, core);
    if (rc) return rc;
    int64_t t = now_ns();
    if (!w->start) {
        w->start = t;
        w->next_live = t + 10000000LL;
    }
    int timed_out = t >= op->deadline, check_live = t >= w->next_live;
    if (timed_out || check_live) {
        char what[MAX_WHAT];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(what, sizeof what, fmt, ap);
        va_end(ap);
        if (timed_out)
            return op_error(op, E_TIMEOUT, core, peer, "rank %d core %d timed out after %.3g s "
                            "waiting for %s (epoch %llu)", op->g->rank, core,
                            (double)op->g->timeout_ns / 1e9, what,
                            (unsigned long long)op->epoch);
        w->next_live = t + 10000000LL;
        rc = check_liveness(op, core, what);
        if (!rc) rc = check_kinds(op, core);
        if (rc) return rc;
    }
    engine_t *g = op->g;
    if (!patient && t - w->start < g->yield_ns) {
        sched_yield();
        return 0;
    }
    if (!w->armed) {
        /* register, then let the caller check its condition once more before sleeping (a
         * publication after this point changes the doorbell and cancels the sleep) */
        atomic_fetch_add_explicit(sleepers(g, g->rank), 1, memory_order_seq_cst);
        atomic_fetch_add(&op->armed, 1);
        w->seq = atomic_load_explicit(doorbell(g, g->rank), memory_order_seq_cst);
        w->armed = 1;
        return 0;
    }
    int64_t left = op->deadline - t, nap = left < 10000000LL ? left : 10000000LL;
    if (nap < 1000) nap = 1000;
    struct timespec ts = {0, (long)nap}; /* wakes for deadline and liveness checks too */
    futex_wait_shared(doorbell(g, g->rank), w->seq, &ts);
    w->seq = atomic_load_explicit(doorbell(g, g->rank), memory_order_seq_cst);
    return 0;
}

int peers_done_geq(engine_t *g, uint64_t epoch) {
    for (int q = 0; q < g->R; q++)
        if (q != g->rank && rd_word(word(g, q, g->off_done)) < epoch) return 0;
    return 1;
}

int wait_peers_done(op_t *op, uint64_t epoch, int core) {
    engine_t *g = op->g;
    if (epoch == 0) return 0;
    for (int q = 0; q < g->R; q++) {
        if (q == g->rank) continue;
        waiter_t w;
        waiter_init(&w);
        while (rd_word(word(g, q, g->off_done)) < epoch) {
            int rc = wait_step(op, &w, core, q, "a peer to finish the call before the last");
            if (rc) return rc;
        }
    }
    return 0;
}

/* "call `epoch` failed here, for reason `code`" (E_BAD_INPUT: rejected before anything of
 * the call reached a peer, so the ranks stay in step; any other code: they may not be) */
void publish_failure(engine_t *g, uint64_t epoch, int code, const char *msg) {
    fail_rec_t *f = fail_block(g, g->rank, epoch);
    size_t len = strlen(msg);
    if (len > FAIL_MSG_MAX) len = FAIL_MSG_MAX;
    uint64_t lencode = (uint64_t)len | (uint64_t)(uint32_t)code << 32;
    memcpy(f->msg, msg, len);
    st_rlx(&f->lencode, lencode);
    st_rlx(&f->sum, notice_sum(epoch, lencode, f->msg, (uint32_t)len));
    st_rel(&f->epoch, epoch);
    ring_all(g);
}

/* a message cut at the end of its buffer (a notice has room for FAIL_MSG_MAX bytes anyway) */
__attribute__((format(printf, 3, 4))) static void say(char *buf, size_t n, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, n, fmt, ap);
    va_end(ap);
}

void format_error(op_t *op, char *buf, size_t n) {
    switch (atomic_load(&op->err)) {
    case E_BAD_INPUT:
        say(buf, n, "rank %d: bad input: %s=%s: %s", op->g->rank, op->arg, op->msg, op->what);
        break;
    case E_REMOTE:
        say(buf, n, "rank %d saw rank %d fail: %s", op->g->rank, op->err_peer, op->msg);
        break;
    default: say(buf, n, "%s", op->what); break;
    }
}
