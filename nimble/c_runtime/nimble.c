/*
 * Nimble's C runtime (see nimble.h): loading a saved graph read by nimble_plan.c (every pointer
 * already resolved to a region, the arena, a weight storage or an external memory range, and an
 * addend: docs/c-host.md), its kernels and memory loaded by nimble_load.c, building it, proving
 * it against its saved outputs, and the API.
 */
#define _POSIX_C_SOURCE 200809L
#include "nimble_internal.h"
#include "nimble_sha256.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

double nimble_seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

void nimble_lap(nimble_model *m, nimble_load_stage stage, double *since) {
    double now = nimble_seconds_now();
    m->stage_seconds[stage] += now - *since;
    *since = now;
}

#define seconds_now nimble_seconds_now
#define lap nimble_lap

/* ---- errors ------------------------------------------------------------------------------ */

static _Thread_local char last_error[NIMBLE_MESSAGE_BYTES];

const char *nimble_last_error(void) { return last_error; }

nimble_status nimble_fail(nimble_status status, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, args);
    va_end(args);
    return status;
}

nimble_status nimble_cuda_fail(const char *call, CUresult r) {
    const char *name = NULL;
    cuGetErrorName(r, &name);
    return nimble_fail(NIMBLE_ERROR_CUDA, "%s failed with %s (%d)", call, name ? name : "?",
                       (int)r);
}

#define fail nimble_fail
#define cuda_fail nimble_cuda_fail

/* ---- loading ------------------------------------------------------------------------------ */

static nimble_status check_device(nimble_model *m, int ordinal) {
    int major = 0, minor = 0, version = 0;
    CUcontext ctx;
    CU(cuInit(0));
    CU(cuDeviceGet(&m->device, ordinal));
    CU(cuDevicePrimaryCtxRetain(&ctx, m->device));
    m->ctx = ctx; /* set only once retained: nimble_free releases it where it is set */
    CU(cuCtxSetCurrent(m->ctx));
    CU(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, m->device));
    CU(cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, m->device));
    if ((uint64_t)(10 * major + minor) != m->arch)
        return fail(NIMBLE_ERROR_DEVICE, "the graph was saved for compute capability %llu; "
                    "device %d is %d: save it on this kind of GPU",
                    (unsigned long long)m->arch, ordinal, 10 * major + minor);
    CU(cuDriverGetVersion(&version));
    if ((uint64_t)version < m->driver)
        return fail(NIMBLE_ERROR_DEVICE, "the graph was saved under driver %llu; this one is "
                    "%d, older: update the driver", (unsigned long long)m->driver, version);
    return NIMBLE_OK;
}

/* ---- building ----------------------------------------------------------------------------- */

static nimble_status add_kernel_node(nimble_model *m, uint64_t j, node_t *nd, CUgraph g,
                                     CUgraphNode *out) {
    uint8_t *args = malloc(nd->args_len ? nd->args_len : 1);
    void **slots = calloc(nd->nparams ? nd->nparams : 1, sizeof(void *));
    if (!args || !slots) { free(args); free(slots); return fail(NIMBLE_ERROR_IO, "out of memory"); }
    memcpy(args, nd->args, nd->args_len);
    for (uint64_t i = 0; i < nd->nrelocs; i++) { /* the reader kept each inside the block */
        uint64_t v = resolve(m, j, nd->relocs[i].place);
        for (int b = 0; b < 8; b++) args[nd->relocs[i].loc + b] = (uint8_t)(v >> (8 * b));
    }
    size_t size = nd->args_len;
    void *extra[5] = {CU_LAUNCH_PARAM_BUFFER_POINTER, args, CU_LAUNCH_PARAM_BUFFER_SIZE, &size,
                      CU_LAUNCH_PARAM_END};
    CUDA_KERNEL_NODE_PARAMS p;
    memset(&p, 0, sizeof p);
    p.func = m->kernels[nd->kernel].fn;
    p.gridDimX = (unsigned)nd->grid[0]; p.gridDimY = (unsigned)nd->grid[1];
    p.gridDimZ = (unsigned)nd->grid[2];
    p.blockDimX = (unsigned)nd->block[0]; p.blockDimY = (unsigned)nd->block[1];
    p.blockDimZ = (unsigned)nd->block[2];
    p.sharedMemBytes = (unsigned)nd->shared;
    if (nd->packed) {
        p.extra = extra;
    } else if (nd->nparams) {
        for (uint64_t i = 0; i < nd->nparams; i++) slots[i] = args + nd->params[2 * i];
        p.kernelParams = slots;
    }
    CUresult r = cuGraphAddKernelNode(out, g, NULL, 0, &p);
    free(args);
    free(slots);
    if (r != CUDA_SUCCESS) return cuda_fail("cuGraphAddKernelNode", r);
    for (uint64_t i = 0; i < nd->nattrs; i++) {
        CUlaunchAttributeValue v;
        memset(&v, 0, sizeof v);
        memcpy(&v, nd->attrs[i].value, nd->attrs[i].len < sizeof v ? nd->attrs[i].len : sizeof v);
        CU(cuGraphKernelNodeSetAttribute(*out, (CUlaunchAttributeID)nd->attrs[i].id, &v));
    }
    if (nd->has_priority) {
        CUlaunchAttributeValue v;
        memset(&v, 0, sizeof v);
        v.priority = (int)nd->priority;
        CU(cuGraphKernelNodeSetAttribute(*out, CU_LAUNCH_ATTRIBUTE_PRIORITY, &v));
    }
    return NIMBLE_OK;
}

