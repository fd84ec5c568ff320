// GGUF block formats, read 32 weights ("an item") at a time.
//
// Every format exposes:
//   BLOCK_BYTES  bytes per block;
//   ITEMS        32-weight items per block (1 for 32-weight blocks, 8 for
//                256-weight super-blocks, 4 for I2_S's 128-weight groups);
//   dequant(blk, sub, rs, w)  item `sub` of the block at `blk`, times the
//                row scale `rs`, into w[0..32] in element order;
//   row_scale(row, cols)      a per-row scale (I2_S) or 1.
// Layouts follow ggml's dequantize_row_* (ggml-quants.c); the Rust scalar
// references in spinfer-kernels are what the tests compare against.

struct FmtQ4_0 {  // {f16 d; u8 qs[16]}: x = d * (q - 8)
    static const int BLOCK_BYTES = 18, ITEMS = 1;
    static __device__ __forceinline__ float row_scale(const u8*, int) { return 1.0f; }
    static __device__ __forceinline__ void dequant(const u8* b, int, float, float* w) {
        const float d = h2f(ld16(b));
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u16 v = ld16(b + 2 + 2 * j);
            const u8 q0 = v & 0xff, q1 = v >> 8;
            w[2 * j] = d * (float)((q0 & 15) - 8);
            w[2 * j + 1] = d * (float)((q1 & 15) - 8);
            w[2 * j + 16] = d * (float)((q0 >> 4) - 8);
            w[2 * j + 17] = d * (float)((q1 >> 4) - 8);
        }
    }
};

struct FmtQ4_1 {  // {f16 d; f16 m; u8 qs[16]}: x = d * q + m
    static const int BLOCK_BYTES = 20, ITEMS = 1;
    static __device__ __forceinline__ float row_scale(const u8*, int) { return 1.0f; }
    static __device__ __forceinline__ void dequant(const u8* b, int, float, float* w) {
        const float d = h2f(ld16(b)), m = h2f(ld16(b + 2));
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 v = *(const u32*)(b + 4 + 4 * j);  // rows are 20*k bytes: 4-aligned
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const u32 q = (v >> (8 * k)) & 0xff;
                w[4 * j + k] = d * (float)(q & 15) + m;
                w[4 * j + k + 16] = d * (float)(q >> 4) + m;
            }
        }
    }
};

struct FmtQ5_0 {  // {f16 d; u8 qh[4]; u8 qs[16]}: x = d * ((q | h << 4) - 16)
    static const int BLOCK_BYTES = 22, ITEMS = 1;
    static __device__ __forceinline__ float row_scale(const u8*, int) { return 1.0f; }
    static __device__ __forceinline__ void dequant(const u8* b, int, float, float* w) {
        const float d = h2f(ld16(b));
        const u32 qh = ld32_a2(b + 2);  // 22*k + 2: 2-aligned
#pragma unroll
        for (int j = 0; j < 16; j += 2) {
            const u16 v = ld16(b + 6 + j);
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                const u32 q = (v >> (8 * k)) & 0xff, jj = j + k;
                const u32 h0 = ((qh >> jj) << 4) & 0x10, h1 = (qh >> (jj + 12)) & 0x10;
                w[jj] = d * (float)((int)((q & 15) | h0) - 16);
                w[jj + 16] = d * (float)((int)((q >> 4) | h1) - 16);
            }
        }
    }
};

struct FmtQ5_1 {  // {f16 d; f16 m; u8 qh[4]; u8 qs[16]}: x = d * (q | h << 4) + m
    static const int BLOCK_BYTES = 24, ITEMS = 1;
    static __device__ __forceinline__ float row_scale(const u8*, int) { return 1.0f; }
    static __device__ __forceinline__ void dequant(const u8* b, int, float, float* w) {
        const float d = h2f(ld16(b)), m = h2f(ld16(b + 2));
        const u32 qh = *(const u32*)(b + 4);  // rows are 24*k bytes: 4-aligned
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 v = *(const u32*)(b + 8 + 4 * j);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const u32 q = (v >> (8 * k)) & 0xff, jj = 4 * j + k;
                const u32 h0 = ((qh >> jj) << 4) & 0x10, h1 = (qh >> (jj + 12)) & 0x10;
                w[jj] = d * (float)((q & 15) | h0) + m;
                w[jj + 16] = d * (float)((q >> 4) | h1) + m;
            }
        }
    }
};

