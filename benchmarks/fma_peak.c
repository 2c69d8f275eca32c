/* fma_peak.c - the machine's float32 FMA peak, measured: the roof of a float32 attention
 * kernel, which is matrix products and little else. kernel_targets.py builds it as a shared
 * library for the machine at hand and times it beside the kernels in each round:
 *
 *     cc -O2 -march=native -shared -fPIC -pthread benchmarks/fma_peak.c -o fma_peak.so
 *
 * fma_peak(threads, iters) runs `threads` threads at once (the kernels' thread count: cores of
 * a VM may share a physical core, and two threads then reach less than twice one), each
 * `iters` times updating ACC independent vectors with one FMA each, held in registers: nothing
 * but FMAs, as many in flight as the FMA units can take, so no kernel does its products faster.
 * Returns the float operations done (2 per lane and FMA).
 */
#include <pthread.h>
#include <stddef.h>

/* The widest vectors the compiler was given, and as many accumulators as fit in the vector
 * registers beside the two operands (32 registers with AVX-512, 16 below it). */
#if defined(__AVX512F__)
#define VEC_BYTES 64
#define ACC 24
#elif defined(__AVX__)
#define VEC_BYTES 32
#define ACC 12
#else
#define VEC_BYTES 16
#define ACC 12
#endif
typedef float vec __attribute__((vector_size(VEC_BYTES)));

struct job {
    long iters;
    volatile float sink;     /* written, so that the loop stays, even where run() is inlined */
};

static void *run(void *arg)
{
    struct job *job = arg;
    /* acc -> acc * m + a converges (|m| < 1): no overflow, no subnormals, however long */
    const vec m = (vec){0} + 0.999999f, a = (vec){0} + 1e-3f;
    vec acc[ACC];
    for (int i = 0; i < ACC; i++)
        acc[i] = (vec){0} + (float)i;
    for (long n = 0; n < job->iters; n++) {
#pragma GCC unroll 32
        for (int i = 0; i < ACC; i++)
            acc[i] = acc[i] * m + a;
    }
    float s = 0;
    for (int i = 0; i < ACC; i++)
        for (int l = 0; l < (int)(VEC_BYTES / sizeof(float)); l++)
            s += acc[i][l];
    job->sink = s;      /* the result is used: the loop cannot be dropped */
    return NULL;
}

double fma_peak(int threads, long iters)
{
    enum { MAX_THREADS = 256 };
    pthread_t tid[MAX_THREADS];
    struct job jobs[MAX_THREADS];
    if (threads < 1 || threads > MAX_THREADS || iters < 1)
        return -1;
    for (int t = 0; t < threads; t++)
        jobs[t].iters = iters;
    /* the calling thread runs job 0, as orchard's pool joins its calls: on one thread nothing
     * waits for another core to wake (a VM's idle vCPU took a good part of a millisecond, and
     * products.py's few-millisecond peaks read 20 % low) */
    int started = 1;
    for (; started < threads; started++)
        if (pthread_create(&tid[started], NULL, run, &jobs[started]) != 0)
            break;
    run(&jobs[0]);
    for (int t = 1; t < started; t++)
        pthread_join(tid[t], NULL);
    if (started < threads)
        return -1;
    return 2.0 * (VEC_BYTES / sizeof(float)) * ACC * (double)iters * threads;
}
