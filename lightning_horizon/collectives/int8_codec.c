/* The int8 codec in one pass over memory: built by native.py with the machine's C compiler, called through ctypes
 * (which releases the GIL, so gloo's threads run meanwhile).
 *
 * A row of `c` fp32 values is cut into blocks of `block`; each block is sent as `block` int8 values
 * round(x * (1 / s)) (half to even, clamped to +-127; NaN gives 0) and its scale s = max|x| / 127 (1 for an all-zero
 * block; NaN where the block holds a NaN, inf where it holds an inf, so a non-finite block decodes non-finite).
 * A packed row is `c` int8 values then the row's scales as raw fp32 bytes (`stride` bytes in all). Every operation
 * is the one the torch fallback does, in the same order, with no contraction into fused multiply-adds (built with
 * -ffp-contract=off): both give the same bytes.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HORIZON_AVX512 1
#endif

/* The largest |x| of a block, as bits. For floats that are not NaN, the order of |x| is the order of its bits as
 * unsigned integers, and every NaN's bits lie above inf's: one integer maximum (which vectorizes; a float maximum
 * must keep NaN's order and does not) gives max|x| and whether the block holds a NaN or an inf. */
static inline uint32_t block_max_bits(const float *x, int64_t n) {
    const uint32_t *bits = (const uint32_t *)x;
    uint32_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t a = bits[i] & 0x7fffffffu;
        m = a > m ? a : m;
    }
    return m;
}

/* round(x * (1 / s)) clamped to +-127, as a float (a multiply: a divide per value cost 18% of the encode). In a
 * finite block x * inv is never NaN (s > 0 and finite)... */
static inline float quantize_finite(float x, float inv) {
    float v = x * inv;
    v = v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v);
    return nearbyintf(v);
}

/* ... in a block with an inf or a NaN it can be (inf * 0, NaN * inv): 0, as torch's nan_to_num_ gives. */
static inline float quantize_any(float x, float inv) {
    float v = x * inv;
    v = v != v ? 0.0f : v;
    v = v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v);
    return nearbyintf(v);
}

/* One loop per case (no error, error written, error added), so that each vectorizes. */
#define ENCODE_BLOCK(QUANTIZE)                                                                                  \
    if (!er) {                                                                                                  \
        for (int64_t i = b; i < end; i++) q[i] = (int8_t)QUANTIZE(xr[i], inv);                                    \
    } else if (!accumulate) {                                                                                   \
        for (int64_t i = b; i < end; i++) {                                                                     \
            const float v = QUANTIZE(xr[i], inv);                                                                 \
            q[i] = (int8_t)v;                                                                                   \
            er[i] = xr[i] - v * s;                                                                              \
        }                                                                                                       \
    } else {                                                                                                    \
        for (int64_t i = b; i < end; i++) {                                                                     \
            const float v = QUANTIZE(xr[i], inv);                                                                 \
            q[i] = (int8_t)v;                                                                                   \
            er[i] = er[i] + (xr[i] - v * s);                                                                    \
        }                                                                                                       \
    }

#ifdef HORIZON_AVX512
/* A finite block of 64 values at a time with AVX-512, the same operations as quantize_finite in the same order
 * (multiply, clamp, round half to even, the error from the rounded float), narrowed with saturating packs instead of
 * one narrowing store per 16 values: 1.2x the compiler's loop here. ``mode``: 0 no error, 1 write it, 2 add it.
 * ``clamp`` 0 leaves the clamp out, for a finite ``inv``: then |x| <= max gives |x * inv| <= 127 (1 + 3 * 2^-24) (three
 * roundings: s, inv, the product), which rounds to at most 127 as the clamped value does: the same bytes and error. A
 * block whose max is tiny enough that inv overflows to inf keeps the clamp (x * inf, 0 * inf). */
