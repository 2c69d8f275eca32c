/* philox.h - the dropout random stream: Philox4x32-10 (Salmon et al., SC'11).
 *
 * A counter-based generator: the keep-decision of score (batch-head bh, row i, column j) is
 * a pure function of (seed, bh, i, j), so backward regenerates the mask instead of storing
 * it, and every backend draws the same one.
 *   key     = (seed lo, seed hi)
 *   counter = (j / 4, i, bh lo, bh hi);   word j % 4 of the output block
 *   keep    = word >= threshold,          threshold = floor(p * 2^32)
 * kernels/ repeats this definition in OpenCL C; tests check both against Random123's vectors.
 */
#ifndef ORCHARD_PHILOX_H
#define ORCHARD_PHILOX_H

#include <stdint.h>

static inline void or_philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1)
{
    for (int round = 0; round < 10; round++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c[0];
        uint64_t p1 = (uint64_t)0xCD9E8D57u * c[2];
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c[1] ^ k0;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c[3] ^ k1;
        c[1] = (uint32_t)p1;
        c[3] = (uint32_t)p0;
        c[0] = n0;
        c[2] = n2;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
}

static inline uint32_t or_dropout_threshold(double p)
{
    return (uint32_t)(p * 4294967296.0);
}

/* keep[c] = 1 if score (bh, row, j0 + c) survives dropout, for c in [0, n). */
static inline void or_dropout_row(uint64_t seed, uint64_t bh, uint32_t row, uint32_t j0,
                                  int n, uint32_t threshold, unsigned char *keep)
{
    uint32_t block = UINT32_MAX;
    uint32_t w[4] = {0, 0, 0, 0};
    for (int c = 0; c < n; c++) {
        uint32_t j = j0 + (uint32_t)c;
        if (j / 4 != block) {
            block = j / 4;
            w[0] = block;
            w[1] = row;
            w[2] = (uint32_t)bh;
            w[3] = (uint32_t)(bh >> 32);
            or_philox4x32_10(w, (uint32_t)seed, (uint32_t)(seed >> 32));
        }
        keep[c] = w[j % 4] >= threshold;
    }
}

#endif
