/*
 * Reading a saved graph for Nimble's C runtime: the container (size, checksum, version, the
 * blobs and c_plan sections) and the c_plan's 64-bit words, in the fixed order
 * nimble/engine/c_plan.py writes them (docs/c-host.md lists it).
 */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* MAP_POPULATE, where the C library has it */
#include "nimble_internal.h"
#include "nimble_sha256.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define fail nimble_fail

/* ---- the plan's words -------------------------------------------------------------------- */

static uint64_t le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static uint64_t rd(plan_t *pl) {
    if (pl->at + 8 > pl->n) { pl->bad = 1; return 0; }
    uint64_t v = le64(pl->p + pl->at);
    pl->at += 8;
    return v;
}

/* A length-prefixed byte string: a pointer into the plan, not a copy. */
static const uint8_t *rd_raw(plan_t *pl, size_t *len) {
    uint64_t n = rd(pl);
    size_t padded = (size_t)((n + 7) / 8 * 8);
    if (pl->bad || n > pl->n || pl->at + padded > pl->n) { pl->bad = 1; *len = 0; return NULL; }
    const uint8_t *p = pl->p + pl->at;
    pl->at += padded;
    *len = (size_t)n;
    return p;
}

static char *rd_text(plan_t *pl) {
    size_t n;
    const uint8_t *p = rd_raw(pl, &n);
    char *s = malloc(n + 1);
    if (!s) { pl->bad = 1; return NULL; }
    if (p) memcpy(s, p, n);
    s[n] = 0;
    return s;
}

/* ---- reading the plan -------------------------------------------------------------------- */

/* A place, its region and index checked against what the plan has listed so far (weights,
 * memory, the low-bits buffers of this bucket and those before it). */
static void rd_place(plan_t *pl, place_t *p, const nimble_model *m) {
    p->region = rd(pl); p->index = rd(pl); p->addend = rd(pl);
    if (p->region > R_LOWBITS || (p->region == R_WEIGHT && p->index >= m->nweights)
        || (p->region == R_MEMORY && p->index >= m->nmemory)
        || (p->region == R_LOWBITS && p->index >= m->nlowbits))
        pl->bad = 1;
}

static void rd_blob(plan_t *pl, blobref_t *b) { b->at = rd(pl); b->size = rd(pl); }

static void *arr(plan_t *pl, uint64_t n, size_t size) {
    if (pl->bad || n > pl->n) { pl->bad = 1; return NULL; } /* no count exceeds the words */
    void *p = calloc(n ? n : 1, size);
    if (!p) pl->bad = 1;
    return p;
}

static void rd_tensor(plan_t *pl, tensor_t *t, const nimble_model *m) {
    rd_place(pl, &t->place, m);
    t->info.nbytes = (size_t)rd(pl);
    t->info.dtype = (nimble_dtype)rd(pl);
    uint64_t ndim = rd(pl);
    if (ndim > NIMBLE_MAX_DIMS) { pl->bad = 1; return; }
    t->info.ndim = (int)ndim;
    for (uint64_t d = 0; d < ndim; d++) t->info.shape[d] = (int64_t)rd(pl);
    t->info.contiguous = (int)rd(pl);
}

/* A kernel node's indices and offsets are checked here, so that the builder may trust them. */
static void rd_node(plan_t *pl, node_t *nd, const nimble_model *m) {
    nd->kind = (int)rd(pl);
    if (nd->kind == N_KERNEL) {
        nd->kernel = rd(pl);
        if (nd->kernel >= m->nkernels) pl->bad = 1;
        for (int i = 0; i < 3; i++) nd->grid[i] = rd(pl);
        for (int i = 0; i < 3; i++) nd->block[i] = rd(pl);
        nd->shared = rd(pl);
        nd->has_priority = rd(pl); nd->priority = (int64_t)rd(pl);
        nd->packed = rd(pl);
        nd->nparams = rd(pl);
        if (nd->nparams > pl->n) pl->bad = 1; /* its double would wrap */
        nd->params = arr(pl, 2 * nd->nparams, sizeof(uint64_t));
        for (uint64_t i = 0; !pl->bad && i < 2 * nd->nparams; i++) nd->params[i] = rd(pl);
        nd->args = rd_raw(pl, &nd->args_len);
        for (uint64_t i = 0; !pl->bad && !nd->packed && i < nd->nparams; i++) /* the slots */
            if (nd->params[2 * i] > nd->args_len ||
                nd->params[2 * i + 1] > nd->args_len - nd->params[2 * i])
                pl->bad = 1;
        nd->nrelocs = rd(pl);
        nd->relocs = arr(pl, nd->nrelocs, sizeof(reloc_t));
        for (uint64_t i = 0; !pl->bad && i < nd->nrelocs; i++) {
            nd->relocs[i].loc = rd(pl);
            rd_place(pl, &nd->relocs[i].place, m);
            if (nd->args_len < 8 || nd->relocs[i].loc > nd->args_len - 8) pl->bad = 1;
        }
        nd->nattrs = rd(pl);
        nd->attrs = arr(pl, nd->nattrs, sizeof(attr_t));
        for (uint64_t i = 0; !pl->bad && i < nd->nattrs; i++) {
            nd->attrs[i].id = rd(pl);
            nd->attrs[i].value = rd_raw(pl, &nd->attrs[i].len);
        }
    } else if (nd->kind == N_MEMSET) {
        rd_place(pl, &nd->dst, m);
        for (int i = 0; i < 5; i++) nd->f[i] = rd(pl);
    } else if (nd->kind == N_MEMCPY) {
        rd_place(pl, &nd->src, m);
        rd_place(pl, &nd->dst, m);
        for (int i = 0; i < 15; i++) nd->f[i] = rd(pl);
    } else if (nd->kind != N_EMPTY) {
        pl->bad = 1;
    }
}

