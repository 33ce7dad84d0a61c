/* Fused CPU kernels of the server rules: one pass over the stacked [K, P] float32 reports.
 *
 * Each kernel walks the columns in chunks of 16 and, inside a chunk, the K client rows, keeping
 * every per-column sum in vector registers: the reports are read from memory once and no
 * [K, P] or [P] temporary is written. Columns are independent and each column's sums run over
 * k = 0 .. K-1 in order, with separate multiply and add (built with -ffp-contract=off, no
 * -ffast-math), so results are bit-for-bit the same on any x86-64 or ARM machine whatever
 * vector width the compiler picks. Every kernel forms the p-weighted mean of the params as
 * ``acc = 0; acc = acc + p_k * w_kj`` so that rules whose neutral setting is FedAvg return
 * fd_mix's bits exactly.
 *
 * Layout: row k of a [K, P] stack starts at base + k * ld (ld >= P, in floats). The last
 * chunk of a range (fewer than 16 columns) is copied into a zero-padded [K, 16] scratch and
 * runs through the same vector code; only its valid lanes are written back.
 * Legend: K clients, P columns, R runs of columns sharing one weight vector.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));

static inline vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf splat(float x) { return (vf){0} + x; }
static inline vf keep(vf x, vi mask) { return (vf)((vi)x & mask); }         /* x where mask */
static inline vf pick(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }
static inline vf to_float(vi x) { return __builtin_convertvector(x, vf); }
static const vi LANE = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* Prefetching. With K rows read one 64-byte line at a time the hardware prefetcher, which
 * follows a few dozen streams, gives up at large K and every row waits on memory (K = 100:
 * under half the speed of K = 32). So while a block of BLOCK_CHUNKS chunks is summed, each
 * row visit prefetches one line of the next block, row after row (DRAM-page order, into L2):
 * K * BLOCK_CHUNKS visits cover the next block exactly. Prefetching past the end of an array
 * is harmless (a prefetch never faults). */
#define BLOCK_CHUNKS 16
typedef struct { const float *base; int64_t ld, K, next, row, chunk; } ahead_t;

static inline void ahead_start(ahead_t *a, const float *base, int64_t ld, int64_t K, int64_t next) {
    *a = (ahead_t){base, ld, K, next, 0, 0};
}

static inline void ahead_step(ahead_t *a) {
    __builtin_prefetch(a->base + a->row * a->ld + a->next + a->chunk * LANES, 0, 2);
    if (++a->chunk == BLOCK_CHUNKS) { a->chunk = 0; if (++a->row == a->K) a->row = 0; }
}

/* A chunk of 16 columns: either in place or in the padded scratch (the tail of a range). */
typedef struct {
    const float *rows;  /* row 0 of the chunk; row k at rows + k * ld */
    int64_t ld;
} chunk_t;

static chunk_t chunk_at(const float *base, int64_t ld, int64_t K, int64_t col, int64_t width,
                        float *pad) {
    if (width == LANES) return (chunk_t){base + col, ld};
    memset(pad, 0, sizeof(float) * LANES * K);
    for (int64_t k = 0; k < K; k++) memcpy(pad + k * LANES, base + k * ld + col, sizeof(float) * width);
    return (chunk_t){pad, LANES};
}

static vf load_vec(const float *v, int64_t col, int64_t width) {
    if (width == LANES) return load(v + col);
    float tmp[LANES] = {0};
    memcpy(tmp, v + col, sizeof(float) * width);
    return load(tmp);
}

static void store_vec(float *out, int64_t col, int64_t width, vf v) {
    if (width == LANES) { store(out + col, v); return; }
    float tmp[LANES];
    store(tmp, v);
    memcpy(out + col, tmp, sizeof(float) * width);
}

static double sum_lanes(vf v) {
    double s = 0.0;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}

/* The block of chunks that follows the one holding `col` (first of the range: `start`). */
static inline int64_t next_block(int64_t start, int64_t col) {
    return start + ((col - start) / (LANES * BLOCK_CHUNKS) + 1) * LANES * BLOCK_CHUNKS;
}
#define NEW_BLOCK(start, col) (((col) - (start)) % (LANES * BLOCK_CHUNKS) == 0)

static inline vf weighted_sum(chunk_t c, int64_t K, const float *p, ahead_t *a) {
    vf acc = {0};
    for (int64_t k = 0; k < K; k++) {
        ahead_step(a);
        acc = acc + splat(p[k]) * load(c.rows + k * c.ld);
    }
    return acc;
}

/* out_j = sum_k weights[r, k] w_kj for the columns [bounds[r], bounds[r + 1]) of each run r.
 * FedAvg is one run; FedER one run per stretch of columns following the same conv layer. */
