/* What one-way large messages over loopback TCP cost the kernel alone: the floor under a
 * 2-rank broadcast of 1M floats in benchmarks/compare.py.
 *
 *     cc -O2 -o /tmp/tcp_stream_floor benchmarks/tcp_stream_floor.c
 *     /tmp/tcp_stream_floor                 # whole 4 MiB writes, an ack after each message
 *     /tmp/tcp_stream_floor 131072 4        # 128 KiB writes, 4 segments of credit
 *     /tmp/tcp_stream_floor 0 0 2           # whole writes, 2 messages in flight
 *
 * Two processes on one TCP connection (TCP_NODELAY, 4 MiB socket buffers as pycollect's
 * mesh asks for), the sender on CPU 0 and the receiver on CPU 1, both spinning on
 * non-blocking calls: the sender writes 300 messages of 4 MiB (after 20 for warmup), the
 * receiver reads each into one buffer and answers with one byte.  Arguments:
 *   SEGMENT  bytes per write (0, the default: the whole message in one write);
 *   CREDITS  with a SEGMENT, how many segments the sender may have written that the
 *            receiver has not read (it answers one byte per segment read; 0: no credits);
 *   WINDOW   how many messages may be unanswered before the sender waits (default 1;
 *            above 1 only without credits).
 * Printed: the time per message, mean over the timed ones.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "floor.h"

enum { MESSAGE = 4 << 20, MESSAGES = 300, WARMUP = 20, BUFFER = 4 << 20 };

/* Read exactly n bytes, spinning on recv(MSG_DONTWAIT). */
static void read_all(int fd, char* buf, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = recv(fd, buf + got, n - got, MSG_DONTWAIT);
        if (r > 0)
            got += (size_t)r;
        else if (r == 0)
            die("recv: the peer closed");
        else if (errno != EAGAIN && errno != EWOULDBLOCK)
            die("recv");
    }
}

/* Write exactly n bytes, spinning on send(MSG_DONTWAIT). */
static void write_all(int fd, const char* buf, size_t n) {
    size_t sent = 0;
    while (sent < n) {
        ssize_t r = send(fd, buf + sent, n - sent, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r > 0)
            sent += (size_t)r;
        else if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
            die("send");
    }
}

static void connect_pair(int fds[2]) {
    struct sockaddr_in addr;
    int listener = loopback_listener(&addr), one = 1, size = BUFFER;
    fds[0] = socket(AF_INET, SOCK_STREAM, 0);
    if (fds[0] < 0 || connect(fds[0], (struct sockaddr*)&addr, sizeof addr) < 0)
        die("connect");
    fds[1] = accept(listener, NULL, NULL);
    if (fds[1] < 0)
        die("accept");
    close(listener);
    for (int i = 0; i < 2; i++) {
        setsockopt(fds[i], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        setsockopt(fds[i], SOL_SOCKET, SO_SNDBUF, &size, sizeof size);
        setsockopt(fds[i], SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
    }
}

static int usage(FILE* to, const char* me) {
    fprintf(to, "usage: %s [SEGMENT [CREDITS [WINDOW]]] (integers: SEGMENT >= 0, CREDITS >= 0, "
            "WINDOW >= 1, a WINDOW above 1 only without credits)\n", me);
    return to == stdout ? 0 : 2;
}

int main(int argc, char** argv) {
    long given = 0, credits = 0, window = 1;
    size_t segment;
    int fds[2];
    char* buf;
    char byte = 0;
    if (argc > 1 && asks_help(argv[1]))
        return usage(stdout, argv[0]);
    if (argc > 4 || (argc > 1 && !parse_long(argv[1], &given)) ||
        (argc > 2 && !parse_long(argv[2], &credits)) ||
        (argc > 3 && !parse_long(argv[3], &window)))
        return usage(stderr, argv[0]);
    /* credits and answers share the receiver's one stream of bytes: a window of several
       messages would read one as the other */
    if (given < 0 || credits < 0 || window < 1 || (credits && window > 1))
        return usage(stderr, argv[0]);
    segment = (size_t)given;
    buf = malloc(MESSAGE);
    if (buf == NULL)
        die("malloc");
    if (segment == 0 || segment > MESSAGE)
        segment = MESSAGE;
    if (segment == MESSAGE)
        credits = 0;                /* one write a message: nothing to credit */
    memset(buf, 1, MESSAGE);
    size_t segments = (MESSAGE + segment - 1) / segment;
    connect_pair(fds);
    pid_t child = fork();
    if (child < 0)
        die("fork");
    if (child == 0) {               /* the receiver */
        on_cpu(1);                  /* best effort: one CPU may run both */
        for (int m = 0; m < WARMUP + MESSAGES; m++) {
            for (size_t g = 0; g < segments; g++) {
                size_t len = g == segments - 1 ? MESSAGE - g * segment : segment;
                read_all(fds[1], buf + g * segment, len);
                if (credits && g + (size_t)credits < segments)
                    write_all(fds[1], &byte, 1);
            }
            write_all(fds[1], &byte, 1);
        }
        _exit(0);
    }
    on_cpu(0);                      /* the sender */
    double start = 0;
    long answered = 0;
    for (long m = 0; m < WARMUP + MESSAGES; m++) {
        if (m == WARMUP)
            start = now();
        for (size_t g = 0; g < segments; g++) {
            if (credits && g >= (size_t)credits)
                read_all(fds[0], &byte, 1);
            size_t len = g == segments - 1 ? MESSAGE - g * segment : segment;
            write_all(fds[0], buf + g * segment, len);
        }
        while (answered < m + 1 - window + 1) {    /* at most `window` unanswered */
            read_all(fds[0], &byte, 1);
            answered++;
        }
    }
    while (answered < WARMUP + MESSAGES) {
        read_all(fds[0], &byte, 1);
        answered++;
    }
    double per = (now() - start) / MESSAGES;
    waitpid(child, NULL, 0);
    printf("segment %zu, credits %ld, window %ld: %.0f us per 4 MiB message\n", segment, credits,
           window, per * 1e6);
    return 0;
}
