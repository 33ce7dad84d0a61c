/* Fused CPU kernels of the server rules: one pass over the stacked [K, P] float32 reports.
 *
 * Two shapes of loop, each the faster one for its kernels (bench/aggregate.py, BENCHMARKS.md):
 * - Row streaming (fd_mix, fd_fedmom, fd_cgw, fd_cgw_stats: sums only). A block of columns is
 *   summed into an accumulator that stays in cache, four client rows per pass, so
 *   every row is read as one long contiguous stretch (the hardware prefetcher follows it) and
 *   the accumulator is loaded and stored once per four rows. Plain C loops that the compiler
 *   vectorises for whatever the CPU has (SSE2, AVX2, AVX-512, NEON).
 * - Register chunks (fd_fedgma, fd_fedcong: sign counts, masks, several sums per column). The
 *   columns are walked in chunks of LANES (one vector register: 16 on AVX-512, 8 on AVX/AVX2,
 *   4 otherwise) and, inside a chunk, the K rows, with every per-column count and sum in
 *   registers. A vector wider than the machine's registers is split by the compiler and its
 *   accumulators spill to the stack on every row (16 lanes on AVX2 ran 3-10x slower), hence
 *   the lane count per instruction set.
 * Columns are independent and each column's sums run over k = 0 .. K-1 in order, with
 * separate multiply and add (built with -ffp-contract=off, no -ffast-math), so results are
 * bit-for-bit the same on any x86-64 or ARM machine whatever the vector width or loop shape.
 * Every kernel forms the p-weighted mean of the params as ``acc = 0; acc = acc + p_k * w_kj``
 * so that rules whose neutral setting is FedAvg return fd_mix's bits exactly. Sums over
 * columns (FedMom's norm, FedGMA's mask density) go into 16 double partial sums by column
 * mod 16, added in order at the end: the same bits for every lane count.
 *
 * Layout: row k of a [K, P] stack starts at base + k * ld (ld >= P, in floats). The last
 * chunk of a range (fewer than LANES columns) is copied into a zero-padded [K, LANES] scratch
 * and runs through the same vector code; only its valid lanes are written back.
 * Legend: K clients, P columns, R runs of columns sharing one weight vector.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A sum over columns in double whose bits do not depend on LANES or the loop shape: column j
 * adds into partial sum j mod 16, and the 16 partial sums are added in order at the end. */
#define PARTS 16
typedef struct { double part[PARTS]; } colsum_t;

static void colsum_add_row(colsum_t *s, const float *v, int64_t width) {  /* from col % 16 == 0 */
    double part[PARTS];
    memcpy(part, s->part, sizeof part);
    int64_t j0 = 0;
    for (; j0 + PARTS <= width; j0 += PARTS)
        for (int i = 0; i < PARTS; i++) part[i] += v[j0 + i];
    for (int i = 0; j0 + i < width; i++) part[i] += v[j0 + i];
    memcpy(s->part, part, sizeof part);
}

static double colsum_total(const colsum_t *s) {
    double total = 0.0;
    for (int j = 0; j < PARTS; j++) total += s->part[j];
    return total;
}

/* -- row streaming ------------------------------------------------------------------------ */

/* Columns per block: 8192 floats = 32 KiB of accumulator (L1 or L2). Longer stretches of each
 * row stream better than short ones (2048 columns ran measurably slower at K = 8-16 on the
 * AVX2 machine); a multiple of PARTS. */
#define BLOCK_COLS 8192

/* acc[j] = sum_k p_k rows[k * ld + j] for j < width, k in order: four rows per pass over acc. */
static void weighted_rows(const float *rows, int64_t K, int64_t ld, const float *p, int64_t width,
                          float *restrict acc) {
    for (int64_t j = 0; j < width; j++) acc[j] = 0.0f;
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
        const float *restrict r0 = rows + k * ld, *restrict r1 = r0 + ld;
        const float *restrict r2 = r1 + ld, *restrict r3 = r2 + ld;
        float p0 = p[k], p1 = p[k + 1], p2 = p[k + 2], p3 = p[k + 3];
        for (int64_t j = 0; j < width; j++)
            acc[j] = (((acc[j] + p0 * r0[j]) + p1 * r1[j]) + p2 * r2[j]) + p3 * r3[j];
    }
    for (; k < K; k++) {
        const float *restrict r = rows + k * ld;
        float pk = p[k];
        for (int64_t j = 0; j < width; j++) acc[j] = acc[j] + pk * r[j];
    }
}

