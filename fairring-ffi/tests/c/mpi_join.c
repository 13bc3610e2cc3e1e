/* A C program against fairring.h run under mpirun: rank 0 makes a job id,
 * MPI_Bcast hands it to every rank, and each joins with (id, rank, size), as
 * an MPI program joins NCCL with ncclGetUniqueId and ncclCommInitRank. It
 * all-reduces and checks the sum, checks that a changed id is refused naming
 * `id`, and exits 0 only if all of that held. */
#include <stdio.h>
#include <string.h>

#include <mpi.h>

#include "fairring.h"

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank = 0, size = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int failures = 0;

    fr_job_id id;
    memset(&id, 0, sizeof id);
    if (rank == 0 && fr_job_id_new(&id) != FR_OK) {
        fprintf(stderr, "rank 0: fr_job_id_new: %s\n", fr_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    MPI_Bcast(id.bytes, (int)sizeof id.bytes, MPI_BYTE, 0, MPI_COMM_WORLD);

    /* A changed id is refused at once, naming it. */
    fr_job_id changed = id;
    changed.bytes[40] ^= 1;
    fr_comm *comm = NULL;
    fr_status s = fr_comm_from_id(&changed, (uint32_t)rank, (uint32_t)size, 20000, &comm);
    if (s != FR_INVALID_ARGUMENT || !strstr(fr_last_error(), "id")) {
        fprintf(stderr, "rank %d: a changed id: %d %s\n", rank, s, fr_last_error());
        failures++;
    }

    s = fr_comm_from_id(&id, (uint32_t)rank, (uint32_t)size, 20000, &comm);
    if (s != FR_OK) {
        fprintf(stderr, "rank %d: fr_comm_from_id: %s\n", rank, fr_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    int64_t data[1000];
    for (int i = 0; i < 1000; i++) data[i] = (int64_t)i * (rank + 1);
    fr_work *work = NULL;
    s = fr_all_reduce(comm, data, 1000, FR_DTYPE_I64, FR_OP_SUM, &work);
    if (s == FR_OK) {
        s = fr_work_wait(work);
        fr_work_free(work);
    }
    int64_t ranks = (int64_t)size * (size + 1) / 2;
    int wrong = 0;
    for (int i = 0; i < 1000; i++) wrong += data[i] != (int64_t)i * ranks;
    if (s != FR_OK || wrong) {
        fprintf(stderr, "rank %d: all-reduce: %d wrong: %s\n", rank, wrong, fr_last_error());
        failures++;
    }
    fr_comm_destroy(comm);

    int all = 0;
    MPI_Allreduce(&failures, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) printf("mpi_join: %d ranks, %s\n", size, all ? "FAILED" : "ok");
    MPI_Finalize();
    return all ? 1 : 0;
}
