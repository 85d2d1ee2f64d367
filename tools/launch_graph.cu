#include <cuda_runtime.h>
extern "C" __global__ void nimble_launch_graph(cudaGraphExec_t exec, int *status, int mode) {
    cudaError_t e = cudaGraphLaunch(exec, mode == 0 ? cudaStreamGraphTailLaunch : cudaStreamGraphFireAndForget);
    *status = (int)e;
}
