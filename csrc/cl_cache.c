/* cl_cache.c - built OpenCL program binaries on disk, so that a second process skips the
 * compiler.
 *
 * Directory: ORCHARD_CACHE_DIR, else $XDG_CACHE_HOME/orchard (an absolute path's), else
 * ~/.cache/orchard (made 0700; files 0600), the one answer for Python too
 * (orchard_ops.cache_dir(), also in a build without OpenCL). ORCHARD_NO_CACHE=1 turns the
 * cache off. A file is
 *   "ORCHARD-CL-BIN-2", the key (32 hex digits), u64 size, u64 checksum (FNV-1a of the
 *   binary), the binary
 * named by the key, a 128-bit hash of the kernel source, build options, device, driver and
 * platform; the key inside is checked too, so a file copied over another entry's name is
 * not run as that program. Tuned block sizes (cl_runtime.c) are entries of the same kind,
 * holding "BQ BK". Anything that does not check out (truncated, corrupt, foreign, not a
 * regular file) is ignored and rebuilt;
 * files are written to a temporary name, synced and renamed, so readers never see half a file.
 * The cache keeps at most CACHE_BYTES of entries: each store past it removes the least
 * recently used (a load marks an entry used: its mtime) down to three quarters of it, so that
 * the binaries of kernels that changed (each orchard version's, each build option's) do not
 * pile up; entries under KEEP_BYTES (tuned block sizes: a few bytes) are kept, and so is the
 * one just stored. A temporary file a killed store left goes after STALE_SECONDS.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cl_runtime.h"
#include "orchard.h"

/* Caching off for a reason the user did not ask for: said once in the log, so that a process
 * that rebuilds every program shows why (an unset HOME had turned it off without a word). */
static __attribute__((format(printf, 1, 2))) int cache_off(const char *fmt, ...)
{
    static int warned;
    if (!__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED)) {
        char line[4400];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(line, sizeof(line), fmt, ap);
        va_end(ap);
        or_log("orchard: the OpenCL program cache is off: %s", line);
    }
    return 0;
}

/* The cache directory (created), or 0 when caching is off (ORCHARD_NO_CACHE) or impossible. */
int or_cache_dir(char *out, size_t size)
{
    if (or_env_flag("ORCHARD_NO_CACHE"))
        return 0;
    const char *dir = getenv("ORCHARD_CACHE_DIR"), *xdg = getenv("XDG_CACHE_HOME"),
               *home = getenv("HOME");
    int n;
    if (dir != NULL && dir[0] != '\0')
        n = snprintf(out, size, "%s", dir);
    else if (xdg != NULL && xdg[0] == '/')     /* a relative one is ignored (XDG's spec) */
        n = snprintf(out, size, "%s/orchard", xdg);
    else if (home != NULL && home[0] != '\0')
        n = snprintf(out, size, "%s/.cache/orchard", home);
    else
        return cache_off("no folder is named (ORCHARD_CACHE_DIR, an absolute XDG_CACHE_HOME "
                         "or HOME)");
    if (n <= 0 || (size_t)n >= size)
        return cache_off("its folder's name is too long");
    for (char *p = out + 1; *p; p++) {          /* mkdir -p, private to the user */
        if (*p != '/')
            continue;
        *p = '\0';
        int rc = mkdir(out, 0700);
        *p = '/';
        if (rc != 0 && errno != EEXIST)
            return cache_off("%s cannot be made (%s)", out, strerror(errno));
    }
    struct stat st;     /* EEXIST: it may be a file */
    if (mkdir(out, 0700) == 0)
        return 1;
    if (errno != EEXIST)
        return cache_off("%s cannot be made (%s)", out, strerror(errno));
    if (stat(out, &st) != 0 || !S_ISDIR(st.st_mode))
        return cache_off("%s is not a folder", out);
    /* its binaries are loaded and run (native code on PoCL): only from a folder that no one
     * else owns or may write to */
    if (st.st_uid == geteuid() && !(st.st_mode & (S_IWGRP | S_IWOTH)))
        return 1;
    return cache_off("%s is %s", out, st.st_uid != geteuid() ? "another user's"
                                                             : "writable by others");
}

#ifdef ORCHARD_HAVE_OPENCL
static const char MAGIC[16] = "ORCHARD-CL-BIN-2";
enum { KEY_LEN = 32, KEEP_BYTES = 4096, STALE_SECONDS = 3600 };
static const uint64_t CACHE_BYTES = (uint64_t)256 << 20;