/* Version 2: the edges built programmatic, each one of the bucket's edges between two kernel
 * nodes (anything else makes the plan bad). */
static void rd_programmatic(plan_t *pl, bucket_t *b) {
    uint64_t n = rd(pl);
    if (n > b->nedges) { pl->bad = 1; return; }
    b->programmatic = arr(pl, b->nedges, 1);
    for (uint64_t i = 0; !pl->bad && i < n; i++) {
        uint64_t u = rd(pl), v = rd(pl), e = 0;
        while (e < b->nedges && (b->edges[2 * e] != u || b->edges[2 * e + 1] != v)) e++;
        if (e == b->nedges || b->nodes[u].kind != N_KERNEL || b->nodes[v].kind != N_KERNEL)
            pl->bad = 1;
        else
            b->programmatic[e] = 1;
    }
}

/* Version 3: the bucket's low-bits buffers, appended to the model's (bucket k's). */
static void rd_low_bits(plan_t *pl, nimble_model *m, uint64_t k) {
    uint64_t n = rd(pl);
    if (pl->bad || n > pl->n) { pl->bad = 1; return; }
    lowbits_t *grown = realloc(m->lowbits, (size_t)(m->nlowbits + n + 1) * sizeof(lowbits_t));
    if (!grown) { pl->bad = 1; return; }
    m->lowbits = grown;
    for (uint64_t i = 0; !pl->bad && i < n; i++) {
        lowbits_t *l = &m->lowbits[m->nlowbits];
        memset(l, 0, sizeof *l);
        l->size = rd(pl); l->address = rd(pl); l->poison = rd(pl); l->bucket = k;
        rd_blob(pl, &l->blob);
        m->nlowbits++;
    }
}

/* A private copy, kept inside the arena past its base's alignment slack: the loader writes the
 * copies while the file's checksum is still being computed, so a damaged plan must not send
 * them outside the model's own allocation (into memory of another model in the context). */
static void rd_private(plan_t *pl, private_t *p, const nimble_model *m) {
    uint64_t room = m->arena_size >= m->alignment ? m->arena_size - m->alignment : 0;
    p->offset = rd(pl);
    p->size = rd(pl);
    rd_blob(pl, &p->blob);
    if (p->offset > room || p->size > room - p->offset) pl->bad = 1;
}

