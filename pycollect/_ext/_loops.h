/* The reduction loops of the integer and floating types, in C, where the compiler is
 * told which vector instructions it may use.
 *
 * The integers, float32 and float64: plain loops (the reductions, and AVG's division),
 * built twice on x86-64, for AVX2 and for the baseline (target_clones: the CPU's choice
 * is made when the module loads).  Integer arithmetic wraps like NumPy's: the extension
 * is built with -fwrapv.
 *
 * The 16-bit types (float16 and bfloat16), and their division (AVG's tail): computed in
 * float32 and rounded to nearest even, as NumPy does (_half.h).
 *
 * float16: where the CPU has the F16C conversions (found at run time), eight values are
 * widened and narrowed per instruction; elsewhere, and for the last n % 8 values, the
 * loops convert one value at a time with _half.h's functions.  Both round alike, bit
 * for bit (round to nearest even, NaNs kept quiet with their upper payload bits).
 * bfloat16: widening is a shift and the narrowing is written without a branch, so the
 * compiler vectorises these loops itself (built twice on x86-64, for AVX2 and for the
 * baseline, the CPU's choice made when the module loads).
 *
 * Every loop reads a[i] and b[i] before it writes out[i]: out may be a or b.
 * In the 16-bit loops a sum or product with a NaN in b is b's NaN (quieted), as NumPy's
 * is; they say so themselves, since a compiler may swap the operands of an addition it
 * sees as commutative (and the CPU's NaN is then the other one).
 * MIN and MAX return one operand's bits: float16's ties keep a (NumPy's
 * np.minimum/np.maximum), bfloat16's take b (ml_dtypes'); a NaN in a wins, then one in b.
 */
#ifndef PYCOLLECT_LOOPS_H
#define PYCOLLECT_LOOPS_H
#include <stddef.h>
#include <stdint.h>
#include "_half.h"

/* The loops' operations (AVG reduces like SUM; the bitwise ones are the integers'). */
enum { PC_K_SUM = 0, PC_K_PRODUCT = 1, PC_K_MIN = 2, PC_K_MAX = 3, PC_K_BAND = 4,
       PC_K_BOR = 5, PC_K_BXOR = 6 };

#if defined(__x86_64__) && defined(__GNUC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define PC_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef PC_CLONES
#define PC_CLONES
#endif

/* -- the integers ---------------------------------------------------------------------- */

#define PC_INT_LOOP(T, NAME)                                                               \
    PC_CLONES static void NAME(T* out, const T* a, const T* b, size_t n, int kind) {       \
        size_t i;                                                                          \
        switch (kind) {                                                                    \
        case PC_K_SUM: for (i = 0; i < n; i++) out[i] = (T)(a[i] + b[i]); break;           \
        case PC_K_PRODUCT: for (i = 0; i < n; i++) out[i] = (T)(a[i] * b[i]); break;       \
        case PC_K_MIN: for (i = 0; i < n; i++) out[i] = a[i] <= b[i] ? a[i] : b[i]; break; \
        case PC_K_MAX: for (i = 0; i < n; i++) out[i] = a[i] >= b[i] ? a[i] : b[i]; break; \
        case PC_K_BAND: for (i = 0; i < n; i++) out[i] = a[i] & b[i]; break;               \
        case PC_K_BOR: for (i = 0; i < n; i++) out[i] = a[i] | b[i]; break;                \
        default: for (i = 0; i < n; i++) out[i] = a[i] ^ b[i]; break;                      \
        }                                                                                  \
    }
PC_INT_LOOP(int8_t, pc_int8_loop)
PC_INT_LOOP(uint8_t, pc_uint8_loop)
PC_INT_LOOP(int16_t, pc_int16_loop)
PC_INT_LOOP(uint16_t, pc_uint16_loop)
PC_INT_LOOP(int32_t, pc_int32_loop)
PC_INT_LOOP(uint32_t, pc_uint32_loop)
PC_INT_LOOP(int64_t, pc_int64_loop)
PC_INT_LOOP(uint64_t, pc_uint64_loop)

/* -- float32, float64 ----------------------------------------------------------------- */

