/* What the floor programs of benchmarks/ (tcp_floor.c, tcp_stream_floor.c, barrier_floor.c)
 * share. */
#ifndef PYCOLLECT_BENCH_FLOOR_H
#define PYCOLLECT_BENCH_FLOOR_H

#include <errno.h>
#include <netinet/in.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

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

/* How many CPUs this process may run on: its affinity mask's count (else the CPUs online). */
static inline int cpus_allowed(void) {
    cpu_set_t set;
    long online;
    if (sched_getaffinity(0, sizeof set, &set) == 0)
        return CPU_COUNT(&set);
    online = sysconf(_SC_NPROCESSORS_ONLN);
    return online > 0 ? (int)online : 1;
}

/* Whether ``text`` is a whole decimal integer (no other characters), then in *value. */
static inline int parse_long(const char* text, long* value) {
    char* end;
    errno = 0;
    *value = strtol(text, &end, 10);
    return end != text && *end == '\0' && errno == 0;
}

/* Whether ``text`` is a whole number (no other characters), then in *value. */
static inline int parse_double(const char* text, double* value) {
    char* end;
    errno = 0;
    *value = strtod(text, &end);
    return end != text && *end == '\0' && errno == 0;
}

/* Whether ``text`` asks for the usage (-h or --help). */
static inline int asks_help(const char* text) {
    return strcmp(text, "-h") == 0 || strcmp(text, "--help") == 0;
}

/* fork() with stdout and stderr flushed first, so that a child leaving through exit() (die)
 * cannot print again what the parent had buffered. */
static inline pid_t fork_flushed(void) {
    fflush(NULL);
    return fork();
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
