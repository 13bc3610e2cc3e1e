/* tcp_duplex.c -- what two processes carry over loopback TCP when each sends and
 * receives at once, as every rank of a 2x1 all-reduce does: the limit that
 * fairring-bench's 2x1 busbw is measured against.
 *
 * Two processes (a fork) share one TCP connection on 127.0.0.1, Nagle off,
 * default socket buffers (the kernel's autotuning, as fairring's sockets).
 * Per size, every iteration both processes send `size` bytes and read `size`
 * bytes at once, one thread each: non-blocking, poll(2) for whichever
 * direction can move, reads and writes of up to `--chunk` bytes (default
 * 4 MiB) per call. Each side times itself from a one-byte handshake over a
 * pipe that lines them up, and the slower side's time counts. The table shows
 * the median and minimum time and the rate per direction, size / time in GB/s
 * (1e9 B/s). A 2-rank all-reduce of `size` bytes sends and receives `size`
 * bytes on each rank, and its busbw is size / time: at most this rate. The
 * `one-way` column times a single direction alone, for comparison.
 *
 * Build: gcc -O2 -o tcp_duplex tcp_duplex.c
 * Run:   ./tcp_duplex [--iters 20] [--chunk 4194304] [--sizes 65536,1048576,268435456]
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_SIZES 32
static long CHUNK = 4L << 20;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die(const char *what) {
    perror(what);
    exit(1);
}

/* Sends and receives `size` bytes at once on the non-blocking `fd`: one thread,
 * poll(2) for whichever direction can move, large reads and writes. */
static void exchange(int fd, const char *out, char *in, long size, int send, int receive) {
    long sent = send ? 0 : size, got = receive ? 0 : size;
    while (sent < size || got < size) {
        struct pollfd p = {.fd = fd, .events = (sent < size ? POLLOUT : 0) | (got < size ? POLLIN : 0)};
        if (poll(&p, 1, -1) < 0) {
            if (errno == EINTR) continue;
            die("poll");
        }
        if (got < size && (p.revents & (POLLIN | POLLHUP | POLLERR))) {
            long n = size - got < CHUNK ? size - got : CHUNK;
            ssize_t r = read(fd, in + got, (size_t)n);
            if (r == 0) {
                fprintf(stderr, "peer closed\n");
                exit(1);
            }
            if (r < 0 && errno != EAGAIN && errno != EINTR) die("read");
            if (r > 0) got += r;
        }
        if (sent < size && (p.revents & POLLOUT)) {
            long n = size - sent < CHUNK ? size - sent : CHUNK;
            ssize_t w = write(fd, out + sent, (size_t)n);
            if (w < 0 && errno != EAGAIN && errno != EINTR) die("write");
            if (w > 0) sent += w;
        }
    }
}

/* One iteration: send and/or receive `size` bytes, after lining up over `sync`. */
static double once(int fd, int sync_out, int sync_in, char *out, char *in, long size,
                   int send, int receive) {
    char token = 1;
    if (write(sync_out, &token, 1) != 1 || read(sync_in, &token, 1) != 1) die("sync");
    double start = now();
    exchange(fd, out, in, size, send, receive);
    /* Each side's own time; the slower side's counts, as in the MPI bench. */
    double mine = now() - start, theirs;
    if (write(sync_out, &mine, sizeof mine) != sizeof mine ||
        read(sync_in, &theirs, sizeof theirs) != sizeof theirs)
        die("sync");
    return mine > theirs ? mine : theirs;
}

static int cmpd(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    long sizes[MAX_SIZES] = {4096, 65536, 1L << 20, 4L << 20, 16L << 20, 64L << 20, 256L << 20};
    int nsizes = 7, iters = 20;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--iters") && i + 1 < argc) {
            iters = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--chunk") && i + 1 < argc) {
            CHUNK = atol(argv[++i]);
        } else if (!strcmp(argv[i], "--sizes") && i + 1 < argc) {
            nsizes = 0;
            for (char *s = strtok(argv[++i], ","); s && nsizes < MAX_SIZES; s = strtok(NULL, ","))
                sizes[nsizes++] = atol(s);
        } else {
            fprintf(stderr, "usage: %s [--iters N] [--chunk BYTES] [--sizes a,b,c]\n", argv[0]);
            return 2;
        }
    }
    if (iters < 1 || nsizes < 1 || CHUNK < 1) return 2;
    long max = 0;
    for (int i = 0; i < nsizes; i++) max = sizes[i] > max ? sizes[i] : max;

    int listener = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof addr;
    if (bind(listener, (struct sockaddr *)&addr, sizeof addr) || listen(listener, 1) ||
        getsockname(listener, (struct sockaddr *)&addr, &len))
        die("listen");
    int to_child[2], to_parent[2];
    if (pipe(to_child) || pipe(to_parent)) die("pipe");
    pid_t child = fork();
    if (child < 0) die("fork");
    int fd, sync_out, sync_in;
    if (child == 0) {
        fd = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(fd, (struct sockaddr *)&addr, sizeof addr)) die("connect");
        sync_out = to_parent[1];
        sync_in = to_child[0];
    } else {
        fd = accept(listener, NULL, NULL);
        if (fd < 0) die("accept");
        sync_out = to_child[1];
        sync_in = to_parent[0];
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK)) die("fcntl");
    char *out = malloc((size_t)max), *in = malloc((size_t)max);
    if (!out || !in) die("malloc");
    memset(out, 7, (size_t)max);
    memset(in, 0, (size_t)max);
    double *both = calloc((size_t)iters, sizeof(double));
    double *alone = calloc((size_t)iters, sizeof(double));
    if (child != 0) {
        printf("# loopback TCP, 2 processes, each sending and receiving at once (duplex) "
               "or one direction alone (one-way); iters=%d\n", iters);
        printf("#%11s %12s %12s %14s %14s\n", "size(B)", "duplex(us)", "min(us)",
               "duplex(GB/s)", "one-way(GB/s)");
    }
    for (int s = 0; s < nsizes; s++) {
        long size = sizes[s];
        once(fd, sync_out, sync_in, out, in, size, 1, 1); /* warm-up */
        for (int i = 0; i < iters; i++)
            both[i] = once(fd, sync_out, sync_in, out, in, size, 1, 1);
        for (int i = 0; i < iters; i++)
            alone[i] = once(fd, sync_out, sync_in, out, in, size, child != 0, child == 0);
        qsort(both, (size_t)iters, sizeof(double), cmpd);
        qsort(alone, (size_t)iters, sizeof(double), cmpd);
        if (child != 0) {
            double median = both[iters / 2], one_way = alone[iters / 2];
            printf("%12ld %12.1f %12.1f %14.3f %14.3f\n", size, median * 1e6, both[0] * 1e6,
                   size / median / 1e9, size / one_way / 1e9);
            fflush(stdout);
        }
    }
    close(fd);
    if (child != 0) {
        int status;
        waitpid(child, &status, 0);
        return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
    }
    return 0;
}
