/*
 * nimble_load on a driver of this file's own, on the CPU: the runtime's threads, the order of
 * its errors and its frees, tested without a GPU (tests/test_c_runtime.py).  Device memory is
 * host memory listed in a table; a library is a record of its binary's tag (an image starts
 * "BIN<index>" and a NUL).  Every copy and memset is held to a live allocation, each call that
 * needs a context checks one is current on its thread, and what is left alive after
 * nimble_free is counted.  FAKE_FAIL_LIBRARY=<index> fails that binary's cuLibraryLoadData,
 * FAKE_MISSING_KERNEL=<name> that kernel's cuLibraryGetKernel; FAKE_JITTER=1 sleeps at random
 * in the loads, so that the binaries' items end out of order; FAKE_PROGRAMMATIC=1 loads with
 * NIMBLE_LOAD_PROGRAMMATIC.
 *
 * Prints "status N: message", then (loaded) "kernels N misplaced N edges N programmatic N" (a
 * kernel whose function is not from its own binary; the dependency edges added, and those of
 * them given the programmatic type), then "left: ..." (every count 0 where all was freed).
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nimble_internal.h"

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static _Thread_local CUcontext current;
static int ctx_token, node_token;
#define CTX ((CUcontext)&ctx_token)
static atomic_int libraries, graphs, execs, retained, wild, no_context;
/* Dependency edges the runtime added, and those of them it gave the programmatic type (from
 * the kernel's programmatic port). */
static atomic_int edges, programmatic;

typedef struct { uintptr_t at; size_t size; } alloc_t;
static alloc_t allocs[4096];
static int nallocs;

/* Kept after cuLibraryUnload (marked dead): a graph node of an unloaded library's kernel shows. */
typedef struct { int tag, dead; } lib_t;
typedef struct { lib_t *lib; char name[64]; } kern_t;

static int need_context(void) {
    if (current == CTX) return 1;
    atomic_fetch_add(&no_context, 1);
    return 0;
}

static int inside(uintptr_t p, size_t n) {
    int ok = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < nallocs && !ok; i++)
        ok = p >= allocs[i].at && n <= allocs[i].size && p - allocs[i].at <= allocs[i].size - n;
    pthread_mutex_unlock(&lock);
    if (!ok) atomic_fetch_add(&wild, 1);
    return ok;
}

static void jitter(void) {
    static _Thread_local unsigned seed;
    if (!getenv("FAKE_JITTER")) return;
    if (!seed) seed = (unsigned)(uintptr_t)&seed;
    struct timespec t = {0, (long)(rand_r(&seed) % 2000) * 1000L};
    nanosleep(&t, NULL);
}

