/* What a barrier of more ranks than cores costs the scheduler alone: the floor under
 * pycollect's (and MPI's) 4-rank barrier on a 2-core machine in benchmarks/compare.py.
 *
 *     cc -O2 -o /tmp/barrier_floor benchmarks/barrier_floor.c && /tmp/barrier_floor
 *     /tmp/barrier_floor 4 2        # ranks, cores (default: 4, the CPUs this process may use)
 *
 * Ranks are processes bound as pycollect-run --bind core binds them (rank r to CPU r mod
 * cores).  Each barrier is what pycollect's flag-area barrier does with nothing else: a
 * rank stores its barrier number in its own cache line of a shared mapping and waits until
 * every other rank's line holds at least that number, 100,000 times after 2,000 for
 * warmup.  While it waits it does one of three things between two looks:
 *
 *   yield to a mate:  sched_yield() while a rank bound to its CPU has not posted yet (that
 *                     rank cannot post unless this one gives up the CPU), else the pause
 *                     instruction (the ranks it waits for run on other CPUs);
 *   ... and every 8th: the same, and sched_yield() on every eighth look besides (what
 *                     pycollect's flags wait does: _flags.pyx, _wait and _spin_once);
 *   always yield:     sched_yield() on every look;
 *   ... and hand over: as "... and every 8th", and a rank that finds the barrier complete
 *                     while a mate that entered it before this rank has not left it yet
 *                     yields until it has: the ranks of a CPU leave in the order they
 *                     came, so a CPU's ranks keep their order from barrier to barrier (what
 *                     MPI's calls show here: benchmarks/compare.py's per-rank times).
 *
 *     /tmp/barrier_floor 4 2 0.8    # ... and 0.8 us of the caller's own work after each call
 *
 * The work (a spin on the clock) stands for what a caller does between two barriers (a
 * Python loop, the library's call path): it is on the CPU while a mate waits.
 *
 * Printed for each: the period (the run's time over its barriers), and two figures of
 * the calls as compare.py sees them: the median over calls of the slowest rank's time in
 * the call (compare.py's p50) and the slowest rank's mean time in its calls (OSU's
 * average).  Where two ranks share a CPU, a call that a rank enters first lasts until its
 * mate has had the CPU and posted, so calls split into a short and a long mode and the
 * median lands on either: the median can sit well above the period.  Without the hand-over
 * the rank that completes a barrier leaves first and enters the next one first, so each
 * CPU switches once a barrier and its two ranks take turns at the long call, which spans
 * the mate's two passes through the caller's work and two switches: p50 = period + one
 * switch.  With it each CPU switches twice a barrier (period + one switch), and the long
 * call spans one pass of work less.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "floor.h"

enum { BARRIERS = 100000, WARMUP = 2000, MAX_RANKS = 64, EVERY = 8 };
enum { YIELD_TO_MATE, YIELD_EIGHTH, YIELD_ALWAYS, HAND_OVER, WAYS };
static const char* WAY_NAME[WAYS] = {"yield to a mate", "... and every 8th", "always yield",
                                     "... and hand over"};

typedef struct {
    volatile long posted;       /* the barrier this rank entered last */
    volatile long left;         /* ... and the one it left last */
    char pad[64 - 2 * sizeof(long)];
} Line;

static int by_value(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}

/* The caller's own work between two barriers: ``us`` microseconds on the CPU. */
static void work(double us) {
    double until = now() + us * 1e-6;
    while (now() < until) {}
}

/* Whether a rank bound to this rank's CPU entered barrier ``k`` and has not left it. */
static int mate_inside(const Line* lines, int me, int ranks, int cores, long k) {
    for (int q = me % cores; q < ranks; q += cores)
        if (q != me && lines[q].posted >= k && lines[q].left < k) return 1;
    return 0;
}

