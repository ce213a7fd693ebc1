/* SiLU(g) = g / (1 + e^-g) for the kernels that apply it. e^-g is taken at no more than e^88 (finite in float32):
 * past it, 1 + e^-g was infinite, and the division that -ffast-math makes a reciprocal refined by a Newton step
 * turned 0 x infinity into NaN, where SiLU is -0 to float32's precision. Below that bound the value is unchanged. */
#ifndef PAGEDSERVE_SILU_H
#define PAGEDSERVE_SILU_H

#include <math.h>

static inline __attribute__((always_inline)) float silu(float g) { return g / (1.0f + expf(fminf(-g, 88.0f))); }

#endif