static uint64_t fnv1a(uint64_t h, const void *data, size_t n)
{
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

void or_cache_key(char out[33], const char *const *parts, int nparts)
{
    uint64_t a = 0xcbf29ce484222325ULL, b = 0x84222325cbf29ce4ULL;
    for (int i = 0; i < nparts; i++) {
        size_t n = strlen(parts[i]) + 1;        /* the NUL separates the parts */
        a = fnv1a(a, parts[i], n);
        b = fnv1a(b ^ (uint64_t)i, parts[i], n);
    }
    snprintf(out, 33, "%016llx%016llx", (unsigned long long)a, (unsigned long long)b);
}

unsigned char *or_cache_load(const char *key, size_t *size)
{
    char dir[4096], path[4200];
    if (!or_cache_dir(dir, sizeof(dir)))
        return NULL;
    snprintf(path, sizeof(path), "%s/%s.clbin", dir, key);
    /* O_NONBLOCK: a FIFO in an entry's place must not hang the open */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    struct stat st;
    if (fd >= 0 && (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))) {
        close(fd);
        return NULL;
    }
    FILE *f = fd >= 0 ? fdopen(fd, "rb") : NULL;
    if (f == NULL) {
        if (fd >= 0)
            close(fd);
        return NULL;
    }
    char magic[16], stored_key[KEY_LEN];
    uint64_t n = 0, sum = 0;
    unsigned char *bin = NULL;
    if (fread(magic, 1, 16, f) == 16 && memcmp(magic, MAGIC, 16) == 0
        && fread(stored_key, 1, KEY_LEN, f) == KEY_LEN
        && memcmp(stored_key, key, KEY_LEN) == 0
        && fread(&n, sizeof(n), 1, f) == 1 && fread(&sum, sizeof(sum), 1, f) == 1
        && n > 0 && n < ((uint64_t)1 << 31) && (bin = malloc(n)) != NULL) {
        if (fread(bin, 1, n, f) != n || fgetc(f) != EOF
            || fnv1a(0xcbf29ce484222325ULL, bin, n) != sum) {
            free(bin);
            bin = NULL;
        }
    }
    if (bin != NULL)
        futimens(fileno(f), NULL);      /* used now (prune's order); read-only: never mind */
    fclose(f);
    *size = bin ? (size_t)n : 0;
    return bin;
}

typedef struct {
    struct timespec used;
    off_t size;
    char name[KEY_LEN + 7];     /* key ".clbin" */
} cache_entry;

/* 1 for an entry's name (key ".clbin"), 2 for a store's temporary file (key ".clbin.XXXXXX"),
 * else 0. */
static int entry_name(const char *name)
{
    for (int i = 0; i < KEY_LEN; i++)
        if (!((name[i] >= '0' && name[i] <= '9') || (name[i] >= 'a' && name[i] <= 'f')))
            return 0;
    if (strncmp(name + KEY_LEN, ".clbin", 6) != 0)
        return 0;
    const char *rest = name + KEY_LEN + 6;
    if (*rest == '\0')
        return 1;
    return rest[0] == '.' && strlen(rest) == 7 ? 2 : 0;     /* mkstemp's ".XXXXXX" */
}

static int less_recently_used(const void *pa, const void *pb)
{
    const struct timespec *a = &((const cache_entry *)pa)->used,
                          *b = &((const cache_entry *)pb)->used;
    if (a->tv_sec != b->tv_sec)
        return a->tv_sec < b->tv_sec ? -1 : 1;
    return (a->tv_nsec > b->tv_nsec) - (a->tv_nsec < b->tv_nsec);
}

/* Removes the least recently used entries of dir but `kept` (a name) while they come to more
 * than CACHE_BYTES, and stale temporary files (see the top of this file). Best effort: an
 * entry another process removed counts as removed, one this user cannot remove is passed
 * over. */
static void prune(const char *dir, const char *kept)
{
    DIR *d = opendir(dir);
    if (d == NULL)
        return;
    cache_entry *list = NULL;
    size_t n = 0, room = 0;
    uint64_t total = 0;
    const time_t now = time(NULL);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        struct stat st;
        const int kind = entry_name(e->d_name);
        if (kind == 0 || strcmp(e->d_name, kept) == 0
            || fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0
            || !S_ISREG(st.st_mode))
            continue;
        if (kind == 2) {
            if (now - st.st_mtime > STALE_SECONDS)
                unlinkat(dirfd(d), e->d_name, 0);
            continue;
        }
        if (st.st_size < KEEP_BYTES)
            continue;
        if (n == room) {
            cache_entry *grown = realloc(list, (room = room ? 2 * room : 256) * sizeof(*list));
            if (grown == NULL)
                break;
            list = grown;
        }
        list[n].used = st.st_mtim;
        list[n].size = st.st_size;
        memcpy(list[n].name, e->d_name, sizeof(list[n].name));
        total += (uint64_t)st.st_size;
        n++;
    }
    if (total > CACHE_BYTES) {
        qsort(list, n, sizeof(*list), less_recently_used);
        for (size_t i = 0; i < n && total > CACHE_BYTES / 4 * 3; i++)
            if (unlinkat(dirfd(d), list[i].name, 0) == 0 || errno == ENOENT)
                total -= (uint64_t)list[i].size;
    }
    free(list);
    closedir(d);
}

/* 1 when stored; failing to write the cache is not an error, it is an optimisation. */
int or_cache_store(const char *key, const unsigned char *binary, size_t size)
{
    char dir[4096], path[4200], tmp[4300];
    if (!or_cache_dir(dir, sizeof(dir)))
        return 0;
    snprintf(path, sizeof(path), "%s/%s.clbin", dir, key);
    snprintf(tmp, sizeof(tmp), "%s.XXXXXX", path);
    int fd = mkstemp(tmp);                      /* created 0600 */
    if (fd < 0)
        return 0;
    uint64_t n = size, sum = fnv1a(0xcbf29ce484222325ULL, binary, size);
    FILE *f = fdopen(fd, "wb");
    int ok = f != NULL && fwrite(MAGIC, 1, 16, f) == 16 && fwrite(key, 1, KEY_LEN, f) == KEY_LEN
             && fwrite(&n, sizeof(n), 1, f) == 1
             && fwrite(&sum, sizeof(sum), 1, f) == 1 && fwrite(binary, 1, size, f) == size
             && fflush(f) == 0 && fsync(fd) == 0;
    if (f != NULL)
        ok = (fclose(f) == 0) && ok;
    else
        close(fd);
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return 0;
    }
    prune(dir, path + strlen(dir) + 1);
    return 1;
}
#endif
