/*
 * Loads a graph saved by Python's nm.save with Nimble's C runtime and runs it: no Python and
 * no libtorch in the process (cuda.h, libcuda and nimble.c only).
 *
 *   run_saved FILE INPUTS OUT   INPUTS: bucket 0's inputs as raw bytes, one set after the
 *                               other, each set run with nimble_run_with_inputs; OUT: each
 *                               set's outputs as raw bytes, in order
 *   run_saved FILE --info       bucket 0's inputs and outputs, one JSON line each
 *   run_saved FILE --bench N    load to first call, then host microseconds per call
 *                               (nimble_run against a bare cuGraphLaunch of the same exec,
 *                               and nimble_run_with_inputs from device buffers, its copies
 *                               counted) and GPU milliseconds per call, as one JSON line; the
 *                               inputs are zeroed on the run's stream before every call, as
 *                               nimble.h asks (the memory plan may reuse an input's bytes),
 *                               nimble_run's host time not counting it, the GPU time counting
 *                               it
 *
 * RUN_SAVED_PROGRAMMATIC=1 loads with NIMBLE_LOAD_PROGRAMMATIC (the plan's programmatic edges
 * built so).  Exit status: 0, or the nimble_status of what failed (its message on stderr).
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nimble.h"

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int check(CUresult r, const char *what) {
    if (r != CUDA_SUCCESS) { fprintf(stderr, "run_saved: %s failed (%d)\n", what, (int)r); }
    return r != CUDA_SUCCESS;
}

/* Every input of bucket 0 zeroed on `s`: written before each call, as nimble.h asks. */
static int zero_inputs(nimble_model *m, CUstream s) {
    for (int i = 0; i < nimble_inputs(m, 0); i++) {
        nimble_tensor_info info;
        if (nimble_input_info(m, 0, i, &info) != NIMBLE_OK ||
            check(cuMemsetD8Async(nimble_input_address(m, 0, 0, i), 0, info.nbytes, s),
                  "cuMemsetD8Async"))
            return 8;
    }
    return 0;
}

/* What a timed call is: nimble_run (its inputs zeroed before, untimed), a bare cuGraphLaunch
 * of the same exec, or nimble_run_with_inputs from device buffers (the inputs' copies timed). */
typedef enum { CALL_RUN, CALL_BARE, CALL_WITH_INPUTS } call_kind;

static double host_us(nimble_model *m, CUstream s, double *t, int calls, call_kind kind,
                      const void *const *sources) {
    CUgraphExec exec = nimble_exec(m, 0, 0);
    for (int i = 0; i < calls; i++) {
        if (kind != CALL_WITH_INPUTS) zero_inputs(m, s);
        cuStreamSynchronize(s); /* the GPU idle before each call: its host cost alone */
        double t0 = now_us();
        if (kind == CALL_BARE) cuGraphLaunch(exec, s);
        else if (kind == CALL_RUN) nimble_run(m, 0, 0, s);
        else nimble_run_with_inputs(m, 0, 0, sources, s);
        t[i] = now_us() - t0;
    }
    cuStreamSynchronize(s);
    qsort(t, (size_t)calls, sizeof(double), cmp);
    return t[calls / 2];
}

/* The warm-up's calls are checked; the timed ones, the same calls, are not (the check would be
 * timed with them): a fault of theirs shows at the synchronization after them. */
