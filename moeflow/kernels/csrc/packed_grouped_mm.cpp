// moeflow: the CPU's few-row grouped product of compiled decode (moeflow/kernels/packed_cpu.py, which
// builds this file with torch.utils.cpp_extension and calls it through the Python binding at the end).
//
// y[r, :] = x[r, :] @ W[e] (+ bias[e])  for the rows r of expert e (counts[e] rows each, in expert order),
// with W[e] ([K, N]) packed as Wp[e][s][k][16]: strip s holds columns 16s .. 16s+15 of every row
// k, so a strip is one contiguous run of memory. A decode step has a few rows per expert and
// reads each weight once: the product is bound by how fast the weight streams from memory. A
// strip's 16 columns of up to MB rows stay in 2*MB vector registers over the whole of K, the
// strip streams past once, and nothing is copied per call (a BLAS GEMM copies its operand into
// its own blocked layout on every call, the likely reason MKL runs these products slowly). The vector type is GCC's generic one: the compiler maps it to the host's ISA
// (AVX2 + FMA here, NEON on ARM).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <vector>

typedef float v8 __attribute__((vector_size(32), aligned(4)));  // aligned(4): unaligned loads

constexpr int64_t kStrip = 16;  // columns per strip (two v8)
constexpr int kMaxRows = 6;     // rows per register block: 12 accumulators + 2 weights + 1 input
// rows of the strip ahead to prefetch: with several rows a block the FMAs of a row of the strip
// take long enough that the hardware prefetcher alone left the stream short of the memory's rate
constexpr int64_t kPrefetch = 64;

template <int MB>
static inline void strip_block(const float* __restrict x, int64_t K, const float* __restrict w,
                               const float* __restrict init /* [16] */, float* __restrict out /* [MB][16] */) {
    v8 a0[MB], a1[MB];
    const v8 b0 = *(const v8*)init, b1 = *(const v8*)(init + 8);
    for (int i = 0; i < MB; ++i) { a0[i] = b0; a1[i] = b1; }
    for (int64_t k = 0; k < K; ++k, w += kStrip) {
        __builtin_prefetch(w + kPrefetch * kStrip);  // (a hint: past the weight's end it reads nothing)
        v8 w0 = *(const v8*)w, w1 = *(const v8*)(w + 8);
        for (int i = 0; i < MB; ++i) {
            float b = x[i * K + k];
            a0[i] += b * w0;
            a1[i] += b * w1;
        }
    }
    for (int i = 0; i < MB; ++i) { *(v8*)(out + i * kStrip) = a0[i]; *(v8*)(out + i * kStrip + 8) = a1[i]; }
}

// bias: the expert's [N] bias (nullptr: none), which the accumulators start from
static void rows_of_strip(const float* x, int64_t rows, int64_t K, const float* w, const float* bias, float* y,
                          int64_t N, int64_t col) {
    float out[kMaxRows * kStrip];
    const int64_t width = N - col < kStrip ? N - col : kStrip;  // the last strip may be partial
    float init[kStrip] = {};
    if (bias != nullptr) std::memcpy(init, bias + col, sizeof(float) * width);
    for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
        const int64_t mb = rows - r0 < kMaxRows ? rows - r0 : kMaxRows;
        const float* xr = x + r0 * K;
        switch (mb) {
            case 6: strip_block<6>(xr, K, w, init, out); break;
            case 5: strip_block<5>(xr, K, w, init, out); break;
            case 4: strip_block<4>(xr, K, w, init, out); break;
            case 3: strip_block<3>(xr, K, w, init, out); break;
            case 2: strip_block<2>(xr, K, w, init, out); break;
            default: strip_block<1>(xr, K, w, init, out); break;
        }
        for (int64_t i = 0; i < mb; ++i)
            std::memcpy(y + (r0 + i) * N + col, out + i * kStrip, sizeof(float) * width);
    }
}

// x [R, K] and y [R, N] row-major; Wp [E, ceil(N/16), K, 16]; counts [E] (int64, each >= 0,
// sum <= R: rows past the sum are zeros); bias [E, N] row-major or nullptr (y = x W[e] + bias[e]).
// threads: OpenMP threads over (expert, strip) pairs.
extern "C" void moeflow_packed_grouped_mm(const float* x, int64_t R, int64_t K, const float* Wp, int64_t E,
                                          int64_t N, const int64_t* counts, const float* bias, float* y, int threads) {
    const int64_t S = (N + kStrip - 1) / kStrip;
    std::vector<int64_t> first(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) {
        const int64_t c = counts[e] < 0 ? 0 : counts[e];
        first[e + 1] = first[e] + c > R ? R : first[e] + c;  // never past the rows there are
    }
    if (first[E] < R) std::memset(y + first[E] * N, 0, sizeof(float) * (R - first[E]) * N);
    std::vector<int64_t> busy;  // the experts with rows: the threads share out their strips evenly
    for (int64_t e = 0; e < E; ++e)
        if (first[e + 1] > first[e]) busy.push_back(e);
    const int64_t jobs = (int64_t)busy.size() * S;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t job = 0; job < jobs; ++job) {
        const int64_t e = busy[job / S], s = job % S, rows = first[e + 1] - first[e];
        rows_of_strip(x + first[e] * K, rows, K, Wp + (e * S + s) * K * kStrip, bias == nullptr ? nullptr : bias + e * N,
                      y + first[e] * N, N, s * kStrip);
    }
}

// The Python binding: the caller (packed_cpu.packed_grouped_mm) has checked every tensor (fp32,
// CPU, contiguous, shapes) and passes their data pointers (0 for no bias). The product runs without the GIL.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("packed_grouped_mm",
          [](std::uintptr_t x, int64_t R, int64_t K, std::uintptr_t Wp, int64_t E, int64_t N, std::uintptr_t counts,
             std::uintptr_t bias, std::uintptr_t y, int threads) {
              pybind11::gil_scoped_release unlocked;
              moeflow_packed_grouped_mm(reinterpret_cast<const float*>(x), R, K, reinterpret_cast<const float*>(Wp), E,
                                        N, reinterpret_cast<const int64_t*>(counts),
                                        reinterpret_cast<const float*>(bias), reinterpret_cast<float*>(y), threads);
          });
}
