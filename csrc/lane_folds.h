/* lane_folds.h - the lane lists of a pairwise fold of vectors, for the instance that includes it
 * (attn_native_impl.h, once per REAL and instruction set; it replaces the last instance's).
 *
 * FOLD_E<b> and FOLD_O<b>, for blocks of b lanes, are __builtin_shufflevector lane lists over
 * two vectors x, y of FOLD_LANES lanes: adding (or taking the max of) the two shuffles gives a
 * vector whose first half holds, for each pair of blocks 2k, 2k + 1 of x, their lane-wise sum
 * (block k of the result; the same offset in each block), and whose second half holds the same
 * of y. So values held in blocks of x and y stay in order, each in half as many lanes; log2 of
 * the lane count such folds turn one vector per row into one vector of row totals, with 2
 * shuffles and one operation per fold where reducing each row alone takes a chain of scalar
 * operations.
 */
#undef FOLD_LANES
#undef FOLD_E1
#undef FOLD_O1
#undef FOLD_E2
#undef FOLD_O2
#undef FOLD_E4
#undef FOLD_O4
#undef FOLD_E8
#undef FOLD_O8

#define FOLD_LANES (VBYTES / REAL_SIZE)
#if FOLD_LANES == 16
#define FOLD_E8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define FOLD_O8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define FOLD_E4 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define FOLD_O4 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define FOLD_E2 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define FOLD_O2 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define FOLD_E1 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define FOLD_O1 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
#elif FOLD_LANES == 8
#define FOLD_E4 0, 1, 2, 3, 8, 9, 10, 11
#define FOLD_O4 4, 5, 6, 7, 12, 13, 14, 15
#define FOLD_E2 0, 1, 4, 5, 8, 9, 12, 13
#define FOLD_O2 2, 3, 6, 7, 10, 11, 14, 15
#define FOLD_E1 0, 2, 4, 6, 8, 10, 12, 14
#define FOLD_O1 1, 3, 5, 7, 9, 11, 13, 15
#elif FOLD_LANES == 4
#define FOLD_E2 0, 1, 4, 5
#define FOLD_O2 2, 3, 6, 7
#define FOLD_E1 0, 2, 4, 6
#define FOLD_O1 1, 3, 5, 7
#elif FOLD_LANES == 2
#define FOLD_E1 0, 2
#define FOLD_O1 1, 3
#else
#error "lane_folds.h: vectors of 2, 4, 8 or 16 lanes"
#endif
