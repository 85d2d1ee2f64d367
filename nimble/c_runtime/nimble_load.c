/*
 * The kernels, the memory and the build of a load (nimble.c's nimble_load): one item per kernel
 * binary, over worker threads, that reads it from the file or its library, holds it to its
 * SHA-256, loads it and takes and checks the functions of its kernels; on the calling thread
 * meanwhile, the memory placed and the graphs built (nimble_build.c), each binary's kernel
 * nodes as its item ends; on a thread of its own, the weights', external memory's and arenas'
 * bytes uploaded; and, on another, the whole file's checksum, which the load joins before its
 * proof.
 */
#define _POSIX_C_SOURCE 200809L
#include "nimble_internal.h"
#include "nimble_sha256.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
    /* the binaries whose items have ended, in the order they did: the build takes them */
    pthread_mutex_t lock;
    pthread_cond_t ended_one;
    uint64_t *ended;
    size_t nended;
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
    pthread_mutex_lock(&job->lock);
    job->ended[job->nended++] = i;
    pthread_cond_signal(&job->ended_one);
    pthread_mutex_unlock(&job->lock);
}

/* The binary whose item ended `taken`-th, once it has. */
static uint64_t ended_binary(kernels_job_t *job, size_t taken) {
    pthread_mutex_lock(&job->lock);
    while (job->nended <= taken) pthread_cond_wait(&job->ended_one, &job->lock);
    uint64_t i = job->ended[taken];
    pthread_mutex_unlock(&job->lock);
    return i;
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
    job->ended = calloc(n, sizeof *job->ended);
    pthread_mutex_init(&job->lock, NULL);
    pthread_cond_init(&job->ended_one, NULL);
    return job->order && job->first && job->members && job->seconds && job->status &&
           job->message && job->ended;
}

static void job_free(kernels_job_t *job) {
    free(job->order); free(job->first); free(job->members);
    free(job->seconds); free(job->status); free(job->message); free(job->ended);
    pthread_mutex_destroy(&job->lock);
    pthread_cond_destroy(&job->ended_one);
}

/* ---- the loaders: the items' threads ---------------------------------------------------- */

#define MOST_LOADERS 16

typedef struct {
    kernels_job_t *job;
    atomic_size_t next;
    pthread_t ids[MOST_LOADERS];
    int started[MOST_LOADERS];
} loaders_t;

/* The online CPUs less two (the upload's thread and the checksum's run beside the items), from
 * 1 to MOST_LOADERS: the driver's loads of the binaries scale with threads. */
static size_t loader_threads(size_t items) {
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    size_t n = cpus > 3 ? (size_t)(cpus - 2) : 1;
    if (n > MOST_LOADERS) n = MOST_LOADERS;
    return n < items ? n : items;
}

/* Items are claimed one at a time, the largest binaries first (order_binaries): a thread that
 * drew small ones takes the next rather than sitting idle beside one that drew a large one. */
static void *run_loader(void *arg) {
    loaders_t *l = arg;
    size_t count = (size_t)l->job->m->nbinaries;
    for (size_t i = atomic_fetch_add(&l->next, 1); i < count; i = atomic_fetch_add(&l->next, 1))
        run_binary_item(l->job, i);
    return NULL;
}

static void loaders_start(loaders_t *l, kernels_job_t *job) {
    l->job = job;
    atomic_init(&l->next, 0);
    size_t threads = loader_threads((size_t)job->m->nbinaries);
    int any = 0;
    for (size_t t = 0; t < threads; t++)
        any |= l->started[t] = pthread_create(&l->ids[t], NULL, run_loader, l) == 0;
    if (!any) run_loader(l); /* no thread: every item here, before the build takes them */
}

static void loaders_join(loaders_t *l) {
    for (size_t t = 0; t < MOST_LOADERS; t++)
        if (l->started[t]) pthread_join(l->ids[t], NULL);
}

/* Every item has run (none is cut short by another's failure), so the error reported, the
 * first failing binary's in binary order, is the same on every run. */
static nimble_status kernels_status(kernels_job_t *job) {
    static const nimble_load_stage PARTS[3] = {
        NIMBLE_STAGE_BINARIES, NIMBLE_STAGE_LIBRARIES, NIMBLE_STAGE_FUNCTIONS};
    nimble_model *m = job->m;
    for (uint64_t i = 0; i < m->nbinaries; i++)
        for (int p = 0; p < 3; p++) m->stage_seconds[PARTS[p]] += job->seconds[i][p];
    for (uint64_t i = 0; i < m->nbinaries; i++)
        if (job->status[i] != NIMBLE_OK) return fail(job->status[i], "%s", job->message[i]);
    return NIMBLE_OK;
}