static int bench(nimble_model *m, double load_ms, int calls) {
    CUstream s = NULL;
    CUevent a = NULL, b = NULL;
    float ms = 0;
    double run = 0, bare = 0, with_inputs = 0, *t = malloc(sizeof(double) * (size_t)calls);
    int n_in = nimble_inputs(m, 0);
    /* zeroed device buffers, one per input: the sources of nimble_run_with_inputs */
    CUdeviceptr *sources = calloc((size_t)(n_in ? n_in : 1), sizeof *sources);
    int status = !t || !sources ||
                 check(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate") ||
                 check(cuEventCreate(&a, 0), "cuEventCreate") ||
                 check(cuEventCreate(&b, 0), "cuEventCreate") ? 8 : 0;
    for (int i = 0; status == 0 && i < n_in; i++) {
        nimble_tensor_info info;
        nimble_input_info(m, 0, i, &info);
        if (check(cuMemAlloc(&sources[i], info.nbytes ? info.nbytes : 1), "cuMemAlloc") ||
            check(cuMemsetD8(sources[i], 0, info.nbytes), "cuMemsetD8"))
            status = 8;
    }
    for (int i = 0; status == 0 && i < 20; i++) /* warm-up */
        if (zero_inputs(m, s) || nimble_run(m, 0, 0, s) != NIMBLE_OK) {
            fprintf(stderr, "run_saved: %s\n", nimble_last_error());
            status = 8;
        }
    if (status == 0) {
        run = host_us(m, s, t, calls, CALL_RUN, NULL);
        bare = host_us(m, s, t, calls, CALL_BARE, NULL);
        with_inputs = host_us(m, s, t, calls, CALL_WITH_INPUTS, (const void *const *)sources);
        cuEventRecord(a, s);
        for (int i = 0; i < calls; i++) {
            zero_inputs(m, s);
            nimble_run(m, 0, 0, s);
        }
        cuEventRecord(b, s);
        if (check(cuEventSynchronize(b), "the timed calls") ||
            check(cuEventElapsedTime(&ms, a, b), "cuEventElapsedTime"))
            status = 8;
    }
    if (b) cuEventDestroy(b);
    if (a) cuEventDestroy(a);
    if (s) cuStreamDestroy(s);
    for (int i = 0; sources && i < n_in; i++)
        if (sources[i]) cuMemFree(sources[i]);
    free(sources);
    free(t);
    if (status != 0) return status;
    /* "_summed": over the kernels' threads, not spans of the load (nimble.h) */
    static const char *stages[] = {
        "read", "binaries_summed", "libraries_summed", "functions_summed", "memory", "build",
        "verify", "kernels", "checksum", "wait"};
    _Static_assert(sizeof stages / sizeof *stages == NIMBLE_STAGE_COUNT, "a name per stage");
    printf("{\"load_to_first_call_ms\": %.3f, \"host_us_nimble_run\": %.2f, "
           "\"host_us_bare_launch\": %.2f, \"host_us_run_with_inputs\": %.2f, "
           "\"gpu_ms_per_call\": %.4f, \"launch\": \"%s\", \"load_stages_ms\": {",
           load_ms, run, bare, with_inputs, ms / calls,
           nimble_launch_note(m)[0] ? nimble_launch_note(m) : "device");
    for (int i = 0; i < NIMBLE_STAGE_COUNT; i++)
        printf("%s\"%s\": %.3f", i ? ", " : "", stages[i],
               1e3 * nimble_load_seconds(m, (nimble_load_stage)i));
    printf("}}\n");
    return 0;
}

static void print_info(const char *what, int i, const nimble_tensor_info *info) {
    printf("{\"%s\": %d, \"dtype\": %d, \"shape\": [", what, i, (int)info->dtype);
    for (int d = 0; d < info->ndim; d++) printf(d ? ", %lld" : "%lld", (long long)info->shape[d]);
    printf("], \"nbytes\": %zu, \"contiguous\": %d}\n", info->nbytes, info->contiguous);
}

static int info(nimble_model *m) {
    nimble_tensor_info t;
    for (int i = 0; i < nimble_inputs(m, 0); i++)
        if (nimble_input_info(m, 0, i, &t) == NIMBLE_OK) print_info("input", i, &t);
    for (int i = 0; i < nimble_outputs(m, 0); i++)
        if (nimble_output_info(m, 0, i, &t) == NIMBLE_OK) print_info("output", i, &t);
    return 0;
}

/* Zeros into every input of bucket 0: a run reads its inputs fresh, and the memory plan may
 * have reused an input's bytes for later work in the run before (a decode step's token ids
 * then read as activations: an embedding's index out of range). */

/* Each set of inputs in turn, until the file of inputs ends, its outputs appended to OUT. */
static int run_sets(nimble_model *m, const char *inputs, const char *out) {
    int n_in = nimble_inputs(m, 0), n_out = nimble_outputs(m, 0), more = 1;
    nimble_tensor_info info;
    size_t most = 1; /* the largest output: each is read back through one host buffer */
    for (int i = 0; i < n_out; i++)
        if (nimble_output_info(m, 0, i, &info) == NIMBLE_OK && info.nbytes > most)
            most = info.nbytes;
    FILE *in = fopen(inputs, "rb"), *o = fopen(out, "wb");
    char *host = malloc(most);
    /* a set's inputs, each in a host buffer of its own: nimble_run_with_inputs copies them */
    void **set = calloc((size_t)(n_in ? n_in : 1), sizeof *set);
    int status = in && o && host && set ? 0 : 2;
    for (int i = 0; status == 0 && i < n_in; i++) {
        nimble_input_info(m, 0, i, &info);
        if (!(set[i] = malloc(info.nbytes ? info.nbytes : 1))) status = 2;
    }
    if (status) fprintf(stderr, "run_saved: cannot open %s or %s\n", inputs, out);
    while (status == 0) {
        for (int i = 0; more && i < n_in; i++) {
            nimble_input_info(m, 0, i, &info);
            more = fread(set[i], 1, info.nbytes, in) == info.nbytes;
        }
        if (!more) break;
        if (nimble_run_with_inputs(m, 0, 0, (const void *const *)set, NULL) != NIMBLE_OK) {
            fprintf(stderr, "run_saved: %s\n", nimble_last_error());
            status = 8;
        } else if (check(cuCtxSynchronize(), "the run")) {
            status = 8;
        }
        for (int i = 0; status == 0 && i < n_out; i++) {
            nimble_output_info(m, 0, i, &info);
            if (check(cuMemcpyDtoH(host, nimble_output_address(m, 0, 0, i), info.nbytes),
                      "cuMemcpyDtoH"))
                status = 8;
            else if (fwrite(host, 1, info.nbytes, o) != info.nbytes)
                status = 2;
        }
    }
    int opened = in && o && host && set;
    for (int i = 0; set && i < n_in; i++) free(set[i]);
    free(set);
    free(host);
    if (in) fclose(in);
    if (o && fclose(o) != 0 && status == 0) status = 2; /* a write's error may show only here */
    if (status == 2 && opened) fprintf(stderr, "run_saved: cannot write %s\n", out);
    return status;
}

/* With the context current: load, do what the command line asks, free. */
static int with_model(char **argv, int bench_calls) {
    nimble_model *m = NULL;
    double t0 = now_us();
    unsigned flags = getenv("RUN_SAVED_PROGRAMMATIC") ? NIMBLE_LOAD_PROGRAMMATIC : 0;
    nimble_status s = nimble_load(argv[1], 0, flags, &m);
    if (s != NIMBLE_OK) {
        fprintf(stderr, "run_saved: nimble_load: %s\n", nimble_last_error());
        return (int)s;
    }
    int status;
    if (bench_calls) {
        /* Only the bench makes a call of its own: a graph with state (a decode step's cache)
         * would otherwise run the caller's inputs on a state this call changed. */
        status = zero_inputs(m, NULL);
        if (status == 0 && nimble_run(m, 0, 0, NULL) != NIMBLE_OK) {
            fprintf(stderr, "run_saved: %s\n", nimble_last_error());
            status = 8;
        }
        if (status == 0 && check(cuCtxSynchronize(), "the first call")) status = 8;
        if (status == 0) status = bench(m, (now_us() - t0) / 1e3, bench_calls);
    } else {
        status = strcmp(argv[2], "--info") == 0 ? info(m) : run_sets(m, argv[2], argv[3]);
    }
    nimble_free(m);
    return status;
}

int main(int argc, char **argv) {
    int bench_calls = argc >= 4 && strcmp(argv[2], "--bench") == 0 ? atoi(argv[3]) : 0;
    if (argc < 3 || (argc < 4 && strcmp(argv[2], "--info") != 0) ||
        (strcmp(argv[2], "--bench") == 0 && bench_calls < 1)) {
        fprintf(stderr, "usage: run_saved FILE INPUTS OUT | run_saved FILE --info | "
                        "run_saved FILE --bench N\n");
        return 1;
    }
    CUdevice dev;
    CUcontext ctx;
    CUdeviceptr probe;
    if (check(cuInit(0), "cuInit") || check(cuDeviceGet(&dev, 0), "cuDeviceGet") ||
        check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain"))
        return 8;
    int status = 8;
    if (!check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent") &&
        !check(cuMemAlloc(&probe, 1), "cuMemAlloc")) {
        cuMemFree(probe); /* the context exists: the load time below leaves its creation out */
        status = with_model(argv, bench_calls);
    }
    cuDevicePrimaryCtxRelease(dev);
    return status;
}