/* out_j = sum_k weights[r, k] w_kj for the columns [bounds[r], bounds[r + 1]) of each run r.
 * FedAvg is one run; FedER one run per stretch of columns following the same conv layer. */
int fd_mix(const float *W, int64_t K, int64_t ld, const float *weights_RK, const int64_t *bounds,
           int64_t R, float *out) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t col = bounds[r]; col < bounds[r + 1]; col += BLOCK_COLS) {
            int64_t width = bounds[r + 1] - col < BLOCK_COLS ? bounds[r + 1] - col : BLOCK_COLS;
            weighted_rows(W + col, K, ld, weights_RK + r * K, width, out + col);
        }
    return 0;
}

/* FedMom in the form w_new = mean + m (w - w_prev), where w - w_prev is the step of the last
 * round; with a server learning rate lr != 1, w + lr (mean - w) in place of the mean (lr = 1
 * keeps the mean's bits). sq_norm = sum_j (w_new_j - w_j)^2, the squared norm of the new step. */
int fd_fedmom(const float *W, int64_t K, int64_t ld, int64_t P, const float *p, const float *g,
              const float *g_prev, float momentum, float lr, float *out, double *sq_norm) {
    colsum_t total = {{0}};
    float sq[BLOCK_COLS];
    for (int64_t col = 0; col < P; col += BLOCK_COLS) {
        int64_t width = P - col < BLOCK_COLS ? P - col : BLOCK_COLS;
        float *restrict w_new = out + col;
        const float *restrict gv = g + col, *restrict gp = g_prev + col;
        weighted_rows(W + col, K, ld, p, width, w_new);
        if (lr != 1.0f)
            for (int64_t j = 0; j < width; j++) w_new[j] = gv[j] + lr * (w_new[j] - gv[j]);
        for (int64_t j = 0; j < width; j++) {
            w_new[j] = w_new[j] + momentum * (gv[j] - gp[j]);
            float v = w_new[j] - gv[j];
            sq[j] = v * v;
        }
        colsum_add_row(&total, sq, width);
    }
    *sq_norm = colsum_total(&total);
    return 0;
}

/* CGW's last step: out_j = sum_k p_k w_kj - sum_k x_k d_kj. With x = 0 the correction sums to
 * +0 and out is the mean's bits. */
int fd_cgw(const float *W, const float *D, int64_t K, int64_t ldw, int64_t ldd, int64_t P,
           const float *p, const float *x, float *out) {
    float correction[BLOCK_COLS];
    for (int64_t col = 0; col < P; col += BLOCK_COLS) {
        int64_t width = P - col < BLOCK_COLS ? P - col : BLOCK_COLS;
        float *restrict mean = out + col;
        weighted_rows(W + col, K, ldw, p, width, mean);
        weighted_rows(D + col, K, ldd, x, width, correction);
        for (int64_t j = 0; j < width; j++) mean[j] = mean[j] - correction[j];
    }
    return 0;
}

/* -- register chunks ---------------------------------------------------------------------- */

#ifndef LANES
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
#endif
typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));

static inline vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf splat(float x) { return (vf){0} + x; }
static inline vf keep(vf x, vi mask) { return (vf)((vi)x & mask); }         /* x where mask */
static inline vf pick(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }
static inline vf to_float(vi x) { return __builtin_convertvector(x, vf); }
static inline vi lane_index(void) { vi v; for (int i = 0; i < LANES; i++) v[i] = i; return v; }
#define LANE lane_index()

/* Prefetching. With K rows read one 64-byte line at a time the hardware prefetcher, which
 * follows a few dozen streams, gives up at large K and every row waits on memory (K = 100:
 * under half the speed of K = 32). So while a block of BLOCK_CHUNKS chunks (256 columns) is
 * summed, each row visit prefetches LANES floats of the next block, row after row (DRAM-page
 * order, into L2): K * BLOCK_CHUNKS visits cover the next block exactly. Prefetching past the
 * end of an array is harmless (a prefetch never faults). */
#define BLOCK_CHUNKS (256 / LANES)
typedef struct { const float *base; int64_t ld, K, next, row, chunk; } ahead_t;

static inline void ahead_start(ahead_t *a, const float *base, int64_t ld, int64_t K, int64_t next) {
    *a = (ahead_t){base, ld, K, next, 0, 0};
}