int fd_mix(const float *W, int64_t K, int64_t ld, const float *weights_RK, const int64_t *bounds,
           int64_t R, float *out) {
    float *pad = malloc(sizeof(float) * LANES * K);
    if (!pad) return 1;
    ahead_t a = {0};
    for (int64_t r = 0; r < R; r++) {
        const float *p = weights_RK + r * K;
        int64_t start = bounds[r], stop = bounds[r + 1];
        for (int64_t col = start; col < stop; col += LANES) {
            int64_t width = stop - col < LANES ? stop - col : LANES;
            if (NEW_BLOCK(start, col)) ahead_start(&a, W, ld, K, next_block(start, col));
            chunk_t c = chunk_at(W, ld, K, col, width, pad);
            store_vec(out, col, width, weighted_sum(c, K, p, &a));
        }
    }
    free(pad);
    return 0;
}

/* FedMom in the form w_new = mean + m (w - w_prev), where w - w_prev is the velocity of the
 * last round; sq_norm = sum_j (w_new_j - w_j)^2, the squared norm of the new velocity. */
int fd_fedmom(const float *W, int64_t K, int64_t ld, int64_t P, const float *p, const float *g,
              const float *g_prev, float momentum, float *out, double *sq_norm) {
    float *pad = malloc(sizeof(float) * LANES * K);
    if (!pad) return 1;
    double total = 0.0;
    vf m = splat(momentum);
    ahead_t a = {0};
    for (int64_t col = 0; col < P; col += LANES) {
        int64_t width = P - col < LANES ? P - col : LANES;
        if (NEW_BLOCK(0, col)) ahead_start(&a, W, ld, K, next_block(0, col));
        vf gv = load_vec(g, col, width);
        vf mean = weighted_sum(chunk_at(W, ld, K, col, width, pad), K, p, &a);
        vf w_new = mean + m * (gv - load_vec(g_prev, col, width));
        vf v = w_new - gv;                       /* padded lanes: 0 - 0 */
        total += sum_lanes(v * v);
        store_vec(out, col, width, w_new);
    }
    free(pad);
    *sq_norm = total;
    return 0;
}

/* CGW's last step: out_j = sum_k p_k w_kj - sum_k x_k d_kj, W and D read in one pass. With
 * x = 0 the correction sums to +0 and out is the mean's bits. */
int fd_cgw(const float *W, const float *D, int64_t K, int64_t ldw, int64_t ldd, int64_t P,
           const float *p, const float *x, float *out) {
    float *pad = malloc(sizeof(float) * 2 * LANES * K);
    if (!pad) return 1;
    ahead_t aw = {0}, ad = {0};
    for (int64_t col = 0; col < P; col += LANES) {
        int64_t width = P - col < LANES ? P - col : LANES;
        if (NEW_BLOCK(0, col)) {
            ahead_start(&aw, W, ldw, K, next_block(0, col));
            ahead_start(&ad, D, ldd, K, next_block(0, col));
        }
        vf mean = weighted_sum(chunk_at(W, ldw, K, col, width, pad), K, p, &aw);
        vf correction = weighted_sum(chunk_at(D, ldd, K, col, width, pad + LANES * K), K, x, &ad);
        store_vec(out, col, width, mean - correction);
    }
    free(pad);
    return 0;
}

/* FedGMA: out = mean - eta * mask * sum_k p_k g_k, mask from |sum_k sign(g_kj)| >= need (soft:
 * agreement / K below the threshold). G == NULL: g_k = w - w_k (the update delta).
 * mask_sum = sum_j mask_j. */
