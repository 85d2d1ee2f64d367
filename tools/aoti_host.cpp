// AOTInductor's C++ side of tools/aoti_compare.py: load a package that
// torch._inductor.aoti_compile_and_package wrote, with libtorch's AOTIModelPackageLoader, and
// time it as tests/c_host/run_saved.c times a Nimble file.
//
//   aoti_host PACKAGE.pt2 DTYPE D0,D1,... CALLS
//
// DTYPE is float32, float16 or bfloat16; D0,D1,... the one input's shape (random values: the
// timing needs no particular input). libtorch's CUDA is started before the clock, as the C
// runtime's context is made before its load is timed. Prints one JSON line:
// load_to_first_call_ms (the loader's construction, one call, a synchronize),
// host_us_per_call (CALLS calls launched back to back, over CALLS) and gpu_ms_per_call
// (the same calls to their end, over CALLS).
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

namespace {

double seconds_now() {
    using clock = std::chrono::steady_clock;
    return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

bool parse_dtype(const std::string& name, torch::Dtype* out) {
    if (name == "float32") *out = torch::kFloat;
    else if (name == "float16") *out = torch::kHalf;
    else if (name == "bfloat16") *out = torch::kBFloat16;
    else return false;
    return true;
}

std::vector<int64_t> parse_shape(const std::string& text) {
    std::vector<int64_t> shape;
    std::stringstream in(text);
    std::string part;
    while (std::getline(in, part, ',')) shape.push_back(std::stoll(part));
    return shape;
}

}  // namespace

int main(int argc, char** argv) {
    torch::Dtype dtype;
    if (argc != 5 || !parse_dtype(argv[2], &dtype) || std::atoi(argv[4]) < 1) {
        std::fprintf(stderr, "usage: aoti_host PACKAGE.pt2 float32|float16|bfloat16 "
                             "D0,D1,... CALLS\n");
        return 2;
    }
    const int calls = std::atoi(argv[4]);
    torch::NoGradGuard no_grad;
    auto options = torch::TensorOptions().dtype(dtype).device(torch::kCUDA);
    torch::Tensor x = torch::randn(parse_shape(argv[3]), options);
    torch::cuda::synchronize();

    double began = seconds_now();
    torch::inductor::AOTIModelPackageLoader loader(argv[1]);
    std::vector<torch::Tensor> out = loader.run({x});
    torch::cuda::synchronize();
    double load_ms = 1e3 * (seconds_now() - began);

    for (int i = 0; i < 10; i++) out = loader.run({x});  // warm
    torch::cuda::synchronize();
    began = seconds_now();
    for (int i = 0; i < calls; i++) out = loader.run({x});
    double host_s = seconds_now() - began;
    torch::cuda::synchronize();
    double total_s = seconds_now() - began;
    std::printf("{\"load_to_first_call_ms\": %.3f, \"host_us_per_call\": %.2f, "
                "\"gpu_ms_per_call\": %.4f, \"outputs\": %zu}\n",
                load_ms, 1e6 * host_s / calls, 1e3 * total_s / calls, out.size());
    return 0;
}
