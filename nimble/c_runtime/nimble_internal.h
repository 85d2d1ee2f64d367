/*
 * Internal to Nimble's C runtime: the model's parts as read from a saved file's c_plan, shared
 * by the reader (nimble_plan.c), the kernels' and memory's loader (nimble_load.c) and the
 * builder and API (nimble.c).  Not installed for users: nimble.h is the API.
 */
#ifndef NIMBLE_INTERNAL_H
#define NIMBLE_INTERNAL_H

#include "nimble.h"

#include <pthread.h>

/* ---- errors and stage clocks (nimble.c) ---------------------------------------------------- */

/* The bytes of one thread's last error message (nimble_last_error), a worker's copied with it. */
#define NIMBLE_MESSAGE_BYTES 1024

nimble_status nimble_fail(nimble_status status, const char *fmt, ...);
nimble_status nimble_cuda_fail(const char *call, CUresult r);
/* A monotonic clock in seconds. */
double nimble_seconds_now(void);
/* Adds the seconds since *since to stage's total and restarts the clock. */
void nimble_lap(nimble_model *m, nimble_load_stage stage, double *since);

#define CU(call)                                                                              \
    do {                                                                                      \
        CUresult r_ = (call);                                                                 \
        if (r_ != CUDA_SUCCESS) return nimble_cuda_fail(#call, r_);                           \
    } while (0)

#define TRY(expr)                                                                             \
    do {                                                                                      \
        nimble_status s_ = (expr);                                                            \
        if (s_ != NIMBLE_OK) return s_;                                                       \
    } while (0)

/* ---- the plan's words (nimble_plan.c) ------------------------------------------------------ */

typedef struct { const uint8_t *p; size_t n, at; int bad; uint64_t version; } plan_t;

/* ---- the model --------------------------------------------------------------------------- */

enum { R_NONE = 0, R_ARENA = 1, R_WEIGHT = 2, R_MEMORY = 3, R_LOWBITS = 4 };
enum { N_KERNEL = 0, N_MEMSET = 1, N_MEMCPY = 2, N_EMPTY = 3 };
#define NO_BLOB UINT64_MAX

typedef struct { uint64_t region, index, addend; } place_t;
typedef struct { uint64_t at, size; } blobref_t;
typedef struct { int library; uint64_t offset, size; const uint8_t *sha; char *path; } binary_t;
typedef struct {
    uint64_t binary; char *name; int64_t fingerprint[6]; int64_t settable[4]; CUfunction fn;
} kernel_t;
typedef struct { uint64_t size; blobref_t blob; CUdeviceptr ptr; } memory_t;
typedef struct { place_t place; nimble_tensor_info info; } tensor_t;
typedef struct { uint64_t offset, size; blobref_t blob; } private_t;
/* One instance's copy of a low-bits buffer: mapped at the buffer's recorded address plus a
 * multiple of 4 GiB (a reservation of 8 GiB and the span, the span mapped in it). */
typedef struct {
    CUdeviceptr va, mapped, ptr; size_t reserve, span;
    CUmemGenericAllocationHandle handle; int have_handle;
} lowmap_t;
/* A buffer kept at its recorded low 32 address bits (the plan's version 3): a word into it may
 * be an integer under a stale top half, which its relocation must leave as it is. */
typedef struct {
    uint64_t size, address, poison, bucket; blobref_t blob;
    lowmap_t *maps; /* per instance */
} lowbits_t;
typedef struct { uint64_t loc; place_t place; } reloc_t;
typedef struct { uint64_t id; const uint8_t *value; size_t len; } attr_t;
typedef struct {
    int kind;
    /* kernel */
    uint64_t kernel, grid[3], block[3], shared, has_priority, packed, nparams, nrelocs, nattrs;
    int64_t priority;
    uint64_t *params; /* (offset, size) pairs */
    const uint8_t *args; size_t args_len;
    reloc_t *relocs; attr_t *attrs;
    /* memset: dst, value, element size, width, height, pitch */
    /* memcpy: src, dst, types, x/y/z/pitch/height per side, width, height, depth */
    place_t src, dst;
    uint64_t f[15];
} node_t;
typedef struct { blobref_t *inputs, *outputs; uint64_t *checked; } refset_t;
typedef struct {
    uint64_t plan_bytes, ninputs, noutputs, nprivate, nnodes, nedges, nsets, nwritten;
    tensor_t *inputs, *outputs;
    private_t *private_;
    node_t *nodes;
    uint64_t *edges;
    /* per edge, whether it is programmatic (the plan's version 2; NULL: none is) */
    uint8_t *programmatic;
    refset_t *sets;
    /* the external memory and the weights the graph writes, each once (the plan names a range
     * once per buffer in it; region R_MEMORY or R_WEIGHT, and its index there): the proof puts
     * them back from the file before each launch */
    place_t *written;
    CUgraphExec *execs; /* per instance */
} bucket_t;

struct nimble_model {
    CUdevice device; CUcontext ctx; /* ctx: the retained primary context, NULL before */
    uint64_t arch, driver, arena_size, alignment, instances, nbuckets;
    uint64_t nbinaries, nkernels, nweights, nmemory;
    binary_t *binaries; kernel_t *kernels; memory_t *weights, *memory;
    /* one allocation each that the weights and the external memory ranges lie in */
    CUdeviceptr weight_block, memory_block;
    uint64_t nlowbits; lowbits_t *lowbits; /* every bucket's, in order */
    bucket_t *buckets;
    CUlibrary *libraries; /* per binary; each written only by the item that loads it */
    CUdeviceptr *arenas, *bases; /* per instance: as allocated, and aligned */
    uint8_t *file; size_t file_size; const uint8_t *blobs; size_t blobs_size;
    char launch_note[256]; /* "" while every exec is device-launchable */
    /* NIMBLE_LOAD_PROGRAMMATIC asked: a plan of version 4's programmatic edges built so (one
     * of version 2 or 3 may list the withdrawn rule's edges: built full) */
    int programmatic;
    uint64_t plan_version;
    double stage_seconds[NIMBLE_STAGE_COUNT];
};

static inline CUdeviceptr resolve(const nimble_model *m, uint64_t instance, place_t p) {
    switch (p.region) {
    case R_ARENA: return m->bases[instance] + p.addend;
    case R_WEIGHT: return m->weights[p.index].ptr + p.addend;
    case R_MEMORY: return m->memory[p.index].ptr + p.addend;
    case R_LOWBITS: return m->lowbits[p.index].maps[instance].ptr + p.addend;
    default: return (CUdeviceptr)p.addend;
    }
}

static inline const uint8_t *blob(const nimble_model *m, blobref_t b) {
    if (b.at == NO_BLOB || b.at > m->blobs_size || b.size > m->blobs_size - b.at) return NULL;
    return m->blobs + b.at;
}

/* Map the file at `path` and check what its checksum does not cover: its header (magic, format
 * version, size).  The file's bytes are m->file. */
nimble_status nimble_map_file(nimble_model *m, const char *path);

/* NIMBLE_OK where `sum` (nimble_checksum of every byte after the header) is the one the header
 * holds; else the damaged file's NIMBLE_ERROR_FORMAT and message. */
nimble_status nimble_file_intact(const nimble_model *m, const uint8_t sum[32], const char *path);

/* The section table read: m->blobs and `plan` (the c_plan section) set.  The table lies in the
 * checksummed bytes: before the checksum is known good, its errors may be the damage's. */
nimble_status nimble_find_sections(nimble_model *m, const char *path, plan_t *plan);

/* nimble_map_file, the checksum checked on this thread (and nimble_checksum's), then
 * nimble_find_sections: a damaged file refused before a byte of its plan is read.  For readers
 * that stop at the plan (tests/c_host/plan_check.c); nimble_load checks beside the loading. */
nimble_status nimble_read_file(nimble_model *m, const char *path, plan_t *plan);

/* Unmap the file nimble_map_file mapped, and forget its blobs (idempotent). */
void nimble_release_file(nimble_model *m);

/* Read the whole c_plan into m (its arrays allocated; raw bytes point into m->file). */
nimble_status nimble_read_plan(nimble_model *m, plan_t *plan);

/* ---- the kernels and the memory (nimble_load.c) -------------------------------------------- */

/* One item per kernel binary, on this thread and its workers: the binary read and held to its
 * SHA-256, loaded, then the functions of its kernels taken; the weights, external memory and
 * arenas uploaded on a thread of their own meanwhile.  The kernels' failure first (the first
 * failing binary's, in binary order), then the memory's, as this thread's error. */
nimble_status nimble_load_kernels_and_memory(nimble_model *m);

/* The whole file's checksum, computed on a thread of its own while the plan, the kernels and
 * the memory load: nimble_file_check_start after nimble_map_file, nimble_file_check_finish
 * (joins it) before the graphs are built.  A damaged file's bytes reach the loaders meanwhile:
 * every read of them is bounded, and whatever they make is freed by nimble_free. */
typedef struct {
    const uint8_t *data; size_t size; uint8_t sum[32]; double seconds;
    pthread_t thread; int started;
} nimble_file_check;

void nimble_file_check_start(const nimble_model *m, nimble_file_check *check);

/* Joins the checksum: its failure wins over `then` (the status of the loading beside it, whose
 * message, if any, is this thread's error and stays so where the checksum is good). */
nimble_status nimble_file_check_finish(nimble_model *m, nimble_file_check *check,
                                       const char *path, nimble_status then);

#endif /* NIMBLE_INTERNAL_H */
