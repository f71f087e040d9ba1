/* IEEE binary16 and bfloat16 <-> binary32 conversions, round to nearest even,
 * the same rounding NumPy applies, so reductions on half types match it bit
 * for bit. */
#ifndef PYCOLLECT_HALF_H
#define PYCOLLECT_HALF_H
#include <stdint.h>
#include <string.h>

static inline float pc_bits_to_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t pc_float_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float pc_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1f) {                       /* inf or nan */
        return pc_bits_to_float(sign | 0x7f800000u | (man << 13));
    }
    if (exp == 0) {
        if (man == 0) return pc_bits_to_float(sign);
        /* subnormal: value = man * 2^-24 */
        float f = (float)man * 5.9604644775390625e-08f;
        return sign ? -f : f;
    }
    return pc_bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline uint16_t pc_float_to_half(float f) {
    uint32_t u = pc_float_to_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) {                  /* inf or nan; keep nans quiet */
        return sign | 0x7c00u | (a > 0x7f800000u ? (0x200u | ((a >> 13) & 0x3ffu)) : 0u);
    }
    if (a >= 0x477ff000u) return sign | 0x7c00u;   /* rounds to inf */
    if (a < 0x38800000u) {                   /* subnormal or zero in half */
        if (a < 0x33000000u) return sign;    /* below half the smallest subnormal */
        uint32_t e = a >> 23;
        uint32_t m = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e;           /* 14 .. 24 */
        uint32_t h = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (h & 1u))) h += 1u;
        return sign | (uint16_t)h;
    }
    uint32_t h = ((a - 0x38000000u) >> 13);
    uint32_t rem = a & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h += 1u;
    return sign | (uint16_t)h;
}

static inline float pc_bf16_to_float(uint16_t b) { return pc_bits_to_float((uint32_t)b << 16); }

static inline uint16_t pc_float_to_bf16(float f) {
    /* branch-free, so that loops over it vectorise: a NaN keeps its upper bits, quieted */
    uint32_t u = pc_float_to_bits(f);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t quiet = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}
#endif