static nimble_status add_copy_node(nimble_model *m, uint64_t j, node_t *nd, CUgraph g,
                                   CUgraphNode *out) {
    if (nd->kind == N_MEMSET) {
        CUDA_MEMSET_NODE_PARAMS p;
        memset(&p, 0, sizeof p);
        p.dst = resolve(m, j, nd->dst);
        p.value = (unsigned)nd->f[0]; p.elementSize = (unsigned)nd->f[1];
        p.width = (size_t)nd->f[2]; p.height = (size_t)nd->f[3]; p.pitch = (size_t)nd->f[4];
        CU(cuGraphAddMemsetNode(out, g, NULL, 0, &p, m->ctx));
        return NIMBLE_OK;
    }
    CUDA_MEMCPY3D p;
    memset(&p, 0, sizeof p);
    p.srcMemoryType = (CUmemorytype)nd->f[0]; p.dstMemoryType = (CUmemorytype)nd->f[1];
    p.srcDevice = resolve(m, j, nd->src); p.dstDevice = resolve(m, j, nd->dst);
    p.srcXInBytes = (size_t)nd->f[2]; p.srcY = (size_t)nd->f[3]; p.srcZ = (size_t)nd->f[4];
    p.srcPitch = (size_t)nd->f[5]; p.srcHeight = (size_t)nd->f[6];
    p.dstXInBytes = (size_t)nd->f[7]; p.dstY = (size_t)nd->f[8]; p.dstZ = (size_t)nd->f[9];
    p.dstPitch = (size_t)nd->f[10]; p.dstHeight = (size_t)nd->f[11];
    p.WidthInBytes = (size_t)nd->f[12]; p.Height = (size_t)nd->f[13]; p.Depth = (size_t)nd->f[14];
    CU(cuGraphAddMemcpyNode(out, g, NULL, 0, &p, m->ctx));
    return NIMBLE_OK;
}

/* Instantiate for device launch (a host launch is then a short, constant-cost submission) as
 * Python's prepare does, uploading on the way; where the driver refuses (a node it cannot
 * launch from the device), for host launch, with the refusal kept for nimble_launch_note. */
static nimble_status instantiate(nimble_model *m, bucket_t *b, uint64_t j, CUgraph g,
                                 int priorities) {
    cuuint64_t flags = priorities ? CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY : 0;
    CUDA_GRAPH_INSTANTIATE_PARAMS p;
    memset(&p, 0, sizeof p);
    p.flags = flags | CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH |
              CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD;
    p.hUploadStream = NULL;
    CUresult r = cuGraphInstantiateWithParams(&b->execs[j], g, &p);
    if (r == CUDA_SUCCESS) return NIMBLE_OK;
    if (!m->launch_note[0]) {
        const char *name = NULL;
        cuGetErrorName(r, &name);
        snprintf(m->launch_note, sizeof m->launch_note, "device launch refused (%s, "
                 "instantiate result %d): launched from the host", name ? name : "?",
                 (int)p.result_out);
    }
    b->execs[j] = NULL;
    CU(cuGraphInstantiateWithFlags(&b->execs[j], g, flags));
    CU(cuGraphUpload(b->execs[j], 0));
    return NIMBLE_OK;
}