static void rd_bucket(plan_t *pl, bucket_t *b, nimble_model *m, uint64_t k) {
    b->plan_bytes = rd(pl);
    if (pl->version >= 3) rd_low_bits(pl, m, k); /* before every place that may name one */
    b->ninputs = rd(pl);
    b->inputs = arr(pl, b->ninputs, sizeof(tensor_t));
    for (uint64_t i = 0; !pl->bad && i < b->ninputs; i++) rd_tensor(pl, &b->inputs[i], m);
    b->noutputs = rd(pl);
    b->outputs = arr(pl, b->noutputs, sizeof(tensor_t));
    for (uint64_t i = 0; !pl->bad && i < b->noutputs; i++) rd_tensor(pl, &b->outputs[i], m);
    b->nprivate = rd(pl);
    b->private_ = arr(pl, b->nprivate, sizeof(private_t));
    for (uint64_t i = 0; !pl->bad && i < b->nprivate; i++) rd_private(pl, &b->private_[i], m);
    b->nnodes = rd(pl);
    b->nodes = arr(pl, b->nnodes, sizeof(node_t));
    for (uint64_t i = 0; !pl->bad && i < b->nnodes; i++) rd_node(pl, &b->nodes[i], m);
    b->nedges = rd(pl);
    if (b->nedges > pl->n) pl->bad = 1; /* its double would wrap */
    b->edges = arr(pl, 2 * b->nedges, sizeof(uint64_t));
    for (uint64_t i = 0; !pl->bad && i < 2 * b->nedges; i++) {
        b->edges[i] = rd(pl);
        if (b->edges[i] >= b->nnodes) pl->bad = 1;
    }
    if (pl->version >= 2) rd_programmatic(pl, b);
    b->nsets = rd(pl);
    b->sets = arr(pl, b->nsets, sizeof(refset_t));
    for (uint64_t s = 0; !pl->bad && s < b->nsets; s++) {
        refset_t *set = &b->sets[s];
        set->inputs = arr(pl, b->ninputs, sizeof(blobref_t));
        set->outputs = arr(pl, b->noutputs, sizeof(blobref_t));
        set->checked = arr(pl, b->noutputs, sizeof(uint64_t));
        for (uint64_t i = 0; !pl->bad && i < b->ninputs; i++) rd_blob(pl, &set->inputs[i]);
        for (uint64_t i = 0; !pl->bad && i < b->noutputs; i++) {
            rd_blob(pl, &set->outputs[i]);
            set->checked[i] = rd(pl);
        }
    }
    uint64_t places = rd(pl);
    b->written = arr(pl, places, sizeof(place_t));
    b->nwritten = 0;
    for (uint64_t i = 0; !pl->bad && i < places; i++) {
        place_t p;
        rd_place(pl, &p, m);
        rd(pl); /* the buffer's size: its whole range is put back */
        int known = (p.region == R_MEMORY && p.index < m->nmemory)
                    || (p.region == R_WEIGHT && p.index < m->nweights);
        uint64_t w = 0;
        while (w < b->nwritten && !(b->written[w].region == p.region
                                    && b->written[w].index == p.index)) w++;
        if (known && w == b->nwritten) b->written[b->nwritten++] = p;
    }
}

nimble_status nimble_read_plan(nimble_model *m, plan_t *pl) {
    if (rd(pl) != 0x5043454c424d494eULL) /* "NIMBLECP", little-endian */
        return fail(NIMBLE_ERROR_FORMAT, "the file's c_plan section has no NIMBLECP magic");
    uint64_t version = rd(pl);
    if (version < 1 || version > 4)
        return fail(NIMBLE_ERROR_VERSION, "c_plan version %llu; this runtime reads 1 to 4: "
                    "rebuild the C runtime from the Nimble that saved the file",
                    (unsigned long long)version);
    pl->version = version;
    m->plan_version = version;
    m->arch = rd(pl); m->driver = rd(pl);
    m->arena_size = rd(pl); m->alignment = rd(pl); m->instances = rd(pl); m->nbuckets = rd(pl);
    m->nbinaries = rd(pl);
    m->binaries = arr(pl, m->nbinaries, sizeof(binary_t));
    for (uint64_t i = 0; !pl->bad && i < m->nbinaries; i++) {
        binary_t *b = &m->binaries[i];
        b->library = rd(pl) == 0;
        b->offset = rd(pl); b->size = rd(pl);
        size_t n;
        b->sha = rd_raw(pl, &n);
        if (n != 32) pl->bad = 1;
        b->path = rd_text(pl);
    }
    m->nkernels = rd(pl);
    m->kernels = arr(pl, m->nkernels, sizeof(kernel_t));
    for (uint64_t i = 0; !pl->bad && i < m->nkernels; i++) {
        kernel_t *k = &m->kernels[i];
        k->binary = rd(pl);
        k->name = rd_text(pl);
        for (int j = 0; j < 6; j++) k->fingerprint[j] = (int64_t)rd(pl);
        for (int j = 0; j < 4; j++) k->settable[j] = (int64_t)rd(pl);
        if (k->binary >= m->nbinaries) pl->bad = 1;
    }
    memory_t **tables[2] = {&m->weights, &m->memory};
    uint64_t *counts[2] = {&m->nweights, &m->nmemory};
    for (int t = 0; t < 2; t++) {
        *counts[t] = rd(pl);
        *tables[t] = arr(pl, *counts[t], sizeof(memory_t));
        for (uint64_t i = 0; !pl->bad && i < *counts[t]; i++) {
            (*tables[t])[i].size = rd(pl);
            rd_blob(pl, &(*tables[t])[i].blob);
        }
    }
    m->buckets = arr(pl, m->nbuckets, sizeof(bucket_t));
    for (uint64_t k = 0; !pl->bad && k < m->nbuckets; k++) rd_bucket(pl, &m->buckets[k], m, k);
    char *unsupported = pl->bad ? NULL : rd_text(pl);
    if (pl->bad) { free(unsupported); return fail(NIMBLE_ERROR_FORMAT, "the file's c_plan "
                                                    "section is damaged"); }
    if (unsupported[0]) {
        nimble_status s = fail(NIMBLE_ERROR_UNSUPPORTED, "the C runtime cannot run this graph: "
                               "%s; load it from Python (nimble.load)", unsupported);
        free(unsupported);
        return s;
    }
    free(unsupported);
    return NIMBLE_OK;
}

