/*
 * Nimble's C runtime: run a graph saved by Python's nm.save(path) with the CUDA driver API
 * alone (cuda.h and libcuda; no CUDA runtime, no Python, no libtorch).
 *
 * nimble_load reads the file, checks it (checksum, format version, GPU architecture, driver),
 * loads every kernel from its binary (a fatbin container of a CUDA library file, checked by
 * its SHA-256, or an image inside the file), places the weights and external memory, builds
 * and instantiates every bucket of every instance as an explicit multi-stream CUDA graph, and
 * proves each against the outputs saved with the file, bit for bit, after poisoning its arena.
 * The file's checksum is computed on a thread of its own while the kernels and memory load,
 * and checked before any graph is built: a damaged file fails on it whatever else failed.
 *
 * A saved file is code: its kernels run with its arguments.  Load only files you trust.
 *
 * Threads: nimble_load and nimble_free may be called from any thread; they make the device's
 * primary context current on the calling thread.  nimble_run and nimble_run_with_inputs may
 * be called from several threads at once for different instances.  The buckets of one
 * instance share its arena: calls on one instance (any bucket) must not overlap: put them on
 * one stream, or order them, and read a call's outputs before the next call of the same
 * instance.  nimble_last_error is per thread.  Every call of this API needs a current
 * context of the model's device on the calling thread (the primary context:
 * cuDevicePrimaryCtxRetain / cuCtxSetCurrent).
 *
 * Build: cc -O2 -std=c11 -I<cuda include> -c nimble.c ; link with -lcuda.
 * (python -m nimble c-runtime --print-include prints this folder.)
 */
#ifndef NIMBLE_H
#define NIMBLE_H

#include <stddef.h>
#include <stdint.h>

#include <cuda.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum nimble_status {
    NIMBLE_OK = 0,
    NIMBLE_ERROR_ARGUMENT = 1,    /* a null pointer, an index out of range */
    NIMBLE_ERROR_IO = 2,          /* the file cannot be read */
    NIMBLE_ERROR_FORMAT = 3,      /* not a saved graph, truncated, damaged */
    NIMBLE_ERROR_VERSION = 4,     /* a format version this library does not read */
    NIMBLE_ERROR_DEVICE = 5,      /* another GPU architecture, an older driver */
    NIMBLE_ERROR_LIBRARY = 6,     /* a kernel's library missing or of another version */
    NIMBLE_ERROR_UNSUPPORTED = 7, /* a saved graph the C runtime cannot run (its reason) */
    NIMBLE_ERROR_CUDA = 8,        /* a driver call failed (the call and its CUDA_ERROR_ name) */
    NIMBLE_ERROR_VERIFY = 9       /* the loaded graph did not reproduce the saved outputs */
} nimble_status;

typedef enum nimble_dtype {
    NIMBLE_FLOAT32 = 0, NIMBLE_FLOAT16 = 1, NIMBLE_BFLOAT16 = 2, NIMBLE_FLOAT64 = 3,
    NIMBLE_INT64 = 4, NIMBLE_INT32 = 5, NIMBLE_INT16 = 6, NIMBLE_INT8 = 7, NIMBLE_UINT8 = 8,
    NIMBLE_BOOL = 9
} nimble_dtype;

#define NIMBLE_MAX_DIMS 8

typedef struct nimble_tensor_info {
    nimble_dtype dtype;
    int ndim;
    int64_t shape[NIMBLE_MAX_DIMS];
    size_t nbytes;    /* the bytes the tensor spans at its address */
    int contiguous;   /* 1: row-major without gaps */
} nimble_tensor_info;

typedef struct nimble_model nimble_model;

/* nimble_load's flags. */
#define NIMBLE_LOAD_NO_VERIFY 1u   /* skip the proof at load (not advised) */
/* Build the plan's programmatic edges (each into one of Nimble's kernels that waits for its
 * predecessor in its code, kept by the saving process where it measured faster) as
 * programmatic, as Python's loader does, rather than as full dependencies; the proof at load
 * runs with them built.  An edge out of a root (a node no edge ends in) stays full.  Plans of
 * version 4 only (older ones are built full), and CUDA 12.3's edge data.  Not the default. */
#define NIMBLE_LOAD_PROGRAMMATIC 2u

/* Load the saved graph at `path` on device ordinal `device`; *model is NULL on failure. */
nimble_status nimble_load(const char *path, int device, unsigned flags, nimble_model **model);

/* The message of the last failed call on this thread ("" if none). */
const char *nimble_last_error(void);

