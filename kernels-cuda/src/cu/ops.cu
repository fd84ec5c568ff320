// The rest of a transformer forward pass on f32 activations: RMSNorm, RoPE,
// causal attention over a KV cache, gated activations and the residual add.
// Same arithmetic as the CPU engine's model/math.rs (f32, RoPE angles in
// f64), so logits agree to rounding.

__device__ __forceinline__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    __syncthreads();  // `red` may still be read from a previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < nw ? red[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < nw ? red[lane] : -SP_INF;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, one block per row of `dim`.
// In place when out == x.
extern "C" __global__ void rms_norm(const float* x, const float* __restrict__ w, float eps, int dim,
                                    float* out) {
    __shared__ float red[32];
    const float* xr = x + (i64)blockIdx.x * dim;
    float* o = out + (i64)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    ss = block_sum(ss, red);
    const float scale = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = xr[i] * scale * w[i];
}

// RoPE in place on `n` tokens of `heads` heads of `hd` values (rows of
// heads * hd, row stride `stride`), token t at position pos0 + t. NeoX pairs
// (i, i + hd/2), otherwise (2i, 2i + 1). Frequencies as HF computes them (f32
// inverse frequencies), angles in f64 (the CPU table's recipe).
extern "C" __global__ void rope(float* x, int n, int heads, int hd, i64 stride, int pos0, float theta,
                                int neox) {
    const int half = hd >> 1;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n * heads * half) return;
    const int i = idx % half, h = (idx / half) % heads, t = idx / (half * heads);
    const float inv = 1.0f / powf(theta, (float)(2 * i) / (float)hd);
    const double a = (double)(pos0 + t) * (double)inv;
    const float c = (float)cos(a), s = (float)sin(a);
    float* v = x + (i64)t * stride + (i64)h * hd;
    const int j0 = neox ? i : 2 * i, j1 = neox ? i + half : 2 * i + 1;
    const float x0 = v[j0], x1 = v[j1];
    v[j0] = x0 * c - x1 * s;
    v[j1] = x0 * s + x1 * c;
}

// Causal attention of `n` new tokens (token t at position pos0 + t) over a
// cache holding positions 0..pos0 + n of this layer (row p = kv_dim values:
// kv heads of hd). One block per (token, head); scores in dynamic shared
// memory (pos0 + n floats). A head attends to positions max(0, p + 1 -
// window) ..= p (window = 0: all). GQA: query head h reads kv head
// h / (heads / kv_heads).
extern "C" __global__ void attention(const float* __restrict__ q, const float* __restrict__ kc,
                                     const float* __restrict__ vc, float* __restrict__ out, int heads,
                                     int kv_heads, int hd, int pos0, int window, float scale) {
    extern __shared__ float sm[];  // hd (query) + 32 (reductions) + positions (scores)
    float* qs = sm;
    float* red = sm + hd;
    float* sc = red + 32;
    const int t = blockIdx.x / heads, h = blockIdx.x % heads;
    const int kv_dim = kv_heads * hd, kvh = h / (heads / kv_heads);
    const int p = pos0 + t;
    const int first = window > 0 ? max(0, p + 1 - window) : 0;
    const int len = p + 1 - first;
    const float* qv = q + ((i64)t * heads + h) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = qv[d];
    __syncthreads();
    // Scores: one warp per position, lanes over the head's values.
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (int j = warp; j < len; j += nw) {
        const float* kv = kc + (i64)(first + j) * kv_dim + (i64)kvh * hd;
        float s = 0.0f;
        for (int d = lane; d < hd; d += 32) s = fmaf(qs[d], kv[d], s);
        s = warp_sum(s);
        if (lane == 0) sc[j] = s * scale;
    }
    __syncthreads();
    float m = -SP_INF;
    for (int j = threadIdx.x; j < len; j += blockDim.x) m = fmaxf(m, sc[j]);
    m = block_max(m, red);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        const float e = expf(sc[j] - m);
        sc[j] = e;
        sum += e;
    }
    sum = block_sum(sum, red);  // its barriers also publish sc[]
    const float inv = 1.0f / sum;
    // out[d] = sum_j p_j v_j[d]: thread d (several passes when hd > threads).
    float* o = out + ((i64)t * heads + h) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        const float* vv = vc + (i64)first * kv_dim + (i64)kvh * hd + d;
        float acc = 0.0f;
        for (int j = 0; j < len; ++j) acc = fmaf(sc[j], vv[(i64)j * kv_dim], acc);
        o[d] = acc * inv;
    }
}

// gate = silu(gate) * up (SwiGLU) or gelu_tanh(gate) * up (GeGLU).
extern "C" __global__ void swiglu(float* gate, const float* __restrict__ up, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float g = gate[i];
        gate[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

extern "C" __global__ void geglu(float* gate, const float* __restrict__ up, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float x = gate[i];
        gate[i] = 0.5f * x * (1.0f + tanhf(0.7978846f * (x + 0.044715f * x * x * x))) * up[i];
    }
}

// x += y.
extern "C" __global__ void add(float* x, const float* __restrict__ y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// x *= s.
extern "C" __global__ void scale(float* x, float s, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}
