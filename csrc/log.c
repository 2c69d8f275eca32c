/* log.c - the optional diagnostic logs (ORCHARD_DEBUG_FLASH_ATN, ORCHARD_TENSOR_PROFILE),
 * written to the file named by ORCHARD_LOG, or to stderr. The environment is read on every
 * call so that tests and notebooks can switch logging on and off at run time. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "pyorchard.h"

int or_env_flag(const char *env_name)
{
    static const char *const off[] = {"0", "false", "no", "off"};
    const char *v = getenv(env_name);
    if (v == NULL || v[0] == '\0')
        return 0;
    for (size_t i = 0; i < sizeof(off) / sizeof(*off); i++)
        if (strcasecmp(v, off[i]) == 0)
            return 0;
    return 1;
}

void or_log(const char *fmt, ...)
{
    const char *path = getenv("ORCHARD_LOG");
    FILE *f = (path != NULL && path[0] != '\0') ? fopen(path, "a") : stderr;
    if (f == NULL) {            /* the line still comes out, saying why it is here */
        f = stderr;
        fprintf(f, "(ORCHARD_LOG='%.200s' cannot be opened: %s) ", path, strerror(errno));
    }
    va_list ap;
    va_start(ap, fmt);
    vfprintf(f, fmt, ap);
    va_end(ap);
    fputc('\n', f);
    if (f != stderr)
        fclose(f);
    else
        fflush(f);
}