/* MIN and MAX keep a where a wins or is NaN, else b (np.minimum/np.maximum's NaN rule). */
#define PC_REAL_LOOP(T, NAME)                                                              \
    PC_CLONES static void NAME(T* out, const T* a, const T* b, size_t n, int kind) {       \
        size_t i;                                                                          \
        if (kind == PC_K_SUM)                                                              \
            for (i = 0; i < n; i++) out[i] = a[i] + b[i];                                  \
        else if (kind == PC_K_PRODUCT)                                                     \
            for (i = 0; i < n; i++) out[i] = a[i] * b[i];                                  \
        else if (kind == PC_K_MIN)                                                         \
            for (i = 0; i < n; i++) out[i] = (a[i] < b[i] || a[i] != a[i]) ? a[i] : b[i];  \
        else                                                                               \
            for (i = 0; i < n; i++) out[i] = (a[i] > b[i] || a[i] != a[i]) ? a[i] : b[i];  \
    }
PC_REAL_LOOP(float, pc_float32_loop)
PC_REAL_LOOP(double, pc_float64_loop)

/* AVG's tail: a division (not a multiplication by 1/d: NumPy's bits). */
PC_CLONES static void pc_float32_divide(float* buf, size_t n, float d) {
    for (size_t i = 0; i < n; i++) buf[i] /= d;
}

PC_CLONES static void pc_float64_divide(double* buf, size_t n, double d) {
    for (size_t i = 0; i < n; i++) buf[i] /= d;
}

/* -- the 16-bit types, one value at a time ---------------------------------------------- */

static inline uint16_t pc_half_pick(uint16_t a, uint16_t b, float x, float y, int kind) {
    /* float16's MIN and MAX: a where it wins, ties or is NaN (NumPy's rule) */
    int keep_a = kind == PC_K_MIN ? (x <= y || x != x) : (x >= y || x != x);
    return keep_a ? a : b;
}

static inline float pc_nan_of_b(float z, float y) {
    /* integer compare and select, so that a loop over it still vectorises */
    uint32_t yb = pc_float_to_bits(y), zb = pc_float_to_bits(z);
    return pc_bits_to_float((yb & 0x7fffffffu) > 0x7f800000u ? (yb | 0x00400000u) : zb);
}

static void pc_half_loop_portable(uint16_t* out, const uint16_t* a, const uint16_t* b,
                                  size_t n, int kind, size_t from) {
    for (size_t i = from; i < n; i++) {
        float x = pc_half_to_float(a[i]), y = pc_half_to_float(b[i]);
        if (kind == PC_K_SUM) out[i] = pc_float_to_half(pc_nan_of_b(x + y, y));
        else if (kind == PC_K_PRODUCT) out[i] = pc_float_to_half(pc_nan_of_b(x * y, y));
        else out[i] = pc_half_pick(a[i], b[i], x, y, kind);
    }
}

static void pc_half_divide_portable(uint16_t* buf, size_t n, float d, size_t from) {
    for (size_t i = from; i < n; i++) buf[i] = pc_float_to_half(pc_half_to_float(buf[i]) / d);
}

/* -- float16 with F16C ---------------------------------------------------------------- */

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <immintrin.h>
#define PC_HAVE_F16C_LOOPS 1

#define PC_F16C __attribute__((target("avx,f16c")))
#define PC_F16C_ROUND (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

PC_F16C static inline __m256 pc_nan_of_b8(__m256 z, __m256 y) {
    __m256 quiet = _mm256_or_ps(y, _mm256_castsi256_ps(_mm256_set1_epi32(0x00400000)));
    __m256 nan = _mm256_cmp_ps(y, y, _CMP_UNORD_Q);
    return _mm256_or_ps(_mm256_and_ps(nan, quiet), _mm256_andnot_ps(nan, z));
}

PC_F16C static size_t pc_half_loop_f16c(uint16_t* out, const uint16_t* a, const uint16_t* b,
                                        size_t n, int kind) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i ha = _mm_loadu_si128((const __m128i*)(a + i));
        __m128i hb = _mm_loadu_si128((const __m128i*)(b + i));
        __m256 x = _mm256_cvtph_ps(ha), y = _mm256_cvtph_ps(hb);
        __m128i r;
        if (kind == PC_K_SUM) {
            r = _mm256_cvtps_ph(pc_nan_of_b8(_mm256_add_ps(x, y), y), PC_F16C_ROUND);
        } else if (kind == PC_K_PRODUCT) {
            r = _mm256_cvtps_ph(pc_nan_of_b8(_mm256_mul_ps(x, y), y), PC_F16C_ROUND);
        } else {
            /* keep a where x <= y (x >= y for MAX) or x is NaN: the portable rule */
            __m256 keep = _mm256_or_ps(
                kind == PC_K_MIN ? _mm256_cmp_ps(x, y, _CMP_LE_OQ)
                                 : _mm256_cmp_ps(x, y, _CMP_GE_OQ),
                _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
            __m256i k = _mm256_castps_si256(keep);
            __m128i k16 = _mm_packs_epi32(_mm256_castsi256_si128(k),
                                          _mm256_extractf128_si256(k, 1));
            r = _mm_blendv_epi8(hb, ha, k16);
        }
        _mm_storeu_si128((__m128i*)(out + i), r);
    }
    return i;
}

