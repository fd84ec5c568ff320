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
#endif

// +infinity (NVRTC has no <math.h> macros).
#define SP_INF __int_as_float(0x7f800000)
