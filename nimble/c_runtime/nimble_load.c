/*
 * The kernels and the memory of a load (nimble.c's nimble_load): one item per kernel binary,
 * over several threads, that reads it from the file or its library, holds it to its SHA-256,
 * loads it and takes and checks the functions of its kernels; beside them, on a thread of its
 * own, the weights, the external memory and the arenas uploaded; and, on another, the whole
 * file's checksum, which the load joins before building.
 */
#define _POSIX_C_SOURCE 200809L
#include "nimble_internal.h"
#include "nimble_sha256.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define fail nimble_fail
#define cuda_fail nimble_cuda_fail
#define seconds_now nimble_seconds_now
#define lap nimble_lap

/* The bytes of binary `b`: a view into the file's blobs, or read from its library file into
 * *owned (the caller frees it).  Its hash is checked by the caller. */
static nimble_status binary_image(nimble_model *m, const binary_t *b, uint8_t **owned,
                                  const uint8_t **image) {
    *owned = NULL;
    if (!b->library) {
        *image = blob(m, (blobref_t){b->offset, b->size});
        if (!*image) return fail(NIMBLE_ERROR_FORMAT, "an embedded kernel binary runs past "
                                 "the blobs");
        return NIMBLE_OK;
    }
    FILE *f = fopen(b->path, "rb");
    if (!f) return fail(NIMBLE_ERROR_LIBRARY, "the library %s that the graph's kernels come "
                        "from cannot be opened: install the CUDA libraries of the saving "
                        "machine", b->path);
    *owned = malloc(b->size ? (size_t)b->size : 1);
    int ok = *owned && fseek(f, (long)b->offset, SEEK_SET) == 0 &&
             fread(*owned, 1, (size_t)b->size, f) == b->size;
    fclose(f);
    if (!ok) return fail(NIMBLE_ERROR_LIBRARY, "cannot read %llu bytes at %llu of %s",
                         (unsigned long long)b->size, (unsigned long long)b->offset, b->path);
    *image = *owned;
    return NIMBLE_OK;
}

static const CUfunction_attribute FINGERPRINT[6] = {
    CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
    CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES,
    CU_FUNC_ATTRIBUTE_NUM_REGS, CU_FUNC_ATTRIBUTE_BINARY_VERSION};
static const CUfunction_attribute SETTABLE[4] = {
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
    CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
    CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE,
    CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT};

static nimble_status load_kernel(nimble_model *m, kernel_t *k) {
    CUkernel kernel;
    CUresult r = cuLibraryGetKernel(&kernel, m->libraries[k->binary], k->name);
    if (r != CUDA_SUCCESS)
        return fail(NIMBLE_ERROR_LIBRARY, "kernel %s is not in the binary the file names for "
                    "it", k->name);
    CU(cuKernelGetFunction(&k->fn, kernel));
    for (int j = 0; j < 6; j++) {
        int v = 0;
        CU(cuFuncGetAttribute(&v, FINGERPRINT[j], k->fn));
        if ((int64_t)v != k->fingerprint[j])
            return fail(NIMBLE_ERROR_LIBRARY, "kernel %s loaded here differs from the one "
                        "saved (function attribute %d: %d, saved %lld)", k->name,
                        (int)FINGERPRINT[j], v, (long long)k->fingerprint[j]);
    }
    for (int j = 0; j < 4; j++) {
        int v = 0;
        CU(cuFuncGetAttribute(&v, SETTABLE[j], k->fn));
        if ((int64_t)v != k->settable[j])
            CU(cuFuncSetAttribute(k->fn, SETTABLE[j], (int)k->settable[j]));
    }
    return NIMBLE_OK;
}

/* ---- kernels: one item per binary ------------------------------------------------------ */