static inline void ahead_step(ahead_t *a) {
    __builtin_prefetch(a->base + a->row * a->ld + a->next + a->chunk * LANES, 0, 2);
    if (++a->chunk == BLOCK_CHUNKS) { a->chunk = 0; if (++a->row == a->K) a->row = 0; }
}

/* A chunk of LANES columns: either in place or in the padded scratch (the tail of a range). */
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

static inline void colsum_add(colsum_t *s, int64_t col, vf v) {   /* col % LANES == 0 */
    double *dst = s->part + col % PARTS;
    for (int i = 0; i < LANES; i++) dst[i] += v[i];
}

/* The lane count of this build, for the benchmark's log. */
int fd_lanes(void) { return LANES; }

/* The block of chunks that follows the one holding `col` (first of the range: `start`). */
static inline int64_t next_block(int64_t start, int64_t col) {
    return start + ((col - start) / (LANES * BLOCK_CHUNKS) + 1) * LANES * BLOCK_CHUNKS;
}
#define NEW_BLOCK(start, col) (((col) - (start)) % (LANES * BLOCK_CHUNKS) == 0)

/* CGW's statistics, in double: sq_norm[k] = ||D_k||^2 and m[k] = D_k . D, where D = sum_k D_k
 * is eq. 29's summed gradient. D is summed first, in double: near a stationary point the
 * clients' gradients nearly cancel (||D|| << ||D_k||) and any float32 route to m (a float32
 * Gram matrix, or a float32 D) loses its digits; products in double neither underflow for a
 * tiny but nonzero D_k nor overflow. Both sums over j run in 16 partial sums by j mod 16 (held
 * as vectors of LANES / 2 doubles), so the bits do not depend on the vector width. A block of
 * the K rows is read from memory by the first pass and from cache by the second. */
typedef double vd __attribute__((vector_size(4 * LANES)));          /* LANES / 2 doubles */
typedef float vh __attribute__((vector_size(2 * LANES)));           /* LANES / 2 floats */
#define HALF (LANES / 2)
#define NQ (PARTS / HALF)                                           /* vectors per 16 columns */

static inline vd load_wide(const float *p) {                       /* LANES / 2 floats, widened */
    vh h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, vd);
}
static inline vd load_d(const double *p) { vd v; memcpy(&v, p, sizeof v); return v; }
static inline void store_d(double *p, vd v) { memcpy(p, &v, sizeof v); }

#define STATS_COLS 2048       /* the K rows of a block (K * 8 KiB) stay in L2 for the 2nd pass */

int fd_cgw_stats(const float *D, int64_t K, int64_t ld, int64_t P, double *sq_norm, double *m) {
    colsum_t *sq = calloc(K, sizeof *sq), *dot = calloc(K, sizeof *dot);
    double *total = malloc(sizeof(double) * STATS_COLS);
    if (!sq || !dot || !total) { free(sq); free(dot); free(total); return 1; }
    for (int64_t col = 0; col < P; col += STATS_COLS) {
        int64_t width = P - col < STATS_COLS ? P - col : STATS_COLS;
        int64_t full = width - width % PARTS;                       /* columns in whole vectors */
        const float *block = D + col;
        for (int64_t j = 0; j < width; j++) total[j] = 0.0;
        int64_t k = 0;
        for (; k + 4 <= K; k += 4) {                   /* the total touched once per 4 rows */
            const float *r0 = block + k * ld, *r1 = r0 + ld, *r2 = r1 + ld, *r3 = r2 + ld;
            for (int64_t j = 0; j < full; j += HALF)
                store_d(total + j, (((load_d(total + j) + load_wide(r0 + j)) + load_wide(r1 + j))
                                   + load_wide(r2 + j)) + load_wide(r3 + j));
            for (int64_t j = full; j < width; j++)
                total[j] = (((total[j] + r0[j]) + r1[j]) + r2[j]) + r3[j];
        }
        for (; k < K; k++) {
            const float *r = block + k * ld;
            for (int64_t j = 0; j < full; j += HALF)
                store_d(total + j, load_d(total + j) + load_wide(r + j));
            for (int64_t j = full; j < width; j++) total[j] += r[j];
        }
        for (int64_t k = 0; k < K; k++) {
            const float *r = block + k * ld;
            vd sq_v[NQ], dot_v[NQ];
            for (int q = 0; q < NQ; q++) {
                sq_v[q] = load_d(sq[k].part + q * HALF);
                dot_v[q] = load_d(dot[k].part + q * HALF);
            }
            for (int64_t j0 = 0; j0 < full; j0 += PARTS)
                for (int q = 0; q < NQ; q++) {
                    vd d = load_wide(r + j0 + q * HALF);
                    sq_v[q] += d * d;
                    dot_v[q] += d * load_d(total + j0 + q * HALF);
                }
            for (int q = 0; q < NQ; q++) {
                store_d(sq[k].part + q * HALF, sq_v[q]);
                store_d(dot[k].part + q * HALF, dot_v[q]);
            }
            for (int64_t j = full; j < width; j++) {                /* the tail: partial j - full */
                double d = r[j];
                sq[k].part[j - full] += d * d;
                dot[k].part[j - full] += d * total[j];
            }
        }
    }
    for (int64_t k = 0; k < K; k++) {
        sq_norm[k] = colsum_total(&sq[k]);
        m[k] = colsum_total(&dot[k]);
    }
    free(sq); free(dot); free(total);
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
    colsum_t total = {0};
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
        colsum_add(&total, col, mask);
        store_vec(out, col, width, result);
    }
    free(pad);
    *mask_sum = colsum_total(&total);
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

