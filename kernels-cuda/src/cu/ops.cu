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
// QKV row, or separate buffers). With `qn` / `kn` set (Gemma's QK-norm),
// each query / key head is first RMS-normalised with those weights (the
// arithmetic of rms_norm, per head). NeoX pairs (i, i + hd/2), otherwise
// (2i, 2i + 1); frequencies as HF computes them (f32 inverse frequencies),
// angles in f64 (the CPU table's recipe). One block per (token, head),
// thread i of hd/2 (rounded up to a warp) rotating pair i.
extern "C" __global__ void rope_append(const float* __restrict__ q, i64 qs, const float* __restrict__ k, i64 ks,
                                       const float* __restrict__ v, i64 vs, float* __restrict__ q_out,
                                       float* __restrict__ kc, float* __restrict__ vc, int n, int heads,
                                       int kv_heads, int hd, int pos0, const int* __restrict__ dpos, float theta,
                                       int neox, const float* __restrict__ qn, const float* __restrict__ kn,
                                       float eps) {
    __shared__ float red[32];
    const int half = hd >> 1, per_token = heads + kv_heads;
    const int t = blockIdx.x / per_token, h = blockIdx.x % per_token, i = threadIdx.x;
    const bool on = i < half;
    const int p = (dpos ? dpos[0] : pos0) + t;
    const int j0 = neox ? i : 2 * i, j1 = neox ? i + half : 2 * i + 1;
    const float* src;
    float* dst;
    const float* nw;
    if (h < heads) {
        src = q + (i64)t * qs + (i64)h * hd;
        dst = q_out + ((i64)t * heads + h) * hd;
        nw = qn;
    } else {
        const int kh = h - heads;
        const i64 row = (i64)p * kv_heads * hd + (i64)kh * hd;
        src = k + (i64)t * ks + (i64)kh * hd;
        dst = kc + row;
        nw = kn;
        if (on) {
            const float* vv = v + (i64)t * vs + (i64)kh * hd;
            vc[row + j0] = vv[j0];
            vc[row + j1] = vv[j1];
        }
    }
    float x0 = on ? src[j0] : 0.0f, x1 = on ? src[j1] : 0.0f;
    if (nw) {  // the same for the whole block
        const float ss = block_sum(fmaf(x1, x1, x0 * x0), red);
        const float scale = 1.0f / sqrtf(ss / (float)hd + eps);
        if (on) {
            x0 = x0 * scale * nw[j0];
            x1 = x1 * scale * nw[j1];
        }
    }
    if (!on) return;
    const float inv = 1.0f / powf(theta, (float)(2 * i) / (float)hd);
    const double a = (double)p * (double)inv;
    const float c = (float)cos(a), sn = (float)sin(a);
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

// Attention of a few new tokens (decode), flash-decoding style: block
// (t * heads + h, s) takes split s of token t's positions (`splits` equal
// chunks of first..=p, see `attention` for the window and GQA), its 8 warps
// every 8th position of the chunk. A lane holds hd / 32 of the head's
// dimensions (d = lane + 32 i: each key or value row is read by whole
// 128-byte lines) and keeps a running softmax (max m, sum l, weighted values
// acc) over its warp's positions, two at a time; the warps then merge in
// shared memory. With one split the block writes the output; with several
// it writes (m, l, acc) to `part` (rows of hd + 2 floats per (t, h, s)) and
// the last block of its (t, h) to finish (counted in `count`, which it sets
// back to 0) merges the splits. hd a multiple of 32, at most 256.
#define DEC_WARPS 8
#define DEC_MAXI 8

extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32)
    attention_dec(const float* __restrict__ q, const float* __restrict__ kc, const float* __restrict__ vc,
                  float* __restrict__ out, int heads, int kv_heads, int hd, int pos0, const int* __restrict__ dpos,
                  int window, float scale, int splits, float* __restrict__ part, int* __restrict__ count) {
    __shared__ float wm[DEC_WARPS], wl[DEC_WARPS], wacc[DEC_WARPS * 256];
    __shared__ int last;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, ni = hd >> 5;
    const int bh = blockIdx.x, s = blockIdx.y;
    const int t = bh / heads, h = bh % heads;
    const int kv_dim = kv_heads * hd, kvh = h / (heads / kv_heads);
    const int p = (dpos ? dpos[0] : pos0) + t;
    const int first = window > 0 ? max(0, p + 1 - window) : 0;
    const int len = p + 1 - first, chunk = (len + splits - 1) / splits;
    const int j0 = first + s * chunk, j1 = min(first + len, j0 + chunk);
    float qr[DEC_MAXI], acc[DEC_MAXI];
    const float* qv = q + (i64)bh * hd;
#pragma unroll
    for (int i = 0; i < DEC_MAXI; ++i) {
        qr[i] = i < ni ? qv[lane + 32 * i] * scale : 0.0f;
        acc[i] = 0.0f;
    }
    float m = -SP_INF, l = 0.0f;
    const float* kb = kc + (i64)kvh * hd + lane;
    const float* vb = vc + (i64)kvh * hd + lane;
    // Two positions per step: their loads are independent.
    int j = j0 + warp;
    for (; j + DEC_WARPS < j1; j += 2 * DEC_WARPS) {
        const float* k0 = kb + (i64)j * kv_dim;
        const float* k1 = k0 + (i64)DEC_WARPS * kv_dim;
        const float* v0 = vb + (i64)j * kv_dim;
        const float* v1 = v0 + (i64)DEC_WARPS * kv_dim;
        float d0 = 0.0f, d1 = 0.0f, va[DEC_MAXI], vb2[DEC_MAXI];
#pragma unroll
        for (int i = 0; i < DEC_MAXI; ++i) {
            if (i < ni) {
                d0 = fmaf(qr[i], k0[32 * i], d0);
                d1 = fmaf(qr[i], k1[32 * i], d1);
                va[i] = v0[32 * i];
                vb2[i] = v1[32 * i];
            }
        }
        d0 = warp_sum(d0);
        d1 = warp_sum(d1);
        const float mn = fmaxf(m, fmaxf(d0, d1));
        const float c = expf(m - mn), e0 = expf(d0 - mn), e1 = expf(d1 - mn);
        l = fmaf(l, c, e0 + e1);
#pragma unroll
        for (int i = 0; i < DEC_MAXI; ++i) {
            if (i < ni) acc[i] = fmaf(acc[i], c, fmaf(e0, va[i], e1 * vb2[i]));
        }
        m = mn;
    }
    if (j < j1) {
        const float* k0 = kb + (i64)j * kv_dim;
        const float* v0 = vb + (i64)j * kv_dim;
        float d0 = 0.0f;
#pragma unroll
        for (int i = 0; i < DEC_MAXI; ++i) {
            if (i < ni) d0 = fmaf(qr[i], k0[32 * i], d0);
        }
        d0 = warp_sum(d0);
        const float mn = fmaxf(m, d0);
        const float c = expf(m - mn), e0 = expf(d0 - mn);
        l = fmaf(l, c, e0);
#pragma unroll
        for (int i = 0; i < DEC_MAXI; ++i) {
            if (i < ni) acc[i] = fmaf(acc[i], c, e0 * v0[32 * i]);
        }
        m = mn;
    }
    // Merge the warps (a warp without positions has m = -inf, l = 0).
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < DEC_MAXI; ++i) {
        if (i < ni) wacc[warp * 256 + lane + 32 * i] = acc[i];
    }
    __syncthreads();
    float bm = -SP_INF;
    for (int w = 0; w < DEC_WARPS; ++w) bm = fmaxf(bm, wm[w]);
    float bl = 0.0f;
    float* o = out + (i64)bh * hd;
    float* pr = part + ((i64)bh * splits + s) * (hd + 2);
    for (int d = threadIdx.x; d < hd; d += DEC_WARPS * 32) {
        float a = 0.0f;
        bl = 0.0f;
        if (bm > -SP_INF) {
            for (int w = 0; w < DEC_WARPS; ++w) {
                const float f = expf(wm[w] - bm);
                a = fmaf(wacc[w * 256 + d], f, a);
                bl = fmaf(wl[w], f, bl);
            }
        }
        if (splits == 1) o[d] = a / bl;
        else pr[2 + d] = a;
    }
    if (splits == 1) return;
    if (threadIdx.x == 0) {
        float l0 = 0.0f;
        if (bm > -SP_INF) {
            for (int w = 0; w < DEC_WARPS; ++w) l0 = fmaf(wl[w], expf(wm[w] - bm), l0);
        }
        pr[0] = bm;
        pr[1] = l0;
    }
    // The last block of this (t, h) to finish merges the splits.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&count[bh], 1) == splits - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const float* p0 = part + (i64)bh * splits * (hd + 2);
    float gm = -SP_INF;
    for (int r = 0; r < splits; ++r) gm = fmaxf(gm, __ldcg(p0 + (i64)r * (hd + 2)));
    for (int d = threadIdx.x; d < hd; d += DEC_WARPS * 32) {
        float a = 0.0f, gl = 0.0f;
        for (int r = 0; r < splits; ++r) {
            const float* pp = p0 + (i64)r * (hd + 2);
            const float mr = __ldcg(pp);
            if (mr == -SP_INF) continue;
            const float f = expf(mr - gm);
            gl = fmaf(__ldcg(pp + 1), f, gl);
            a = fmaf(__ldcg(pp + 2 + d), f, a);
        }
        o[d] = a / gl;
    }
    if (threadIdx.x == 0) count[bh] = 0;
}

