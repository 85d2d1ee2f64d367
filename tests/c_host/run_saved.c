/*
 * Loads a graph saved by Python's nm.save with Nimble's C runtime and runs it: no Python and
 * no libtorch in the process (cuda.h, libcuda and nimble.c only).
 *
 *   run_saved FILE INPUTS OUT   INPUTS: bucket 0's inputs as raw bytes, one set after the
 *                               other; OUT: each set's outputs as raw bytes, in order
 *   run_saved FILE --info       bucket 0's inputs and outputs, one JSON line each
 *   run_saved FILE --bench N    load to first call (inputs zeroed), then host microseconds
 *                               per call (nimble_run against a bare cuGraphLaunch of the
 *                               same exec) and GPU milliseconds per call, as one JSON line;
 *                               the inputs are not written again between calls, so it suits
 *                               graphs whose inputs are not indices
 *
 * Exit status: 0, or the nimble_status of what failed (its message on stderr).
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

static double host_us(nimble_model *m, CUstream s, int calls, int bare) {
    double *t = malloc(sizeof(double) * (size_t)calls), median;
    CUgraphExec exec = nimble_exec(m, 0, 0);
    for (int i = 0; i < calls; i++) {
        cuStreamSynchronize(s); /* the GPU idle before each call: its host cost alone */
        double t0 = now_us();
        if (bare) cuGraphLaunch(exec, s); else nimble_run(m, 0, 0, s);
        t[i] = now_us() - t0;
    }
    cuStreamSynchronize(s);
    qsort(t, (size_t)calls, sizeof(double), cmp);
    median = t[calls / 2];
    free(t);
    return median;
}

static int bench(nimble_model *m, double load_ms, int calls) {
    CUstream s;
    CUevent a, b;
    float ms = 0;
    if (check(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate") ||
        check(cuEventCreate(&a, 0), "cuEventCreate") ||
        check(cuEventCreate(&b, 0), "cuEventCreate"))
        return 8;
    for (int i = 0; i < 20; i++) nimble_run(m, 0, 0, s); /* warm-up */
    double run = host_us(m, s, calls, 0), bare = host_us(m, s, calls, 1);
    cuEventRecord(a, s);
    for (int i = 0; i < calls; i++) nimble_run(m, 0, 0, s);
    cuEventRecord(b, s);
    cuEventSynchronize(b);
    cuEventElapsedTime(&ms, a, b);
    static const char *stages[NIMBLE_STAGE_COUNT] = {
        "read", "binaries", "libraries", "functions", "memory", "build", "verify"};
    printf("{\"load_to_first_call_ms\": %.3f, \"host_us_nimble_run\": %.2f, "
           "\"host_us_bare_launch\": %.2f, \"gpu_ms_per_call\": %.4f, "
           "\"launch\": \"%s\", \"load_stages_ms\": {",
           load_ms, run, bare, ms / calls,
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
static int zero_inputs(nimble_model *m) {
    for (int i = 0; i < nimble_inputs(m, 0); i++) {
        nimble_tensor_info info;
        if (nimble_input_info(m, 0, i, &info) != NIMBLE_OK ||
            check(cuMemsetD8(nimble_input_address(m, 0, 0, i), 0, info.nbytes), "cuMemsetD8"))
            return 8;
    }
    return 0;
}

static int run_sets(nimble_model *m, const char *inputs, const char *out) {
    FILE *in = fopen(inputs, "rb"), *o = fopen(out, "wb");
    if (!in || !o) { fprintf(stderr, "run_saved: cannot open %s or %s\n", inputs, out); return 2; }
    int n_in = nimble_inputs(m, 0), n_out = nimble_outputs(m, 0);
    for (;;) {
        for (int i = 0; i < n_in; i++) {
            nimble_tensor_info info;
            nimble_input_info(m, 0, i, &info);
            char *host = malloc(info.nbytes);
            size_t got = fread(host, 1, info.nbytes, in);
            if (got != info.nbytes) { free(host); fclose(in); fclose(o); return 0; }
            cuMemcpyHtoD(nimble_input_address(m, 0, 0, i), host, info.nbytes);
            free(host);
        }
        if (nimble_run(m, 0, 0, NULL) != NIMBLE_OK) {
            fprintf(stderr, "run_saved: %s\n", nimble_last_error());
            return 8;
        }
        cuCtxSynchronize();
        for (int i = 0; i < n_out; i++) {
            nimble_tensor_info info;
            nimble_output_info(m, 0, i, &info);
            char *host = malloc(info.nbytes);
            cuMemcpyDtoH(host, nimble_output_address(m, 0, 0, i), info.nbytes);
            fwrite(host, 1, info.nbytes, o);
            free(host);
        }
    }
}

int main(int argc, char **argv) {
    if (argc < 3 || (argc < 4 && strcmp(argv[2], "--info") != 0)) {
        fprintf(stderr, "usage: run_saved FILE INPUTS OUT | run_saved FILE --info | "
                        "run_saved FILE --bench N\n");
        return 1;
    }
    CUdevice dev;
    CUcontext ctx;
    CUdeviceptr probe;
    if (check(cuInit(0), "cuInit") || check(cuDeviceGet(&dev, 0), "cuDeviceGet") ||
        check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain") ||
        check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent") ||
        check(cuMemAlloc(&probe, 1), "cuMemAlloc"))
        return 8;
    cuMemFree(probe); /* the context exists: the load time below leaves its creation out */
    nimble_model *m = NULL;
    double t0 = now_us();
    nimble_status s = nimble_load(argv[1], 0, 0, &m);
    if (s != NIMBLE_OK) {
        fprintf(stderr, "run_saved: nimble_load: %s\n", nimble_last_error());
        return (int)s;
    }
    int status;
    if (strcmp(argv[2], "--bench") == 0) {
        /* Only the bench makes a call of its own: a graph with state (a decode step's cache)
         * would otherwise run the caller's inputs on a state this call changed. */
        if (zero_inputs(m) != 0) return 8;
        nimble_run(m, 0, 0, NULL);
        if (check(cuCtxSynchronize(), "the first call")) return 8;
        status = bench(m, (now_us() - t0) / 1e3, atoi(argv[3]));
    } else {
        status = strcmp(argv[2], "--info") == 0 ? info(m) : run_sets(m, argv[2], argv[3]);
    }
    nimble_free(m);
    cuDevicePrimaryCtxRelease(dev);
    return status;
}
