/* What a barrier of more ranks than cores costs the scheduler alone: the floor under
 * pycollect's (and MPI's) 4-rank barrier on a 2-core machine in benchmarks/compare.py.
 *
 *     cc -O2 -o /tmp/barrier_floor benchmarks/barrier_floor.c && /tmp/barrier_floor
 *     /tmp/barrier_floor 4 2        # ranks, cores (default: 4, the CPUs this process may use)
 *
 * CORES is at most the CPUs this process may use (more would bind a rank where it cannot
 * run); a rank that cannot be bound or started calls the run off for every rank, and so
 * does a rank that dies in the run, or a run past RUN_S: no rank waits for ever.
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
#include <math.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "floor.h"

enum { BARRIERS = 100000, WARMUP = 2000, MAX_RANKS = 64, EVERY = 8, SETUP_S = 10,
       RUN_S = 120, CHECK_EVERY = 4096 };
enum { YIELD_TO_MATE, YIELD_EIGHTH, YIELD_ALWAYS, HAND_OVER, WAYS };
static const char* WAY_NAME[WAYS] = {"yield to a mate", "... and every 8th", "always yield",
                                     "... and hand over"};

typedef struct {
    volatile long posted;       /* the barrier this rank entered last */
    volatile long left;         /* ... and the one it left last */
    char pad[64 - 2 * sizeof(long)];
} Line;

/* The line after the ranks' lines: how many ranks have joined the run, or -1 once it is off. */
typedef struct {
    volatile int joined;
    char pad[64 - sizeof(int)];
} Setup;

static int by_value(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}

/* The caller's own work between two barriers: ``us`` microseconds on the CPU. */
static void work(double us) {
    double until = now() + us * 1e-6;
    while (now() < until) {}
}

/* The ranks bound to this rank's CPU that entered barrier ``k`` and have not left it, as a
 * mask of rank numbers. */
static unsigned long long mates_inside(const Line* lines, int me, int ranks, int cores,
                                       long k) {
    unsigned long long inside = 0;
    for (int q = me % cores; q < ranks; q += cores)
        if (q != me && lines[q].posted >= k && lines[q].left < k) inside |= 1ULL << q;
    return inside;
}

/* Whether a rank of ``mask`` has not left barrier ``k``. */
static int still_inside(const Line* lines, unsigned long long mask, long k) {
    for (; mask; mask &= mask - 1)
        if (lines[__builtin_ctzll(mask)].left < k) return 1;
    return 0;
}

/* Call the run off unless every one of ``ranks`` has joined it: whether it is off. */
static int call_off(Setup* setup, int ranks) {
    for (;;) {
        int joined = setup->joined;
        if (joined < 0) return 1;
        if (joined >= ranks) return 0;
        if (__sync_bool_compare_and_swap(&setup->joined, joined, -1)) return 1;
    }
}

/* Whether rank ``me``, waiting in the run that started at ``start``, stops: the run is off,
 * or rank 0 found a rank dead (it forked them) or the run past RUN_S, and called it off. */
static int stops(Setup* setup, int me, double start) {
    int status;
    pid_t gone;
    if (setup->joined < 0) return 1;
    if (me != 0) return 0;
    while ((gone = waitpid(-1, &status, WNOHANG)) > 0)
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "barrier_floor: a rank died in the run (pid %d)\n", (int)gone);
            setup->joined = -1;
            return 1;
        }
    if (now() - start > RUN_S) {
        fprintf(stderr, "barrier_floor: the run took more than %d s\n", RUN_S);
        setup->joined = -1;
        return 1;
    }
    return 0;
}

/* Rank ``me`` bound to its CPU joins the run and waits for the others: 1 once every rank
 * has, 0 where the run is off (a rank could not be bound or started, or SETUP_S passed), so
 * that no rank waits in a barrier for one that will never come. */
static int join(Setup* setup, int me, int ranks, int cores) {
    double give_up;
    if (on_cpu(me % cores) < 0) {
        fprintf(stderr, "barrier_floor: rank %d cannot run on CPU %d: %s\n", me, me % cores,
                strerror(errno));
        call_off(setup, ranks);
        return 0;
    }
    for (;;) {
        int joined = setup->joined;
        if (joined < 0) return 0;
        if (__sync_bool_compare_and_swap(&setup->joined, joined, joined + 1)) break;
    }
    give_up = now() + SETUP_S;
    while (setup->joined != ranks) {
        if (setup->joined < 0) return 0;
        if (now() > give_up && call_off(setup, ranks)) {
            fprintf(stderr, "barrier_floor: not every rank started within %d s\n", SETUP_S);
            return 0;
        }
        sched_yield();
    }
    return 1;
}