// y' = y / rms(y) * wp (Gemma's post-norm of a block's output), x += y',
// then out = x / rms(x) * w: the post-norm, the residual add and the next
// RMSNorm in one pass, one block per row of `dim` (the arithmetic of
// rms_norm followed by add_rms_norm).
extern "C" __global__ void post_add_rms_norm(float* x, const float* __restrict__ y, const float* __restrict__ wp,
                                             const float* __restrict__ w, float eps, int dim,
                                             float* __restrict__ out) {
    __shared__ float red[32];
    float* xr = x + (i64)blockIdx.x * dim;
    const float* yr = y + (i64)blockIdx.x * dim;
    float* o = out + (i64)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss = fmaf(yr[i], yr[i], ss);
    ss = block_sum(ss, red);
    const float sp = 1.0f / sqrtf(ss / (float)dim + eps);
    float s2 = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = xr[i] + yr[i] * sp * wp[i];
        xr[i] = v;
        s2 = fmaf(v, v, s2);
    }
    s2 = block_sum(s2, red);
    const float scale = 1.0f / sqrtf(s2 / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = xr[i] * scale * w[i];
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

// The first index of the largest of x[0..n] (NaN and -inf never win; 0 when
// nothing is above -inf): the host sampler's greedy pick, so only 4 bytes
// come back per token. Two launches: block b of argmax_part keeps the first
// best of x[b * chunk ..) in part[2b] (its bits) and part[2b + 1] (its
// index), then argmax_final reduces the blocks' pairs into *out. Pairs are
// reduced by the larger value or, equal, the lower index; each thread walks
// its indices in ascending order, so a tie keeps the earlier.
#define ARGMAX_NONE 0x7fffffff

__device__ __forceinline__ void better(float& bv, int& bi, float ov, int oi) {
    if (ov > bv || (ov == bv && oi < bi)) {
        bv = ov;
        bi = oi;
    }
}

// The block's best pair in (bv, bi) of thread 0.
__device__ __forceinline__ void block_best(float& bv, int& bi) {
    __shared__ float sv[32];
    __shared__ int si[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        better(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        bv = lane < nw ? sv[lane] : -SP_INF;
        bi = lane < nw ? si[lane] : ARGMAX_NONE;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            better(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
    }
}

extern "C" __global__ void argmax_part(const float* __restrict__ x, int n, int chunk, int* __restrict__ part) {
    const int start = blockIdx.x * chunk, end = min(n, start + chunk);
    float bv = -SP_INF;
    int bi = ARGMAX_NONE;
    for (int i = start + threadIdx.x; i < end; i += blockDim.x) {
        const float v = x[i];
        if (v > bv) {
            bv = v;
            bi = i;
        }
    }
    block_best(bv, bi);
    if (threadIdx.x == 0) {
        part[2 * blockIdx.x] = __float_as_int(bv);
        part[2 * blockIdx.x + 1] = bi;
    }
}

extern "C" __global__ void argmax_final(const int* __restrict__ part, int blocks, int* __restrict__ out) {
    float bv = -SP_INF;
    int bi = ARGMAX_NONE;
    for (int b = threadIdx.x; b < blocks; b += blockDim.x) better(bv, bi, __int_as_float(part[2 * b]), part[2 * b + 1]);
    block_best(bv, bi);
    if (threadIdx.x == 0) out[0] = bi == ARGMAX_NONE ? 0 : bi;
}
