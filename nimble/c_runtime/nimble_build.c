/*
 * Building a load's graphs (nimble_internal.h's nimble_builds): every bucket's graph per
 * instance, its nodes added while the kernels load (nimble_load.c), each kernel's node as soon
 * as its binary's functions are taken, the edges and the instantiation once every binary is.
 * Adding a node needs its kernel's function and the addresses its arguments point at, not the
 * bytes there: the memory uploads beside the build.
 */
#define _POSIX_C_SOURCE 200809L
#include "nimble_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define fail nimble_fail
#define cuda_fail nimble_cuda_fail

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

/* The bucket's edges, every one a full dependency: the plan's programmatic marks are read and
 * not served (Python's loader does the same), since graphs built with them gave wrong outputs
 * on a busy GPU (docs/findings.md, "Programmatic edges raced on a busy GPU"). */
static nimble_status add_edges(bucket_t *b, CUgraph g, CUgraphNode *from, CUgraphNode *to) {
#if CUDA_VERSION >= 13000
    CUresult r = cuGraphAddDependencies(g, from, to, NULL, b->nedges);
#elif CUDA_VERSION >= 12030
    CUresult r = cuGraphAddDependencies_v2(g, from, to, NULL, b->nedges);
#else
    CUresult r = cuGraphAddDependencies(g, from, to, b->nedges);
#endif
    return r == CUDA_SUCCESS ? NIMBLE_OK : cuda_fail("cuGraphAddDependencies", r);
}

/* A kernel node's place: bucket `bucket`, its node `node`. */
typedef struct { uint64_t bucket, node; } node_ref_t;

struct nimble_builds {
    nimble_model *m;
    CUgraph *graphs;          /* bucket k's instance j at k * instances + j; NULL: not made */
    CUgraphNode **nodes;      /* per graph, per node of its bucket */
    uint64_t *first;          /* binary i's kernel nodes: members[first[i]] to first[i + 1] - 1 */
    node_ref_t *members;
    int *priorities;          /* per bucket: whether a kernel node of it has a priority */
};

static uint64_t graph_count(const nimble_model *m) { return m->nbuckets * m->instances; }

/* Every bucket's kernel nodes grouped by their kernel's binary (a counting sort; the reader
 * checked every node's kernel and every kernel's binary). */
static void group_nodes(nimble_builds *bs) {
    const nimble_model *m = bs->m;
    for (uint64_t k = 0; k < m->nbuckets; k++)
        for (uint64_t i = 0; i < m->buckets[k].nnodes; i++) {
            const node_t *nd = &m->buckets[k].nodes[i];
            if (nd->kind == N_KERNEL) bs->first[m->kernels[nd->kernel].binary + 1]++;
        }
    for (uint64_t i = 0; i < m->nbinaries; i++) bs->first[i + 1] += bs->first[i];
    for (uint64_t k = 0; k < m->nbuckets; k++)
        for (uint64_t i = 0; i < m->buckets[k].nnodes; i++) {
            const node_t *nd = &m->buckets[k].nodes[i];
            if (nd->kind != N_KERNEL) continue;
            bs->members[bs->first[m->kernels[nd->kernel].binary]++] = (node_ref_t){k, i};
            bs->priorities[k] |= nd->has_priority != 0;
        }
    for (uint64_t i = m->nbinaries; i > 0; i--) bs->first[i] = bs->first[i - 1];
    bs->first[0] = 0;
}

static nimble_status builds_alloc(nimble_model *m, nimble_builds *bs) {
    uint64_t kernel_nodes = 0;
    for (uint64_t k = 0; k < m->nbuckets; k++)
        for (uint64_t i = 0; i < m->buckets[k].nnodes; i++)
            kernel_nodes += m->buckets[k].nodes[i].kind == N_KERNEL;
    bs->m = m;
    bs->graphs = calloc(graph_count(m) + 1, sizeof *bs->graphs);
    bs->nodes = calloc(graph_count(m) + 1, sizeof *bs->nodes);
    bs->first = calloc(m->nbinaries + 1, sizeof *bs->first);
    bs->members = calloc(kernel_nodes + 1, sizeof *bs->members);
    bs->priorities = calloc(m->nbuckets + 1, sizeof *bs->priorities);
    if (!bs->graphs || !bs->nodes || !bs->first || !bs->members || !bs->priorities)
        return fail(NIMBLE_ERROR_IO, "out of memory");
    for (uint64_t k = 0; k < m->nbuckets; k++) {
        bucket_t *b = &m->buckets[k];
        b->execs = calloc(m->instances ? m->instances : 1, sizeof(CUgraphExec));
        if (!b->execs) return fail(NIMBLE_ERROR_IO, "out of memory");
        for (uint64_t j = 0; j < m->instances; j++) {
            bs->nodes[k * m->instances + j] = calloc(b->nnodes ? b->nnodes : 1,
                                                     sizeof(CUgraphNode));
            if (!bs->nodes[k * m->instances + j]) return fail(NIMBLE_ERROR_IO, "out of memory");
        }
    }
    group_nodes(bs);
    return NIMBLE_OK;
}

