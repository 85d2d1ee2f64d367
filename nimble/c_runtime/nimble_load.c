/*
 * The kernels and the memory of a load (nimble.c's nimble_load): every kernel binary read from
 * the file or its library and hashed, the libraries loaded and each kernel's function taken and
 * checked, on several threads; beside them, on a thread of its own, the weights, the external
 * memory and the arenas uploaded.
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
static nimble_status binary_image(nimble_model *m, binary_t *b, uint8_t **owned,
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

/* ---- work spread over threads -------------------------------------------------------------- */

/* One item of parallel work, run with the model's context current: its status, and its
 * message (a worker's nimble_last_error is its own thread's). */
typedef nimble_status (*item_fn)(nimble_model *m, uint64_t i);
typedef struct {
    nimble_model *m; item_fn fn; nimble_status *status; char (*message)[NIMBLE_MESSAGE_BYTES];
} items_t;

static void run_item(void *arg, size_t i) {
    items_t *job = arg;
    CUresult r = cuCtxSetCurrent(job->m->ctx);
    job->status[i] = r == CUDA_SUCCESS ? job->fn(job->m, i)
                                       : nimble_cuda_fail("cuCtxSetCurrent", r);
    if (job->status[i] != NIMBLE_OK)
        snprintf(job->message[i], sizeof job->message[i], "%s", nimble_last_error());
}

/* fn(m, i) for every i < count, over nimble_spread's threads; the first failing item's status
 * and message, in item order, as this thread's error. */
static nimble_status spread(nimble_model *m, item_fn fn, uint64_t count) {
    if (count == 0) return NIMBLE_OK;
    nimble_status *status = calloc((size_t)count, sizeof *status);
    char (*message)[NIMBLE_MESSAGE_BYTES] = calloc((size_t)count, sizeof *message);
    if (!status || !message) {
        free(status); free(message);
        return fail(NIMBLE_ERROR_IO, "out of memory");
    }
    items_t job = {m, fn, status, message};
    nimble_spread(run_item, &job, (size_t)count);
    nimble_status s = NIMBLE_OK;
    for (uint64_t i = 0; i < count && s == NIMBLE_OK; i++)
        if (status[i] != NIMBLE_OK) s = fail(status[i], "%s", message[i]);
    free(status); free(message);
    return s;
}

/* ---- kernels ----------------------------------------------------------------------------- */

static nimble_status load_library(nimble_model *m, uint64_t i) {
    CUresult r = cuLibraryLoadData(&m->libraries[i], m->images[i], NULL, NULL, 0, NULL, NULL,
                                   0);
    return r == CUDA_SUCCESS ? NIMBLE_OK : cuda_fail("cuLibraryLoadData", r);
}

static nimble_status load_kernel_item(nimble_model *m, uint64_t i) {
    return load_kernel(m, &m->kernels[i]);
}

/* Binary i read (from its library file, or viewed in the file) and its SHA-256 held to the
 * saved one: one item of the threads' work, so that the library files are read side by side
 * as they are hashed. */
static nimble_status read_binary_item(nimble_model *m, uint64_t i) {
    binary_t *b = &m->binaries[i];
    TRY(binary_image(m, b, &m->owned_images[i], &m->images[i]));
    uint8_t sum[32];
    nimble_sha256(m->images[i], (size_t)b->size, sum);
    if (memcmp(sum, b->sha, 32) != 0)
        return fail(NIMBLE_ERROR_LIBRARY, "the kernel binary at byte %llu of %s is not the "
                    "one the graph was saved with (another version of the library)",
                    (unsigned long long)b->offset, b->library ? b->path : "the file");
    return NIMBLE_OK;
}

/* Every binary read and its hash checked (on several threads), before the driver loads any;
 * then the libraries loaded side by side. */
static nimble_status load_binaries(nimble_model *m) {
    double clock = seconds_now();
    TRY(spread(m, read_binary_item, m->nbinaries));
    lap(m, NIMBLE_STAGE_BINARIES, &clock);
    TRY(spread(m, load_library, m->nbinaries));
    lap(m, NIMBLE_STAGE_LIBRARIES, &clock);
    return NIMBLE_OK;
}

/* The binaries and libraries (load_binaries), then every kernel's function; the binaries'
 * bytes read from library files are freed once the libraries are loaded. */
static nimble_status load_kernels(nimble_model *m) {
    size_t n = m->nbinaries ? (size_t)m->nbinaries : 1;
    m->libraries = calloc(n, sizeof(CUlibrary));
    m->images = calloc(n, sizeof *m->images);
    m->owned_images = calloc(n, sizeof *m->owned_images);
    nimble_status s = m->libraries && m->images && m->owned_images
                          ? load_binaries(m)
                          : fail(NIMBLE_ERROR_IO, "out of memory");
    for (uint64_t i = 0; m->owned_images && i < m->nbinaries; i++) free(m->owned_images[i]);
    free(m->images); free(m->owned_images);
    m->images = NULL;
    m->owned_images = NULL;
    TRY(s);
    double clock = seconds_now();
    TRY(spread(m, load_kernel_item, m->nkernels));
    lap(m, NIMBLE_STAGE_FUNCTIONS, &clock);
    return NIMBLE_OK;
}

static nimble_status upload(nimble_model *m, memory_t *t, uint64_t n, const char *what) {
    for (uint64_t i = 0; i < n; i++) {
        const uint8_t *data = blob(m, t[i].blob);
        if (!data || t[i].blob.size != t[i].size)
            return fail(NIMBLE_ERROR_UNSUPPORTED, "the file holds no bytes for %s %llu (saved "
                        "with weights=False?): the C runtime needs them in the file", what,
                        (unsigned long long)i);
        CU(cuMemAlloc(&t[i].ptr, t[i].size ? t[i].size : 1));
        if (t[i].size) CU(cuMemcpyHtoD(t[i].ptr, data, t[i].size));
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
    TRY(upload(m, m->weights, m->nweights, "weight storage"));
    TRY(upload(m, m->memory, m->nmemory, "external memory range"));
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
    if (started)
        pthread_join(id, NULL);
    else if (kernels == NIMBLE_OK)
        memory_worker(&job);
    TRY(kernels);
    return job.status == NIMBLE_OK ? NIMBLE_OK : fail(job.status, "%s", job.message);
}