/* The bucket's edges, a full dependency each; under NIMBLE_LOAD_PROGRAMMATIC a plan of version
 * 4's programmatic ones built so, as Python's loader builds them (nimble.engine.loading's
 * LOAD_WAITING_EDGES): the writer lists there only edges into Nimble's waiting kernels, where
 * a plan of version 2 or 3 may list the withdrawn rule's, which raced on a busy GPU
 * (docs/findings.md).  Otherwise the marks are read and not served.
 *
 * An edge out of a root (a node no edge ends in) stays a full dependency: built programmatic
 * it gave wrong outputs, every time, where the same edges built by Python passed (there each
 * root kernel waits for an input gather node, which this runtime has none of; docs/findings.md,
 * "A programmatic edge out of a graph's root"). */
static nimble_status add_edges(const nimble_model *m, bucket_t *b, CUgraph g, CUgraphNode *from,
                               CUgraphNode *to) {
#if CUDA_VERSION >= 12030
    CUgraphEdgeData *data = NULL; /* NULL: every edge the default, a full dependency */
    if (m->programmatic && m->plan_version >= 4 && b->programmatic) {
        data = calloc(b->nedges, sizeof *data);
        uint8_t *entered = calloc(b->nnodes ? b->nnodes : 1, 1);
        if (!data || !entered) {
            free(data);
            free(entered);
            return fail(NIMBLE_ERROR_IO, "out of memory");
        }
        for (uint64_t e = 0; e < b->nedges; e++) entered[b->edges[2 * e + 1]] = 1;
        for (uint64_t e = 0; e < b->nedges; e++) {
            if (!b->programmatic[e] || !entered[b->edges[2 * e]]) continue;
            data[e].type = CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC;
            data[e].from_port = CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC;
        }
        free(entered);
    }
#if CUDA_VERSION >= 13000
    CUresult r = cuGraphAddDependencies(g, from, to, data, b->nedges);
#else
    CUresult r = cuGraphAddDependencies_v2(g, from, to, data, b->nedges);
#endif
    free(data);
#else
    (void)m;
    CUresult r = cuGraphAddDependencies(g, from, to, b->nedges);
#endif
    return r == CUDA_SUCCESS ? NIMBLE_OK : cuda_fail("cuGraphAddDependencies", r);
}

/* The graph is destroyed once instantiated: the exec is the driver's own copy of it. */
static nimble_status build(nimble_model *m, bucket_t *b, uint64_t j) {
    CUgraph g;
    CU(cuGraphCreate(&g, 0));
    CUgraphNode *nodes = calloc(b->nnodes ? b->nnodes : 1, sizeof(CUgraphNode));
    CUgraphNode *from = calloc(b->nedges ? b->nedges : 1, sizeof(CUgraphNode));
    CUgraphNode *to = calloc(b->nedges ? b->nedges : 1, sizeof(CUgraphNode));
    nimble_status s = nodes && from && to ? NIMBLE_OK : fail(NIMBLE_ERROR_IO, "out of memory");
    int priorities = 0;
    for (uint64_t i = 0; s == NIMBLE_OK && i < b->nnodes; i++) {
        node_t *nd = &b->nodes[i];
        priorities |= nd->kind == N_KERNEL && nd->has_priority;
        if (nd->kind == N_KERNEL) s = add_kernel_node(m, j, nd, g, &nodes[i]);
        else if (nd->kind == N_EMPTY) {
            CUresult r = cuGraphAddEmptyNode(&nodes[i], g, NULL, 0);
            if (r != CUDA_SUCCESS) s = cuda_fail("cuGraphAddEmptyNode", r);
        } else s = add_copy_node(m, j, nd, g, &nodes[i]);
    }
    for (uint64_t e = 0; s == NIMBLE_OK && e < b->nedges; e++) {
        from[e] = nodes[b->edges[2 * e]];
        to[e] = nodes[b->edges[2 * e + 1]];
    }
    if (s == NIMBLE_OK && b->nedges) s = add_edges(m, b, g, from, to);
    free(nodes); free(from); free(to);
    if (s == NIMBLE_OK) s = instantiate(m, b, j, g, priorities);
    cuGraphDestroy(g);
    return s;
}

/* ---- the proof at load -------------------------------------------------------------------- */

static nimble_status restore_written(nimble_model *m, bucket_t *b) {
    for (uint64_t i = 0; i < b->nwritten; i++) {
        place_t p = b->written[i];
        memory_t *t = p.region == R_WEIGHT ? &m->weights[p.index] : &m->memory[p.index];
        const uint8_t *data = blob(m, t->blob);
        if (data && t->size) CU(cuMemcpyHtoD(t->ptr, data, t->size));
    }
    return NIMBLE_OK;
}

