/* A C program against fairring.h: one rank of a job torchrun-style
 * environment variables describe. It all-reduces, broadcasts, all-gathers,
 * reduce-scatters and waits on a barrier, checks every result, checks that bad
 * arguments are refused with a message naming them, and exits 0 only if all
 * of that held. */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fairring.h"

static int failures = 0;

#define CHECK(cond, ...)                                   \
    do {                                                   \
        if (!(cond)) {                                     \
            fprintf(stderr, "rank %u: ", rank);            \
            fprintf(stderr, __VA_ARGS__);                  \
            fprintf(stderr, " (%s:%d)\n", __FILE__, __LINE__); \
            failures++;                                    \
        }                                                  \
    } while (0)

static unsigned rank = 0;
static volatile int called_back = -1;

static void on_complete(void *user, fr_status status) {
    (void)user;
    called_back = status;
}

static fr_status finish(fr_status started, fr_work *work) {
    if (started != FR_OK) {
        return started;
    }
    fr_status s = fr_work_wait(work);
    fr_work_free(work);
    return s;
}

int main(void) {
    fr_comm *comm = NULL;
    fr_status s = fr_comm_from_env(&comm);
    if (s != FR_OK) {
        fprintf(stderr, "fr_comm_from_env: %s: %s\n", fr_status_name(s), fr_last_error());
        return 2;
    }
    unsigned world = 0;
    CHECK(fr_comm_rank(comm, &rank, &world) == FR_OK, "fr_comm_rank");

    enum { N = 1000 };
    float data[N];
    for (int i = 0; i < N; i++) data[i] = (float)(rank * 1000 + i);
    fr_work *work = NULL;
    s = fr_all_reduce(comm, data, N, FR_DTYPE_F32, FR_OP_SUM, &work);
    CHECK(s == FR_OK, "fr_all_reduce: %s", fr_last_error());
    if (s == FR_OK) {
        CHECK(fr_work_on_complete(work, on_complete, NULL) == FR_OK, "on_complete");
        s = fr_work_wait(work);
        CHECK(s == FR_OK, "fr_work_wait: %s", fr_last_error());
        bool done = false;
        CHECK(fr_work_test(work, &done) == FR_OK && done, "fr_work_test after wait");
        fr_work_free(work);
    }
    for (int i = 0; i < N; i++) {
        float expected = 0;
        for (unsigned r = 0; r < world; r++) expected += (float)(r * 1000 + i);
        CHECK(data[i] == expected, "all_reduce[%d] = %f, expected %f", i, data[i], expected);
        if (data[i] != expected) break;
    }

    int64_t value[3] = {rank == 1 ? 7 : -1, rank == 1 ? -8 : -1, rank == 1 ? 9 : -1};
    s = fr_broadcast(comm, value, 3, FR_DTYPE_I64, 1, &work);
    s = finish(s, work);
    CHECK(s == FR_OK && value[0] == 7 && value[1] == -8 && value[2] == 9,
          "broadcast: %s", fr_last_error());

    int32_t mine[2] = {(int32_t)rank * 10, (int32_t)rank * 10 + 1};
    int32_t *gathered = calloc(2 * world, sizeof(int32_t));
    s = fr_all_gather(comm, mine, gathered, 2, FR_DTYPE_I32, &work);
    s = finish(s, work);
    CHECK(s == FR_OK, "all_gather: %s", fr_last_error());
    for (unsigned r = 0; r < world; r++) {
        CHECK(gathered[2 * r] == (int32_t)r * 10 && gathered[2 * r + 1] == (int32_t)r * 10 + 1,
              "all_gather from rank %u", r);
    }
    free(gathered);

    double *input = malloc(world * 4 * sizeof(double));
    double share[4];
    for (unsigned i = 0; i < world * 4; i++) input[i] = (double)(rank + 1) * i;
    s = fr_reduce_scatter(comm, input, share, 4, FR_DTYPE_F64, FR_OP_MAX, &work);
    s = finish(s, work);
    CHECK(s == FR_OK, "reduce_scatter: %s", fr_last_error());
    for (unsigned i = 0; i < 4; i++) {
        double expected = (double)world * (rank * 4 + i);
        CHECK(share[i] == expected, "reduce_scatter[%u] = %f, expected %f", i, share[i], expected);
    }
    free(input);

    /* Reduce, gather and scatter, rooted at the last rank. */
    unsigned root = world - 1;
    int16_t flags[3] = {(int16_t)(1 << rank), (int16_t)rank, -1};
    int16_t reduced[3] = {0, 0, 0};
    s = fr_reduce(comm, flags, reduced, 3, FR_DTYPE_I16, FR_OP_BOR, root, &work);
    s = finish(s, work);
    CHECK(s == FR_OK, "reduce: %s", fr_last_error());
    if (rank == root) {
        CHECK(reduced[0] == (int16_t)((1 << world) - 1) && reduced[2] == -1,
              "reduce: %d %d", reduced[0], reduced[2]);
    }
    CHECK(flags[0] == (int16_t)(1 << rank), "reduce changed its input");
    int32_t *all = calloc(2 * world, sizeof(int32_t));
    s = fr_gather(comm, mine, all, 2, FR_DTYPE_I32, root, &work);
    s = finish(s, work);
    CHECK(s == FR_OK, "gather: %s", fr_last_error());
    for (unsigned r = 0; rank == root && r < world; r++) {
        CHECK(all[2 * r] == (int32_t)r * 10 && all[2 * r + 1] == (int32_t)r * 10 + 1,
              "gather from rank %u", r);
    }
    for (unsigned i = 0; i < 2 * world; i++) all[i] = rank == root ? (int32_t)(100 + i) : -5;
    int32_t part[2] = {0, 0};
    s = fr_scatter(comm, all, part, 2, FR_DTYPE_I32, root, &work);
    s = finish(s, work);
    CHECK(s == FR_OK && part[0] == (int32_t)(100 + 2 * rank) && part[1] == (int32_t)(101 + 2 * rank),
          "scatter: %d %d: %s", part[0], part[1], fr_last_error());
    free(all);

    /* From 2 MiB in all, a gather and a scatter move as messages after a
     * check: their works cover the messages, polled to the end here. */
    {
        const uint64_t n = (2u << 20) / 4 / world + 7;
        int32_t *mine_big = malloc(n * sizeof(int32_t));
        int32_t *every = malloc(n * world * sizeof(int32_t));
        for (uint64_t i = 0; i < n; i++) mine_big[i] = (int32_t)(rank * 1000003u + i);
        s = fr_gather(comm, mine_big, every, n, FR_DTYPE_I32, root, &work);
        CHECK(s == FR_OK, "large gather: %s", fr_last_error());
        if (s == FR_OK) {
            bool done = false;
            while ((s = fr_work_test(work, &done)) == FR_OK && !done) sched_yield();
            CHECK(s == FR_OK, "large gather: %s", fr_last_error());
            fr_work_free(work);
        }
        uint64_t wrong = 0;
        for (uint64_t j = 0; rank == root && j < n * world; j++) {
            wrong += every[j] != (int32_t)((j / n) * 1000003u + j % n);
        }
        CHECK(wrong == 0, "large gather: %llu elements wrong", (unsigned long long)wrong);
        for (uint64_t j = 0; j < n * world; j++) every[j] = rank == root ? (int32_t)(7 * j) : -1;
        s = fr_scatter(comm, every, mine_big, n, FR_DTYPE_I32, root, &work);
        s = finish(s, work);
        CHECK(s == FR_OK, "large scatter: %s", fr_last_error());
        wrong = 0;
        for (uint64_t i = 0; i < n; i++) wrong += mine_big[i] != (int32_t)(7 * (rank * n + i));
        CHECK(wrong == 0, "large scatter: %llu elements wrong", (unsigned long long)wrong);
        free(mine_big);
        free(every);
    }

    uint8_t a[5] = {1, 2, 3, 4, 5}, b[3] = {9, 9, 9};
    void *tensors[2] = {a, b};
    uint64_t counts[2] = {5, 3};
    s = fr_all_reduce_coalesced(comm, tensors, counts, 2, FR_DTYPE_U8, FR_OP_SUM, &work);
    s = finish(s, work);
    CHECK(s == FR_OK && a[4] == 5 * world && b[0] == (uint8_t)(9 * world),
          "coalesced: %s", fr_last_error());

    s = fr_barrier(comm, &work);
    s = finish(s, work);
    CHECK(s == FR_OK, "barrier: %s", fr_last_error());

    /* Any call, described: a group of three under one work, with options. */
    int32_t summed[4] = {1, 2, 3, 4};
    uint64_t from_root[2] = {rank, rank};
    fr_call calls[3];
    memset(calls, 0, sizeof calls);
    calls[0].collective = FR_COLLECTIVE_ALL_REDUCE;
    calls[0].input = summed;
    calls[0].output = summed;
    calls[0].count = 4;
    calls[0].dtype = FR_DTYPE_I32;
    calls[0].op = FR_OP_SUM;
    calls[0].algorithm = FR_ALGO_RING;
    calls[1].collective = FR_COLLECTIVE_BROADCAST;
    calls[1].input = from_root;
    calls[1].output = from_root;
    calls[1].count = 2;
    calls[1].dtype = FR_DTYPE_I64;
    calls[1].root = world - 1;
    calls[2].collective = FR_COLLECTIVE_BARRIER;
    s = fr_start(comm, calls, 3, &work);
    s = finish(s, work);
    CHECK(s == FR_OK && summed[3] == 4 * (int32_t)world && from_root[1] == world - 1,
          "fr_start group: %s", fr_last_error());
    /* A bad field is named; in a group, with the call's index. */
    fr_call bad = calls[0];
    bad.collective = 99;
    s = fr_start(comm, &bad, 1, &work);
    CHECK(s == FR_INVALID_ARGUMENT && strstr(fr_last_error(), "collective"),
          "bad collective: %d %s", s, fr_last_error());
    calls[2] = bad;
    s = fr_start(comm, calls, 3, &work);
    CHECK(s == FR_INVALID_ARGUMENT && strstr(fr_last_error(), "call 2"),
          "bad call in a group: %d %s", s, fr_last_error());
    CHECK(summed[0] == (int32_t)world, "a refused group touched its memory");

    /* Point-to-point: both directions between ranks 0 and 1 in flight at
       once, the receive posted first on one side; and tags: rank 1 sends a
       tag 9 message before its tag 7 one, rank 0 receives tag 7 first. */
    if (rank < 2) {
        unsigned peer = 1 - rank;
        int16_t out[3] = {(int16_t)(10 * rank), (int16_t)(10 * rank + 1), -7};
        int16_t in[3] = {0, 0, 0};
        int16_t early[2] = {(int16_t)(100 + rank), 0};
        fr_work *sent = NULL, *got = NULL, *tagged = NULL;
        if (rank == 0) {
            s = fr_recv(comm, peer, 7, in, 3, FR_DTYPE_I16, &got);
            CHECK(s == FR_OK, "fr_recv: %d %s", s, fr_last_error());
            s = fr_recv(comm, peer, 9, early, 2, FR_DTYPE_I16, &tagged);
            CHECK(s == FR_OK, "fr_recv of tag 9: %s", fr_last_error());
            s = fr_send(comm, peer, 7, out, 3, FR_DTYPE_I16, &sent);
        } else {
            s = fr_send(comm, peer, 9, early, 2, FR_DTYPE_I16, &tagged);
            CHECK(s == FR_OK, "fr_send of tag 9: %s", fr_last_error());
            s = fr_send(comm, peer, 7, out, 3, FR_DTYPE_I16, &sent);
            CHECK(s == FR_OK, "fr_send: %s", fr_last_error());
            s = fr_recv(comm, peer, 7, in, 3, FR_DTYPE_I16, &got);
        }
        CHECK(s == FR_OK, "posting: %s", fr_last_error());
        s = finish(FR_OK, sent);
        CHECK(s == FR_OK, "send: %s", fr_last_error());
        s = finish(FR_OK, tagged);
        CHECK(s == FR_OK && early[0] == 101, "tag 9: %d: %s", early[0], fr_last_error());
        s = finish(FR_OK, got);
        CHECK(s == FR_OK && in[0] == (int16_t)(10 * peer) && in[1] == (int16_t)(10 * peer + 1) &&
                  in[2] == -7 && out[0] == (int16_t)(10 * rank),
              "recv: %d %d %d: %s", in[0], in[1], in[2], fr_last_error());
    }
    /* Sends and receives are calls: one group of an all-reduce and, between
       ranks 0 and 1, a send and a receive of tag 5, under one work. */
    {
        int64_t total = 1, mine[2] = {(int64_t)rank, -1}, theirs[2] = {0, 0};
        fr_call group[3];
        memset(group, 0, sizeof group);
        group[0].collective = FR_COLLECTIVE_ALL_REDUCE;
        group[0].input = &total;
        group[0].output = &total;
        group[0].count = 1;
        group[0].dtype = FR_DTYPE_I64;
        group[0].op = FR_OP_SUM;
        size_t n = 1;
        if (rank < 2) {
            group[1].collective = FR_COLLECTIVE_SEND;
            group[1].input = mine;
            group[1].count = 2;
            group[1].dtype = FR_DTYPE_I64;
            group[1].peer = 1 - rank;
            group[1].tag = 5;
            group[2] = group[1];
            group[2].collective = FR_COLLECTIVE_RECV;
            group[2].input = NULL;
            group[2].output = theirs;
            n = 3;
        }
        s = fr_start(comm, group, n, &work);
        s = finish(s, work);
        CHECK(s == FR_OK && total == (int64_t)world &&
                  (rank >= 2 || (theirs[0] == (int64_t)(1 - rank) && theirs[1] == -1)),
              "fr_start of a send, a receive and an all-reduce: %s", fr_last_error());
    }
    /* All-to-all, blocks of unequal lengths: rank r sends 1 + r + j elements
       to rank j. */
    {
        uint64_t ins[8], outs[8], in_total = 0, out_total = 0;
        for (unsigned j = 0; j < world; j++) {
            ins[j] = 1 + rank + j;
            outs[j] = 1 + j + rank;
            in_total += ins[j];
            out_total += outs[j];
        }
        int32_t *input = malloc(in_total * sizeof *input), *output = calloc(out_total, sizeof *output);
        for (unsigned j = 0, at = 0; j < world; j++)
            for (unsigned i = 0; i < ins[j]; i++) input[at++] = (int32_t)(100 * rank + 10 * j + i);
        s = fr_all_to_all(comm, input, ins, output, outs, FR_DTYPE_I32, &work);
        s = finish(s, work);
        unsigned wrong = 0;
        for (unsigned j = 0, at = 0; j < world; j++)
            for (unsigned i = 0; i < outs[j]; i++) wrong += output[at++] != (int32_t)(100 * j + 10 * rank + i);
        CHECK(s == FR_OK && wrong == 0, "all_to_all: %u wrong: %s", wrong, fr_last_error());
        s = fr_all_to_all(comm, input, NULL, output, outs, FR_DTYPE_I32, &work);
        CHECK(s == FR_INVALID_ARGUMENT && strstr(fr_last_error(), "input_counts"),
              "all_to_all without counts: %d %s", s, fr_last_error());
        free(input);
        free(output);
    }
    s = fr_send(comm, rank, 0, data, 1, FR_DTYPE_F32, &work);
    CHECK(s == FR_INVALID_ARGUMENT && strstr(fr_last_error(), "peer"),
          "send to itself: %d %s", s, fr_last_error());

    /* Refusals name what was wrong and start nothing. */
    s = fr_all_reduce(comm, data, N, 42, FR_OP_SUM, &work);
    CHECK(s == FR_INVALID_ARGUMENT && strstr(fr_last_error(), "dtype"),
          "bad dtype: %d %s", s, fr_last_error());
    s = fr_all_reduce(comm, data, N, FR_DTYPE_I32, FR_OP_AVG, &work);
    CHECK(s == FR_INVALID_ARGUMENT && strstr(fr_last_error(), "avg"),
          "avg on i32: %d %s", s, fr_last_error());
    s = fr_all_reduce(comm, NULL, N, FR_DTYPE_F32, FR_OP_SUM, &work);
    CHECK(s == FR_INVALID_ARGUMENT && strstr(fr_last_error(), "data"),
          "null data: %d %s", s, fr_last_error());
    s = fr_broadcast(comm, data, 1, FR_DTYPE_F32, world, &work);
    CHECK(s == FR_INVALID_ARGUMENT && strstr(fr_last_error(), "root"),
          "bad root: %d %s", s, fr_last_error());
    s = fr_all_reduce(comm, data, N, FR_DTYPE_F32, FR_OP_SUM, NULL);
    CHECK(s == FR_INVALID_ARGUMENT && strstr(fr_last_error(), "out"),
          "null out: %d %s", s, fr_last_error());
    CHECK(fr_work_wait(NULL) == FR_INVALID_ARGUMENT, "wait on null");

    /* The refusals took no sequence number: the ranks still agree. */
    float one = 1;
    s = fr_all_reduce(comm, &one, 1, FR_DTYPE_F32, FR_OP_SUM, &work);
    s = finish(s, work);
    CHECK(s == FR_OK && one == (float)world, "after refusals: %s", fr_last_error());

    fr_comm_destroy(comm);
    /* The completion callback has run by now (destroy waits for it). */
    CHECK(called_back == FR_OK, "completion callback status %d", called_back);
    if (failures == 0) printf("rank %u: ok\n", rank);
    return failures == 0 ? 0 : 1;
}
