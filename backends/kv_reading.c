/* A decode row's attention over int8 and int4 KV rows on the CPU, read where they are stored: each key's score
   and each block's weighted values computed from the integers, scales and biases in one pass over the rows, with
   no float copy of them (backends/kv_reading.py builds and loads it; torch's integer_reading.py and MLX's
   cpu_attention.py call it over their rows: their kv_storage.py say how a row is laid out).

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
    QUERIES_AT_ONCE = 16, /* a block's weighted values are summed for this many queries per pass over its rows */
    TILE = 256,          /* keys a thread scores at a time */
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

static inline float lanes_sum(floats x) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)x);
#elif defined(__aarch64__)
    return vaddvq_f32((float32x4_t)x);
#else
    float sum = 0;
    for (int lane = 0; lane < LANES; lane++) sum += x[lane];
    return sum;
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

/* Scores of queries q (head h's query i at q + h * q_head + i * q_row, `dim` floats) against keys [0, t) (head
   h's key k at stored + h * head_bytes + k * row_bytes): out + h * out_head + i * out_row + k. */
void kv_scores(const float *q, int64_t q_head, int64_t q_row, int64_t heads, int64_t n, int64_t dim,
               const uint8_t *stored, int64_t head_bytes, int64_t row_bytes, int64_t t, int bits, int64_t group,
               int64_t half_step, int64_t bias_first, float *out, int64_t out_head, int64_t out_row, int threads) {
    int64_t groups = dim / group, vectors = dim / LANES, per_group = group / LANES, packed = dim * bits / 8;
    halves at = {packed, half_step, bias_first};
    int64_t tiles = (t + TILE - 1) / TILE;
#pragma omp parallel for num_threads(threads) schedule(static) if (heads * t > 4 * TILE)
    for (int64_t task = 0; task < heads * tiles; task++) {
        int64_t h = task / tiles, first = task % tiles * TILE, last = first + TILE < t ? first + TILE : t;
        for (int64_t i = 0; i < n; i++) {
            const float *qi = q + h * q_head + i * q_row;
            floats qv[MOST_VECTORS];
            float sums[MOST_GROUPS];
            for (int64_t v = 0; v < vectors; v++)
                for (int64_t lane = 0; lane < LANES; lane++) qv[v][lane] = qi[lane_dim(bits, v, lane)];
            for (int64_t g = 0; g < groups; g++) {
                float s = 0;
                for (int64_t d = 0; d < group; d++) s += qi[g * group + d];
                sums[g] = s;
            }
            float *o = out + h * out_head + i * out_row;
            for (int64_t k = first; k < last; k++) {
                const uint8_t *row = stored + h * head_bytes + k * row_bytes;
                floats score = {0};
                float biased = 0;
                for (int64_t g = 0; g < groups; g++) {
                    floats dot = {0};
                    /* int4: a group's vectors are whole pairs (group >= 32) */
                    for (int64_t v = g * per_group; v < (g + 1) * per_group; v += bits == 8 ? 1 : 2) {
                        bytes b = loaded(row, bits, v);
                        if (bits == 8) {
                            dot += qv[v] * widened(b);
                        } else {
                            dot += qv[v] * widened(b & 15);
                            dot += qv[v + 1] * widened(b >> 4);
                        }
                    }
                    score += scale_of(row, at, g) * dot;
                    biased += bias_of(row, at, g) * sums[g];
                }
                o[k] = lanes_sum(score) + biased;
            }
        }
    }
}

/* Weights w (head h's query i's weight of key k at w + h * w_head + i * w_row + k) of values [0, t), summed per
   block of `block` keys: out [heads, blocks, n, dim], contiguous. */
void kv_block_sums(const float *w, int64_t w_head, int64_t w_row, int64_t heads, int64_t n, int64_t dim,
                   const uint8_t *stored, int64_t head_bytes, int64_t row_bytes, int64_t t, int bits, int64_t group,
                   int64_t half_step, int64_t bias_first, int64_t block, float *out, int threads) {
    int64_t groups = dim / group, vectors = dim / LANES, per_group = group / LANES, packed = dim * bits / 8;
    halves at = {packed, half_step, bias_first};
    int64_t blocks = (t + block - 1) / block;
#pragma omp parallel for num_threads(threads) schedule(static) if (heads * t > 4 * TILE)
    for (int64_t task = 0; task < heads * blocks; task++) {
        int64_t h = task / blocks, b = task % blocks, first = b * block, last = first + block < t ? first + block : t;
        for (int64_t i0 = 0; i0 < n; i0 += QUERIES_AT_ONCE) {
            int64_t m = n - i0 < QUERIES_AT_ONCE ? n - i0 : QUERIES_AT_ONCE;
            floats sum[QUERIES_AT_ONCE * MOST_VECTORS];
            float biased[QUERIES_AT_ONCE * MOST_GROUPS];
            memset(sum, 0, sizeof(floats) * m * vectors);
            memset(biased, 0, sizeof(float) * m * groups);
            for (int64_t k = first; k < last; k++) {
                const uint8_t *row = stored + h * head_bytes + k * row_bytes;
                floats x[MOST_VECTORS];
                integers(row, bits, vectors, x);
                for (int64_t g = 0; g < groups; g++) {
                    float scale = scale_of(row, at, g), bias = bias_of(row, at, g);
                    for (int64_t i = 0; i < m; i++) {
                        float weight = w[h * w_head + (i0 + i) * w_row + k];
                        floats scaled = (floats){0} + weight * scale;
                        floats *s = sum + i * vectors;
                        for (int64_t v = g * per_group; v < (g + 1) * per_group; v++) s[v] += scaled * x[v];
                        biased[i * groups + g] += weight * bias;
                    }
                }
            }
            float *o = out + ((h * blocks + b) * n + i0) * dim;
            for (int64_t i = 0; i < m; i++)
                for (int64_t v = 0; v < vectors; v++)
                    for (int64_t lane = 0; lane < LANES; lane++) {
                        int64_t d = lane_dim(bits, v, lane);
                        o[i * dim + d] = sum[i * vectors + v][lane] + biased[i * groups + d / group];
                    }
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