static inline __attribute__((always_inline)) void encode_finite_avx512(const float *restrict x, int64_t n, float s,
                                                                       float inv, int8_t *restrict q,
                                                                       float *restrict er, int mode, int clamp) {
    const __m512 vinv = _mm512_set1_ps(inv), vs = _mm512_set1_ps(s);
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (int64_t i = 0; i < n; i += 64) {
        __m512i k[4];
        for (int j = 0; j < 4; j++) {
            const __m512 v = _mm512_loadu_ps(x + i + 16 * j);
            __m512 t = _mm512_mul_ps(v, vinv);
            if (clamp) t = _mm512_min_ps(_mm512_max_ps(t, lo), hi);
            t = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            k[j] = _mm512_cvttps_epi32(t);
            if (mode) {
                __m512 e = _mm512_sub_ps(v, _mm512_mul_ps(t, vs));
                if (mode == 2) e = _mm512_add_ps(_mm512_loadu_ps(er + i + 16 * j), e);
                _mm512_storeu_ps(er + i + 16 * j, e);
            }
        }
        const __m512i packed = _mm512_packs_epi16(_mm512_packs_epi32(k[0], k[1]), _mm512_packs_epi32(k[2], k[3]));
        _mm512_storeu_si512(q + i, _mm512_permutexvar_epi32(order, packed));
    }
}
#endif

static inline __attribute__((always_inline)) void encode(const float *restrict x, int64_t rows, int64_t c,
                                                         int64_t block, uint8_t *restrict packed, int64_t stride,
                                                         float *restrict err, int accumulate) {
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict xr = x + r * c;
        int8_t *restrict q = (int8_t *)(packed + r * stride);
        uint8_t *scales = packed + r * stride + c;
        float *restrict er = err ? err + r * c : 0;
        for (int64_t b = 0; b < c; b += block) {
            const uint32_t m = block_max_bits(xr + b, block);
            float s = NAN;
            if (m <= 0x7f800000u) {
                float max;
                memcpy(&max, &m, 4);
                s = max / 127.0f;
                s = s == 0.0f ? 1.0f : s;
            }
            const float inv = 1.0f / s;
            const int64_t end = b + block;
            memcpy(scales + (b / block) * 4, &s, 4); /* not 4-byte aligned for every block size */
            if (m < 0x7f800000u) {
#ifdef HORIZON_AVX512
                if (block % 64 == 0) {
                    const int mode = er ? 1 + accumulate : 0;
                    if (isfinite(inv)) /* no clamp needed */
                        encode_finite_avx512(xr + b, block, s, inv, q + b, er ? er + b : 0, mode, 0);
                    else
                        encode_finite_avx512(xr + b, block, s, inv, q + b, er ? er + b : 0, mode, 1);
                    continue;
                }
#endif
                ENCODE_BLOCK(quantize_finite)
            } else {
                ENCODE_BLOCK(quantize_any)
            }
        }
    }
}

/* Encode `rows` rows of `x` into `packed`. With `err` (rows x c), also write (accumulate = 0) or add
 * (accumulate = 1) what the encoding lost: x - decode(encode(x)). The default block, a constant, lets the
 * compiler drop the loops' remainders (1.4x here). */
void horizon_int8_encode(const float *restrict x, int64_t rows, int64_t c, int64_t block, uint8_t *restrict packed,
                         int64_t stride, float *restrict err, int accumulate) {
    if (block == 256)
        encode(x, rows, c, 256, packed, stride, err, accumulate);
    else
        encode(x, rows, c, block, packed, stride, err, accumulate);
}

/* Decode `rows` packed rows into `out`: rows x c values, or (sum = 1) c values, the rows' sum in row order. */
void horizon_int8_decode(const uint8_t *packed, int64_t rows, int64_t c, int64_t block, int64_t stride, float *out,
                         int sum) {
    for (int64_t r = 0; r < rows; r++) {
        const int8_t *q = (const int8_t *)(packed + r * stride);
        const uint8_t *scales = packed + r * stride + c;
        float *o = sum ? out : out + r * c;
        for (int64_t b = 0; b < c; b += block) {
            float s;
            memcpy(&s, scales + (b / block) * 4, 4);
            if (sum && r > 0) {
                for (int64_t i = b; i < b + block; i++) o[i] = o[i] + (float)q[i] * s;
            } else {
                for (int64_t i = b; i < b + block; i++) o[i] = (float)q[i] * s;
            }
        }
    }
}
