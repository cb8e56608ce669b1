/* Attention over int8 and int4 KV rows on the CPU (a decode row's, and every pass of --batch-invariant's), read
   where they are stored: each key's score and each block's weighted values computed from the integers, scales
   and biases in one pass over the rows, with no float copy of them (backends/kv_reading.py builds and loads it;
   torch's integer_reading.py and MLX's cpu_attention.py call it over their rows: their kv_storage.py say how a
   row is laid out).

   A row of a head's token: its integers (int8: byte d is dim d; int4: byte i holds dim 2i in its low nibble and
   dim 2i + 1 in its high one), then each group's float16 scale and bias (`halves` says in which order); dim d of
   group g is x = q * scale_g + bias_g. So, per group,
       score:  k . x = scale_g (k_g . q_g) + bias_g sum(k_g)
       values: sum_t w_t x_t = sum_t (w_t scale_t) q_t + sum_t w_t bias_t.

   Vectors are GCC's and clang's vector extensions, with x86's or Arm's intrinsics where the generic form compiles
   to lane-by-lane code (widening bytes, a vector's sum); compiled for the CPU it runs on (-march=native). A key's
   score is one fixed order of operations wherever the key stands, and a block's sum one fixed order over its
   keys, so any split of the rows into runs (a run starting at a block boundary) gives the same bits; the threads
   (OpenMP: under torch, torch's own runtime, loaded first) split the work by key tiles and blocks, never a sum. */

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#else
#error "written for x86-64 with AVX2 or AVX-512 and for 64-bit Arm alone: elsewhere the backends read the rows"
#endif

/* LANES dims to a vector: the CPU's widest (a wider generic vector is split into pieces the compiler moves
   through memory: measured slower than torch's own products on AVX2) */
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX2__)
#define LANES 8
#else /* Advanced SIMD (NEON), which every 64-bit Arm CPU has */
#define LANES 4
#endif
typedef float floats __attribute__((vector_size(4 * LANES)));
typedef uint8_t bytes __attribute__((vector_size(LANES)));

enum {
    MOST_DIMS = 256,
    MOST_VECTORS = MOST_DIMS / LANES,
    MOST_GROUPS = 8, /* groups of 32 */
    QUERIES_AT_ONCE = 4, /* a block's weighted values are summed for this many queries per pass over its rows */
    TILE = 256,          /* keys a thread scores at a time */
    SHARED_FROM = 4,     /* queries from which a key is read once for all of them (fewer: once for each) */
    QUERY_CHUNK = 64,    /* queries a thread reads into vectors at a time (on its stack) */
    MOST_TREE = 4096,    /* the most floats a block's sum of weights adds (`halved_sum`), on a thread's stack */
};

/* LANES bytes as floats: GCC does not vectorize this from the generic form (it converts lane by lane) */
static inline floats widened(bytes b) {
#if defined(__AVX512F__)
    return (floats)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)b));
#elif defined(__AVX2__)
    __m128i x = _mm_loadl_epi64((const __m128i *)&b);
    return (floats)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x));
#else
    uint32_t four;
    memcpy(&four, &b, 4);
    uint16x8_t x = vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(four)));
    return (floats)vcvtq_f32_u32(vmovl_u16(vget_low_u16(x)));
#endif
}

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#elif defined(__aarch64__)
    __fp16 x;
    memcpy(&x, &h, 2);
    return (float)x;
#else /* AVX2 without F16C */
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24 */
        float x = (float)mantissa * (1.0f / 16777216.0f);
        return sign ? -x : x;
    }
    bits = sign | (exponent == 31 ? 0x7f800000u : (exponent + 112) << 23) | (mantissa << 13);
    float x;
    memcpy(&x, &bits, 4);
    return x;
#endif
}

/* Where a row keeps its groups' float16 scales and biases after its `packed` bytes of integers, counted in
   float16s: group g's scale at g * step, its bias at bias_first + g * step (every scale then every bias: step 1,
   bias_first the group count; each group's scale and bias side by side: step 2, bias_first 1) */
typedef struct {
    int64_t packed, step, bias_first;
} halves;

static inline float half_at(const uint8_t *row, int64_t packed, int64_t j) {
    uint16_t h;
    memcpy(&h, row + packed + 2 * j, 2);
    return half_to_float(h);
}

static inline float scale_of(const uint8_t *row, halves at, int64_t g) { return half_at(row, at.packed, g * at.step); }

static inline float bias_of(const uint8_t *row, halves at, int64_t g) {
    return half_at(row, at.packed, at.bias_first + g * at.step);
}

