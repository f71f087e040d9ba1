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
static inline int pc_atomic_exchange(int *p, int v) {
    return __atomic_exchange_n(p, v, __ATOMIC_ACQ_REL);
}
#endif

#ifndef PYCOLLECT_SYS_ERRNO
#define PYCOLLECT_SYS_ERRNO
#include <errno.h>
/* Cython makes a local of a C global assigned in a function: set errno here. */
static inline void pc_set_errno(int e) { errno = e; }
#endif

#ifndef PYCOLLECT_SYS_ATOMIC64
#define PYCOLLECT_SYS_ATOMIC64
static inline uint64_t pc_load_u64(uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void pc_store_u64(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline void pc_store_u32_sc(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_SEQ_CST); }
static inline uint32_t pc_exchange_u32(uint32_t *p, uint32_t v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
static inline void pc_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
#endif

#ifndef PYCOLLECT_SYS_SPIN
#define PYCOLLECT_SYS_SPIN
/* Spinning on shared memory (the flags path, _flags.pyx): a relaxed-cost load of a
 * 32-bit word and the CPU's spin-wait hint. */
static inline uint32_t pc_load_u32(uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
/* A counter that threads bump at once (statistics: no ordering). */
static inline void pc_count_u64(uint64_t *p) { __atomic_fetch_add(p, 1, __ATOMIC_RELAXED); }
static inline void pc_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}
#endif