/* Graph g's nodes of no kernel: they wait for nothing the loading does. */
static nimble_status add_other_nodes(nimble_builds *bs, uint64_t k, uint64_t j) {
    nimble_model *m = bs->m;
    bucket_t *b = &m->buckets[k];
    uint64_t g = k * m->instances + j;
    CU(cuGraphCreate(&bs->graphs[g], 0));
    for (uint64_t i = 0; i < b->nnodes; i++) {
        node_t *nd = &b->nodes[i];
        if (nd->kind == N_KERNEL) continue;
        if (nd->kind == N_EMPTY) CU(cuGraphAddEmptyNode(&bs->nodes[g][i], bs->graphs[g], NULL, 0));
        else TRY(add_copy_node(m, j, nd, bs->graphs[g], &bs->nodes[g][i]));
    }
    return NIMBLE_OK;
}

nimble_status nimble_builds_start(nimble_model *m, nimble_builds **out) {
    nimble_builds *bs = calloc(1, sizeof *bs);
    *out = bs;
    if (!bs) return fail(NIMBLE_ERROR_IO, "out of memory");
    TRY(builds_alloc(m, bs));
    for (uint64_t k = 0; k < m->nbuckets; k++)
        for (uint64_t j = 0; j < m->instances; j++) TRY(add_other_nodes(bs, k, j));
    return NIMBLE_OK;
}

nimble_status nimble_builds_add_binary(nimble_builds *bs, uint64_t binary) {
    nimble_model *m = bs->m;
    for (uint64_t f = bs->first[binary]; f < bs->first[binary + 1]; f++) {
        node_ref_t r = bs->members[f];
        for (uint64_t j = 0; j < m->instances; j++) {
            uint64_t g = r.bucket * m->instances + j;
            TRY(add_kernel_node(m, j, &m->buckets[r.bucket].nodes[r.node], bs->graphs[g],
                                &bs->nodes[g][r.node]));
        }
    }
    return NIMBLE_OK;
}

/* Graph g's edges, then its instantiation: its exec is the driver's own copy of it. */
static nimble_status finish_graph(nimble_builds *bs, uint64_t k, uint64_t j) {
    nimble_model *m = bs->m;
    bucket_t *b = &m->buckets[k];
    uint64_t g = k * m->instances + j;
    if (b->nedges) {
        CUgraphNode *from = calloc(b->nedges, sizeof(CUgraphNode));
        CUgraphNode *to = calloc(b->nedges, sizeof(CUgraphNode));
        nimble_status s = from && to ? NIMBLE_OK : fail(NIMBLE_ERROR_IO, "out of memory");
        for (uint64_t e = 0; s == NIMBLE_OK && e < b->nedges; e++) {
            from[e] = bs->nodes[g][b->edges[2 * e]];
            to[e] = bs->nodes[g][b->edges[2 * e + 1]];
        }
        if (s == NIMBLE_OK) s = add_edges(b, bs->graphs[g], from, to);
        free(from);
        free(to);
        TRY(s);
    }
    return instantiate(m, b, j, bs->graphs[g], bs->priorities[k]);
}

nimble_status nimble_builds_finish(nimble_builds *bs) {
    nimble_model *m = bs->m;
    for (uint64_t k = 0; k < m->nbuckets; k++)
        for (uint64_t j = 0; j < m->instances; j++) TRY(finish_graph(bs, k, j));
    return NIMBLE_OK;
}

void nimble_builds_free(nimble_builds *bs) {
    if (!bs) return;
    for (uint64_t g = 0; bs->graphs && g < graph_count(bs->m); g++)
        if (bs->graphs[g]) cuGraphDestroy(bs->graphs[g]);
    for (uint64_t g = 0; bs->nodes && g < graph_count(bs->m); g++) free(bs->nodes[g]);
    free(bs->graphs); free(bs->nodes); free(bs->first); free(bs->members); free(bs->priorities);
    free(bs);
}
