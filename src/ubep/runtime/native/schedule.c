/* The send scheduler in the native core (schedule.h): ubep.sched's three policies over one rank's
 * routing, as a counting sort by key and a cut of the sorted sequence into per-core slices.
 *
 * Units (ubep/sched/units.py): a valid (token, k) in the expert layout; a (token, destination)
 * in the rank layout, named by the token's lowest-k expert there. Slots count, in token order,
 * per expert (expert layout) or per destination (rank layout): the receiver's row order.
 * Keys: the unit's expert for the baselines ((expert, token) order), hop x E + remapped position
 * for the hierarchical policy (its hop-major remapped sequence). A stable counting sort over a
 * token-order unit list keeps tokens ascending inside a key, as ubep.sched's stable argsorts do.
 * Cuts: expert_contiguous gives core j the experts [j*E/n, (j+1)*E/n); balanced, equal slices
 * (the first U mod n one longer); hierarchical, per hop class h the chunk of v[j,h] units after
 * those of cores < j, a core's chunks issued by its hop classes' issue rank (farthest first). */
#include "schedule.h"

#include <stdlib.h>
#include <string.h>

void sched_work_init(sched_work_t *w, int64_t cap, int H, int E, int R, int n) {
    memset(w, 0, sizeof *w);
    size_t c = (size_t)(cap > 0 ? cap : 1), keys = (size_t)H * (size_t)E + 1;
    size_t runs = (size_t)(E > R ? E : R) + (size_t)R;
    w->cap = cap; w->H = H; w->E = E; w->R = R; w->n = n;
    w->token = malloc(c * 6 * sizeof(int64_t));
    w->u_t = malloc(c * 7 * sizeof(int32_t));
    w->core_ptr = malloc(((size_t)n + 1) * sizeof(int64_t));
    w->key_start = malloc(keys * sizeof(int64_t));
    w->run = malloc(runs * sizeof(int64_t));
    w->quota = malloc((size_t)n * (size_t)H * 2 * sizeof(int64_t));
    if (!sched_work_ok(w)) return;
    w->k = w->token + c; w->expert = w->k + c; w->dst = w->expert + c;
    w->hop = w->dst + c; w->slot = w->hop + c;
    w->u_k = w->u_t + c; w->u_e = w->u_k + c; w->u_d = w->u_e + c; w->u_slot = w->u_d + c;
    w->u_key = w->u_slot + c; w->seq = w->u_key + c;
    w->start = w->quota + (size_t)n * (size_t)H;
}

int sched_work_ok(const sched_work_t *w) {
    return w->token && w->u_t && w->core_ptr && w->key_start && w->run && w->quota;
}

void sched_work_free(sched_work_t *w) {
    free(w->token); free(w->u_t); free(w->core_ptr); free(w->key_start); free(w->run);
    free(w->quota);
    memset(w, 0, sizeof *w);
}

const char *sched_spec_check(const sched_spec_t *s) {
    if (s->policy < SCHED_EXPERT_CONTIGUOUS || s->policy > SCHED_HIERARCHICAL)
        return "policy code out of range";
    if (s->n < 1 || s->H < 1 || s->H > 64 || s->L < 1 || s->E != s->R * s->L)
        return "sizes out of range";
    for (int d = 0; d < s->R; d++)
        if (s->hop[d] < 0 || s->hop[d] >= s->H) return "hop class out of range";
    for (int e = 0; e < s->E; e++)
        if (s->rpos[e] < 0 || s->rpos[e] >= s->E) return "remapped position out of range";
    uint64_t seen = 0; /* H <= 64 */
    for (int h = 0; h < s->H; h++) {
        if (s->issue[h] < 0 || s->issue[h] >= s->H || (seen >> s->issue[h] & 1))
            return "issue ranks are not a permutation of the hop classes";
        seen |= 1ULL << s->issue[h];
    }
    return NULL;
}

/* the units in token order, their slots and keys; key_start[key + 1] counts each key. Locals
 * with restrict: the build compiles with -fno-strict-aliasing, so every store through w's
 * arrays would otherwise reload w's fields. */
