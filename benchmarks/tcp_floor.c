/* What a 1-float allreduce of 2 ranks over loopback TCP costs the kernel alone: the floor
 * under pycollect's (and MPI's) figure in benchmarks/compare.py.
 *
 *     cc -O2 -o /tmp/tcp_floor benchmarks/tcp_floor.c && /tmp/tcp_floor
 *     /tmp/tcp_floor spin         # the spinning recv() alone (benchmarks/compare.py runs this)
 *
 * Two processes on one TCP connection (TCP_NODELAY) do what such an allreduce does on the
 * wire: each sends one 44-byte message (pycollect's 40-byte header and a float) and
 * receives the peer's, in lockstep, 100,000 times after 1,000 for warmup.  The receive
 * waits three ways: blocking in recv(), spinning on recv(MSG_DONTWAIT) (what pycollect's
 * engine does for its spin time), and spinning on poll(0) before each recv.  Printed: the
 * mean time per exchange and the median exchange, seen by one of the two processes.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "floor.h"

enum { EXCHANGES = 100000, WARMUP = 1000, MSG = 44 };
enum { BLOCKING, SPIN_RECV, SPIN_POLL, WAYS };
static const char* WAY_NAME[WAYS] = {"blocking recv()", "spinning on recv(MSG_DONTWAIT)",
                                     "spinning on poll(0), then recv()"};

static void receive(int fd, char* buf, int way) {
    int got = 0;
    while (got < MSG) {
        ssize_t r;
        if (way == SPIN_POLL) {
            struct pollfd p = {fd, POLLIN, 0};
            if (poll(&p, 1, 0) <= 0) continue;
        }
        r = recv(fd, buf + got, MSG - got, way == BLOCKING ? 0 : MSG_DONTWAIT);
        if (r > 0) got += (int)r;
        else if (r == 0) { fprintf(stderr, "peer closed\n"); exit(1); }
        else if (errno != EAGAIN && errno != EINTR) die("recv");
    }
}

static int by_time(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}

/* The mean time per exchange; *median: the median exchange. */
static double exchange(int fd, int way, double* median) {
    static double took[EXCHANGES];
    char buf[MSG] = {0};
    int one = 1, i;
    double t0 = now(), t = t0, t1;
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) < 0) die("setsockopt");
    for (i = 0; i < WARMUP + EXCHANGES; i++) {
        if (i == WARMUP) t0 = t = now();
        if (send(fd, buf, MSG, 0) != MSG) die("send");
        receive(fd, buf, way);
        if (i >= WARMUP) {
            t1 = now();
            took[i - WARMUP] = t1 - t;
            t = t1;
        }
    }
    qsort(took, EXCHANGES, sizeof took[0], by_time);
    *median = took[EXCHANGES / 2];
    return (t - t0) / EXCHANGES;
}

int main(int argc, char** argv) {
    int only = -1;
    if (argc > 2 || (argc == 2 && strcmp(argv[1], "spin") != 0)) {
        fprintf(stderr, "usage: %s [spin]\n", argv[0]);
        return 2;
    }
    if (argc == 2) only = SPIN_RECV;
    for (int way = 0; way < WAYS; way++) {
        if (only >= 0 && way != only) continue;
        double mean, median;
        struct sockaddr_in a;
        int ls = loopback_listener(&a), s;
        pid_t child;
        child = fork_flushed();     /* the rows printed so far stay the parent's */
        if (child < 0) die("fork");
        if (child == 0) {
            int c = socket(AF_INET, SOCK_STREAM, 0);
            if (c < 0 || connect(c, (struct sockaddr*)&a, sizeof a) < 0) die("connect");
            exchange(c, way, &median);
            _exit(0);
        }
        s = accept(ls, NULL, NULL);
        if (s < 0) die("accept");
        mean = exchange(s, way, &median);
        printf("%-34s %6.2f us per exchange (median %.2f)\n", WAY_NAME[way], mean * 1e6,
               median * 1e6);
        close(s);
        close(ls);
        waitpid(child, NULL, 0);
    }
    return 0;
}
