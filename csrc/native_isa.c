/* native_isa.c - which native kernel set runs: the widest this CPU supports (default_set), chosen
 * once at import (or named by ORCHARD_ISA), switchable with orchard_ops.set_native_isa(). */
#include <string.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "native.h"

extern const or_kernels or_kernels_baseline;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
extern const or_kernels or_kernels_avx2, or_kernels_avx512, or_kernels_avx512bf16, or_kernels_amx;
#define OR_X86_SETS 1

/* Linux gives a process AMX's tile state (8 KB a thread) only when it asks; without it the
 * first tile instruction is SIGILL. Asking again is harmless. */
static int amx_granted(void)
{
#if defined(__linux__)
    return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16")
           && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                      18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return 0;
#endif
}
#endif

/* The sets this CPU runs, narrowest first: each is compiled for an x86-64 level (isa_*.c),
 * which __builtin_cpu_supports checks whole, including that the OS saves the vector registers. */
int or_native_isas(const or_kernels **out, int max)
{
    int n = 0;
    if (n < max)
        out[n++] = &or_kernels_baseline;
#ifdef OR_X86_SETS
    __builtin_cpu_init();
    const int v3 = __builtin_cpu_supports("x86-64-v3"), v4 = __builtin_cpu_supports("x86-64-v4");
    if (v3 && n < max)
        out[n++] = &or_kernels_avx2;
    if (v4 && n < max)
        out[n++] = &or_kernels_avx512;
    const int bf16 = v4 && __builtin_cpu_supports("avx512bf16");
    if (bf16 && n < max)
        out[n++] = &or_kernels_avx512bf16;
    if (bf16 && amx_granted() && n < max)
        out[n++] = &or_kernels_amx;
#endif
    return n;
}

/* The set chosen at import: the widest, but bfloat16 dot products without AMX tiles only on
 * AMD's CPUs (Zen 4 on: VDPBF16PS at a float FMA's rate, 2.0x its products,
 * benchmarks/bf16_dot.c); Intel's Sapphire Rapids issues it at half rate (0.51x), where the
 * float kernels are faster unless AMX takes the products (README "Kernel targets"). */
static const or_kernels *default_set(void)
{
    const or_kernels *sets[OR_MAX_KERNEL_SETS];
    const int n = or_native_isas(sets, OR_MAX_KERNEL_SETS);
#ifdef OR_X86_SETS
    if (sets[n - 1] == &or_kernels_avx512bf16 && !__builtin_cpu_is("amd"))
        return sets[n - 2];
#endif
    return sets[n - 1];
}

static const or_kernels *chosen;

const or_kernels *or_native_kernels(void)
{
    const or_kernels *k = __atomic_load_n(&chosen, __ATOMIC_ACQUIRE);
    if (k == NULL) {
        k = default_set();
        __atomic_store_n(&chosen, k, __ATOMIC_RELEASE);
    }
    return k;
}

int or_set_native_isa(const char *name)
{
    const or_kernels *sets[OR_MAX_KERNEL_SETS];
    const int n = or_native_isas(sets, OR_MAX_KERNEL_SETS);
    for (int i = 0; i < n; i++)
        if (strcmp(sets[i]->name, name) == 0) {
            __atomic_store_n(&chosen, sets[i], __ATOMIC_RELEASE);
            return 0;
        }
    return -1;
}
