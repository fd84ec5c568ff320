// Quantised GEMV and small-batch GEMM on GGUF blocks, dense or on gathered
// rows, and the gathered-row AXPY that serves the sparse down projection.
//
// gemv: y[b][i] = dot(W[row(i)], x[b]) for b < B tokens, where row(i) is
//   i (dense) or rows[i] (gathered: the sparse gate/up, the sparse output
//   head's row ranges expanded to indices). One warp computes R = 2 outputs;
//   its lanes stride over the row's 32-weight items, dequantise each item
//   once into registers and use it for all B tokens. Consecutive lanes read
//   consecutive items, so a warp's loads cover contiguous bytes of the row;
//   x comes from shared memory (see GEMV_PAD).
//
// axpy_rows: part[split][b][h] = sum over kept k in this split of
//   a[b][k] * Wt[rows[k]][h], where Wt is the down projection repacked
//   neuron-major (one row per FFN neuron). A block of 8 warps owns 32 items
//   (1024 outputs) of the hidden vector, lane l item l; blockIdx.y splits
//   the kept neurons, and within a split warp g takes every 8th from g; the
//   warps' sums meet in shared memory in a fixed order. A second kernel,
//   sum_splits, adds the splits in a fixed order, so the result does not
//   depend on scheduling.

#define GEMV_WARPS 8
#define GEMV_R 2
// x is staged in shared memory 1024 columns (32 items, one per lane) at a
// time, as f32, each item's 32 values padded to 36 floats: lane l then reads
// its item with float4 loads at 36 l + k, which fall in distinct banks for
// every 8 lanes (a conflict-free LDS.128), instead of 32 lanes each reading
// their own 128-byte line of x from L1.
#define GEMV_CHUNK 1024
#define GEMV_PAD 36

// What the staging computes from x. The fused variants (gemv_fused_*, f32 x)
// take the step before the product into their staging, saving a launch and a
// pass over the activations:
//   PRO_SILU / PRO_GELU: act(x) * aux, x and aux the gate and up rows (the
//     down projection with the gated activation fused in);
//   PRO_ADD_NORM: r = x + aux, staged as r / rms(r) * nw (the residual add and
//     the next RMSNorm fused in); block 0 also writes r to x_out, the next
//     residual stream. Sums as add_rms_norm in ops.cu sums them (256 threads,
//     same order), so the staged values are the ones it would write.
//   PRO_POST_ADD_NORM: as PRO_ADD_NORM with aux first normalised by its own
//     RMSNorm (weights pw; Gemma's post-norms): r = x + aux / rms(aux) * pw,
//     summed as post_add_rms_norm in ops.cu sums it.
// aux and x_out rows have x's stride.
#define PRO_NONE 0
#define PRO_SILU 1
#define PRO_GELU 2
#define PRO_ADD_NORM 3
#define PRO_POST_ADD_NORM 4
struct Prologue {
    int mode;
    const float* aux;
    const float* nw;
    float eps;
    float* x_out;
    const float* pw;
};

__device__ __forceinline__ float prologue_value(const Prologue& p, i64 at, int col, float v, float scale,
                                                float pscale) {
    const float a = p.aux[at];
    if (p.mode >= PRO_ADD_NORM) {
        const float r = p.mode == PRO_POST_ADD_NORM ? v + a * pscale * p.pw[col] : v + a;
        if (blockIdx.x == 0) p.x_out[at] = r;
        return r * scale * p.nw[col];
    }
    return p.mode == PRO_SILU ? silu_mul(v, a) : gelu_mul(v, a);
}

