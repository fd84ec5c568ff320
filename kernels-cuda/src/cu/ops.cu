// The rest of a transformer forward pass on f32 activations: RMSNorm, RoPE,
// causal attention over a KV cache, gated activations and the residual add.
// Same arithmetic as the CPU engine's model/math.rs (f32, RoPE angles in
// f64), so logits agree to rounding.

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

// The step after the Q/K/V projections: RoPE on q (into `q_out`, rows of
// heads * hd) and on k (into the key cache), and v copied into the value
// cache, for `n` tokens at positions p0 + t, where p0 is *dpos when dpos is
// set (a captured decode graph reads the position from the device) and pos0
// otherwise. q, k and v are read at row strides qs, ks and vs (one stacked
// QKV row, or three buffers). NeoX pairs (i, i + hd/2), otherwise (2i,
// 2i + 1); frequencies as HF computes them (f32 inverse frequencies),
// angles in f64 (the CPU table's recipe).
extern "C" __global__ void rope_append(const float* __restrict__ q, i64 qs, const float* __restrict__ k, i64 ks,
                                       const float* __restrict__ v, i64 vs, float* __restrict__ q_out,
                                       float* __restrict__ kc, float* __restrict__ vc, int n, int heads,
                                       int kv_heads, int hd, int pos0, const int* __restrict__ dpos, float theta,
                                       int neox) {
    const int half = hd >> 1;
    const int per_token = (heads + kv_heads) * half;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n * per_token) return;
    const int t = idx / per_token, r = idx % per_token;
    const int h = r / half, i = r % half;
    const int p = (dpos ? dpos[0] : pos0) + t;
    const float inv = 1.0f / powf(theta, (float)(2 * i) / (float)hd);
    const double a = (double)p * (double)inv;
    const float c = (float)cos(a), sn = (float)sin(a);
    const int j0 = neox ? i : 2 * i, j1 = neox ? i + half : 2 * i + 1;
    const float* src;
    float* dst;
    if (h < heads) {
        src = q + (i64)t * qs + (i64)h * hd;
        dst = q_out + ((i64)t * heads + h) * hd;
    } else {
        const int kh = h - heads;
        const i64 row = (i64)p * kv_heads * hd + (i64)kh * hd;
        src = k + (i64)t * ks + (i64)kh * hd;
        dst = kc + row;
        const float* vv = v + (i64)t * vs + (i64)kh * hd;
        vc[row + j0] = vv[j0];
        vc[row + j1] = vv[j1];
    }
    const float x0 = src[j0], x1 = src[j1];
    dst[j0] = x0 * c - x1 * sn;
    dst[j1] = x0 * sn + x1 * c;
}

// Causal attention of `n` new tokens (token t at position p0 + t, p0 =
// *dpos when dpos is set, else pos0) over a cache holding this layer's
// positions (row p = kv_dim values: kv heads of hd). One block of 256
// threads per (token, head). A head attends to positions max(0, p + 1 -
// window) ..= p (window = 0: all). GQA: query head h reads kv head
// h / (heads / kv_heads).
//   scores: one thread per position (a whole dot product each, float4 loads
//     of its key row), so 256 positions are scored in one pass;
//   softmax: block max and sum;
//   values: 256 / hd groups of hd threads, group g summing positions
//     g, g + G, ... (thread d of a group reads v[d] of each: coalesced),
//     then the groups' partial sums added in shared memory.
// Shared memory: hd (query) + 32 (reductions) + 256 (partial sums) +
// positions (scores) floats.
#define ATT_THREADS 256

extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attention(const float* __restrict__ q, const float* __restrict__ kc, const float* __restrict__ vc,
              float* __restrict__ out, int heads, int kv_heads, int hd, int pos0, const int* __restrict__ dpos,
              int window, float scale) {
    extern __shared__ __align__(16) float sm[];
    float* qs = sm;
    float* red = sm + hd;
    float* part = red + 32;
    float* sc = part + ATT_THREADS;
    const int tid = threadIdx.x;
    const int t = blockIdx.x / heads, h = blockIdx.x % heads;
    const int kv_dim = kv_heads * hd, kvh = h / (heads / kv_heads);
    const int p = (dpos ? dpos[0] : pos0) + t;
    const int first = window > 0 ? max(0, p + 1 - window) : 0;
    const int len = p + 1 - first;
    const float* qv = q + ((i64)t * heads + h) * hd;
    for (int d = tid; d < hd; d += ATT_THREADS) qs[d] = qv[d];
    __syncthreads();
    // Scores.
    const bool vec4 = (hd & 3) == 0 && (kv_dim & 3) == 0 && (((unsigned long long)kc) & 15) == 0;
    for (int j = tid; j < len; j += ATT_THREADS) {
        const float* kr = kc + (i64)(first + j) * kv_dim + (i64)kvh * hd;
        float s = 0.0f;
        if (vec4) {
            const float4* k4 = (const float4*)kr;
            const float4* q4 = (const float4*)qs;
#pragma unroll 4
            for (int d = 0; d < (hd >> 2); ++d) {
                const float4 kv = k4[d], qq = q4[d];
                s = fmaf(qq.x, kv.x, s);
                s = fmaf(qq.y, kv.y, s);
                s = fmaf(qq.z, kv.z, s);
                s = fmaf(qq.w, kv.w, s);
            }
        } else {
            for (int d = 0; d < hd; ++d) s = fmaf(qs[d], kr[d], s);
        }
        sc[j] = s * scale;
    }
    __syncthreads();
    // Softmax.
    float m = -SP_INF;
    for (int j = tid; j < len; j += ATT_THREADS) m = fmaxf(m, sc[j]);
    m = block_max(m, red);
    float sum = 0.0f;
    for (int j = tid; j < len; j += ATT_THREADS) {
        const float e = expf(sc[j] - m);
        sc[j] = e;
        sum += e;
    }
    sum = block_sum(sum, red);  // its barriers also publish sc[]
    const float inv = 1.0f / sum;
    // Values.
    const int groups = ATT_THREADS / hd;
    if (tid < groups * hd) {
        const int g = tid / hd, d = tid % hd;
        const float* vv = vc + (i64)first * kv_dim + (i64)kvh * hd + d;
        float acc = 0.0f;
#pragma unroll 4
        for (int j = g; j < len; j += groups) acc = fmaf(sc[j], vv[(i64)j * kv_dim], acc);
        part[tid] = acc;
    }
    __syncthreads();
    float* o = out + ((i64)t * heads + h) * hd;
    for (int d = tid; d < hd; d += ATT_THREADS) {
        float acc = 0.0f;
        for (int g = 0; g < groups; ++g) acc += part[g * hd + d];
        o[d] = acc * inv;
    }
}

// out = silu(gate) * up (SwiGLU) or gelu_tanh(gate) * up (GeGLU), for n
// tokens of f values: gate row t at gate + t * gs, up row t at up + t * us,
// out row t at out + t * f (gate and up may be the two halves of one
// stacked projection; out may be gate when gs == f).
extern "C" __global__ void swiglu(const float* gate, i64 gs, const float* __restrict__ up, i64 us, float* out,
                                  int f, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * f) return;
    const int t = i / f, j = i % f;
    out[i] = silu_mul(gate[t * gs + j], up[t * us + j]);
}

extern "C" __global__ void geglu(const float* gate, i64 gs, const float* __restrict__ up, i64 us, float* out,
                                 int f, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * f) return;
    const int t = i / f, j = i % f;
    out[i] = gelu_mul(gate[t * gs + j], up[t * us + j]);
}

// x[r] += y[r]; out[r] = x[r] / rms(x[r]) * w: the residual add and the
// next RMSNorm in one pass, one block per row of `dim`.
extern "C" __global__ void add_rms_norm(float* x, const float* __restrict__ y, const float* __restrict__ w,
                                        float eps, int dim, float* __restrict__ out) {
    __shared__ float red[32];
    float* xr = x + (i64)blockIdx.x * dim;
    const float* yr = y + (i64)blockIdx.x * dim;
    float* o = out + (i64)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = xr[i] + yr[i];
        xr[i] = v;
        ss = fmaf(v, v, ss);
    }
    ss = block_sum(ss, red);
    const float scale = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = xr[i] * scale * w[i];
}

// x += y.
extern "C" __global__ void add(float* x, const float* __restrict__ y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}
