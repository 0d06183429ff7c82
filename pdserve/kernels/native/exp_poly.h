/* e^x as a polynomial (Cephes' expf coefficients, within 2 ulp of expf), scalar C that
 * compilers vectorise. Shared by the kernels in this folder; the build key hashes the
 * headers here with each source (kernels/native/library.py).
 *
 * Precondition: -87.3 <= x <= 88.7 (callers clamp to the range they need: at -87.3 the
 * result is ~1e-38, the smallest normal float; above 88.7 it would overflow). */
#ifndef PD_EXP_POLY_H
#define PD_EXP_POLY_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float pd_exp_in_range(float x) {
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