int fd_fedgma(const float *W, const float *G, int64_t K, int64_t ldw, int64_t ldg, int64_t P,
              const float *p, const float *g, int32_t need, int32_t soft, float eta, float *out,
              double *mask_sum) {
    float *pad = malloc(sizeof(float) * 2 * LANES * K);
    if (!pad) return 1;
    double total = 0.0;
    vf one = splat(1.0f);
    ahead_t aw = {0}, ag = {0};
    for (int64_t col = 0; col < P; col += LANES) {
        int64_t width = P - col < LANES ? P - col : LANES;
        if (NEW_BLOCK(0, col)) {
            ahead_start(&aw, W, ldw, K, next_block(0, col));
            ahead_start(&ag, G ? G : W, ldg, K, next_block(0, col));
        }
        chunk_t cw = chunk_at(W, ldw, K, col, width, pad);
        chunk_t cg = G ? chunk_at(G, ldg, K, col, width, pad + LANES * K) : cw;
        vf gv = load_vec(g, col, width);
        vf mean = {0}, grad = {0};
        vi signs = {0};
        for (int64_t k = 0; k < K; k++) {
            vf pk = splat(p[k]);
            ahead_step(&aw);
            vf w = load(cw.rows + k * cw.ld);
            vf gk = gv - w;
            if (G) {
                ahead_step(&ag);
                gk = load(cg.rows + k * cg.ld);
            }
            mean = mean + pk * w;
            grad = grad + pk * gk;
            signs = signs - (vi)(gk > 0) + (vi)(gk < 0);   /* comparisons give -1 / 0 */
        }
        vi flip = signs >> 31;                          /* |s| = (s ^ flip) - flip */
        vi agree = (signs ^ flip) - flip;
        vi pass = agree >= need;
        vf mask = keep(one, pass);
        if (soft) mask = pick(pass, one, to_float(agree) / (float)K);
        vf result = mean - splat(eta) * (grad * mask);
        if (width < LANES) mask = keep(mask, LANE < (int32_t)width);  /* padded lanes */
        total += sum_lanes(mask);
        store_vec(out, col, width, result);
    }
    free(pad);
    *mask_sum = total;
    return 0;
}

static void flush_counts(vi *lanes_pos, vi *lanes_neg, int64_t *pos, int64_t *neg, int64_t *chunks) {
    for (int i = 0; i < LANES; i++) { *pos += (*lanes_pos)[i]; *neg += (*lanes_neg)[i]; }
    *lanes_pos = (vi){0};
    *lanes_neg = (vi){0};
    *chunks = 0;
}

/* FedCong: per column, the p-weighted mean of the clients whose update agrees in sign
 * (w_kj > w_j or w_kj < w_j) when at least `need` of them do, else of all clients. When both
 * groups qualify (alpha <= 1/2) the larger count wins, ties to the positive group.
 * took[0], took[1]: columns that took the positive and the negative group. */
int fd_fedcong(const float *W, int64_t K, int64_t ld, int64_t P, const float *p, const float *g,
               int32_t need, float *out, int64_t *took) {
    float *pad = malloc(sizeof(float) * LANES * K);
    if (!pad) return 1;
    int64_t took_pos = 0, took_neg = 0, chunks = 0;
    vi lanes_pos = {0}, lanes_neg = {0};     /* per-lane counts, added up every 2^24 chunks */
    float p_total = 0.0f;                       /* the weight of "all clients", in client order */
    for (int64_t k = 0; k < K; k++) p_total += p[k];
    vf all_weight = splat(p_total);
    ahead_t a = {0};
    for (int64_t col = 0; col < P; col += LANES) {
        int64_t width = P - col < LANES ? P - col : LANES;
        if (NEW_BLOCK(0, col)) ahead_start(&a, W, ld, K, next_block(0, col));
        chunk_t c = chunk_at(W, ld, K, col, width, pad);
        vf gv = load_vec(g, col, width);
        vi num_pos = {0}, num_neg = {0};
        vf p_pos = {0}, p_neg = {0}, w_pos = {0}, w_neg = {0}, w_all = {0};
        for (int64_t k = 0; k < K; k++) {
            vf pk = splat(p[k]);
            ahead_step(&a);
            vf w = load(c.rows + k * c.ld);
            vf pw = pk * w;
            vi above = (vi)(w > gv), below = (vi)(w < gv);
            num_pos -= above;
            num_neg -= below;
            p_pos += keep(pk, above);
            p_neg += keep(pk, below);
            w_pos += keep(pw, above);
            w_neg += keep(pw, below);
            w_all += pw;
        }
        vi take_pos = num_pos >= need, take_neg = num_neg >= need;
        /* both may qualify: the larger count wins, ties positive (an empty group never: need >= 1) */
        take_neg = take_neg & ~(take_pos & (num_pos >= num_neg));
        take_pos = take_pos & ~take_neg;
        vf num = pick(take_pos, w_pos, pick(take_neg, w_neg, w_all));
        vf den = pick(take_pos, p_pos, pick(take_neg, p_neg, all_weight));
        store_vec(out, col, width, num / den);
        if (width < LANES) {                 /* padded lanes took nothing */
            take_pos &= LANE < (int32_t)width;
            take_neg &= LANE < (int32_t)width;
        }
        lanes_pos -= take_pos;               /* comparisons give -1 / 0 */
        lanes_neg -= take_neg;
        if (++chunks == (1 << 24)) flush_counts(&lanes_pos, &lanes_neg, &took_pos, &took_neg, &chunks);
    }
    flush_counts(&lanes_pos, &lanes_neg, &took_pos, &took_neg, &chunks);
    took[0] = took_pos;
    took[1] = took_neg;
    free(pad);
    return 0;
}