static nimble_status prove_one(nimble_model *m, uint64_t k, uint64_t j, uint64_t launch,
                               CUstream stream, uint8_t *host) {
    bucket_t *b = &m->buckets[k];
    refset_t *set = &b->sets[launch % b->nsets];
    TRY(restore_written(m, b));
    CU(cuMemsetD8(m->bases[j], 0xFF, b->plan_bytes)); /* poison: a missed pointer reads NaN */
    for (uint64_t i = 0; i < m->nlowbits; i++) { /* the plan's buffers kept apart, likewise */
        const lowbits_t *l = &m->lowbits[i];
        if (l->bucket == k && l->poison && l->size)
            CU(cuMemsetD8(l->maps[j].ptr, 0xFF, l->size));
    }
    for (uint64_t i = 0; i < b->ninputs; i++) { /* the inputs' slots lie in the plan */
        const uint8_t *data = blob(m, set->inputs[i]);
        if (!data || set->inputs[i].size != b->inputs[i].info.nbytes)
            return fail(NIMBLE_ERROR_FORMAT, "a saved reference input has the wrong size");
        CU(cuMemcpyHtoD(resolve(m, j, b->inputs[i].place), data, set->inputs[i].size));
    }
    CU(cuGraphLaunch(b->execs[j], stream));
    CU(cuStreamSynchronize(stream));
    for (uint64_t i = 0; i < b->noutputs; i++) {
        tensor_t *t = &b->outputs[i];
        const uint8_t *want = blob(m, set->outputs[i]);
        if (!set->checked[i] || !t->info.contiguous) continue;
        if (!want || set->outputs[i].size != t->info.nbytes)
            return fail(NIMBLE_ERROR_FORMAT, "a saved reference output has the wrong size");
        CU(cuMemcpyDtoH(host, resolve(m, j, t->place), t->info.nbytes));
        if (memcmp(host, want, t->info.nbytes) != 0)
            return fail(NIMBLE_ERROR_VERIFY, "bucket %llu, instance %llu, launch %llu: output "
                        "%llu differs from the saved one: the loaded graph does not reproduce "
                        "the saving process's", (unsigned long long)k, (unsigned long long)j,
                        (unsigned long long)launch, (unsigned long long)i);
    }
    return NIMBLE_OK;
}

static nimble_status prove(nimble_model *m) {
    size_t most = 1;
    for (uint64_t k = 0; k < m->nbuckets; k++)
        for (uint64_t i = 0; i < m->buckets[k].noutputs; i++)
            if (m->buckets[k].outputs[i].info.nbytes > most)
                most = m->buckets[k].outputs[i].info.nbytes;
    uint8_t *host = malloc(most);
    CUstream stream;
    if (!host) return fail(NIMBLE_ERROR_IO, "out of memory");
    CUresult r = cuStreamCreate(&stream, CU_STREAM_DEFAULT); /* ordered with the copies */
    if (r != CUDA_SUCCESS) { free(host); return cuda_fail("cuStreamCreate", r); }
    nimble_status s = NIMBLE_OK;
    for (uint64_t k = 0; s == NIMBLE_OK && k < m->nbuckets; k++) {
        if (!m->buckets[k].nsets) continue;
        for (uint64_t j = 0; s == NIMBLE_OK && j < m->instances; j++)
            for (uint64_t launch = 0; s == NIMBLE_OK && launch < 4; launch++)
                s = prove_one(m, k, j, launch, stream, host);
        if (s == NIMBLE_OK) s = restore_written(m, &m->buckets[k]);
    }
    cuStreamDestroy(stream);
    free(host);
    return s;
}

/* ---- the API ------------------------------------------------------------------------------ */

/* What the checksum runs beside, reading bytes it has not vouched for yet (each read bounded). */
static nimble_status load_unchecked(nimble_model *m, const char *path, int device, double *clock) {
    plan_t pl = {0};
    TRY(nimble_find_sections(m, path, &pl));
    TRY(nimble_read_plan(m, &pl));
    TRY(check_device(m, device));
    lap(m, NIMBLE_STAGE_READ, clock);
    return nimble_load_kernels_and_memory(m);
}

/* The checksum is joined on every path before load returns (nimble_load unmaps the file it
 * reads), and its failure is the load's whatever else failed meanwhile: a damaged file's
 * other errors are the damage's. */