/* The bytes of binary `b` (*owned: the caller frees it) held to its saved SHA-256. */
static nimble_status read_binary(nimble_model *m, const binary_t *b, uint8_t **owned,
                                 const uint8_t **image) {
    TRY(binary_image(m, b, owned, image));
    uint8_t sum[32];
    nimble_sha256(*image, (size_t)b->size, sum);
    if (memcmp(sum, b->sha, 32) != 0)
        return fail(NIMBLE_ERROR_LIBRARY, "the kernel binary at byte %llu of %s is not the "
                    "one the graph was saved with (another version of the library)",
                    (unsigned long long)b->offset, b->library ? b->path : "the file");
    return NIMBLE_OK;
}

/* Set only where the load worked: nimble_free unloads every library that is not NULL. */
static nimble_status load_library(nimble_model *m, uint64_t i, const uint8_t *image) {
    CUlibrary library = NULL;
    CUresult r = cuLibraryLoadData(&library, image, NULL, NULL, 0, NULL, NULL, 0);
    if (r != CUDA_SUCCESS) return cuda_fail("cuLibraryLoadData", r);
    m->libraries[i] = library;
    return NIMBLE_OK;
}

typedef struct { uint64_t size, binary; } sized_t;

/* The items' shared state.  An item writes only its own binary's slots (status, message,
 * seconds, m->libraries[binary]) and the functions of its own kernels: each kernel has one
 * binary, so no two items write one place. */
typedef struct {
    nimble_model *m;
    sized_t *order;            /* the order items are taken in: the largest binaries first */
    uint64_t *first, *members; /* binary i's kernels: members[first[i]] to members[first[i+1]-1] */
    double (*seconds)[3];      /* per binary: read and hashed, loaded, its functions taken */
    nimble_status *status;
    char (*message)[NIMBLE_MESSAGE_BYTES];
} kernels_job_t;

static void tick(double *into, double *clock) {
    double now = seconds_now();
    *into += now - *clock;
    *clock = now;
}

/* Binary i read and hashed, loaded, then its kernels' functions taken: a library's load need
 * not wait for every other binary's hash, nor a function for every other library's load.  The
 * bytes read from a library file are freed once its kernels' functions are taken. */
static nimble_status binary_item(kernels_job_t *job, uint64_t i) {
    nimble_model *m = job->m;
    double *seconds = job->seconds[i], clock = seconds_now();
    uint8_t *owned = NULL;
    const uint8_t *image = NULL;
    nimble_status s = read_binary(m, &m->binaries[i], &owned, &image);
    tick(&seconds[0], &clock);
    if (s == NIMBLE_OK) s = load_library(m, i, image);
    tick(&seconds[1], &clock);
    for (uint64_t f = job->first[i]; s == NIMBLE_OK && f < job->first[i + 1]; f++)
        s = load_kernel(m, &m->kernels[job->members[f]]);
    tick(&seconds[2], &clock);
    free(owned);
    return s;
}

/* Run with the model's context current (cuKernelGetFunction needs one); a worker's
 * nimble_last_error is its own thread's, so the message is copied beside the status. */
static void run_binary_item(void *arg, size_t taken) {
    kernels_job_t *job = arg;
    uint64_t i = job->order[taken].binary;
    CUresult r = cuCtxSetCurrent(job->m->ctx);
    job->status[i] = r == CUDA_SUCCESS ? binary_item(job, i)
                                       : nimble_cuda_fail("cuCtxSetCurrent", r);
    if (job->status[i] != NIMBLE_OK)
        snprintf(job->message[i], sizeof job->message[i], "%s", nimble_last_error());
}

static int larger_first(const void *a, const void *b) {
    const sized_t *x = a, *y = b;
    if (x->size != y->size) return x->size < y->size ? 1 : -1;
    return (x->binary > y->binary) - (x->binary < y->binary);
}

/* The largest binaries are taken first, so that none of them starts last, alone. */
static void order_binaries(kernels_job_t *job) {
    for (uint64_t i = 0; i < job->m->nbinaries; i++)
        job->order[i] = (sized_t){job->m->binaries[i].size, i};
    qsort(job->order, (size_t)job->m->nbinaries, sizeof *job->order, larger_first);
}

