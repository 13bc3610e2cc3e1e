/* OpenMPI point-to-point, timed as fairring-bench --collective send_recv
 * times fairring's: a ping-pong between ranks 0 and 1, the median over
 * iterations of half the round trip (the slower rank's), algbw = bytes / that.
 *
 * Build: mpicc -O2 -o mpi_send_recv mpi_send_recv.c
 * Shared memory (like --local 1x2):
 *   mpirun --allow-run-as-root --oversubscribe -np 2 ./mpi_send_recv
 * TCP loopback (like --local 2x1):
 *   mpirun --allow-run-as-root --oversubscribe -np 2 --mca btl tcp,self ./mpi_send_recv
 * Arguments: [min_bytes] [max_bytes] [factor] [iters]. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int compare(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, world;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    long min = argc > 1 ? atol(argv[1]) : 4096;
    long max = argc > 2 ? atol(argv[2]) : 64L << 20;
    long factor = argc > 3 ? atol(argv[3]) : 16;
    int iters = argc > 4 ? atoi(argv[4]) : 50;
    if (world != 2) {
        if (rank == 0) fprintf(stderr, "mpi_send_recv: run with -np 2\n");
        MPI_Finalize();
        return 1;
    }
    char *buf = malloc(max);
    double *times = malloc(sizeof(double) * iters);
    double *slowest = malloc(sizeof(double) * iters);
    int peer = 1 - rank;
    if (rank == 0) printf("%12s %10s %9s %7s\n", "size(B)", "time(us)", "algbw", "#wrong");
    for (long size = min; size <= max; size *= factor) {
        long wrong = 0;
        for (int i = -5; i < iters; i++) {
            if (rank == 0) memset(buf, (int)(i & 0x7f), size);
            MPI_Barrier(MPI_COMM_WORLD);
            double start = MPI_Wtime();
            if (rank == 0) {
                MPI_Send(buf, (int)size, MPI_BYTE, peer, 0, MPI_COMM_WORLD);
                MPI_Recv(buf, (int)size, MPI_BYTE, peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            } else {
                MPI_Recv(buf, (int)size, MPI_BYTE, peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                MPI_Send(buf, (int)size, MPI_BYTE, peer, 0, MPI_COMM_WORLD);
            }
            double t = (MPI_Wtime() - start) / 2;
            if (i >= 0) {
                times[i] = t;
                wrong += buf[size - 1] != (char)(i & 0x7f);
            }
        }
        MPI_Reduce(times, slowest, iters, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        if (rank == 0) {
            qsort(slowest, iters, sizeof(double), compare);
            double t = slowest[iters / 2];
            printf("%12ld %10.1f %9.3f %7ld\n", size, t * 1e6, size / t / 1e9, wrong);
        }
    }
    free(buf);
    free(times);
    free(slowest);
    MPI_Finalize();
    return 0;
}