struct FmtQ8_0 {  // {f16 d; i8 qs[32]}: x = d * q
    static const int BLOCK_BYTES = 34, ITEMS = 1;
    static __device__ __forceinline__ float row_scale(const u8*, int) { return 1.0f; }
    static __device__ __forceinline__ void dequant(const u8* b, int, float, float* w) {
        const float d = h2f(ld16(b));
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const u16 v = ld16(b + 2 + 2 * j);
            w[2 * j] = d * (float)(i8)(v & 0xff);
            w[2 * j + 1] = d * (float)(i8)(v >> 8);
        }
    }
};

// The 6-bit scale and min of sub-block j of a Q4_K/Q5_K super-block
// (ggml's get_scale_min_k4); `q` is the 12 scale bytes.
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, float* sc, float* mn) {
    if (j < 4) {
        *sc = (float)(q[j] & 63);
        *mn = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *mn = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

struct FmtQ4_K {  // {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}
    static const int BLOCK_BYTES = 144, ITEMS = 8;
    static __device__ __forceinline__ float row_scale(const u8*, int) { return 1.0f; }
    static __device__ __forceinline__ void dequant(const u8* b, int s, float, float* w) {
        float sc, mn;
        scale_min_k4(s, b + 4, &sc, &mn);
        const float d = h2f(ld16(b)) * sc, m = h2f(ld16(b + 2)) * mn;
        // Items 2p and 2p+1 share the 32 bytes at qs + 32p: low, then high nibbles.
        const uint4* q = (const uint4*)(b + 16 + 32 * (s >> 1));  // 144*k + 16 + 32p: 16-aligned
        const int shift = 4 * (s & 1);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint4 v = q[h];
            const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int k = 0; k < 16; ++k) {
                const u32 byte = (words[k >> 2] >> (8 * (k & 3))) & 0xff;
                w[16 * h + k] = d * (float)((byte >> shift) & 15) - m;
            }
        }
    }
};

struct FmtQ5_K {  // {f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}
    static const int BLOCK_BYTES = 176, ITEMS = 8;
    static __device__ __forceinline__ float row_scale(const u8*, int) { return 1.0f; }
    static __device__ __forceinline__ void dequant(const u8* b, int s, float, float* w) {
        float sc, mn;
        scale_min_k4(s, b + 4, &sc, &mn);
        const float d = h2f(ld16(b)) * sc, m = h2f(ld16(b + 2)) * mn;
        const uint4* qh = (const uint4*)(b + 16);            // 176*k + 16: 16-aligned
        const uint4* ql = (const uint4*)(b + 48 + 32 * (s >> 1));
        const int shift = 4 * (s & 1);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint4 vl = ql[h], vh = qh[h];
            const u32 lw[4] = {vl.x, vl.y, vl.z, vl.w};
            const u32 hw[4] = {vh.x, vh.y, vh.z, vh.w};
#pragma unroll
            for (int k = 0; k < 16; ++k) {
                const u32 lo = (lw[k >> 2] >> (8 * (k & 3))) & 0xff;
                const u32 hi = (hw[k >> 2] >> (8 * (k & 3))) & 0xff;
                const u32 q = ((lo >> shift) & 15) | (((hi >> s) & 1) << 4);
                w[16 * h + k] = d * (float)q - m;
            }
        }
    }
};