static nimble_status load(nimble_model *m, const char *path, int device, unsigned flags) {
    double clock = seconds_now();
    m->programmatic = (flags & NIMBLE_LOAD_PROGRAMMATIC) != 0;
    TRY(nimble_map_file(m, path));
    nimble_file_check check;
    nimble_file_check_start(m, &check);
    nimble_status s = load_unchecked(m, path, device, &clock);
    TRY(nimble_file_check_finish(m, &check, path, s));
    clock = seconds_now();
    for (uint64_t k = 0; k < m->nbuckets; k++) {
        bucket_t *b = &m->buckets[k];
        b->execs = calloc(m->instances, sizeof(CUgraphExec));
        if (!b->execs) return fail(NIMBLE_ERROR_IO, "out of memory");
        for (uint64_t j = 0; j < m->instances; j++) TRY(build(m, b, j));
    }
    lap(m, NIMBLE_STAGE_BUILD, &clock);
    if (!(flags & NIMBLE_LOAD_NO_VERIFY)) TRY(prove(m));
    lap(m, NIMBLE_STAGE_VERIFY, &clock);
    return NIMBLE_OK;
}

nimble_status nimble_load(const char *path, int device, unsigned flags, nimble_model **model) {
    if (!model || !path) return fail(NIMBLE_ERROR_ARGUMENT, "nimble_load: a NULL argument");
    *model = NULL;
    nimble_model *m = calloc(1, sizeof *m);
    if (!m) return fail(NIMBLE_ERROR_IO, "out of memory");
    nimble_status s = load(m, path, device, flags);
    nimble_release_file(m); /* blobs and plan strings point into it; only loading reads them */
    if (s != NIMBLE_OK) {
        nimble_free(m); /* sets no error: the load's message stays */
        return s;
    }
    last_error[0] = 0;
    *model = m;
    return NIMBLE_OK;
}

int nimble_buckets(const nimble_model *m) { return m ? (int)m->nbuckets : 0; }
int nimble_instances(const nimble_model *m) { return m ? (int)m->instances : 0; }

static const bucket_t *bucket_of(const nimble_model *m, int k) {
    return m && k >= 0 && (uint64_t)k < m->nbuckets ? &m->buckets[k] : NULL;
}

int nimble_inputs(const nimble_model *m, int k) {
    const bucket_t *b = bucket_of(m, k);
    return b ? (int)b->ninputs : 0;
}

int nimble_outputs(const nimble_model *m, int k) {
    const bucket_t *b = bucket_of(m, k);
    return b ? (int)b->noutputs : 0;
}

static nimble_status info_of(const tensor_t *t, uint64_t n, int i, nimble_tensor_info *info) {
    if (!t || !info || i < 0 || (uint64_t)i >= n)
        return fail(NIMBLE_ERROR_ARGUMENT, "no tensor %d (of %llu)", i, (unsigned long long)n);
    *info = t[i].info;
    return NIMBLE_OK;
}

nimble_status nimble_input_info(const nimble_model *m, int k, int i, nimble_tensor_info *info) {
    const bucket_t *b = bucket_of(m, k);
    return info_of(b ? b->inputs : NULL, b ? b->ninputs : 0, i, info);
}

nimble_status nimble_output_info(const nimble_model *m, int k, int i, nimble_tensor_info *info) {
    const bucket_t *b = bucket_of(m, k);
    return info_of(b ? b->outputs : NULL, b ? b->noutputs : 0, i, info);
}

static CUdeviceptr address_of(const nimble_model *m, const bucket_t *b, const tensor_t *t,
                              uint64_t n, int instance, int i) {
    if (!b || instance < 0 || (uint64_t)instance >= m->instances || i < 0 || (uint64_t)i >= n)
        return 0;
    return resolve(m, (uint64_t)instance, t[i].place);
}

CUdeviceptr nimble_input_address(const nimble_model *m, int k, int instance, int i) {
    const bucket_t *b = bucket_of(m, k);
    return address_of(m, b, b ? b->inputs : NULL, b ? b->ninputs : 0, instance, i);
}

CUdeviceptr nimble_output_address(const nimble_model *m, int k, int instance, int i) {
    const bucket_t *b = bucket_of(m, k);
    return address_of(m, b, b ? b->outputs : NULL, b ? b->noutputs : 0, instance, i);
}

double nimble_load_seconds(const nimble_model *m, nimble_load_stage stage) {
    return m && stage >= 0 && stage < NIMBLE_STAGE_COUNT ? m->stage_seconds[stage] : 0.0;
}

const char *nimble_launch_note(const nimble_model *m) { return m ? m->launch_note : ""; }