/* -- sorts over the client axis ------------------------------------------------------------ */

/* Clients a column sort holds: two [SORT_MAX_CLIENTS, LANES] float buffers on the stack
 * (32 KiB at 16 lanes). More clients take the torch ops (kernels.SORT_MAX_CLIENTS, the same figure): the sort
 * below is K^2 / 2 compare-exchanges, against torch.sort's K log K: still 2.7x torch.sort's
 * speed at K = 256 on a 2-core AVX-512 machine, 7x at K = 100, 15x at K = 32. */
#define SORT_MAX_CLIENTS 256

/* a before b in ascending order, NaN last (as torch.sort): a < b, or b is NaN and a is not. */
static inline vi before(vf a, vf b) { return (vi)(a < b) | ((vi)(b != b) & (vi)(a == a)); }

/* The K values of each of a chunk's LANES columns, sorted ascending into sorted[0 .. K-1]: an
 * insertion sort without branches, row k passed down the k sorted rows by compare-exchanges
 * (each keeps the smaller, hands on the larger). The result is the column's multiset in order,
 * so its values are torch.sort's whatever the order of equal values. */
static void sort_chunk(chunk_t c, int64_t K, ahead_t *a, vf *sorted) {
    for (int64_t k = 0; k < K; k++) {
        ahead_step(a);
        vf x = load(c.rows + k * c.ld);
        for (int64_t i = 0; i < k; i++) {
            vf y = sorted[i];
            vi x_first = before(x, y);
            sorted[i] = pick(x_first, x, y);
            x = pick(x_first, y, x);
        }
        sorted[k] = x;
    }
}

/* Per column the rows [lo, hi) of the column sorted over its K clients: out_j = their mean,
 * acc = 0; acc = acc + weight * v_r for r = lo .. hi-1 in order (weight = 1 / (hi - lo) as a
 * float32, fd_mix's arithmetic on the kept rows, so the torch form through fd_mix has these
 * bits), or with median != 0 the median, (v_lo + v_hi-1) / 2 (lo == hi-1 for odd K: v_lo). */
int fd_sorted_mean(const float *W, int64_t K, int64_t ld, int64_t P, int64_t lo, int64_t hi,
                   float weight, int32_t median, float *out) {
    if (K > SORT_MAX_CLIENTS || lo < 0 || hi > K || lo >= hi) return 2;
    vf sorted[SORT_MAX_CLIENTS];
    float pad[LANES * SORT_MAX_CLIENTS];
    ahead_t a = {0};
    for (int64_t col = 0; col < P; col += LANES) {
        int64_t width = P - col < LANES ? P - col : LANES;
        if (NEW_BLOCK(0, col)) ahead_start(&a, W, ld, K, next_block(0, col));
        sort_chunk(chunk_at(W, ld, K, col, width, pad), K, &a, sorted);
        vf result;
        if (median) {
            result = lo == hi - 1 ? sorted[lo] : (sorted[lo] + sorted[hi - 1]) / splat(2.0f);
        } else {
            result = splat(0.0f);
            for (int64_t r = lo; r < hi; r++) result = result + splat(weight) * sorted[r];
        }
        store_vec(out, col, width, result);
    }
    return 0;
}
