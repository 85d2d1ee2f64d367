/*
 * The C runtime's reader alone (nimble_plan.c, no driver call): reads a saved file and its
 * c_plan, prints what it read as one line, or the nimble_status and message of what it refused.
 * The CPU tests run it (tests/test_c_runtime.py); the loader's own nimble_fail lives in
 * nimble.c, which needs libcuda, so this program brings its own (the reader makes no driver
 * call, so nimble_cuda_fail is not needed).
 */
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "nimble_internal.h"

static char message[1024];

nimble_status nimble_fail(nimble_status status, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(message, sizeof message, fmt, args);
    va_end(args);
    return status;
}

int main(int argc, char **argv) {
    if (argc != 2) return 1;
    nimble_model *m = calloc(1, sizeof *m);
    plan_t plan = {0};
    nimble_status s = nimble_read_file(m, argv[1], &plan);
    if (s == NIMBLE_OK) s = nimble_read_plan(m, &plan);
    if (s != NIMBLE_OK) {
        printf("status %d: %s\n", (int)s, message);
        return (int)s;
    }
    unsigned long long nodes = 0, relocs = 0, edges = 0, written = 0, written_weights = 0;
    unsigned long long programmatic = 0;
    for (uint64_t k = 0; k < m->nbuckets; k++) {
        nodes += m->buckets[k].nnodes;
        edges += m->buckets[k].nedges;
        for (uint64_t e = 0; m->buckets[k].programmatic && e < m->buckets[k].nedges; e++)
            programmatic += m->buckets[k].programmatic[e];
        written += m->buckets[k].nwritten;
        for (uint64_t i = 0; i < m->buckets[k].nwritten; i++)
            written_weights += m->buckets[k].written[i].region == R_WEIGHT;
        for (uint64_t i = 0; i < m->buckets[k].nnodes; i++)
            relocs += m->buckets[k].nodes[i].nrelocs;
    }
    unsigned long long low_relocs = 0;
    for (uint64_t k = 0; k < m->nbuckets; k++)
        for (uint64_t i = 0; i < m->buckets[k].nnodes; i++)
            for (uint64_t r = 0; r < m->buckets[k].nodes[i].nrelocs; r++)
                low_relocs += m->buckets[k].nodes[i].relocs[r].place.region == R_LOWBITS;
    printf("arch %llu instances %llu buckets %llu binaries %llu kernels %llu weights %llu "
           "memory %llu nodes %llu relocations %llu edges %llu (programmatic %llu) written %llu "
           "(weights %llu) low-bits %llu (relocations %llu)\n",
           (unsigned long long)m->arch, (unsigned long long)m->instances,
           (unsigned long long)m->nbuckets, (unsigned long long)m->nbinaries,
           (unsigned long long)m->nkernels, (unsigned long long)m->nweights,
           (unsigned long long)m->nmemory, nodes, relocs, edges, programmatic, written,
           written_weights, (unsigned long long)m->nlowbits, low_relocs);
    return 0;
}