CUgraphExec nimble_exec(const nimble_model *m, int k, int instance) {
    const bucket_t *b = bucket_of(m, k);
    if (!b || instance < 0 || (uint64_t)instance >= m->instances) return NULL;
    return b->execs[instance];
}

nimble_status nimble_run(const nimble_model *m, int k, int instance, CUstream stream) {
    CUgraphExec exec = nimble_exec(m, k, instance);
    if (!exec) return fail(NIMBLE_ERROR_ARGUMENT, "no bucket %d, instance %d", k, instance);
    CU(cuGraphLaunch(exec, stream));
    return NIMBLE_OK;
}

nimble_status nimble_run_with_inputs(const nimble_model *m, int k, int instance,
                                     const void *const *inputs, CUstream stream) {
    CUgraphExec exec = nimble_exec(m, k, instance);
    if (!exec) return fail(NIMBLE_ERROR_ARGUMENT, "no bucket %d, instance %d", k, instance);
    const bucket_t *b = &m->buckets[k];
    if (b->ninputs && !inputs)
        return fail(NIMBLE_ERROR_ARGUMENT, "inputs is NULL: bucket %d takes %llu input(s)", k,
                    (unsigned long long)b->ninputs);
    /* every pointer checked before anything is queued: no run on half its inputs */
    for (uint64_t i = 0; i < b->ninputs; i++)
        if (!inputs[i] && b->inputs[i].info.nbytes)
            return fail(NIMBLE_ERROR_ARGUMENT, "inputs[%llu] is NULL (bucket %d takes %llu "
                        "input(s))", (unsigned long long)i, k, (unsigned long long)b->ninputs);
    for (uint64_t i = 0; i < b->ninputs; i++) {
        size_t n = b->inputs[i].info.nbytes;
        if (n) CU(cuMemcpyAsync(resolve(m, (uint64_t)instance, b->inputs[i].place),
                                (CUdeviceptr)(uintptr_t)inputs[i], n, stream));
    }
    return nimble_run(m, k, instance, stream);
}

static void free_bucket(bucket_t *b, uint64_t instances) {
    for (uint64_t j = 0; b->execs && j < instances; j++)
        if (b->execs[j]) cuGraphExecDestroy(b->execs[j]);
    for (uint64_t i = 0; b->nodes && i < b->nnodes; i++) {
        free(b->nodes[i].params); free(b->nodes[i].relocs); free(b->nodes[i].attrs);
    }
    for (uint64_t s = 0; b->sets && s < b->nsets; s++) {
        free(b->sets[s].inputs); free(b->sets[s].outputs); free(b->sets[s].checked);
    }
    free(b->execs); free(b->nodes); free(b->inputs); free(b->outputs);
    free(b->private_); free(b->edges); free(b->programmatic); free(b->sets); free(b->written);
}

void nimble_free(nimble_model *m) {
    if (!m) return;
    if (m->ctx) cuCtxSetCurrent(m->ctx);
    for (uint64_t k = 0; m->buckets && k < m->nbuckets; k++) free_bucket(&m->buckets[k],
                                                                          m->instances);
    for (uint64_t j = 0; m->arenas && j < m->instances; j++)
        if (m->arenas[j]) cuMemFree(m->arenas[j]);
    for (uint64_t i = 0; m->lowbits && i < m->nlowbits; i++) {
        lowmap_t *maps = m->lowbits[i].maps;
        for (uint64_t j = 0; maps && j < m->instances; j++) {
            if (maps[j].mapped) cuMemUnmap(maps[j].mapped, maps[j].span);
            if (maps[j].have_handle) cuMemRelease(maps[j].handle);
            if (maps[j].va) cuMemAddressFree(maps[j].va, maps[j].reserve);
        }
        free(maps);
    }
    free(m->lowbits);
    if (m->weight_block) cuMemFree(m->weight_block);
    if (m->memory_block) cuMemFree(m->memory_block);
    for (uint64_t i = 0; m->libraries && i < m->nbinaries; i++)
        if (m->libraries[i]) cuLibraryUnload(m->libraries[i]);
    for (uint64_t i = 0; m->binaries && i < m->nbinaries; i++) free(m->binaries[i].path);
    for (uint64_t i = 0; m->kernels && i < m->nkernels; i++) free(m->kernels[i].name);
    free(m->buckets); free(m->arenas); free(m->bases); free(m->weights); free(m->memory);
    free(m->libraries); free(m->binaries); free(m->kernels);
    nimble_release_file(m);
    if (m->ctx) cuDevicePrimaryCtxRelease(m->device);
    free(m);
}
