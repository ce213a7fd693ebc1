/* A float rounded to bfloat16 as torch rounds it (to nearest, ties to even; NaN stays NaN): the
 * kernels whose output feeds a product that takes bfloat16 rows (cpu_gemm.c) write them so, and no
 * separate pass converts their float32 output. Bit tests only, so -ffast-math keeps the NaN case. */
#ifndef PAGEDSERVE_BFLOAT16_H
#define PAGEDSERVE_BFLOAT16_H

#include <stdint.h>
#include <string.h>

static inline uint16_t bfloat16_of(float value)
{
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#endif
