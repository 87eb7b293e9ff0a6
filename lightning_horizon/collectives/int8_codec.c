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
