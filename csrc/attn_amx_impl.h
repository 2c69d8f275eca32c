/* attn_amx_impl.h - the bfloat16 matrix products whose left operand is row-major (A's words
 * (i, x) at a[i lda + x]) on AMX tiles: S = q K^T and P V in the forward, S, dP and dQ in the
 * backward. attn_bf16_impl.h includes it in sets compiled with AMX-BF16 (isa_amx.c).
 *
 * TDPBF16PS multiplies a tile of 16 rows x 16 words of A by one of 16 words x 16 columns of B
 * (word (x, j): the pair of column j at 2x, 2x + 1 along the sum: the layout of kt, vc and the
 * other right operands already) into 16 x 16 floats: 8,192 products per instruction, 16x a
 * float FMA's per cycle on Sapphire Rapids. Tile registers, configured once per work item
 * (bf16_tiles_begin, bf16_tiles_end):
 *   0-3  C: 16 x 16 floats each, a block of C of 2 x 2 tiles (32 rows x 32 columns)
 *   4, 7 A: 16 rows x 16 words, the block's two row tiles
 *   5, 6 B: 16 words x 16 columns, its two column tiles
 * Rows past the last multiple of 16 and words past the last multiple of 16 go to the bfloat16
 * dot products (bf16_gemm): a tile's shape is fixed by the configuration, and reading past
 * an operand's words would read past its buffer.
 */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];     /* bytes per row of each tile register */
    uint8_t rows[16];
} amx_config;

static inline void bf16_tiles_begin(void)
{
    amx_config cfg = {.palette = 1};
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

static inline void bf16_tiles_end(void)
{
    _tile_release();
}

/* C (16 rt x 32 floats, ldc) = or += the sum over terms of A_t (16 rt x k2 words) B_t (k2 x 32
 * words), rt (row tiles) 1 or 2, k2 a multiple of 16. One term is A B; four are float16's
 * split into two bfloat16 (attn_f16_split_impl.h): A B + A (B + boff) + (A + aoff) B
 * + (A + aoff) (B + boff), term t's A offset where t & 2, its B's where t & 1. With
 * two row tiles each B tile loaded serves both (forward 0.90-0.96x the time of one row tile
 * by four column tiles). */
static inline __attribute__((always_inline)) void
amx_block(float *c, int ldc, const uint32_t *a, int lda, or_ssize aoff, const uint32_t *b,
          or_ssize ldb, or_ssize boff, const int terms, int k2, const int rt, int accumulate)
{
    const long sc = 4L * ldc, sa = 4L * lda, sb = 4L * ldb;
    float *c1 = c + (or_ssize)16 * ldc;
    if (accumulate) {
        _tile_loadd(0, c, sc);
        _tile_loadd(1, c + 16, sc);
        if (rt == 2) {
            _tile_loadd(2, c1, sc);
            _tile_loadd(3, c1 + 16, sc);
        }
    } else {
        _tile_zero(0);
        _tile_zero(1);
        if (rt == 2) {
            _tile_zero(2);
            _tile_zero(3);
        }
    }
    for (int t = 0; t < terms; t++) {
        const uint32_t *at = t & 2 ? a + aoff : a, *bt = t & 1 ? b + boff : b;
        const uint32_t *at1 = at + (or_ssize)16 * lda;
        for (int x = 0; x < k2; x += 16) {
            const uint32_t *bx = bt + (or_ssize)x * ldb;
            _tile_loadd(4, at + x, sa);
            _tile_loadd(5, bx, sb);
            _tile_loadd(6, bx + 16, sb);
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 4, 6);
            if (rt == 2) {
                _tile_loadd(7, at1 + x, sa);
                _tile_dpbf16ps(2, 7, 5);
                _tile_dpbf16ps(3, 7, 6);
            }
        }
    }
    _tile_stored(0, c, sc);
    _tile_stored(1, c + 16, sc);
    if (rt == 2) {
        _tile_stored(2, c1, sc);
        _tile_stored(3, c1 + 16, sc);
    }
}