/* Kernel indices grouped by binary, in kernel order within each (a counting sort; the reader
 * checked every kernel's binary index). */
static void group_kernels(kernels_job_t *job) {
    const nimble_model *m = job->m;
    for (uint64_t k = 0; k < m->nkernels; k++) job->first[m->kernels[k].binary + 1]++;
    for (uint64_t i = 0; i < m->nbinaries; i++) job->first[i + 1] += job->first[i];
    for (uint64_t k = 0; k < m->nkernels; k++) /* first[b] moves to first[b + 1] as it fills */
        job->members[job->first[m->kernels[k].binary]++] = k;
    for (uint64_t i = m->nbinaries; i > 0; i--) job->first[i] = job->first[i - 1];
    job->first[0] = 0;
}

static int job_alloc(kernels_job_t *job, nimble_model *m) {
    size_t n = (size_t)m->nbinaries + 1, k = (size_t)m->nkernels + 1;
    job->m = m;
    job->order = calloc(n, sizeof *job->order);
    job->first = calloc(n, sizeof *job->first);
    job->members = calloc(k, sizeof *job->members);
    job->seconds = calloc(n, sizeof *job->seconds);
    job->status = calloc(n, sizeof *job->status);
    job->message = calloc(n, sizeof *job->message);
    return job->order && job->first && job->members && job->seconds && job->status &&
           job->message;
}

static void job_free(kernels_job_t *job) {
    free(job->order); free(job->first); free(job->members);
    free(job->seconds); free(job->status); free(job->message);
}

/* The items spread over threads; every item runs (none is cut short by another's failure), so
 * the error reported, the first failing binary's in binary order, is the same on every run. */
static nimble_status run_binaries(kernels_job_t *job) {
    static const nimble_load_stage PARTS[3] = {
        NIMBLE_STAGE_BINARIES, NIMBLE_STAGE_LIBRARIES, NIMBLE_STAGE_FUNCTIONS};
    nimble_model *m = job->m;
    order_binaries(job);
    group_kernels(job);
    nimble_spread(run_binary_item, job, (size_t)m->nbinaries);
    for (uint64_t i = 0; i < m->nbinaries; i++)
        for (int p = 0; p < 3; p++) m->stage_seconds[PARTS[p]] += job->seconds[i][p];
    for (uint64_t i = 0; i < m->nbinaries; i++)
        if (job->status[i] != NIMBLE_OK) return fail(job->status[i], "%s", job->message[i]);
    return NIMBLE_OK;
}

static nimble_status load_kernels(nimble_model *m) {
    double clock = seconds_now();
    kernels_job_t job = {0};
    m->libraries = calloc(m->nbinaries ? (size_t)m->nbinaries : 1, sizeof(CUlibrary));
    nimble_status s = m->libraries && job_alloc(&job, m) ? run_binaries(&job)
                                                         : fail(NIMBLE_ERROR_IO, "out of memory");
    job_free(&job);
    lap(m, NIMBLE_STAGE_KERNELS, &clock);
    return s;
}

/* ---- memory ------------------------------------------------------------------------------ */

/* Each range's place in its table's one allocation: as torch's allocator aligns a storage,
 * which is what the saving process's kernels saw. */
#define RANGE_ALIGNMENT 512u

static uint64_t range_room(uint64_t size) {
    return (size + RANGE_ALIGNMENT - 1) / RANGE_ALIGNMENT * RANGE_ALIGNMENT;
}

/* One allocation for the whole table, each range at its aligned offset in it: a cuMemAlloc per
 * range (a thousand storages in the widest zoo models) waited on the driver's lock while the
 * kernels loaded beside it. */
