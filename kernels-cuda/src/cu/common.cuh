// Shared helpers for spinfer's CUDA kernels. Compiled by NVRTC at load, so
// no system headers: fixed-width types and half/bfloat16 conversions are
// spelled out here.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#ifndef SPINFER_HOST
// f16 bits -> f32 (hardware conversion).
__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
#else
// The host build of the format readers (tests/host_formats.rs) defines
// SPINFER_HOST and supplies h2f, __uint_as_float, __int_as_float and uint4.
#endif

// bf16 bits -> f32 (the high half of an f32).
__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float(((u32)b) << 16); }

// Loads of little-endian values at 2-byte-aligned addresses.
__device__ __forceinline__ u16 ld16(const u8* p) { return *(const u16*)p; }
__device__ __forceinline__ u32 ld32_a2(const u8* p) {
    return (u32)ld16(p) | ((u32)ld16(p + 2) << 16);
}

// Activation element types: the kernels read x through one of these.
struct ActF32 {
    typedef float T;
    static __device__ __forceinline__ float get(const float* x, int i) { return x[i]; }
};
struct ActF16 {
    typedef u16 T;
    static __device__ __forceinline__ float get(const u16* x, int i) { return h2f(x[i]); }
};
struct ActBF16 {
    typedef u16 T;
    static __device__ __forceinline__ float get(const u16* x, int i) { return bf2f(x[i]); }
};

#ifndef SPINFER_HOST
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The sum of v over the block (blockDim.x a multiple of 32, at most
// 1024), in a fixed order; `red` holds 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    __syncthreads();  // `red` may still be read from a previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < nw ? red[lane] : 0.0f;
    return warp_sum(v);
}

// The gated activations: act(g) * u, SwiGLU and GeGLU (tanh).
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }
__device__ __forceinline__ float gelu_mul(float x, float u) {
    return 0.5f * x * (1.0f + tanhf(0.7978846f * (x + 0.044715f * x * x * x))) * u;
}

#endif

// +infinity (NVRTC has no <math.h> macros).
#define SP_INF __int_as_float(0x7f800000)