/* Rank ``me``'s part: its calls' times into took[me * BARRIERS ...]; 0 where the run was
 * called off. */
static int run_rank(Line* lines, Setup* setup, double* took, int me, int ranks, int cores,
                    int way, double work_us) {
    double start = now();
    for (long k = 1; k <= WARMUP + BARRIERS; k++) {
        double t0 = now();
        unsigned looks = 0;
        /* the mates that came first: with three or more ranks on a CPU, waiting for a mate
           that came later too would have two ranks wait for each other */
        unsigned long long first = mates_inside(lines, me, ranks, cores, k);
        lines[me].posted = k;
        for (int p = 0; p < ranks; p++) {
            while (p != me && lines[p].posted < k) {
                int mate_missing = 0;
                for (int q = me % cores; q < ranks; q += cores)
                    if (q != me && lines[q].posted < k) mate_missing = 1;
                if (++looks % CHECK_EVERY == 0 && stops(setup, me, start)) return 0;
                if (mate_missing || way == YIELD_ALWAYS ||
                    ((way == YIELD_EIGHTH || way == HAND_OVER) && looks % EVERY == 0))
                    sched_yield();
                else
                    _mm_pause();
            }
        }
        if (way == HAND_OVER && first)
            while (still_inside(lines, first, k)) {
                if (++looks % CHECK_EVERY == 0 && stops(setup, me, start)) return 0;
                sched_yield();
            }
        lines[me].left = k;
        if (k > WARMUP) took[(long)me * BARRIERS + (k - WARMUP - 1)] = now() - t0;
        work(work_us);
    }
    return 1;
}

static int usage(FILE* to, const char* me, int cpus) {
    fprintf(to, "usage: %s [ranks 2..%d] [cores 1..%d: the CPUs this process may use] "
            "[work us >= 0]\n", me, MAX_RANKS, cpus);
    return to == stdout ? 0 : 2;
}

int main(int argc, char** argv) {
    int cpus = cpus_allowed(), ranks, cores;
    long ranks_given = 4, cores_given = cpus;
    double work_us = 0.0;
    pid_t me = getpid();
    if (argc > 1 && asks_help(argv[1]))
        return usage(stdout, argv[0], cpus);
    /* More cores than CPUs would bind a rank to a CPU it may not use. */
    if (argc > 4 || (argc > 1 && !parse_long(argv[1], &ranks_given)) ||
        (argc > 2 && !parse_long(argv[2], &cores_given)) ||
        (argc > 3 && !parse_double(argv[3], &work_us)) ||
        ranks_given < 2 || ranks_given > MAX_RANKS || cores_given < 1 || cores_given > cpus ||
        !(work_us >= 0 && isfinite(work_us)))
        return usage(stderr, argv[0], cpus);
    ranks = (int)ranks_given;
    cores = (int)cores_given;
    printf("%d ranks on %d CPUs (rank r on CPU r mod %d), %d barriers each way, %.2f us of "
           "work after each\n", ranks, cores, cores, BARRIERS, work_us);
    printf("%-20s %9s %9s %9s  (us)\n", "wait", "period", "p50", "average");
    for (int way = 0; way < WAYS; way++) {
        size_t bytes = (size_t)ranks * BARRIERS * sizeof(double);
        size_t shared = (MAX_RANKS + 1) * sizeof(Line);   /* the ranks' lines, the Setup */
        Line* lines = mmap(NULL, shared, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                           -1, 0);
        Setup* setup = (Setup*)(lines + MAX_RANKS);
        double* took = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                            -1, 0);
        double* slowest = malloc(BARRIERS * sizeof(double));
        double start, period, mean = 0, sum;
        int ok, status;
        if (lines == MAP_FAILED || took == MAP_FAILED || slowest == NULL) die("memory");
        start = now();
        for (int r = 1; r < ranks; r++) {
            pid_t child = fork_flushed();
            if (child < 0) {
                call_off(setup, ranks);     /* the ranks already started give up */
                die("fork");
            }
            if (child == 0) {
                /* a rank left alone would wait for the others for ever */
                prctl(PR_SET_PDEATHSIG, SIGKILL);
                if (getppid() != me) _exit(1);
                if (!join(setup, r, ranks, cores)) _exit(1);
                _exit(run_rank(lines, setup, took, r, ranks, cores, way, work_us) ? 0 : 1);
            }
        }
        ok = join(setup, 0, ranks, cores);
        if (ok) ok = run_rank(lines, setup, took, 0, ranks, cores, way, work_us);
        /* the ranks not reaped in the run (stops reaps those that ended before rank 0) */
        while (wait(&status) > 0)
            if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ok = 0;
        if (!ok) return 1;
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
        munmap(lines, shared);
    }
    return 0;
}