/* ---- the file ---------------------------------------------------------------------------- */

void nimble_release_file(nimble_model *m) {
    if (m->file) munmap(m->file, m->file_size);
    m->file = NULL;
    m->file_size = 0;
    m->blobs = NULL; /* they lay in the mapping */
    m->blobs_size = 0;
}

nimble_status nimble_map_file(nimble_model *m, const char *path) {
    /* Mapped, not copied: the checksum, the plan and the weights' uploads read the page
     * cache's bytes where they are. */
    int fd = open(path, O_RDONLY);
    if (fd < 0) return fail(NIMBLE_ERROR_IO, "cannot open %s", path);
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size < 0) {
        close(fd);
        return fail(NIMBLE_ERROR_IO, "cannot read %s", path);
    }
    size_t got = (size_t)st.st_size;
    if (got < 64) {
        close(fd);
        return fail(NIMBLE_ERROR_FORMAT, "%s is not a saved Nimble graph", path);
    }
    int flags = MAP_PRIVATE;
#ifdef MAP_POPULATE
    flags |= MAP_POPULATE;
#endif
    void *mapped = mmap(NULL, got, PROT_READ, flags, fd, 0);
    close(fd);
    if (mapped == MAP_FAILED) return fail(NIMBLE_ERROR_IO, "cannot map %s", path);
    m->file = mapped;
    m->file_size = got;
    const uint8_t *d = m->file;
    if (memcmp(d, "NIMBLEGR", 8) != 0)
        return fail(NIMBLE_ERROR_FORMAT, "%s is not a saved Nimble graph", path);
    uint32_t version = (uint32_t)(le64(d + 8) & 0xffffffffu);
    if (version < 1 || version > 2) /* 2: workspaces without bytes, which the plan zeroes */
        return fail(NIMBLE_ERROR_VERSION, "%s is of format version %u; this runtime reads 1 "
                    "to 2", path, version);
    if (le64(d + 24) != got)
        return fail(NIMBLE_ERROR_FORMAT, "%s is truncated or has bytes appended", path);
    return NIMBLE_OK;
}

nimble_status nimble_file_intact(const nimble_model *m, const uint8_t sum[32], const char *path) {
    if (memcmp(sum, m->file + 32, 32) != 0)
        return fail(NIMBLE_ERROR_FORMAT, "%s is damaged: its checksum does not match", path);
    return NIMBLE_OK;
}

nimble_status nimble_find_sections(nimble_model *m, const char *path, plan_t *pl) {
    const uint8_t *d = m->file;
    size_t got = m->file_size;
    uint32_t count = (uint32_t)(le64(d + 16) & 0xffffffffu);
    int have_plan = 0;
    for (uint32_t i = 0; i < count && 64 + 48 * (size_t)(i + 1) <= got; i++) {
        const uint8_t *row = d + 64 + 48 * (size_t)i;
        uint64_t off = le64(row + 16), len = le64(row + 24);
        if (off > got || len > got - off)
            return fail(NIMBLE_ERROR_FORMAT, "%s: a section runs past the file", path);
        if (strncmp((const char *)row, "blobs", 16) == 0) {
            m->blobs = d + off; m->blobs_size = (size_t)len;
        } else if (strncmp((const char *)row, "c_plan", 16) == 0) {
            pl->p = d + off; pl->n = (size_t)len; have_plan = 1;
        }
    }
    if (!have_plan || !m->blobs)
        return fail(NIMBLE_ERROR_UNSUPPORTED, "%s has no c_plan section: save it again with "
                    "a Nimble that writes one", path);
    return NIMBLE_OK;
}

nimble_status nimble_read_file(nimble_model *m, const char *path, plan_t *pl) {
    uint8_t sum[32];
    TRY(nimble_map_file(m, path));
    nimble_checksum(m->file + 64, m->file_size - 64, sum);
    TRY(nimble_file_intact(m, sum, path));
    return nimble_find_sections(m, path, pl);
}
