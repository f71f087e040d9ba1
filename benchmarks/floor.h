/* What the floor programs of benchmarks/ (tcp_floor.c, tcp_stream_floor.c, barrier_floor.c)
 * share. */
#ifndef PYCOLLECT_BENCH_FLOOR_H
#define PYCOLLECT_BENCH_FLOOR_H

#include <netinet/in.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
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

/* Run this process on CPU ``cpu`` alone: sched_setaffinity's result. */
static inline int on_cpu(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return sched_setaffinity(0, sizeof set, &set);
}

/* A TCP socket listening on a free port of 127.0.0.1, whose address goes into *addr. */
static inline int loopback_listener(struct sockaddr_in* addr) {
    socklen_t len = sizeof *addr;
    int one = 1, fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        die("socket");
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    memset(addr, 0, sizeof *addr);
    addr->sin_family = AF_INET;
    addr->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(fd, (struct sockaddr*)addr, sizeof *addr) < 0 || listen(fd, 1) < 0 ||
        getsockname(fd, (struct sockaddr*)addr, &len) < 0)
        die("listen");
    return fd;
}

#endif