/* A vector's lanes added (AVX-512: lane i + lane i + 8, then + 4, + 2, + 1, written out so that no compiler's
   lowering of a reduction chooses it; GCC's _mm512_reduce_add_ps adds so too) */
static inline float lanes_sum(floats x) {
#if defined(__AVX512F__)
    __m512 v = (__m512)x;
    __m256 eighths = _mm256_add_ps(_mm512_castps512_ps256(v),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 quarters = _mm_add_ps(_mm256_castps256_ps128(eighths), _mm256_extractf128_ps(eighths, 1));
    __m128 halves_ = _mm_add_ps(quarters, _mm_movehl_ps(quarters, quarters));
    return _mm_cvtss_f32(_mm_add_ss(halves_, _mm_shuffle_ps(halves_, halves_, _MM_SHUFFLE(1, 1, 1, 1))));
#elif defined(__aarch64__)
    return vaddvq_f32((float32x4_t)x);
#else
    float sum = 0;
    for (int lane = 0; lane < LANES; lane++) sum += x[lane];
    return sum;
#endif
}

/* lanes_sum of each of LANES vectors, lane k the sum of x[k]: the same terms added in the same order */
static inline floats lanes_sums(const floats *x) {
#if defined(__AVX512F__)
    /* lanes_sum's tree for 16 vectors at once, two to four of them a register */
    __m512 eighths[8], quarters[4], halves_[2];
    for (int j = 0; j < 8; j++) {
        __m512 a = (__m512)x[2 * j], b = (__m512)x[2 * j + 1];
        eighths[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)),
                                   _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)));
    }
    for (int j = 0; j < 4; j++) {
        __m512 a = eighths[2 * j], b = eighths[2 * j + 1];
        quarters[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)),
                                    _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)));
    }
    for (int j = 0; j < 2; j++) {
        __m512 a = quarters[2 * j], b = quarters[2 * j + 1];
        halves_[j] = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(halves_[0], halves_[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_ps(halves_[0], halves_[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* lane 4c + r holds vector 4r + c's sum */
    return (floats)_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
                                         sums);
#elif defined(__AVX2__)
    /* lanes_sum's order, lane 0 first: the 8 vectors transposed, then their lanes added as vectors */
    __m256 pairs[8], quads[8], lanes[8];
    for (int j = 0; j < 4; j++) {
        pairs[2 * j] = _mm256_unpacklo_ps((__m256)x[2 * j], (__m256)x[2 * j + 1]);
        pairs[2 * j + 1] = _mm256_unpackhi_ps((__m256)x[2 * j], (__m256)x[2 * j + 1]);
    }
    for (int j = 0; j < 2; j++) {
        __m256 *p = pairs + 4 * j;
        quads[4 * j] = _mm256_shuffle_ps(p[0], p[2], _MM_SHUFFLE(1, 0, 1, 0));
        quads[4 * j + 1] = _mm256_shuffle_ps(p[0], p[2], _MM_SHUFFLE(3, 2, 3, 2));
        quads[4 * j + 2] = _mm256_shuffle_ps(p[1], p[3], _MM_SHUFFLE(1, 0, 1, 0));
        quads[4 * j + 3] = _mm256_shuffle_ps(p[1], p[3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int j = 0; j < 4; j++) {
        lanes[j] = _mm256_permute2f128_ps(quads[j], quads[4 + j], 0x20);
        lanes[4 + j] = _mm256_permute2f128_ps(quads[j], quads[4 + j], 0x31);
    }
    floats out = {0};
    for (int lane = 0; lane < LANES; lane++) out += (floats)lanes[lane];
    return out;
#else
    floats out;
    for (int k = 0; k < LANES; k++) out[k] = lanes_sum(x[k]);
    return out;
#endif
}

/* A row's integers as `vectors` vectors of LANES dims. int4: vector 2j holds the even dims of dims
   [2 LANES j, 2 LANES (j + 1)) and vector 2j + 1 the odd ones (`lane_dim` says which dim a lane holds). */
static inline bytes loaded(const uint8_t *row, int bits, int64_t v) {
    bytes b;
    memcpy(&b, row + (bits == 8 ? LANES * v : LANES / 2 * v), LANES);
    return b;
}

static inline void integers(const uint8_t *row, int bits, int64_t vectors, floats *out) {
    for (int64_t v = 0; v < vectors; v += bits == 8 ? 1 : 2) {
        bytes b = loaded(row, bits, v);
        if (bits == 8) {
            out[v] = widened(b);
        } else {
            out[v] = widened(b & 15);
            out[v + 1] = widened(b >> 4);
        }
    }
}

static inline int64_t lane_dim(int bits, int64_t v, int64_t lane) {
    return bits == 8 ? LANES * v + lane : 2 * LANES * (v / 2) + 2 * lane + (v & 1);
}

/* A key's widened integers, and its groups' scales and biases */
static inline void key_read(const uint8_t *row, int bits, int64_t vectors, int64_t groups, halves at, floats *x,
                            float *scales, float *biases) {
    integers(row, bits, vectors, x);
    for (int64_t g = 0; g < groups; g++) {
        scales[g] = scale_of(row, at, g);
        biases[g] = bias_of(row, at, g);
    }
}

/* A query's score of a key (`key_read`'s) but for the sum of its lanes, which `lanes_sum` (or `lanes_sums`)
   adds to `*biased`: one order of operations wherever the key and the query stand */
static inline floats key_score(const floats *qi, const float *sums, const floats *x, const float *scales,
                               const float *biases, int64_t groups, int64_t per_group, float *biased) {
    floats score = {0};
    float b = 0;
    for (int64_t g = 0; g < groups; g++) {
        floats dot = {0};
        for (int64_t v = g * per_group; v < (g + 1) * per_group; v++) dot += qi[v] * x[v];
        score += scales[g] * dot;
        b += biases[g] * sums[g];
    }
    *biased = b;
    return score;
}

/* `key_score` read from the stored row as it goes, its integers widened in registers: the same operations in the
   same order */
static inline floats row_score(const floats *qi, const float *sums, const uint8_t *row, int bits, int64_t groups,
                               int64_t per_group, halves at, float *biased) {
    floats score = {0};
    float b = 0;
    for (int64_t g = 0; g < groups; g++) {
        floats dot = {0};
        /* int4: a group's vectors are whole pairs (group >= 32) */
        for (int64_t v = g * per_group; v < (g + 1) * per_group; v += bits == 8 ? 1 : 2) {
            bytes x = loaded(row, bits, v);
            if (bits == 8) {
                dot += qi[v] * widened(x);
            } else {
                dot += qi[v] * widened(x & 15);
                dot += qi[v + 1] * widened(x >> 4);
            }
        }
        score += scale_of(row, at, g) * dot;
        b += bias_of(row, at, g) * sums[g];
    }
    *biased = b;
    return score;
}

/* A query's vectors in the order a row's integers are loaded (`lane_dim`), and its groups' sums */
static inline void query_read(const float *qi, int bits, int64_t vectors, int64_t groups, int64_t group, floats *qv,
                              float *sums) {
    for (int64_t v = 0; v < vectors; v++)
        for (int64_t lane = 0; lane < LANES; lane++) qv[v][lane] = qi[lane_dim(bits, v, lane)];
    for (int64_t g = 0; g < groups; g++) {
        float s = 0;
        for (int64_t d = 0; d < group; d++) s += qi[g * group + d];
        sums[g] = s;
    }
}

/* Scores of queries q (head h's query i at q + h * q_head + i * q_row, `dim` floats) against keys [0, t) (head
   h's key k at stored + h * head_bytes + k * row_bytes): out + h * out_head + i * out_row + k. For SHARED_FROM
   queries or more, LANES keys at a time are read once and scored for every query (QUERY_CHUNK at a time). */
void kv_scores(const float *q, int64_t q_head, int64_t q_row, int64_t heads, int64_t n, int64_t dim,
               const uint8_t *stored, int64_t head_bytes, int64_t row_bytes, int64_t t, int bits, int64_t group,
               int64_t half_step, int64_t bias_first, float *out, int64_t out_head, int64_t out_row, int threads) {
    int64_t groups = dim / group, vectors = dim / LANES, per_group = group / LANES, packed = dim * bits / 8;
    halves at = {packed, half_step, bias_first};
    int64_t tiles = (t + TILE - 1) / TILE;
#pragma omp parallel for num_threads(threads) schedule(static) if (heads * t > 4 * TILE)
    for (int64_t task = 0; task < heads * tiles; task++) {
        int64_t h = task / tiles, first = task % tiles * TILE, last = first + TILE < t ? first + TILE : t;
        const uint8_t *rows = stored + h * head_bytes;
        for (int64_t i0 = 0; i0 < n; i0 += QUERY_CHUNK) {
            int64_t m = n - i0 < QUERY_CHUNK ? n - i0 : QUERY_CHUNK;
            floats qv[QUERY_CHUNK][MOST_VECTORS];
            float sums[QUERY_CHUNK][MOST_GROUPS];
            for (int64_t i = 0; i < m; i++)
                query_read(q + h * q_head + (i0 + i) * q_row, bits, vectors, groups, group, qv[i], sums[i]);
            if (n < SHARED_FROM) {
                for (int64_t i = 0; i < m; i++) {
                    float *o = out + h * out_head + (i0 + i) * out_row, biased;
                    for (int64_t k = first; k < last; k++) {
                        floats score = row_score(qv[i], sums[i], rows + k * row_bytes, bits, groups, per_group, at,
                                                 &biased);
                        o[k] = lanes_sum(score) + biased;
                    }
                }
                continue;
            }
            for (int64_t k0 = first; k0 < last; k0 += LANES) {
                int64_t keys = last - k0 < LANES ? last - k0 : LANES;
                floats x[LANES][MOST_VECTORS], score[LANES];
                float scales[LANES][MOST_GROUPS], biases[LANES][MOST_GROUPS], biased[LANES];
                for (int64_t k = 0; k < keys; k++)
                    key_read(rows + (k0 + k) * row_bytes, bits, vectors, groups, at, x[k], scales[k], biases[k]);
                for (int64_t i = 0; i < m; i++) {
                    for (int64_t k = 0; k < keys; k++)
                        score[k] = key_score(qv[i], sums[i], x[k], scales[k], biases[k], groups, per_group,
                                             &biased[k]);
                    float *o = out + h * out_head + (i0 + i) * out_row + k0;
                    if (keys == LANES) {
                        floats summed = lanes_sums(score);
                        for (int64_t k = 0; k < LANES; k++) o[k] = summed[k] + biased[k];
                    } else {
                        for (int64_t k = 0; k < keys; k++) o[k] = lanes_sum(score[k]) + biased[k];
                    }
                }
            }
        }
    }
}

/* Queries [0, M)'s weighted values (query i's weights at w + i * w_row) of vectors v and v + 1 (in group g) over
   keys [first, last): sum[2 i], sum[2 i + 1], each lane added key by key; and where `biased` is not NULL, each
   query's weighted biases of group g there, added key by key. M and bits are constants where it is inlined
   (`weighted_pairs`), so the sums stay in registers. */
static inline __attribute__((always_inline)) void weighted_pair(int M, int bits, const float *w, int64_t w_row,
                                                               const uint8_t *rows, int64_t row_bytes,
                                                               int64_t first, int64_t last, int64_t v, int64_t g,
                                                               halves at, floats *sum, float *biased) {
    floats acc[QUERIES_AT_ONCE][2];
    float bias_acc[QUERIES_AT_ONCE];
    for (int i = 0; i < M; i++) {
        acc[i][0] = acc[i][1] = (floats){0};
        bias_acc[i] = 0;
    }
    for (int64_t k = first; k < last; k++) {
        const uint8_t *row = rows + k * row_bytes;
        floats x0, x1;
        if (bits == 8) {
            x0 = widened(loaded(row, 8, v));
            x1 = widened(loaded(row, 8, v + 1));
        } else {
            bytes b = loaded(row, 4, v);
            x0 = widened(b & 15);
            x1 = widened(b >> 4);
        }
        float scale = scale_of(row, at, g), bias = biased ? bias_of(row, at, g) : 0;
        for (int i = 0; i < M; i++) {
            float weight = w[i * w_row + k];
            floats scaled = (floats){0} + weight * scale;
            acc[i][0] += scaled * x0;
            acc[i][1] += scaled * x1;
            if (biased) bias_acc[i] += weight * bias;
        }
    }
    for (int i = 0; i < M; i++) {
        sum[2 * i] = acc[i][0];
        sum[2 * i + 1] = acc[i][1];
        if (biased) biased[i] = bias_acc[i];
    }
}

static void weighted_pairs(int m, int bits, const float *w, int64_t w_row, const uint8_t *rows, int64_t row_bytes,
                           int64_t first, int64_t last, int64_t v, int64_t g, halves at, floats *sum,
                           float *biased) {
#define PAIR(M, BITS) weighted_pair(M, BITS, w, w_row, rows, row_bytes, first, last, v, g, at, sum, biased)
    switch (m * 16 + bits) {
    case 1 * 16 + 8: PAIR(1, 8); break;
    case 2 * 16 + 8: PAIR(2, 8); break;
    case 3 * 16 + 8: PAIR(3, 8); break;
    case 4 * 16 + 8: PAIR(4, 8); break;
    case 1 * 16 + 4: PAIR(1, 4); break;
    case 2 * 16 + 4: PAIR(2, 4); break;
    case 3 * 16 + 4: PAIR(3, 4); break;
    default: PAIR(4, 4); break;
    }
#undef PAIR
}

/* The sum of x's `count` floats as ordered_attention.halved adds them: zero-padded to a power of two, then each
   half added to the other until one is left (`tree` holds that power of two's floats) */
static float halved_sum(const float *x, int64_t count, float *tree, int64_t power) {
    memcpy(tree, x, sizeof(float) * count);
    memset(tree + count, 0, sizeof(float) * (power - count));
    for (int64_t half = power / 2; half >= 1; half /= 2)
        for (int64_t j = 0; j < half; j++) tree[j] = tree[j] + tree[j + half];
    return tree[0];
}

/* Weights w (head h's query i's weight of key k at w + h * w_head + i * w_row + k) of values [0, t), summed per
   block of `block` keys: out [heads, blocks, n, dim], contiguous; and, where weight_sums is not NULL (`block` then
   at most MOST_TREE), each block's sum of weights (`halved_sum`) there, [heads, blocks, n]. */
void kv_block_sums(const float *w, int64_t w_head, int64_t w_row, int64_t heads, int64_t n, int64_t dim,
                   const uint8_t *stored, int64_t head_bytes, int64_t row_bytes, int64_t t, int bits, int64_t group,
                   int64_t half_step, int64_t bias_first, int64_t block, float *out, float *weight_sums,
                   int threads) {
    int64_t vectors = dim / LANES, per_group = group / LANES, packed = dim * bits / 8;
    halves at = {packed, half_step, bias_first};
    int64_t blocks = (t + block - 1) / block, power = 1;
    while (power < block) power *= 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (heads * t > 4 * TILE)
    for (int64_t task = 0; task < heads * blocks; task++) {
        int64_t h = task / blocks, b = task % blocks, first = b * block, last = first + block < t ? first + block : t;
        const uint8_t *rows = stored + h * head_bytes;
        float tree[MOST_TREE];
        for (int64_t i0 = 0; i0 < n; i0 += QUERIES_AT_ONCE) {
            int64_t m = n - i0 < QUERIES_AT_ONCE ? n - i0 : QUERIES_AT_ONCE;
            const float *wi = w + h * w_head + i0 * w_row;
            float *o = out + ((h * blocks + b) * n + i0) * dim, biased[QUERIES_AT_ONCE];
            for (int64_t v = 0; v < vectors; v += 2) {
                floats sum[2 * QUERIES_AT_ONCE];
                int64_t g = v / per_group;
                /* a group's biases are added with its first pair (a group is whole pairs) */
                weighted_pairs((int)m, bits, wi, w_row, rows, row_bytes, first, last, v, g, at, sum,
                               v % per_group ? NULL : biased);
                for (int64_t i = 0; i < m; i++)
                    for (int64_t j = 0; j < 2; j++)
                        for (int64_t lane = 0; lane < LANES; lane++)
                            o[i * dim + lane_dim(bits, v + j, lane)] = sum[2 * i + j][lane] + biased[i];
            }
            if (weight_sums)
                for (int64_t i = 0; i < m; i++)
                    weight_sums[(h * blocks + b) * n + i0 + i] = halved_sum(wi + i * w_row + first, last - first, tree,
                                                                            power);
        }
    }
}

/* Rows [0, t) decoded to floats (a prefill chunk's reading): head h's key k at out + h * out_head + k * out_row. */
void kv_decode(const uint8_t *stored, int64_t head_bytes, int64_t row_bytes, int64_t heads, int64_t t, int64_t dim,
               int bits, int64_t group, int64_t half_step, int64_t bias_first, float *out, int64_t out_head,
               int64_t out_row, int threads) {
    int64_t groups = dim / group, vectors = dim / LANES, per_group = group / LANES, packed = dim * bits / 8;
    halves at = {packed, half_step, bias_first};
    int64_t tiles = (t + TILE - 1) / TILE;
#pragma omp parallel for num_threads(threads) schedule(static) if (heads * t > 4 * TILE)
    for (int64_t task = 0; task < heads * tiles; task++) {
        int64_t h = task / tiles, first = task % tiles * TILE, last = first + TILE < t ? first + TILE : t;
        for (int64_t k = first; k < last; k++) {
            const uint8_t *row = stored + h * head_bytes + k * row_bytes;
            float *o = out + h * out_head + k * out_row;
            floats x[MOST_VECTORS];
            integers(row, bits, vectors, x);
            for (int64_t g = 0; g < groups; g++) {
                float scale = scale_of(row, at, g), bias = bias_of(row, at, g);
                for (int64_t v = g * per_group; v < (g + 1) * per_group; v++) x[v] = x[v] * scale + bias;
            }
            for (int64_t v = 0; v < vectors; v++)
                for (int64_t lane = 0; lane < LANES; lane++) o[lane_dim(bits, v, lane)] = x[v][lane];
        }
    }
}