/* ---- the memory's upload (nimble_memory.c) on a thread of its own ---------------------- */

typedef struct {
    nimble_model *m; nimble_status status; char message[NIMBLE_MESSAGE_BYTES];
} memory_job_t;

static void *memory_worker(void *arg) {
    memory_job_t *job = arg;
    CUresult r = cuCtxSetCurrent(job->m->ctx);
    job->status = r == CUDA_SUCCESS ? nimble_upload_memory(job->m)
                                    : nimble_cuda_fail("cuCtxSetCurrent", r);
    if (job->status != NIMBLE_OK)
        snprintf(job->message, sizeof job->message, "%s", nimble_last_error());
    return NULL;
}

/* ---- the load: the three side by side ------------------------------------------------------ */

/* A failure's message kept beside its status: this thread's error changes with the next. */
typedef struct { nimble_status status; char message[NIMBLE_MESSAGE_BYTES]; } outcome_t;

static void keep(outcome_t *o, nimble_status s) {
    o->status = s;
    if (s != NIMBLE_OK) snprintf(o->message, sizeof o->message, "%s", nimble_last_error());
}

/* The graphs built on this thread as the items end: the nodes of no kernel first, then each
 * ended binary's kernel nodes; once one fails, the rest of the items are waited for, not
 * built.  KERNELS is the span from `started` to the last item's end. */
static void build_as_items_end(kernels_job_t *job, outcome_t *built, double started) {
    nimble_model *m = job->m;
    nimble_builds *bs = NULL;
    double clock = seconds_now();
    if (built->status == NIMBLE_OK) keep(built, nimble_builds_start(m, &bs));
    lap(m, NIMBLE_STAGE_NODES, &clock);
    for (size_t n = 0; n < (size_t)m->nbinaries; n++) {
        uint64_t i = ended_binary(job, n);
        clock = seconds_now();
        if (built->status == NIMBLE_OK && job->status[i] == NIMBLE_OK)
            keep(built, nimble_builds_add_binary(bs, i));
        lap(m, NIMBLE_STAGE_NODES, &clock);
    }
    m->stage_seconds[NIMBLE_STAGE_KERNELS] += seconds_now() - started;
    int loaded = 1;
    for (uint64_t i = 0; i < m->nbinaries; i++) loaded &= job->status[i] == NIMBLE_OK;
    clock = seconds_now();
    if (built->status == NIMBLE_OK && loaded) keep(built, nimble_builds_finish(bs));
    nimble_builds_free(bs);
    lap(m, NIMBLE_STAGE_BUILD, &clock);
}

/* The items started first (they need nothing of the memory), the memory placed, its upload
 * started, then the build; precedence of errors as nimble_internal.h says. */
static nimble_status load_and_build(nimble_model *m, kernels_job_t *job) {
    double clock = seconds_now();
    loaders_t loaders;
    memset(&loaders, 0, sizeof loaders);
    order_binaries(job);
    group_kernels(job);
    loaders_start(&loaders, job);
    outcome_t placed, built, uploaded;
    memset(&built, 0, sizeof built);
    keep(&placed, nimble_place_memory(m));
    memory_job_t upload = {m, NIMBLE_OK, ""};
    pthread_t id;
    int uploading = placed.status == NIMBLE_OK &&
                    pthread_create(&id, NULL, memory_worker, &upload) == 0;
    built.status = placed.status; /* no build without the memory's addresses */
    build_as_items_end(job, &built, clock);
    loaders_join(&loaders);
    clock = seconds_now();
    if (uploading) pthread_join(id, NULL);
    else if (placed.status == NIMBLE_OK) memory_worker(&upload); /* no thread: here, last */
    lap(m, NIMBLE_STAGE_WAIT, &clock);
    uploaded.status = upload.status;
    snprintf(uploaded.message, sizeof uploaded.message, "%s", upload.message);
    TRY(kernels_status(job));
    const outcome_t *order[3] = {&placed, &built, &uploaded};
    for (int i = 0; i < 3; i++)
        if (order[i]->status != NIMBLE_OK) return fail(order[i]->status, "%s", order[i]->message);
    return NIMBLE_OK;
}

nimble_status nimble_load_and_build(nimble_model *m) {
    kernels_job_t job;
    memset(&job, 0, sizeof job);
    int made = job_alloc(&job, m); /* its lock made whatever else fails: job_free ends it */
    m->libraries = calloc(m->nbinaries ? (size_t)m->nbinaries : 1, sizeof(CUlibrary));
    nimble_status s = made && m->libraries ? load_and_build(m, &job)
                                           : fail(NIMBLE_ERROR_IO, "out of memory");
    job_free(&job);
    return s;
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