template <typename F, typename A, int B>
__device__ __forceinline__ void gemv_impl(const u8* __restrict__ w, i64 row_bytes, int cols,
                                          const typename A::T* __restrict__ x, int x_stride,
                                          const int* __restrict__ rows, int n_out,
                                          float* __restrict__ y, int y_stride, const Prologue pro) {
    __shared__ __align__(16) float xs[B][32 * GEMV_PAD];
    __shared__ float red[32];
    const int lane = threadIdx.x & 31;
    const int first = (blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * GEMV_R;
    // A warp past the last output still stages x and meets the barriers.
    const bool active = first < n_out;
    const u8* row_ptr[GEMV_R];
    float rs[GEMV_R];
#pragma unroll
    for (int r = 0; r < GEMV_R; ++r) {
        const int i = min(first + r, n_out - 1);  // a missing second row repeats the first; not stored
        const i64 ri = rows ? (i64)rows[i] : (i64)i;
        row_ptr[r] = w + ri * row_bytes;
        rs[r] = active ? F::row_scale(row_ptr[r], cols) : 0.0f;
    }
    float acc[GEMV_R][B];
#pragma unroll
    for (int r = 0; r < GEMV_R; ++r)
#pragma unroll
        for (int b = 0; b < B; ++b) acc[r][b] = 0.0f;

    // PRO_ADD_NORM: each token's 1 / rms(x + aux), every thread in the sum;
    // PRO_POST_ADD_NORM: first 1 / rms(aux), then 1 / rms(x + aux').
    float scale[B], pscale[B];
#pragma unroll
    for (int b = 0; b < B; ++b) {
        scale[b] = 1.0f;
        pscale[b] = 1.0f;
        if (pro.mode < PRO_ADD_NORM) continue;
        const typename A::T* xb = x + (i64)b * x_stride;
        const float* ab = pro.aux + (i64)b * x_stride;
        const bool post = pro.mode == PRO_POST_ADD_NORM;
        if (post) {
            float ps = 0.0f;
            for (int i = threadIdx.x; i < cols; i += 32 * GEMV_WARPS) ps = fmaf(ab[i], ab[i], ps);
            ps = block_sum(ps, red);
            pscale[b] = 1.0f / sqrtf(ps / (float)cols + pro.eps);
        }
        float ss = 0.0f;
        for (int i = threadIdx.x; i < cols; i += 32 * GEMV_WARPS) {
            const float v = post ? A::get(xb, i) + ab[i] * pscale[b] * pro.pw[i] : A::get(xb, i) + ab[i];
            ss = fmaf(v, v, ss);
        }
        ss = block_sum(ss, red);
        scale[b] = 1.0f / sqrtf(ss / (float)cols + pro.eps);
    }

    const int items = cols >> 5;
    for (int base = 0; base < items; base += 32) {
        // Stage columns [32 base, 32 base + n) of every token.
        const int n = min(GEMV_CHUNK, cols - 32 * base);
        __syncthreads();
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const typename A::T* xb = x + (i64)b * x_stride + 32 * base;
            for (int c = threadIdx.x; c < n; c += 32 * GEMV_WARPS) {
                float v = A::get(xb, c);
                if (pro.mode != PRO_NONE)
                    v = prologue_value(pro, (i64)b * x_stride + 32 * base + c, 32 * base + c, v, scale[b],
                                       pscale[b]);
                xs[b][(c >> 5) * GEMV_PAD + (c & 31)] = v;
            }
        }
        __syncthreads();
        const int it = base + lane;
        if (!active || it >= items) continue;
        const int blk = it / F::ITEMS, sub = it % F::ITEMS;
#pragma unroll
        for (int r = 0; r < GEMV_R; ++r) {
            float wv[32];
            F::dequant(row_ptr[r] + (i64)blk * F::BLOCK_BYTES, sub, rs[r], wv);
#pragma unroll
            for (int b = 0; b < B; ++b) {
                const float4* xv = (const float4*)&xs[b][lane * GEMV_PAD];
                float s = 0.0f;
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    const float4 v = xv[k];
                    s = fmaf(wv[4 * k], v.x, s);
                    s = fmaf(wv[4 * k + 1], v.y, s);
                    s = fmaf(wv[4 * k + 2], v.z, s);
                    s = fmaf(wv[4 * k + 3], v.w, s);
                }
                acc[r][b] += s;
            }
        }
    }
    if (!active) return;
#pragma unroll
    for (int r = 0; r < GEMV_R; ++r) {
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const float v = warp_sum(acc[r][b]);
            if (lane == 0 && first + r < n_out) y[(i64)b * y_stride + first + r] = v;
        }
    }
}

// gemm: the same product for many tokens (prefill): y[t][i] = dot(W[row(i)],
// x[t]). A block computes a tile of 64 outputs x 64 tokens, 4 x 4 per
// thread, walking the row in 32-weight items: 64 threads dequantise one item
// of each tile row into shared memory, all threads stage the tokens' 32
// activations, then every thread does 32 x 16 multiply-adds from shared
// memory. Tiles are k-major and padded to 65 floats, so both the staging
// writes and the reads of a k step fall in distinct banks.
#define GEMM_T 64
#define GEMM_LD 65

