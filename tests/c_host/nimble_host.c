/* nimble_host.c: a C host driving a graph prepared by Nimble, on the CUDA driver API alone.
 *
 * For each iteration it writes every input tensor's device address into that input's cell of the
 * graph (one 8-byte stream write per input), launches the graph's CUgraphExec, copies the output
 * bytes to the host and waits for the stream: the recipe of README.md's "From C or C++".  The
 * handles come from Python: nm.exec_handle, nm.input_cells, and the data_ptr() of the tensor a
 * Python call returns.  Call it on a thread where the graph's context is current (torch's is).
 *
 * Build (tests/test_gpu_c_host.py does this):
 *   cc -shared -fPIC -O2 nimble_host.c -I<cuda include> -L<dir of libcuda> -lcuda -o libnimble_host.so
 */
#include <stddef.h>
#include <stdint.h>

#include <cuda.h>

#define NIMBLE_CHECK(call)                         \
    do {                                           \
        CUresult nimble_rc_ = (call);              \
        if (nimble_rc_ != CUDA_SUCCESS)            \
            return (int)nimble_rc_;                \
    } while (0)

/* Runs `iterations` launches.  sources holds iterations x n_inputs device addresses (row-major),
 * host_out receives iterations x output_bytes bytes.  Returns 0, or the first failing CUresult. */
int nimble_host_run(unsigned long long exec, unsigned long long stream, int n_inputs,
                    const unsigned long long *cells, const unsigned long long *sources,
                    unsigned long long output, size_t output_bytes, void *host_out,
                    int iterations)
{
    CUgraphExec graph = (CUgraphExec)(uintptr_t)exec;
    CUstream s = (CUstream)(uintptr_t)stream;
    int it, i;

    if (graph == NULL || n_inputs < 0 || iterations < 0 || (n_inputs > 0 && cells == NULL) ||
        (n_inputs > 0 && iterations > 0 && sources == NULL) ||
        (output_bytes > 0 && iterations > 0 && (output == 0 || host_out == NULL)))
        return (int)CUDA_ERROR_INVALID_VALUE;
    for (i = 0; i < n_inputs; ++i)
        if (cells[i] == 0) /* that input is copied into its slot, not gathered through a cell */
            return (int)CUDA_ERROR_INVALID_VALUE;

    for (it = 0; it < iterations; ++it) {
        const unsigned long long *src = sources + (size_t)it * (size_t)n_inputs;
        for (i = 0; i < n_inputs; ++i)
            NIMBLE_CHECK(cuStreamWriteValue64(s, (CUdeviceptr)cells[i], (cuuint64_t)src[i], 0));
        NIMBLE_CHECK(cuGraphLaunch(graph, s));
        if (output_bytes > 0)
            NIMBLE_CHECK(cuMemcpyDtoHAsync((char *)host_out + (size_t)it * output_bytes,
                                           (CUdeviceptr)output, output_bytes, s));
        NIMBLE_CHECK(cuStreamSynchronize(s));
    }
    return 0;
}