_Static_assert(16 % MR == 0, "rows past the tiles' (m % 16) must be whole micro-kernels: with "
               "MR 12 bf16_gemm wrote 4 rows past a strip's 24");

/* C = mul (sum of terms as amx_block's) or C += it, for a row-major A: whole tiles on AMX, the
 * rest on dot products (bf16_gemm, unscaled), then the scale. m a multiple of MR, n of W (32
 * floats: two column tiles). */
static inline __attribute__((always_inline)) void
tiles_gemm(float *c, int ldc, const uint32_t *a, int lda, or_ssize aoff, const uint32_t *b,
           or_ssize ldb, or_ssize boff, const int terms, int m, int n, int k2, float mul,
           int accumulate)
{
    const int m16 = m / 16 * 16, k16 = k2 / 16 * 16;
    for (int i0 = 0; k16 > 0 && i0 < m16; i0 += 32)
        for (int j0 = 0; j0 < n; j0 += 32) {
            float *cij = c + (or_ssize)i0 * ldc + j0;
            const uint32_t *ai = a + (or_ssize)i0 * lda;
            if (i0 + 32 <= m16)
                amx_block(cij, ldc, ai, lda, aoff, b + j0, ldb, boff, terms, k16, 2, accumulate);
            else
                amx_block(cij, ldc, ai, lda, aoff, b + j0, ldb, boff, terms, k16, 1, accumulate);
        }
    for (int t = 0; t < terms; t++) {
        const uint32_t *at = t & 2 ? a + aoff : a, *bt = t & 1 ? b + boff : b;
        if (k16 < k2)
            bf16_gemm(c, ldc, at + k16, lda, 1, bt + (or_ssize)k16 * ldb, ldb, m16, n, k2 - k16,
                      1, accumulate || k16 > 0 || t > 0);
        if (m16 < m)
            bf16_gemm(c + (or_ssize)m16 * ldc, ldc, at + (or_ssize)m16 * lda, lda, 1, bt, ldb,
                      m - m16, n, k2, 1, accumulate || t > 0);
    }
    if (!accumulate && mul != 1)
        for (int i = 0; i < m; i++)
            for (int j = 0; j < n; j += 16) {
                float *cij = c + (or_ssize)i * ldc + j;
                _mm512_storeu_ps(cij, _mm512_mul_ps(_mm512_loadu_ps(cij), _mm512_set1_ps(mul)));
            }
}

/* bf16_gemm's C = mul A B or C += A B for a row-major A (acs 1), on tiles. */
static inline __attribute__((always_inline)) void
bf16_rows_gemm(float *c, int ldc, const uint32_t *a, int lda, const uint32_t *b, or_ssize ldb,
               int m, int n, int k2, float mul, int accumulate)
{
    tiles_gemm(c, ldc, a, lda, 0, b, ldb, 0, 1, m, n, k2, mul, accumulate);
}

/* Words (c, x) of dst (rows BR / 2 words apart) = elements (2x, c), (2x + 1, c) of src, for
 * pairs of rows [0, pairs) and columns [0, n): q^T and dO^T, the left operands of the
 * backward's dK^T += q^T dS and dV^T += dO^T P. Exact: src holds bfloat16 values, whose bits
 * are a float's upper half. */
static void bf16_column_pairs(uint32_t *dst, const float *src, int lds, int pairs, int n)
{
    for (int x = 0; x < pairs; x++) {
        const uint32_t *lo = (const uint32_t *)(src + (or_ssize)2 * x * lds);
        const uint32_t *hi = lo + lds;
        for (int c = 0; c < n; c++)
            dst[(or_ssize)c * (BR / 2) + x] = lo[c] >> 16 | (hi[c] & 0xFFFF0000u);
    }
}
