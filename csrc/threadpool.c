/* threadpool.c - the worker threads of the native path.
 *
 * One pool per process. A call acquires it (trylock), hands out work items through an atomic
 * counter and joins in as worker 0. A call that finds the pool busy (another Python thread is
 * computing) simply runs its items on its own thread: concurrent calls are safe and never
 * wait for each other. Results never depend on which worker ran an item, so they are
 * bit-identical for every thread count. After fork() the child starts with no workers.
 *
 * Where an OpenMP runtime is loaded in the process (torch's libgomp, as a rule), the items run
 * on its threads instead (GOMP_parallel, which GNU, LLVM and Intel OpenMP all export): between
 * torch's operations those threads spin, waiting for torch's next parallel region, and on the
 * pool's own workers an orchard call shared the cores with them (the demo model's training
 * step: libgomp's spinning was 18 % of its samples, and the step ran at 0.89x of torch SDPA's
 * speed; on torch's threads, 1.02x). ORCHARD_OPENMP=0 keeps the pool's own threads.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dlfcn.h>
#include <limits.h>
#include <link.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "orchard.h"

typedef struct {
    pthread_mutex_t owner;      /* held by the call that uses the workers */
    pthread_mutex_t mu;         /* guards everything below */
    pthread_cond_t wake, done;
    atomic_int nthreads;        /* configured, the calling thread included */
    int started;                /* worker threads created (ids 1..started) */
    unsigned long generation;   /* bumped for every job */
    or_task fn;
    void *ctx;
    or_ssize n_items;
    int nworkers;
    atomic_int finished;        /* workers done with the job (read without mu by the caller) */
    atomic_llong next;
} pool_t;

static pool_t pool = {
    .owner = PTHREAD_MUTEX_INITIALIZER,
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .wake = PTHREAD_COND_INITIALIZER,
    .done = PTHREAD_COND_INITIALIZER,
};
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

/* The process's OpenMP runtime, once one is loaded (and allowed): its entry points, and the
 * count of objects the dynamic linker had loaded when it was last looked for. */
static struct {
    int allowed;
    unsigned long long adds;
    void (*parallel)(void (*fn)(void *), void *data, unsigned nthreads, unsigned flags);
    int (*thread_num)(void);
    char name[64];
} omp;

/* How long a call polls for its workers to finish before it sleeps on pool.done. Their last
 * items end within microseconds of the caller's, as a rule, and a thread that sleeps takes
 * 20-30 us to wake on a VM (a decode step of 0.7 ms was 2 % faster polling). Only the caller
 * polls, inside its own call: workers that finish sleep at once, so that they leave the
 * cores to whatever runs next (polling workers slowed torch's next product, measured). */
#define POLL_NS 50000

static void wait_awake(int nworkers)
{
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 1; atomic_load(&pool.finished) < nworkers - 1; i++) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        __asm__ volatile("yield");
#endif
        if (i % 64 == 0) {
            clock_gettime(CLOCK_MONOTONIC, &t);
            if ((t.tv_sec - t0.tv_sec) * 1000000000L + (t.tv_nsec - t0.tv_nsec) > POLL_NS)
                return;
        }
    }
}

int or_cpu_count(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0)
        return CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static void drain(or_task fn, void *ctx, or_ssize n_items, int worker)
{
    for (;;) {
        long long item = atomic_fetch_add(&pool.next, 1);
        if (item >= n_items)
            return;
        fn(ctx, (or_ssize)item, worker);
    }
}

typedef struct {
    int id;
    unsigned long seen;     /* the generation when it was created: only later jobs are its */
} worker_arg;

static void *worker_main(void *varg)
{
    worker_arg arg = *(worker_arg *)varg;
    int id = arg.id;
    unsigned long seen = arg.seen;
    free(varg);
    pthread_mutex_lock(&pool.mu);
    for (;;) {
        while (pool.generation == seen)
            pthread_cond_wait(&pool.wake, &pool.mu);
        seen = pool.generation;
        if (id >= pool.nworkers)
            continue;
        or_task fn = pool.fn;
        void *ctx = pool.ctx;
        or_ssize n = pool.n_items;
        pthread_mutex_unlock(&pool.mu);
        drain(fn, ctx, n, id);
        pthread_mutex_lock(&pool.mu);
        if (atomic_fetch_add(&pool.finished, 1) + 1 == pool.nworkers - 1)
            pthread_cond_signal(&pool.done);
    }
    return NULL;
}

