/* tiles.cl - the register-tiled matrix product and the tile loads of the tiled family
 * (flash_fwd_tiled.cl, flash_bwd_tiled.cl, flash_decode.cl).
 *
 * A CPU runs a work-group on one core and a work-item on its SIMD lanes, so a work-item there
 * does best what the native path does (csrc/attn_native_impl.h): hold a TM x TN block of the
 * result in registers (TM rows of two VW-lane vectors: 6 x 2 with 8 lanes, 8 x 2 with 16)
 * while the inner dimension streams through. BQ and BK are multiples of STEP, the least
 * common multiple of TM and TN (params.h).
 */
#if OR_FAMILY == OR_FAMILY_TILED
#define TM OR_TM(VW)
#define TN OR_TN(VW)
#define STEP or_tiled_step(VW)
#define DT ((HEAD_D + TN - 1) / TN * TN)       /* a q or k row padded to whole tiles */
#define DVT ((HEAD_DV + TN - 1) / TN * TN)     /* a v row padded to whole tiles */
/* params.h's tile lists, each aligned to a vector */
#define LOCAL_TILE(name, reals) __local real name[reals] __attribute__((aligned(sizeof(realv))));
/* The vector at p in a local tile, where p is a whole number of vectors from the tile's start
 * (the kernels index whole tiles from rows of whole tiles): PoCL (LLVM 15) splits a vstore16
 * into three stores, an aligned vector store is one (4 % faster forward and backward). */
#define TILE_VEC(p) (*(__local realv *)(p))

/* Rows [r0, r0 + rows) of operand slot s of a unit (rows_of), times mul, into a local tile
 * with ld elements between its rows: as rows (dst[r * ld + x]; columns [n, ld) are zero) or,
 * transposed, as n columns (dst[x * ld + r]); rows [rows, pad_rows) are zero. Rows of whole
 * vectors go a vector at a time: PoCL made the element loop 256-bit moves, 6 % of the forward
 * at D 64 on an AVX-512 Xeon (with softmax_cols' maxima by compares, 0.966x its time). Not
 * float16's, whose vectors load_halves reads a lane at a time (common.cl): the forward took
 * 1.15x the time that way. */
inline void load_block(__local real *dst, int ld, int transposed, __global const storage_t *src,
                       __global const long *meta, __global const long *unit, int s, long r0,
                       int rows, int pad_rows, int n, real mul)
{
    or_rows at;
    rows_of(&at, meta, unit, s);
    for (int r = 0; r < pad_rows; r++) {
        const long row = r < rows ? row_at(&at, r0 + r) : 0;
        if (OR_STORAGE != OR_STORAGE_F16 && !transposed && ld % VW == 0) {
            for (int x = 0; x < ld; x += VW)
                TILE_VEC(dst + r * ld + x) = r < rows ? load_vec(src, row, x, n, mul) : (realv)0;
            continue;
        }
        for (int x = 0; x < (transposed ? n : ld); x++)
            dst[transposed ? x * ld + r : r * ld + x] =
                r < rows && x < n ? (real)LOAD(src, row + x) * mul : 0;
    }
}

/* Whether scores of keys [j0, j0 + cols) in the row aligned with key `diag` need
 * transform_score: softcap or ALiBi, or a mask edge inside the block. */
inline int needs_transform(const or_params *p, long diag, long j0, int cols)
{
    return p->softcap > 0 || p->has_alibi || (p->left >= 0 && j0 < diag - p->left)
           || (p->right >= 0 && j0 + cols - 1 > diag + p->right);
}

/* c (rows x cols, row stride ldc) = or += a (rows x n) * b (n x cols, row stride ldb), where
 * a's element (i, x) is a[i * ars + x * acs], so that a may be read transposed; rows is a
 * multiple of TM, cols and ldc of TN, c whole vectors from its tile's start. Always inlined:
 * PoCL kept it a function whose strides and `accumulate` were run-time values, an address
 * computation per row of a in the inner loop (forwards 4-5 % faster inlined). */
inline __attribute__((always_inline)) void
tile_product(__local real *c, int ldc, __local const real *a, int ars, int acs,
             __local const real *b, int ldb, int rows, int cols, int n, int accumulate)
{
    for (int i0 = 0; i0 < rows; i0 += TM) {
        for (int j0 = 0; j0 < cols; j0 += TN) {
            realv acc[TM][2];
            /* unrolled, so that the accumulators live in registers */
#pragma unroll
            for (int i = 0; i < TM; i++) {
                acc[i][0] = accumulate ? TILE_VEC(c + (i0 + i) * ldc + j0) : (realv)0;
                acc[i][1] = accumulate ? TILE_VEC(c + (i0 + i) * ldc + j0 + VW) : (realv)0;
            }
            for (int x = 0; x < n; x++) {
                const realv b0 = CAT(vload, VW)(0, b + x * ldb + j0);
                const realv b1 = CAT(vload, VW)(0, b + x * ldb + j0 + VW);
#pragma unroll
                for (int i = 0; i < TM; i++) {
                    const real av = a[(i0 + i) * ars + x * acs];
                    acc[i][0] += av * b0;
                    acc[i][1] += av * b1;
                }
            }
#pragma unroll
            for (int i = 0; i < TM; i++) {
                TILE_VEC(c + (i0 + i) * ldc + j0) = acc[i][0];
                TILE_VEC(c + (i0 + i) * ldc + j0 + VW) = acc[i][1];
            }
        }
    }
}
#endif