int nimble_buckets(const nimble_model *model);
int nimble_instances(const nimble_model *model);
int nimble_inputs(const nimble_model *model, int bucket);
int nimble_outputs(const nimble_model *model, int bucket);
nimble_status nimble_input_info(const nimble_model *model, int bucket, int i,
                                nimble_tensor_info *info);
nimble_status nimble_output_info(const nimble_model *model, int bucket, int i,
                                 nimble_tensor_info *info);

/* Where input `i` of `bucket` lives on `instance`: write (or copy) the input there, on the
 * stream of the run, before every nimble_run, even of the same values: the memory plan may
 * give an input's bytes to later work of the run once its last reader has run, so a run on
 * inputs not written again reads what the run before left there.  0 for an index out of
 * range. */
CUdeviceptr nimble_input_address(const nimble_model *model, int bucket, int instance, int i);
/* Where the run writes output `i`; valid until the next run of the same instance. */
CUdeviceptr nimble_output_address(const nimble_model *model, int bucket, int instance, int i);

/* One launch of `bucket` on `instance`, queued on `stream`; returns without waiting. */
nimble_status nimble_run(const nimble_model *model, int bucket, int instance, CUstream stream);

/* The inputs written, then the launch, in one call that cannot run on stale inputs: for each
 * input i of `bucket`, its nimble_input_info nbytes copied from inputs[i] to its address on
 * `instance`, on `stream` (cuMemcpyAsync: device memory or host memory, pinned or not, as
 * unified addressing tells them apart; keep a device or pinned source unchanged until the
 * stream has run the copy, a pageable one is copied when the call returns), then the launch.
 * NIMBLE_ERROR_ARGUMENT, with nothing queued, for a bucket or instance out of range, a NULL
 * `inputs` or a NULL inputs[i]. */
nimble_status nimble_run_with_inputs(const nimble_model *model, int bucket, int instance,
                                     const void *const *inputs, CUstream stream);

/* "" where every graph was instantiated for device launch (cheap host launches, as Python's
 * load gives); else why the driver refused, and the graphs launch from the host. */
const char *nimble_launch_note(const nimble_model *model);

/* Where nimble_load's time went, in seconds.  Three kinds of number:
 *  - wall-clock on the calling thread, one after another, together about the whole load:
 *    READ, KERNELS, WAIT, BUILD, VERIFY;
 *  - wall-clock on a thread of its own, beside READ and KERNELS: MEMORY, CHECKSUM;
 *  - the kernels' work summed over their threads (the time the binaries' items spent in each
 *    part, not a span of the load: with threads side by side, together they can exceed
 *    KERNELS): BINARIES, LIBRARIES, FUNCTIONS. */
typedef enum nimble_load_stage {
    NIMBLE_STAGE_READ = 0,     /* the file mapped, its header, sections and plan read, the device
                                  checked (not the checksum: CHECKSUM) */
    NIMBLE_STAGE_BINARIES,     /* summed: kernel binaries read from their libraries and hashed */
    NIMBLE_STAGE_LIBRARIES,    /* summed: cuLibraryLoadData of each binary */
    NIMBLE_STAGE_FUNCTIONS,    /* summed: each kernel's function taken and checked */
    NIMBLE_STAGE_MEMORY,       /* weights and external memory uploaded, arenas allocated, on a
                                  thread of its own beside KERNELS */
    NIMBLE_STAGE_BUILD,        /* graphs built and instantiated */
    NIMBLE_STAGE_VERIFY,       /* the proof at load */
    NIMBLE_STAGE_KERNELS,      /* every binary read, hashed, loaded and its kernels' functions
                                  taken: one item per binary over up to 8 threads */
    NIMBLE_STAGE_CHECKSUM,     /* the whole file's checksum, on a thread of its own from the
                                  header's check on, beside READ and KERNELS */
    NIMBLE_STAGE_WAIT,         /* after KERNELS, waiting for the MEMORY and CHECKSUM threads */
    NIMBLE_STAGE_COUNT
} nimble_load_stage;
double nimble_load_seconds(const nimble_model *model, nimble_load_stage stage);

/* The instantiated graph itself (a bare cuGraphLaunch of it is what nimble_run does). */
CUgraphExec nimble_exec(const nimble_model *model, int bucket, int instance);

/* Free everything the model holds (after its last run has finished); NULL is ignored. */
void nimble_free(nimble_model *model);

#ifdef __cplusplus
}
#endif

#endif /* NIMBLE_H */