/* The child of a fork has none of the parent's threads: start from scratch. */
static void after_fork_child(void)
{
    pthread_mutex_init(&pool.owner, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.started = 0;
    pool.generation = 0;
    omp.allowed = 0;    /* an OpenMP team does not survive fork() either (libgomp hangs) */
    omp.parallel = NULL;
}

static int loaded_objects(struct dl_phdr_info *info, size_t size, void *count)
{
    if (size >= offsetof(struct dl_phdr_info, dlpi_subs))
        *(unsigned long long *)count = info->dlpi_adds;
    return 1;   /* the first object tells */
}

static int openmp_object(struct dl_phdr_info *info, size_t size, void *path)
{
    static const char *const names[] = {"libgomp", "libomp", "libiomp5"};
    (void)size;
    const char *base = strrchr(info->dlpi_name, '/');
    base = base != NULL ? base + 1 : info->dlpi_name;
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (strncmp(base, names[i], strlen(names[i])) == 0) {
            snprintf(path, PATH_MAX, "%s", info->dlpi_name);
            return 1;
        }
    return 0;
}

/* Looks for a loaded OpenMP runtime, again only when the dynamic linker has loaded something
 * since the last look (reading its count costs about 0.1 us; a dlopen of a name that is not
 * loaded, 11 us). Called by the pool's owner only. */
static void find_openmp(void)
{
    unsigned long long adds = 0;
    if (!omp.allowed || omp.parallel != NULL)
        return;
    dl_iterate_phdr(loaded_objects, &adds);
    if (adds == omp.adds)
        return;
    omp.adds = adds;
    char path[PATH_MAX] = "";
    if (!dl_iterate_phdr(openmp_object, path))
        return;
    void *lib = dlopen(path, RTLD_LAZY | RTLD_NOLOAD);     /* kept open: it stays loaded */
    if (lib == NULL)
        return;
    *(void **)&omp.thread_num = dlsym(lib, "omp_get_thread_num");
    void *parallel = dlsym(lib, "GOMP_parallel");
    if (omp.thread_num == NULL || parallel == NULL)
        return;
    const char *base = strrchr(path, '/');
    snprintf(omp.name, sizeof(omp.name), "openmp: %s", base != NULL ? base + 1 : path);
    __atomic_store_n((void **)&omp.parallel, parallel, __ATOMIC_RELEASE);  /* after name */
}

/* An ORCHARD_NUM_THREADS that is not a count: the pool takes every CPU, and devices() and
 * every call that resolves a device report it (cpu_info.c) until set_num_threads() sets one. */
static char bad_threads_env[64];

static void pool_init(void)
{
    int n = or_cpu_count();
    const char *env = getenv("ORCHARD_NUM_THREADS");
    if (env != NULL && *env != '\0') {
        char *end;
        const long given = strtol(env, &end, 10);
        if (isdigit((unsigned char)env[0]) && *end == '\0' && given >= 1
            && given <= OR_MAX_THREADS)     /* strtol would take leading spaces and signs */
            n = (int)given;
        else
            snprintf(bad_threads_env, sizeof(bad_threads_env), "%s", env);
    }
    atomic_store(&pool.nthreads, n);
    env = getenv("ORCHARD_OPENMP");
    omp.allowed = env == NULL || env[0] == '\0' || or_env_flag("ORCHARD_OPENMP");
    pthread_atfork(NULL, NULL, after_fork_child);
}

int or_pool_acquire(or_ssize n_items)
{
    pthread_once(&pool_once, pool_init);
    if (n_items <= 1 || pthread_mutex_trylock(&pool.owner) != 0)
        return 1;
    int nthreads = atomic_load(&pool.nthreads);
    int want = nthreads < n_items ? nthreads : (int)n_items;
    find_openmp();
    while (omp.parallel == NULL && pool.started < want - 1) {
        worker_arg *arg = malloc(sizeof(*arg));
        if (arg == NULL)
            break;      /* fewer threads is slower, not wrong */
        arg->id = pool.started + 1;
        arg->seen = pool.generation;    /* stable: only the owner changes it */
        pthread_t tid;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&tid, &attr, worker_main, arg);
        pthread_attr_destroy(&attr);
        if (rc != 0) {
            free(arg);
            break;
        }
        pool.started++;
    }
    if (omp.parallel == NULL && want > pool.started + 1)
        want = pool.started + 1;
    if (want <= 1) {
        pthread_mutex_unlock(&pool.owner);
        return 1;
    }
    return want;
}

typedef struct {
    or_task fn;
    void *ctx;
    or_ssize n_items;
} omp_job;

/* The body of the OpenMP parallel region: every thread of its team (however many it got)
 * takes items until none is left. */
static void omp_body(void *data)
{
    const omp_job *job = data;
    drain(job->fn, job->ctx, job->n_items, omp.thread_num());
}

void or_pool_run(int nworkers, or_ssize n_items, or_task fn, void *ctx)
{
    if (nworkers <= 1) {
        for (or_ssize i = 0; i < n_items; i++)
            fn(ctx, i, 0);
        return;
    }
    atomic_store(&pool.next, 0);
    if (omp.parallel != NULL) {
        omp_job job = {fn, ctx, n_items};
        omp.parallel(omp_body, &job, (unsigned)nworkers, 0);
        return;
    }
    pthread_mutex_lock(&pool.mu);
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n_items = n_items;
    pool.nworkers = nworkers;
    atomic_store(&pool.finished, 0);
    pool.generation++;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);

    drain(fn, ctx, n_items, 0);

    wait_awake(nworkers);
    pthread_mutex_lock(&pool.mu);
    while (pool.finished < nworkers - 1)
        pthread_cond_wait(&pool.done, &pool.mu);
    pthread_mutex_unlock(&pool.mu);
}

void or_pool_release(int nworkers)
{
    if (nworkers > 1)
        pthread_mutex_unlock(&pool.owner);
}

/* Takes effect from the next call; a running call keeps its workers. */
void or_set_num_threads(int n)
{
    pthread_once(&pool_once, pool_init);
    atomic_store(&pool.nthreads, n);
    bad_threads_env[0] = '\0';
}

const char *or_bad_threads_env(void)
{
    pthread_once(&pool_once, pool_init);
    return bad_threads_env[0] ? bad_threads_env : NULL;
}

int or_get_num_threads(void)
{
    pthread_once(&pool_once, pool_init);
    return atomic_load(&pool.nthreads);
}

/* The threads a multithreaded call runs on: "openmp: " and the OpenMP runtime's file name, or
 * "orchard" (the pool's own). */
const char *or_pool_runtime(void)
{
    pthread_once(&pool_once, pool_init);
    if (pthread_mutex_trylock(&pool.owner) == 0) {  /* a running call is using the answer */
        find_openmp();
        pthread_mutex_unlock(&pool.owner);
    }
    return __atomic_load_n((void **)&omp.parallel, __ATOMIC_ACQUIRE) != NULL ? omp.name
                                                                              : "orchard";
}