template <typename F, typename A>
__device__ __forceinline__ void gemm_impl(const u8* __restrict__ w, i64 row_bytes, int cols,
                                          const typename A::T* __restrict__ x, int x_stride, int n_tok,
                                          const int* __restrict__ rows, int n_out,
                                          float* __restrict__ y, int y_stride) {
    __shared__ float ws[32 * GEMM_LD];
    __shared__ float xs[32 * GEMM_LD];
    const int tid = threadIdx.x;
    const int r_base = blockIdx.x * GEMM_T, t_base = blockIdx.y * GEMM_T;
    const int tr = (tid & 15) * 4, tt = (tid >> 4) * 4;
    // The tile row this thread dequantises (threads 0..63).
    const int my_row = r_base + tid;
    const bool loads_row = tid < GEMM_T && my_row < n_out;
    const u8* row_ptr = w;
    float rs = 0.0f;
    if (loads_row) {
        const i64 ri = rows ? (i64)rows[my_row] : (i64)my_row;
        row_ptr = w + ri * row_bytes;
        rs = F::row_scale(row_ptr, cols);
    }
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

    const int items = cols >> 5;
    for (int it = 0; it < items; ++it) {
        __syncthreads();
        if (tid < GEMM_T) {
            float wv[32];
            if (loads_row) {
                F::dequant(row_ptr + (i64)(it / F::ITEMS) * F::BLOCK_BYTES, it % F::ITEMS, rs, wv);
            } else {
#pragma unroll
                for (int k = 0; k < 32; ++k) wv[k] = 0.0f;
            }
#pragma unroll
            for (int k = 0; k < 32; ++k) ws[k * GEMM_LD + tid] = wv[k];
        }
        // 64 tokens x 32 activations: element e = tid + 256 m is token
        // e / 32, activation e % 32 (a warp reads one token's 32).
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            const int e = tid + 256 * m, t = e >> 5, k = e & 31;
            const int tok = t_base + t;
            xs[k * GEMM_LD + t] = tok < n_tok ? A::get(x + (i64)tok * x_stride + 32 * it, k) : 0.0f;
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < 32; ++k) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                a[i] = ws[k * GEMM_LD + tr + i];
                b[i] = xs[k * GEMM_LD + tt + i];
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = r_base + tr + i;
        if (r >= n_out) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int tok = t_base + tt + j;
            if (tok < n_tok) y[(i64)tok * y_stride + r] = acc[i][j];
        }
    }
}

#define AXPY_WARPS 8
#define AXPY_LD 33

template <typename F, int B>
__device__ __forceinline__ void axpy_rows_impl(const u8* __restrict__ w, i64 row_bytes, int cols,
                                               const float* __restrict__ a, int a_stride,
                                               const int* __restrict__ rows, int n_rows,
                                               float* __restrict__ part) {
    // The warps' sums of the block's 32 items (1024 outputs), one token at a
    // time; rows padded to 33 floats so that both the writes (a lane's 32
    // values) and the reads (consecutive outputs) fall in distinct banks.
    __shared__ float red[AXPY_WARPS * 32 * AXPY_LD];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int items = cols >> 5;
    const int it = blockIdx.x * 32 + lane;
    const int per = (n_rows + gridDim.y - 1) / gridDim.y;
    const int k0 = blockIdx.y * per, k1 = min(n_rows, k0 + per);
    float acc[B][32];
#pragma unroll
    for (int b = 0; b < B; ++b)
#pragma unroll
        for (int k = 0; k < 32; ++k) acc[b][k] = 0.0f;
    if (it < items) {
        const int blk = it / F::ITEMS, sub = it % F::ITEMS;
        // Warp g takes the split's neurons g, g + 8, ...
#pragma unroll 2
        for (int k = k0 + warp; k < k1; k += AXPY_WARPS) {
            const u8* row = w + (i64)rows[k] * row_bytes;
            float wv[32];
            F::dequant(row + (i64)blk * F::BLOCK_BYTES, sub, F::row_scale(row, cols), wv);
#pragma unroll
            for (int b = 0; b < B; ++b) {
                const float ab = a[(i64)b * a_stride + k];
#pragma unroll
                for (int j = 0; j < 32; ++j) acc[b][j] = fmaf(ab, wv[j], acc[b][j]);
            }
        }
    }
    const int outs = 32 * min(32, items - (int)blockIdx.x * 32);
#pragma unroll
    for (int b = 0; b < B; ++b) {
        __syncthreads();
#pragma unroll
        for (int j = 0; j < 32; ++j) red[(warp * 32 + lane) * AXPY_LD + j] = acc[b][j];
        __syncthreads();
        float* out = part + ((i64)blockIdx.y * B + b) * cols + (i64)blockIdx.x * 1024;
        for (int o = threadIdx.x; o < outs; o += 32 * AXPY_WARPS) {
            float sum = 0.0f;
#pragma unroll
            for (int g = 0; g < AXPY_WARPS; ++g) sum += red[(g * 32 + (o >> 5)) * AXPY_LD + (o & 31)];
            out[o] = sum;
        }
    }
}