/* Rank ``me``'s part: its calls' times into took[me * BARRIERS ...]. */
static void run_rank(Line* lines, double* took, int me, int ranks, int cores, int way,
                     double work_us) {
    if (on_cpu(me % cores) < 0) die("sched_setaffinity");
    for (long k = 1; k <= WARMUP + BARRIERS; k++) {
        double t0 = now();
        unsigned looks = 0;
        int after_mate = mate_inside(lines, me, ranks, cores, k);   /* a mate came first */
        lines[me].posted = k;
        for (int p = 0; p < ranks; p++) {
            while (p != me && lines[p].posted < k) {
                int mate_missing = 0;
                for (int q = me % cores; q < ranks; q += cores)
                    if (q != me && lines[q].posted < k) mate_missing = 1;
                looks++;
                if (mate_missing || way == YIELD_ALWAYS ||
                    ((way == YIELD_EIGHTH || way == HAND_OVER) && looks % EVERY == 0))
                    sched_yield();
                else
                    _mm_pause();
            }
        }
        if (way == HAND_OVER && after_mate)
            while (mate_inside(lines, me, ranks, cores, k)) sched_yield();
        lines[me].left = k;
        if (k > WARMUP) took[(long)me * BARRIERS + (k - WARMUP - 1)] = now() - t0;
        work(work_us);
    }
}

int main(int argc, char** argv) {
    int ranks = argc > 1 ? atoi(argv[1]) : 4, cores;
    double work_us = argc > 3 ? atof(argv[3]) : 0.0;
    cpu_set_t mine;
    if (sched_getaffinity(0, sizeof mine, &mine) < 0) die("sched_getaffinity");
    cores = argc > 2 ? atoi(argv[2]) : CPU_COUNT(&mine);
    if (argc > 4 || ranks < 2 || ranks > MAX_RANKS || cores < 1 || !(work_us >= 0)) {
        fprintf(stderr, "usage: %s [ranks 2..%d] [cores] [work us]\n", argv[0], MAX_RANKS);
        return 2;
    }
    printf("%d ranks on %d CPUs (rank r on CPU r mod %d), %d barriers each way, %.2f us of "
           "work after each\n", ranks, cores, cores, BARRIERS, work_us);
    printf("%-20s %9s %9s %9s  (us)\n", "wait", "period", "p50", "average");
    for (int way = 0; way < WAYS; way++) {
        size_t bytes = (size_t)ranks * BARRIERS * sizeof(double);
        Line* lines = mmap(NULL, MAX_RANKS * sizeof(Line), PROT_READ | PROT_WRITE,
                           MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        double* took = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                            -1, 0);
        double* slowest = malloc(BARRIERS * sizeof(double));
        double start, period, mean = 0, sum;
        if (lines == MAP_FAILED || took == MAP_FAILED || slowest == NULL) die("memory");
        start = now();
        for (int r = 1; r < ranks; r++) {
            pid_t child = fork();
            if (child < 0) die("fork");
            if (child == 0) {
                run_rank(lines, took, r, ranks, cores, way, work_us);
                _exit(0);
            }
        }
        run_rank(lines, took, 0, ranks, cores, way, work_us);
        for (int r = 1; r < ranks; r++) wait(NULL);
        period = (now() - start) / (WARMUP + BARRIERS);
        for (long i = 0; i < BARRIERS; i++) {
            slowest[i] = 0;
            for (int r = 0; r < ranks; r++)
                if (took[(long)r * BARRIERS + i] > slowest[i]) slowest[i] = took[(long)r * BARRIERS + i];
        }
        for (int r = 0; r < ranks; r++) {
            sum = 0;
            for (long i = 0; i < BARRIERS; i++) sum += took[(long)r * BARRIERS + i];
            if (sum / BARRIERS > mean) mean = sum / BARRIERS;
        }
        qsort(slowest, BARRIERS, sizeof(double), by_value);
        printf("%-20s %9.2f %9.2f %9.2f\n", WAY_NAME[way], period * 1e6,
               slowest[BARRIERS / 2] * 1e6, mean * 1e6);
        free(slowest);
        munmap(took, bytes);
        munmap(lines, MAX_RANKS * sizeof(Line));
    }
    return 0;
}