PC_F16C static size_t pc_half_divide_f16c(uint16_t* buf, size_t n, float d) {
    size_t i = 0;
    __m256 vd = _mm256_set1_ps(d);
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(buf + i)));
        _mm_storeu_si128((__m128i*)(buf + i), _mm256_cvtps_ph(_mm256_div_ps(x, vd),
                                                               PC_F16C_ROUND));
    }
    return i;
}

static int pc_f16c_state = -1;       /* -1: not looked at yet; 0 or 1: the loops in use */

static inline int pc_f16c_usable(void) {
    return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
}

static inline int pc_f16c_on(void) {
    if (pc_f16c_state < 0) pc_f16c_state = pc_f16c_usable();
    return pc_f16c_state;
}
#else
#define PC_HAVE_F16C_LOOPS 0
static inline int pc_f16c_usable(void) { return 0; }
static inline int pc_f16c_on(void) { return 0; }
static int pc_f16c_state = 0;
#endif

/* Turn the F16C loops on or off (a test aid: both paths must agree); the previous
   state.  They stay off where the CPU lacks them. */
static inline int pc_f16c_set(int on) {
    int before = pc_f16c_on();
    pc_f16c_state = on && pc_f16c_usable();
    return before;
}

static void pc_float16_loop(uint16_t* out, const uint16_t* a, const uint16_t* b, size_t n,
                            int kind) {
    size_t done = 0;
#if PC_HAVE_F16C_LOOPS
    if (pc_f16c_on()) done = pc_half_loop_f16c(out, a, b, n, kind);
#endif
    pc_half_loop_portable(out, a, b, n, kind, done);
}

static void pc_float16_divide(uint16_t* buf, size_t n, float d) {
    size_t done = 0;
#if PC_HAVE_F16C_LOOPS
    if (pc_f16c_on()) done = pc_half_divide_f16c(buf, n, d);
#endif
    pc_half_divide_portable(buf, n, d, done);
}

/* -- bfloat16: loops the compiler vectorises ------------------------------------------ */


static inline uint16_t pc_bf16_result(float z, uint16_t b) {
    /* z rounded to bfloat16, or b's NaN (quieted) where b is a NaN: _half.h's rounding
       and pc_nan_of_b spelled out in integers, which the compiler vectorises */
    uint32_t u = pc_float_to_bits(z), yb = (uint32_t)b << 16;
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t r = (u & 0x7fffffffu) > 0x7f800000u ? ((u >> 16) | 0x40u) : rounded;
    return (uint16_t)((yb & 0x7fffffffu) > 0x7f800000u ? (b | 0x40u) : r);
}

PC_CLONES static void pc_bfloat16_loop(uint16_t* out, const uint16_t* a, const uint16_t* b,
                                       size_t n, int kind) {
    size_t i;
    if (kind == PC_K_SUM) {
        for (i = 0; i < n; i++)
            out[i] = pc_bf16_result(pc_bf16_to_float(a[i]) + pc_bf16_to_float(b[i]), b[i]);
    } else if (kind == PC_K_PRODUCT) {
        for (i = 0; i < n; i++)
            out[i] = pc_bf16_result(pc_bf16_to_float(a[i]) * pc_bf16_to_float(b[i]), b[i]);
    } else if (kind == PC_K_MIN) {
        for (i = 0; i < n; i++) {
            float x = pc_bf16_to_float(a[i]), y = pc_bf16_to_float(b[i]);
            out[i] = (x < y || x != x) ? a[i] : b[i];
        }
    } else {
        for (i = 0; i < n; i++) {
            float x = pc_bf16_to_float(a[i]), y = pc_bf16_to_float(b[i]);
            out[i] = (x > y || x != x) ? a[i] : b[i];
        }
    }
}

PC_CLONES static void pc_bfloat16_divide(uint16_t* buf, size_t n, float d) {
    for (size_t i = 0; i < n; i++) buf[i] = pc_float_to_bf16(pc_bf16_to_float(buf[i]) / d);
}
#endif