static int64_t token_order_units(const sched_spec_t *s, const int32_t *restrict route, int64_t T,
                                 sched_work_t *w) {
    const int K = s->K, L = s->L, E = s->E, hier = s->policy == SCHED_HIERARCHICAL;
    const int expert = s->expert_layout, runs = s->E > s->R ? s->E : s->R;
    const int64_t *restrict hop = s->hop, *restrict rpos = s->rpos;
    int32_t *restrict ut = w->u_t, *restrict uk = w->u_k, *restrict ue = w->u_e;
    int32_t *restrict ud = w->u_d, *restrict us = w->u_slot, *restrict ukey = w->u_key;
    int64_t *restrict run = w->run, *restrict seen = w->run + runs;
    int64_t *restrict count = w->key_start + 1, nu = 0;
    memset(run, 0, sizeof(int64_t) * (size_t)runs);
    for (int d = 0; d < s->R; d++) seen[d] = -1;
    memset(w->key_start, 0, sizeof(int64_t) * ((size_t)s->H * (size_t)E + 1));
    for (int64_t t = 0; t < T; t++) {
        const int32_t *row = route + t * K;
        for (int k = 0; k < K; k++) {
            int32_t e = row[k];
            if (e < 0) continue;
            int d = e / L;
            if (!expert) {
                if (seen[d] == t) continue; /* the token crosses to d once, named by this k */
                seen[d] = t;
            }
            /* the key (module comment): the expert, or hop-major remapped position */
            int32_t key = hier ? (int32_t)(hop[d] * E + rpos[e]) : e;
            ut[nu] = (int32_t)t; uk[nu] = k; ue[nu] = e; ud[nu] = d;
            us[nu] = (int32_t)run[expert ? e : d]++;
            ukey[nu] = key;
            count[key]++;
            nu++;
        }
    }
    return nu;
}

/* per-core hop quotas v[j,h] and chunk starts (ubep.sched.hierarchical.hop_quotas) */
static void hop_chunks(const sched_spec_t *s, sched_work_t *w) {
    const int H = s->H, n = s->n;
    int64_t first = 0; /* number of the first leftover of class h */
    for (int h = 0; h < H; h++) {
        int64_t lo = w->key_start[(int64_t)h * s->E], hi = w->key_start[(int64_t)(h + 1) * s->E];
        int64_t v = hi - lo, q = v / n, r = v % n, at = lo;
        for (int j = 0; j < n; j++) {
            /* leftover p goes to core p mod n: core j gets one of [first, first + r) if any */
            int64_t off = ((j - first) % n + n) % n;
            int64_t quota = q + (off < r);
            w->quota[j * H + h] = quota;
            w->start[j * H + h] = at;
            at += quota;
        }
        first += r;
    }
}

/* the baselines' core bounds over the (expert, token) sequence */
static void baseline_cuts(const sched_spec_t *s, sched_work_t *w, int64_t nu) {
    const int n = s->n;
    for (int j = 0; j <= n; j++) {
        if (s->policy == SCHED_BALANCED) {
            int64_t q = nu / n, r = nu % n;
            w->core_ptr[j] = j * q + (j < r ? j : r);
        } else { /* units whose expert lies below core j's first expert */
            w->core_ptr[j] = j == n ? nu : w->key_start[((int64_t)j * s->E) / n];
        }
    }
}

/* the units of sequence positions [p0, p1), in order, to the Plan's arrays from position o */
static int64_t emit(const sched_spec_t *s, sched_work_t *w, int64_t o, int64_t p0, int64_t p1) {
    const int32_t *restrict seq = w->seq, *restrict ut = w->u_t, *restrict uk = w->u_k;
    const int32_t *restrict ue = w->u_e, *restrict ud = w->u_d, *restrict us = w->u_slot;
    const int64_t *restrict hop = s->hop;
    int64_t *restrict token = w->token, *restrict k = w->k, *restrict expert = w->expert;
    int64_t *restrict dst = w->dst, *restrict h = w->hop, *restrict slot = w->slot;
    for (int64_t p = p0; p < p1; p++, o++) {
        int32_t u = seq[p];
        token[o] = ut[u]; k[o] = uk[u]; expert[o] = ue[u];
        dst[o] = ud[u]; h[o] = hop[ud[u]]; slot[o] = us[u];
    }
    return o;
}

/* stable placement of the units by key; key_start becomes each key's end */
static void place(sched_work_t *w, int64_t nu) {
    const int32_t *restrict ukey = w->u_key;
    int32_t *restrict seq = w->seq;
    int64_t *restrict at = w->key_start;
    for (int64_t u = 0; u < nu; u++) seq[at[ukey[u]]++] = (int32_t)u;
}

int64_t sched_build(const sched_spec_t *s, const int32_t *route, int64_t T, sched_work_t *w) {
    const int64_t nkeys = (int64_t)s->H * s->E;
    int64_t nu = token_order_units(s, route, T, w);
    for (int64_t i = 0; i < nkeys; i++) w->key_start[i + 1] += w->key_start[i];
    if (s->policy == SCHED_HIERARCHICAL) hop_chunks(s, w);
    else baseline_cuts(s, w, nu);
    place(w, nu);
    if (s->policy != SCHED_HIERARCHICAL) {
        emit(s, w, 0, 0, nu);
        return nu;
    }
    int order[64]; /* hop classes by issue rank */
    for (int h = 0; h < s->H; h++) order[s->issue[h]] = h;
    int64_t o = 0;
    for (int j = 0; j < s->n; j++) {
        w->core_ptr[j] = o;
        for (int i = 0; i < s->H; i++) {
            int64_t c = (int64_t)j * s->H + order[i];
            o = emit(s, w, o, w->start[c], w->start[c] + w->quota[c]);
        }
    }
    w->core_ptr[s->n] = o;
    return nu;
}