static nimble_status upload(nimble_model *m, memory_t *t, uint64_t n, CUdeviceptr *block,
                            const char *what) {
    uint64_t total = 0;
    for (uint64_t i = 0; i < n; i++) {
        if (!blob(m, t[i].blob) || t[i].blob.size != t[i].size)
            return fail(NIMBLE_ERROR_UNSUPPORTED, "the file holds no bytes for %s %llu (saved "
                        "with weights=False?): the C runtime needs them in the file", what,
                        (unsigned long long)i);
        total += range_room(t[i].size);
    }
    if (!n) return NIMBLE_OK;
    CU(cuMemAlloc(block, total ? total : 1));
    uint64_t offset = 0;
    for (uint64_t i = 0; i < n; i++) {
        t[i].ptr = *block + offset;
        if (t[i].size) CU(cuMemcpyHtoD(t[i].ptr, blob(m, t[i].blob), t[i].size));
        offset += range_room(t[i].size);
    }
    return NIMBLE_OK;
}

static nimble_status place_arenas(nimble_model *m) {
    m->arenas = calloc(m->instances, sizeof(CUdeviceptr));
    m->bases = calloc(m->instances, sizeof(CUdeviceptr));
    if (!m->arenas || !m->bases) return fail(NIMBLE_ERROR_IO, "out of memory");
    for (uint64_t j = 0; j < m->instances; j++) {
        CU(cuMemAlloc(&m->arenas[j], m->arena_size ? m->arena_size : 1));
        uint64_t a = m->alignment ? m->alignment : 1;
        m->bases[j] = (m->arenas[j] + a - 1) / a * a;
        for (uint64_t k = 0; k < m->nbuckets; k++) {
            bucket_t *b = &m->buckets[k];
            for (uint64_t i = 0; i < b->nprivate; i++) {
                private_t *p = &b->private_[i];
                const uint8_t *data = blob(m, p->blob);
                if (data && p->blob.size == p->size)
                    CU(cuMemcpyHtoD(m->bases[j] + p->offset, data, p->size));
                else
                    CU(cuMemsetD8(m->bases[j] + p->offset, 0, p->size));
            }
        }
    }
    return NIMBLE_OK;
}

/* One instance's copy of low-bits buffer `l`: 8 GiB and the span reserved, the span mapped at
 * the first 4 GiB boundary in them plus the buffer's recorded low bits (rounded down to the
 * allocation granularity), its first bytes uploaded (zeroes where the plan gives none).  What
 * was made is noted in `map` as it is made, for nimble_free. */
