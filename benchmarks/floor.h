/* What the floor programs of benchmarks/ (tcp_floor.c, tcp_stream_floor.c, barrier_floor.c)
 * share. */
#ifndef PYCOLLECT_BENCH_FLOOR_H
#define PYCOLLECT_BENCH_FLOOR_H

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

/* Seconds on the monotonic clock. */
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Say what failed (with errno's words) and exit. */
static void die(const char* what) {
    perror(what);
    exit(1);
}

#endif