// out[t][..] = s * W[ids[t]][..] for t < n (embedding lookup): one thread
// per 32-weight item.
template <typename F>
__device__ __forceinline__ void rows_impl(const u8* __restrict__ w, i64 row_bytes, int cols,
                                          const int* __restrict__ ids, int n, float s,
                                          float* __restrict__ out) {
    const int items = cols >> 5;
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)n * items) return;
    const int t = (int)(idx / items), it = (int)(idx % items);
    const u8* row = w + (i64)ids[t] * row_bytes;
    float wv[32];
    F::dequant(row + (i64)(it / F::ITEMS) * F::BLOCK_BYTES, it % F::ITEMS, F::row_scale(row, cols), wv);
    float* o = out + (i64)t * cols + 32 * it;
#pragma unroll
    for (int k = 0; k < 32; ++k) o[k] = wv[k] * s;
}

// y[i] = sum over s < splits of part[s][i], i < n (n = B * cols).
extern "C" __global__ void sum_splits(const float* __restrict__ part, int splits, int n,
                                      float* __restrict__ y) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float s = 0.0f;
    for (int k = 0; k < splits; ++k) s += part[(i64)k * n + i];
    y[i] = s;
}

#define GEMV(FN, F, A, B)                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                              \
        gemv_##FN##_##A##_b##B(const u8* w, i64 row_bytes, int cols, const A::T* x,             \
                               int x_stride, const int* rows, int n_out, float* y,             \
                               int y_stride) {                                                 \
        gemv_impl<F, A, B>(w, row_bytes, cols, x, x_stride, rows, n_out, y, y_stride,            \
                           Prologue{PRO_NONE, 0, 0, 0.0f, 0, 0});                                \
    }

#define GEMV_FUSED(FN, F, B)                                                                    \
    extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                              \
        gemv_fused_##FN##_b##B(const u8* w, i64 row_bytes, int cols, const float* x,            \
                               int x_stride, const int* rows, int n_out, float* y,             \
                               int y_stride, int mode, const float* aux, const float* nw,      \
                               float eps, float* x_out, const float* pw) {                      \
        gemv_impl<F, ActF32, B>(w, row_bytes, cols, x, x_stride, rows, n_out, y, y_stride,        \
                                Prologue{mode, aux, nw, eps, x_out, pw});                        \
    }

#define GEMM(FN, F, A)                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                           \
        gemm_##FN##_##A(const u8* w, i64 row_bytes, int cols, const A::T* x, int x_stride,       \
                        int n_tok, const int* rows, int n_out, float* y, int y_stride) {          \
        gemm_impl<F, A>(w, row_bytes, cols, x, x_stride, n_tok, rows, n_out, y, y_stride);         \
    }
#define GEMM_ACTS(FN, F) GEMM(FN, F, ActF32) GEMM(FN, F, ActF16) GEMM(FN, F, ActBF16)

#define GEMV_ACTS(FN, F, B) GEMV(FN, F, ActF32, B) GEMV(FN, F, ActF16, B) GEMV(FN, F, ActBF16, B)
#define GEMV_BATCHES(FN, F) \
    GEMV_ACTS(FN, F, 1) GEMV_ACTS(FN, F, 2) GEMV_ACTS(FN, F, 4) GEMV_ACTS(FN, F, 8) \
    GEMV_FUSED(FN, F, 1) GEMV_FUSED(FN, F, 2) GEMV_FUSED(FN, F, 4) GEMV_FUSED(FN, F, 8)

#define AXPY(FN, F, B)                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * AXPY_WARPS)                              \
        axpy_rows_##FN##_b##B(const u8* w, i64 row_bytes, int cols, const float* a,              \
                              int a_stride, const int* rows, int n_rows, float* part) {          \
        axpy_rows_impl<F, B>(w, row_bytes, cols, a, a_stride, rows, n_rows, part);               \
    }
#define AXPY_BATCHES(FN, F) AXPY(FN, F, 1) AXPY(FN, F, 2) AXPY(FN, F, 4)

#define ROWS(FN, F)                                                                             \
    extern "C" __global__ void dequant_rows_##FN(const u8* w, i64 row_bytes, int cols,           \
                                                 const int* ids, int n, float s, float* out) {    \
        rows_impl<F>(w, row_bytes, cols, ids, n, s, out);                                         \
    }

#define FORMAT(FN, F) GEMV_BATCHES(FN, F) GEMM_ACTS(FN, F) AXPY_BATCHES(FN, F) ROWS(FN, F)

// The Rust side appends one `FORMAT(name, FmtStruct)` line per compiled
// module (src/format.rs, kernel_source): one module per weight format.
