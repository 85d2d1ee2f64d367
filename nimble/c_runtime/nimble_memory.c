/*
 * A load's device memory (nimble_internal.h): placed on the calling thread before the graphs
 * are built (one allocation for the weights, one for the external memory, an arena and the
 * low-bits buffers' mappings per instance: every address a graph points at), then its bytes
 * uploaded from the file on a thread of its own beside the kernels' loading and the build.
 */
#define _POSIX_C_SOURCE 200809L
#include "nimble_internal.h"

#include <stdlib.h>
#include <string.h>

#define fail nimble_fail
#define seconds_now nimble_seconds_now
#define lap nimble_lap

/* Each range's place in its table's one allocation: as torch's allocator aligns a storage,
 * which is what the saving process's kernels saw. */
#define RANGE_ALIGNMENT 512u

static uint64_t range_room(uint64_t size) {
    return (size + RANGE_ALIGNMENT - 1) / RANGE_ALIGNMENT * RANGE_ALIGNMENT;
}

/* One allocation for the whole table, each range at its aligned offset in it: a cuMemAlloc per
 * range (a thousand storages in the widest zoo models) waited on the driver's lock while the
 * kernels loaded beside it. */
static nimble_status place_table(nimble_model *m, memory_t *t, uint64_t n, CUdeviceptr *block,
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
        offset += range_room(t[i].size);
    }
    return NIMBLE_OK;
}

static nimble_status fill_table(nimble_model *m, const memory_t *t, uint64_t n) {
    for (uint64_t i = 0; i < n; i++)
        if (t[i].size) CU(cuMemcpyHtoD(t[i].ptr, blob(m, t[i].blob), t[i].size));
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
    }
    return NIMBLE_OK;
}

/* The private copies the plan puts in each instance's arena (zeroes where it gives no bytes). */
static nimble_status fill_arenas(nimble_model *m) {
    for (uint64_t j = 0; j < m->instances; j++)
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
    return NIMBLE_OK;
}

/* One instance's copy of low-bits buffer `l`: 8 GiB and the span reserved, the span mapped at
 * the first 4 GiB boundary in them plus the buffer's recorded low bits (rounded down to the
 * allocation granularity).  What was made is noted in `map` as it is made, for nimble_free. */
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

/* Each instance's copy of every low-bits buffer: its first bytes from the plan (zeroes where it
 * gives none). */
static nimble_status fill_low_bits(nimble_model *m) {
    for (uint64_t i = 0; i < m->nlowbits; i++) {
        const lowbits_t *l = &m->lowbits[i];
        const uint8_t *data = blob(m, l->blob);
        for (uint64_t j = 0; j < m->instances && l->size; j++) {
            if (data && l->blob.size == l->size) CU(cuMemcpyHtoD(l->maps[j].ptr, data, l->size));
            else CU(cuMemsetD8(l->maps[j].ptr, 0, l->size));
        }
    }
    return NIMBLE_OK;
}

/* Every allocation of the load made, every address the graphs point at known: what the build
 * needs of the memory, on the calling thread before it. */
nimble_status nimble_place_memory(nimble_model *m) {
    double clock = seconds_now();
    TRY(place_table(m, m->weights, m->nweights, &m->weight_block, "weight storage"));
    TRY(place_table(m, m->memory, m->nmemory, &m->memory_block, "external memory range"));
    TRY(place_arenas(m));
    TRY(place_low_bits(m));
    lap(m, NIMBLE_STAGE_MEMORY, &clock);
    return NIMBLE_OK;
}

/* The bytes of the placed memory, uploaded while the kernels load and the graphs build: they
 * share nothing but the context (the build reads the addresses, set before this thread
 * starts). */
nimble_status nimble_upload_memory(nimble_model *m) {
    double clock = seconds_now();
    TRY(fill_table(m, m->weights, m->nweights));
    TRY(fill_table(m, m->memory, m->nmemory));
    TRY(fill_arenas(m));
    TRY(fill_low_bits(m));
    lap(m, NIMBLE_STAGE_MEMORY, &clock);
    return NIMBLE_OK;
}