CUresult CUDAAPI cuInit(unsigned f) { (void)f; return CUDA_SUCCESS; }
CUresult CUDAAPI cuGetErrorName(CUresult r, const char **s) {
    *s = r == CUDA_ERROR_INVALID_IMAGE ? "CUDA_ERROR_INVALID_IMAGE" : "CUDA_ERROR_OTHER";
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceGet(CUdevice *d, int o) { *d = o; return CUDA_SUCCESS; }
CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
    (void)d;
    atomic_fetch_add(&retained, 1);
    *c = CTX;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice d) {
    (void)d;
    atomic_fetch_sub(&retained, 1);
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuCtxSetCurrent(CUcontext c) { current = c; return CUDA_SUCCESS; }
CUresult CUDAAPI cuDeviceGetAttribute(int *v, CUdevice_attribute a, CUdevice d) {
    (void)d;
    *v = a == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR ? 9 : 0;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDriverGetVersion(int *v) { *v = 13000; return CUDA_SUCCESS; }

CUresult CUDAAPI cuLibraryLoadData(CUlibrary *l, const void *code, CUjit_option *o, void **ov,
                                   unsigned n, CUlibraryOption *lo, void **lov, unsigned ln) {
    (void)o; (void)ov; (void)n; (void)lo; (void)lov; (void)ln;
    int tag = memcmp(code, "BIN", 3) == 0 ? atoi((const char *)code + 3) : -1;
    const char *fail = getenv("FAKE_FAIL_LIBRARY");
    jitter();
    if (tag < 0 || (fail && atoi(fail) == tag)) return CUDA_ERROR_INVALID_IMAGE;
    lib_t *lib = calloc(1, sizeof *lib);
    if (!lib) return CUDA_ERROR_OUT_OF_MEMORY;
    lib->tag = tag;
    atomic_fetch_add(&libraries, 1);
    *l = (CUlibrary)lib;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuLibraryUnload(CUlibrary l) {
    lib_t *lib = (lib_t *)l;
    if (lib->dead) abort();
    lib->dead = 1;
    atomic_fetch_sub(&libraries, 1);
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuLibraryGetKernel(CUkernel *k, CUlibrary l, const char *name) {
    lib_t *lib = (lib_t *)l;
    const char *missing = getenv("FAKE_MISSING_KERNEL");
    if (!lib || lib->dead) return CUDA_ERROR_INVALID_HANDLE;
    if (missing && strcmp(missing, name) == 0) return CUDA_ERROR_NOT_FOUND;
    kern_t *kern = calloc(1, sizeof *kern);
    if (!kern) return CUDA_ERROR_OUT_OF_MEMORY;
    kern->lib = lib;
    snprintf(kern->name, sizeof kern->name, "%s", name);
    *k = (CUkernel)kern;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuKernelGetFunction(CUfunction *f, CUkernel k) {
    if (!need_context()) return CUDA_ERROR_INVALID_CONTEXT;
    *f = (CUfunction)k;
    return CUDA_SUCCESS;
}
/* The stand-in's fingerprint is 7 throughout; every settable attribute reads 0. */
CUresult CUDAAPI cuFuncGetAttribute(int *v, CUfunction_attribute a, CUfunction f) {
    (void)f;
    *v = a == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES ||
         a == CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED ||
         a == CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE ||
         a == CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT ? 0 : 7;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuFuncSetAttribute(CUfunction f, CUfunction_attribute a, int v) {
    (void)f; (void)a; (void)v;
    return need_context() ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult CUDAAPI cuMemAlloc(CUdeviceptr *p, size_t n) {
    if (!need_context()) return CUDA_ERROR_INVALID_CONTEXT;
    void *m = n <= ((size_t)1 << 32) ? malloc(n) : NULL;
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    int room = nallocs < (int)(sizeof allocs / sizeof *allocs);
    if (room) allocs[nallocs++] = (alloc_t){(uintptr_t)m, n};
    pthread_mutex_unlock(&lock);
    if (!room) { free(m); return CUDA_ERROR_OUT_OF_MEMORY; }
    *p = (CUdeviceptr)(uintptr_t)m;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemFree(CUdeviceptr p) {
    pthread_mutex_lock(&lock);
    int i = 0;
    while (i < nallocs && allocs[i].at != (uintptr_t)p) i++;
    if (i == nallocs) abort();
    allocs[i] = allocs[--nallocs];
    pthread_mutex_unlock(&lock);
    free((void *)(uintptr_t)p);
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr d, const void *s, size_t n) {
    if (!need_context()) return CUDA_ERROR_INVALID_CONTEXT;
    if (!inside((uintptr_t)d, n)) return CUDA_ERROR_INVALID_VALUE;
    memcpy((void *)(uintptr_t)d, s, n);
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemsetD8(CUdeviceptr d, unsigned char v, size_t n) {
    if (!need_context()) return CUDA_ERROR_INVALID_CONTEXT;
    if (!inside((uintptr_t)d, n)) return CUDA_ERROR_INVALID_VALUE;
    memset((void *)(uintptr_t)d, v, n);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuGraphCreate(CUgraph *g, unsigned f) {
    (void)f;
    if (!need_context()) return CUDA_ERROR_INVALID_CONTEXT;
    atomic_fetch_add(&graphs, 1);
    *g = (CUgraph)malloc(1);
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuGraphDestroy(CUgraph g) {
    atomic_fetch_sub(&graphs, 1);
    free(g);
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuGraphAddKernelNode(CUgraphNode *n, CUgraph g, const CUgraphNode *d, size_t c,
                                      const CUDA_KERNEL_NODE_PARAMS *p) {
    (void)g; (void)d; (void)c;
    const kern_t *k = (const kern_t *)p->func;
    if (!k || k->lib->dead) return CUDA_ERROR_INVALID_HANDLE;
    *n = (CUgraphNode)&node_token;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuGraphAddEmptyNode(CUgraphNode *n, CUgraph g, const CUgraphNode *d, size_t c) {
    (void)g; (void)d; (void)c;
    *n = (CUgraphNode)&node_token;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuGraphAddMemsetNode(CUgraphNode *n, CUgraph g, const CUgraphNode *d, size_t c,
                                      const CUDA_MEMSET_NODE_PARAMS *p, CUcontext x) {
    (void)g; (void)d; (void)c; (void)p; (void)x;
    *n = (CUgraphNode)&node_token;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuGraphAddMemcpyNode(CUgraphNode *n, CUgraph g, const CUgraphNode *d, size_t c,
                                      const CUDA_MEMCPY3D *p, CUcontext x) {
    (void)g; (void)d; (void)c; (void)p; (void)x;
    *n = (CUgraphNode)&node_token;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuGraphKernelNodeSetAttribute(CUgraphNode n, CUkernelNodeAttrID a,
                                               const CUkernelNodeAttrValue *v) {
    (void)n; (void)a; (void)v;
    return CUDA_SUCCESS;
}
/* The runtime's call (nimble.c's add_edges): with edge data from CUDA 12.3, named _v2 before
 * CUDA 13 (where cuda.h maps the plain name to it). */
#if CUDA_VERSION >= 12030
static void count_edges(const CUgraphEdgeData *e, size_t n) {
    atomic_fetch_add(&edges, (int)n);
    for (size_t i = 0; e && i < n; i++)
        if (e[i].type == CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC &&
            e[i].from_port == CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC && e[i].to_port == 0)
            atomic_fetch_add(&programmatic, 1);
}
#endif
#if CUDA_VERSION >= 13000
CUresult CUDAAPI cuGraphAddDependencies(CUgraph g, const CUgraphNode *f, const CUgraphNode *t,
                                        const CUgraphEdgeData *e, size_t n) {
    (void)g; (void)f; (void)t;
    count_edges(e, n);
    return CUDA_SUCCESS;
}
#elif CUDA_VERSION >= 12030
CUresult CUDAAPI cuGraphAddDependencies_v2(CUgraph g, const CUgraphNode *f, const CUgraphNode *t,
                                           const CUgraphEdgeData *e, size_t n) {
    (void)g; (void)f; (void)t;
    count_edges(e, n);
    return CUDA_SUCCESS;
}
#else
CUresult CUDAAPI cuGraphAddDependencies(CUgraph g, const CUgraphNode *f, const CUgraphNode *t,
                                        size_t n) {
    (void)g; (void)f; (void)t;
    atomic_fetch_add(&edges, (int)n);
    return CUDA_SUCCESS;
}
#endif
CUresult CUDAAPI cuGraphInstantiateWithParams(CUgraphExec *e, CUgraph g,
                                              CUDA_GRAPH_INSTANTIATE_PARAMS *p) {
    (void)g; (void)p;
    atomic_fetch_add(&execs, 1);
    *e = (CUgraphExec)malloc(1);
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuGraphExecDestroy(CUgraphExec e) {
    atomic_fetch_sub(&execs, 1);
    free(e);
    return CUDA_SUCCESS;
}

/* Not reached by these files (no proof: NIMBLE_LOAD_NO_VERIFY; plan version 1: no low-bits
 * buffers; device launch never refused): each ends the program where it is. */
CUresult CUDAAPI cuGraphInstantiateWithFlags(CUgraphExec *e, CUgraph g, unsigned long long f) {
    (void)e; (void)g; (void)f; abort();
}
CUresult CUDAAPI cuGraphUpload(CUgraphExec e, CUstream s) { (void)e; (void)s; abort(); }
/* Set by main around its runs: the loader never launches (its proof is off). */
static int running;
static atomic_int launches, copies;
static atomic_long copied;
CUresult CUDAAPI cuGraphLaunch(CUgraphExec e, CUstream s) {
    (void)s;
    if (!running) abort();
    if (!e) return CUDA_ERROR_INVALID_VALUE;
    atomic_fetch_add(&launches, 1);
    return need_context() ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}
/* The source is host memory here (as unified addressing allows); the target must be device
 * memory, every byte inside one allocation. */
CUresult CUDAAPI cuMemcpyAsync(CUdeviceptr d, CUdeviceptr src, size_t n, CUstream s) {
    (void)s;
    if (!running) abort();
    if (!need_context() || !inside(d, n)) return CUDA_ERROR_INVALID_VALUE;
    memcpy((void *)d, (const void *)src, n);
    atomic_fetch_add(&copies, 1);
    atomic_fetch_add(&copied, (long)n);
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamCreate(CUstream *s, unsigned f) { (void)s; (void)f; abort(); }
CUresult CUDAAPI cuStreamDestroy(CUstream s) { (void)s; abort(); }
CUresult CUDAAPI cuStreamSynchronize(CUstream s) { (void)s; abort(); }
CUresult CUDAAPI cuMemcpyDtoH(void *d, CUdeviceptr s, size_t n) {
    (void)d; (void)s; (void)n; abort();
}
CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr *p, size_t s, size_t a, CUdeviceptr h,
                                     unsigned long long f) {
    (void)p; (void)s; (void)a; (void)h; (void)f; abort();
}
CUresult CUDAAPI cuMemAddressFree(CUdeviceptr p, size_t s) { (void)p; (void)s; abort(); }
CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *h, size_t s,
                             const CUmemAllocationProp *p, unsigned long long f) {
    (void)h; (void)s; (void)p; (void)f; abort();
}
CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle h) { (void)h; abort(); }
CUresult CUDAAPI cuMemMap(CUdeviceptr p, size_t s, size_t o, CUmemGenericAllocationHandle h,
                          unsigned long long f) {
    (void)p; (void)s; (void)o; (void)h; (void)f; abort();
}
CUresult CUDAAPI cuMemUnmap(CUdeviceptr p, size_t s) { (void)p; (void)s; abort(); }
CUresult CUDAAPI cuMemSetAccess(CUdeviceptr p, size_t s, const CUmemAccessDesc *d, size_t n) {
    (void)p; (void)s; (void)d; (void)n; abort();
}
CUresult CUDAAPI cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *p,
                                               CUmemAllocationGranularity_flags f) {
    (void)g; (void)p; (void)f; abort();
}

static int misplaced(const nimble_model *m) {
    int count = 0;
    for (uint64_t k = 0; k < m->nkernels; k++) {
        const kern_t *f = (const kern_t *)m->kernels[k].fn;
        count += !f || strcmp(f->name, m->kernels[k].name) != 0 ||
                 (uint64_t)f->lib->tag != m->kernels[k].binary;
    }
    return count;
}

/* FAKE_RUN=1: nimble_run_with_inputs on bucket 0, instance 0 from host buffers, each input's
 * bytes a pattern of its own, then read back from its input address; then with a NULL input
 * pointer and with no inputs, which must queue nothing.  Prints "run: status N copies N
 * bytes N launches N same N", "null input: status N queued N", "no inputs: status N
 * queued N". */
static void run_with_inputs(nimble_model *m) {
    int n = nimble_inputs(m, 0), same = 1;
    long total = 0;
    const void **inputs = calloc((size_t)(n ? n : 1), sizeof *inputs);
    for (int i = 0; i < n; i++) {
        nimble_tensor_info info;
        nimble_input_info(m, 0, i, &info);
        unsigned char *host = malloc(info.nbytes ? info.nbytes : 1);
        memset(host, 0x11 * (i + 1), info.nbytes);
        inputs[i] = host;
        total += (long)info.nbytes;
    }
    running = 1;
    nimble_status s = nimble_run_with_inputs(m, 0, 0, inputs, NULL);
    for (int i = 0; i < n && s == NIMBLE_OK; i++) {
        nimble_tensor_info info;
        nimble_input_info(m, 0, i, &info);
        same &= memcmp((const void *)nimble_input_address(m, 0, 0, i), inputs[i],
                       info.nbytes) == 0;
    }
    printf("run: status %d copies %d bytes %ld launches %d same %d (of %ld)\n", (int)s,
           atomic_load(&copies), atomic_load(&copied), atomic_load(&launches), same, total);
    int before = atomic_load(&copies) + atomic_load(&launches);
    if (n) {
        const void *kept = inputs[n - 1];
        inputs[n - 1] = NULL;
        s = nimble_run_with_inputs(m, 0, 0, inputs, NULL);
        printf("null input: status %d queued %d: %s\n", (int)s,
               atomic_load(&copies) + atomic_load(&launches) - before, nimble_last_error());
        inputs[n - 1] = kept;
        before = atomic_load(&copies) + atomic_load(&launches);
        s = nimble_run_with_inputs(m, 0, 0, NULL, NULL);
        printf("no inputs: status %d queued %d: %s\n", (int)s,
               atomic_load(&copies) + atomic_load(&launches) - before, nimble_last_error());
    }
    running = 0;
    for (int i = 0; i < n; i++) free((void *)inputs[i]);
    free(inputs);
}

int main(int argc, char **argv) {
    if (argc != 2) return 1;
    nimble_model *m = NULL;
    unsigned flags = NIMBLE_LOAD_NO_VERIFY;
    if (getenv("FAKE_PROGRAMMATIC")) flags |= NIMBLE_LOAD_PROGRAMMATIC;
    nimble_status s = nimble_load(argv[1], 0, flags, &m);
    printf("status %d: %s\n", (int)s, nimble_last_error());
    if (s == NIMBLE_OK)
        printf("kernels %llu misplaced %d edges %d programmatic %d\n",
               (unsigned long long)m->nkernels, misplaced(m), atomic_load(&edges),
               atomic_load(&programmatic));
    if (s == NIMBLE_OK && getenv("FAKE_RUN")) run_with_inputs(m);
    nimble_free(m);
    printf("left: allocations %d libraries %d graphs %d execs %d contexts %d wild %d "
           "no-context %d\n", nallocs, atomic_load(&libraries), atomic_load(&graphs),
           atomic_load(&execs), atomic_load(&retained), atomic_load(&wild),
           atomic_load(&no_context));
    return (int)s;
}