static nimble_status map_low_bits(nimble_model *m, const lowbits_t *l, lowmap_t *map) {
    const uint64_t four_gib = 1ULL << 32;
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = (int)m->device;
    size_t grain = 0;
    CU(cuMemGetAllocationGranularity(&grain, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    if (!grain) grain = 1;
    uint64_t low = l->address % four_gib, first = low - low % grain;
    uint64_t need = low + (l->size ? l->size : 1) - first;
    size_t span = (size_t)((need + grain - 1) / grain * grain);
    size_t reserve = (size_t)(2 * four_gib) + span;
    CU(cuMemAddressReserve(&map->va, reserve, 0, 0, 0));
    map->reserve = reserve;
    CUdeviceptr window = (map->va + four_gib - 1) / four_gib * four_gib;
    CU(cuMemCreate(&map->handle, span, &prop, 0));
    map->have_handle = 1;
    CU(cuMemMap(window + first, span, 0, map->handle, 0));
    map->mapped = window + first;
    map->span = span;
    CUmemAccessDesc access;
    memset(&access, 0, sizeof access);
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CU(cuMemSetAccess(map->mapped, span, &access, 1));
    map->ptr = window + low;
    const uint8_t *data = blob(m, l->blob);
    if (data && l->blob.size == l->size && l->size) CU(cuMemcpyHtoD(map->ptr, data, l->size));
    else if (l->size) CU(cuMemsetD8(map->ptr, 0, l->size));
    return NIMBLE_OK;
}

static nimble_status place_low_bits(nimble_model *m) {
    for (uint64_t i = 0; i < m->nlowbits; i++) {
        lowbits_t *l = &m->lowbits[i];
        l->maps = calloc(m->instances ? m->instances : 1, sizeof(lowmap_t));
        if (!l->maps) return fail(NIMBLE_ERROR_IO, "out of memory");
        for (uint64_t j = 0; j < m->instances; j++) TRY(map_low_bits(m, l, &l->maps[j]));
    }
    return NIMBLE_OK;
}

/* The weights, the external memory, the arenas and the low-bits buffers, uploaded while
 * another thread loads the kernels: the two share nothing but the context. */
static nimble_status upload_memory(nimble_model *m) {
    double clock = seconds_now();
    TRY(upload(m, m->weights, m->nweights, &m->weight_block, "weight storage"));
    TRY(upload(m, m->memory, m->nmemory, &m->memory_block, "external memory range"));
    TRY(place_arenas(m));
    TRY(place_low_bits(m));
    lap(m, NIMBLE_STAGE_MEMORY, &clock);
    return NIMBLE_OK;
}

typedef struct {
    nimble_model *m; nimble_status status; char message[NIMBLE_MESSAGE_BYTES];
} memory_job_t;

static void *memory_worker(void *arg) {
    memory_job_t *job = arg;
    CUresult r = cuCtxSetCurrent(job->m->ctx);
    job->status = r == CUDA_SUCCESS ? upload_memory(job->m)
                                    : nimble_cuda_fail("cuCtxSetCurrent", r);
    if (job->status != NIMBLE_OK)
        snprintf(job->message, sizeof job->message, "%s", nimble_last_error());
    return NULL;
}

/* The kernels on this thread and the memory on one of its own, side by side; the kernels'
 * failure first, then the memory's, as this thread's error. */
nimble_status nimble_load_kernels_and_memory(nimble_model *m) {
    memory_job_t job = {m, NIMBLE_OK, ""};
    pthread_t id;
    int started = pthread_create(&id, NULL, memory_worker, &job) == 0;
    nimble_status kernels = load_kernels(m);
    double clock = seconds_now();
    if (started)
        pthread_join(id, NULL);
    else if (kernels == NIMBLE_OK)
        memory_worker(&job);
    lap(m, NIMBLE_STAGE_WAIT, &clock);
    TRY(kernels);
    return job.status == NIMBLE_OK ? NIMBLE_OK : fail(job.status, "%s", job.message);
}

/* ---- the file's checksum ------------------------------------------------------------------ */

/* Touches nothing of the model: the loading beside it writes the model freely. */
static void *check_worker(void *arg) {
    nimble_file_check *check = arg;
    double clock = seconds_now();
    nimble_checksum(check->data, check->size, check->sum);
    check->seconds = seconds_now() - clock;
    return NULL;
}

void nimble_file_check_start(const nimble_model *m, nimble_file_check *check) {
    check->data = m->file + 64; /* nimble_map_file checked there are 64 bytes */
    check->size = m->file_size - 64;
    check->seconds = 0.0;
    check->started = pthread_create(&check->thread, NULL, check_worker, check) == 0;
    if (!check->started) check_worker(check); /* no thread: hashed here, before the loading */
}

nimble_status nimble_file_check_finish(nimble_model *m, nimble_file_check *check,
                                       const char *path, nimble_status then) {
    double clock = seconds_now();
    if (check->started) pthread_join(check->thread, NULL);
    check->started = 0;
    lap(m, NIMBLE_STAGE_WAIT, &clock);
    m->stage_seconds[NIMBLE_STAGE_CHECKSUM] = check->seconds;
    nimble_status sum = nimble_file_intact(m, check->sum, path);
    return sum != NIMBLE_OK ? sum : then;
}
