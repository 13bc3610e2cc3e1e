// Runs reduce.cu's kernels on the CPU for the host emulation tests
// (kernel/emulation.rs): the CUDA keywords and intrinsics the source uses, as
// plain C++, and a launcher that runs every thread of a grid one after another
// (the kernels share nothing between threads, so the order does not matter).
#include <cstring>

#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __restrict__ __restrict

struct uint4 {
    unsigned int x, y, z, w;
};
struct fairring_dim3 {
    unsigned int x, y, z;
};
// One grid position per host thread: tests emulating kernels at once each
// walk a grid of their own.
static thread_local fairring_dim3 blockIdx, blockDim, gridDim, threadIdx;

template <class T> inline T __ldg(const T* p) { return *p; }
inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
inline double __longlong_as_double(long long u) { double f; std::memcpy(&f, &u, 8); return f; }
inline long long __double_as_longlong(double f) { long long u; std::memcpy(&u, &f, 8); return u; }
inline float fairring_emulated_f16_to_f32(unsigned short h) {
    _Float16 x;
    std::memcpy(&x, &h, 2);
    return (float)x;
}
inline unsigned short fairring_emulated_f32_to_f16(float f) {
    _Float16 x = (_Float16)f;
    unsigned short h;
    std::memcpy(&h, &x, 2);
    return h;
}

static void fairring_emulate_grid(unsigned int grid, unsigned int block) {
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    blockIdx = {0, 0, 0};
    threadIdx = {0, 0, 0};
}

#define FAIRRING_FOR_EACH_THREAD(grid, block, body)                              \
    fairring_emulate_grid(grid, block);                                           \
    for (unsigned int b = 0; b < (grid); ++b)                                     \
        for (unsigned int t = 0; t < (block); ++t) {                              \
            blockIdx.x = b;                                                       \
            threadIdx.x = t;                                                      \
            body;                                                                 \
        }

// The kernel is passed by address: every reduce kernel takes two pointers and
// three u64, every many-source kernel a pointer, the sources block, a u32 and
// three u64, every divide kernel a pointer, a u32 and three u64.
extern "C" void fairring_emulate_reduce(void* kernel, void* dst, const void* src,
                                        unsigned long long head, unsigned long long vectors,
                                        unsigned long long tail, unsigned int grid,
                                        unsigned int block);
extern "C" void fairring_emulate_reduce_many(void* kernel, void* dst, const void* const* srcs,
                                             unsigned int count, unsigned long long head,
                                             unsigned long long vectors, unsigned long long tail,
                                             unsigned int grid, unsigned int block);
extern "C" void fairring_emulate_divide(void* kernel, void* dst, unsigned int n,
                                        unsigned long long head, unsigned long long vectors,
                                        unsigned long long tail, unsigned int grid,
                                        unsigned int block);