struct FmtQ6_K {  // {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}
    static const int BLOCK_BYTES = 210, ITEMS = 8;
    static __device__ __forceinline__ float row_scale(const u8*, int) { return 1.0f; }
    static __device__ __forceinline__ void dequant(const u8* b, int s, float, float* w) {
        // Item s = 4n + t holds elements 128n + 32t + l: low nibbles of
        // ql[64n + l] (t = 0) or ql[64n + 32 + l] (t = 1), high nibbles of
        // the same (t = 2, 3); bits 2t of qh[32n + l]; scale 8n + 2t + l/16.
        const int n = s >> 2, t = s & 3;
        const float d = h2f(ld16(b + 208));
        const u8* ql = b + 64 * n + 32 * (t & 1);
        const u8* qh = b + 128 + 32 * n;
        const i8* sc = (const i8*)(b + 192 + 8 * n + 2 * t);
        const float d0 = d * (float)sc[0], d1 = d * (float)sc[1];
        const int lshift = 4 * (t >> 1), hshift = 2 * t;
#pragma unroll
        for (int l = 0; l < 32; l += 2) {
            const u16 lv = ld16(ql + l), hv = ld16(qh + l);  // 210*k + even offsets: 2-aligned
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                const int lo = ((lv >> (8 * k)) >> lshift) & 15;
                const int hi = ((hv >> (8 * k)) >> hshift) & 3;
                w[l + k] = (l < 16 ? d0 : d1) * (float)((lo | (hi << 4)) - 32);
            }
        }
    }
};

// Base-3 digit n of a TQ1_0 byte (ggml: q * 3^n mod 256, then (q * 3) >> 8).
__device__ __forceinline__ float trit(u32 q, u32 pow3) {
    const u32 v = (q * pow3) & 0xff;
    return (float)((int)((v * 3) >> 8) - 1);
}

struct FmtTQ1_0 {  // {u8 qs[48]; u8 qh[4]; f16 d}
    static const int BLOCK_BYTES = 54, ITEMS = 8;
    static __device__ __forceinline__ float row_scale(const u8*, int) { return 1.0f; }
    static __device__ __forceinline__ void dequant(const u8* b, int s, float, float* w) {
        const float d = h2f(ld16(b + 52));
        const u32 pow3[5] = {1, 3, 9, 27, 81};
        if (s < 5) {  // elements 0..160: digit s of qs[0..32]
#pragma unroll
            for (int m = 0; m < 32; m += 2) {
                const u16 v = ld16(b + m);
                w[m] = d * trit(v & 0xff, pow3[s]);
                w[m + 1] = d * trit(v >> 8, pow3[s]);
            }
        } else {
            // elements 160..240: digit e/16 of qs[32 + e%16] (e from 160);
            // elements 240..256: digit e/4 of qh[e%4] (e from 240).
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                const int e = 32 * s + i;
                if (e < 240) {
                    const int r = e - 160;
                    w[i] = d * trit(b[32 + (r & 15)], pow3[r >> 4]);
                } else {
                    const int r = e - 240;
                    w[i] = d * trit(b[48 + (r & 3)], pow3[r >> 2]);
                }
            }
        }
    }
};

struct FmtTQ2_0 {  // {u8 qs[64]; f16 d}: element 128g + 32l + m is bits 2l of qs[32g + m]
    static const int BLOCK_BYTES = 66, ITEMS = 8;
    static __device__ __forceinline__ float row_scale(const u8*, int) { return 1.0f; }
    static __device__ __forceinline__ void dequant(const u8* b, int s, float, float* w) {
        const float d = h2f(ld16(b + 64));
        const u8* q = b + 32 * (s >> 2);
        const int shift = 2 * (s & 3);
#pragma unroll
        for (int m = 0; m < 32; m += 2) {
            const u16 v = ld16(q + m);
            w[m] = d * (float)((int)((v >> shift) & 3) - 1);
            w[m + 1] = d * (float)((int)((v >> (8 + shift)) & 3) - 1);
        }
    }
};

// spinfer's I2_S (see spinfer-kernels dot/ternary.rs): a row is cols/4 code
// bytes then an f32 scale; byte j of 32-byte group g holds element
// 128g + 32l + j in bits 6 - 2l; weight = (code - 1) * scale.
struct FmtI2_S {
    static const int BLOCK_BYTES = 32, ITEMS = 4;
    static __device__ __forceinline__ float row_scale(const u8* row, int cols) {
        return __uint_as_float(*(const u32*)(row + cols / 4));  // rows are cols/4 + 4 bytes: 4-aligned
    }
    static __device__ __forceinline__ void dequant(const u8* b, int s, float rs, float* w) {
        const int shift = 6 - 2 * s;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 v = *(const u32*)(b + 4 * j);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                w[4 * j + k] = rs * (float)((int)((v >> (8 * k + shift)) & 3) - 1);
            }
        }
    }
};
