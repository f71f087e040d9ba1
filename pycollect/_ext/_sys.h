/* Small system helpers for the transports: a monotonic clock and the atomic
 * flag that Context.abort() sets from another thread. */
#ifndef PYCOLLECT_SYS_H
#define PYCOLLECT_SYS_H
#include <stdint.h>
#include <time.h>

static inline int64_t pc_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline int pc_atomic_load(int *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void pc_atomic_store(int *p, int v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
#endif
