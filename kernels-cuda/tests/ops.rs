//! The transformer steps (ops.cu) against f64 references written out here
//! on random inputs: RMSNorm (rows and in place), RoPE (both pairings),
//! causal attention with GQA and a window, SwiGLU, GeGLU, the residual add
//! and the embedding lookup. Skipped, saying why, without a device.

mod support;

use spinfer_kernels::GgmlType;
use spinfer_kernels::dequant::dequantize_row;
use spinfer_kernels_cuda::{
    ARGMAX_SCRATCH, AttentionShape, KvCache, Position, QkNorm, QkvRows, RopePairs, RopeShape, WeightFormat,
    synthetic_acts, synthetic_matrix,
};
use support::backend;

fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite() && (f64::from(g) - w).abs() <= tol * (1.0 + w.abs()), "{what}[{i}]: {g} vs {w}");
    }
}

#[test]
fn rms_norm_rows_and_in_place() {
    let Some(be) = backend() else { return };
    let (rows, dim) = (5, 576);
    let x = synthetic_acts(rows * dim, 1);
    let w = synthetic_acts(dim, 2);
    let mut want = Vec::new();
    for r in x.chunks_exact(dim) {
        let ms: f64 = r.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / dim as f64;
        let s = 1.0 / (ms + 1e-5).sqrt();
        want.extend(r.iter().zip(&w).map(|(&v, &g)| f64::from(v) * s * f64::from(g)));
    }
    let (dx, dw) = (be.upload(&x).unwrap(), be.upload(&w).unwrap());
    let mut out = be.upload(&vec![f32::NAN; rows * dim]).unwrap();
    be.rms_norm(dx.all(), dw.all(), 1e-5, out.all_mut()).unwrap();
    assert_close("rms_norm", &be.download(&out).unwrap(), &want, 1e-5);
    let mut inplace = be.upload(&x).unwrap();
    be.rms_norm_in_place(inplace.all_mut(), dw.all(), 1e-5).unwrap();
    assert_close("rms_norm in place", &be.download(&inplace).unwrap(), &want, 1e-5);
}

/// RoPE of one head vector at position p, in f64.
fn rope_ref(x: &[f32], p: usize, theta: f32, pairs: RopePairs) -> Vec<f64> {
    let hd = x.len();
    let mut out: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    for i in 0..hd / 2 {
        let inv = 1.0 / theta.powf((2 * i) as f32 / hd as f32);
        let a = p as f64 * f64::from(inv);
        let (j0, j1) = if pairs == RopePairs::Halves { (i, i + hd / 2) } else { (2 * i, 2 * i + 1) };
        let (x0, x1) = (out[j0], out[j1]);
        out[j0] = x0 * a.cos() - x1 * a.sin();
        out[j1] = x0 * a.sin() + x1 * a.cos();
    }
    out
}

/// RMSNorm of one head vector with weights `w`, in f64 (Gemma's QK-norm).
fn norm_ref(x: &[f32], w: &[f32], eps: f64) -> Vec<f32> {
    let ms = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / x.len() as f64;
    let s = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(&v, &g)| (f64::from(v) * s * f64::from(g)) as f32).collect()
}

/// q rotated into q_out, k rotated into the cache rows of its positions,
/// v copied into the value cache, with the position given as a value and
/// read from the device, with and without the QK-norm, for head sizes of
/// one warp's pairs (64), more (256) and a part of one (80).
#[test]
fn rope_append_rotates_q_and_k_and_fills_the_cache() {
    let Some(be) = backend() else { return };
    for (tokens, heads, kv_heads, hd, pos0) in [(3, 4, 2, 64, 37), (2, 4, 1, 256, 5), (1, 2, 2, 80, 11)] {
        let theta = 10000.0f32;
        let (q_dim, kv_dim) = (heads * hd, kv_heads * hd);
        let w = q_dim + 2 * kv_dim;
        let qkv = synthetic_acts(tokens * w, 3);
        let (qn, kn) = (synthetic_acts(hd, 11), synthetic_acts(hd, 12));
        let (dqn, dkn) = (be.upload(&qn).unwrap(), be.upload(&kn).unwrap());
        let ctx = 48;
        for pairs in [RopePairs::Adjacent, RopePairs::Halves] {
            for (on_device, normed) in [(false, false), (true, false), (false, true), (true, true)] {
                let head = |x: &[f32], g: &[f32]| if normed { norm_ref(x, g, 1e-6) } else { x.to_vec() };
                let mut want_q = Vec::new();
                let mut want_k = vec![0f64; ctx * kv_dim];
                let mut want_v = vec![0f64; ctx * kv_dim];
                for t in 0..tokens {
                    let row = &qkv[t * w..(t + 1) * w];
                    for h in 0..heads {
                        want_q.extend(rope_ref(&head(&row[h * hd..(h + 1) * hd], &qn), pos0 + t, theta, pairs));
                    }
                    for h in 0..kv_heads {
                        let kh = head(&row[q_dim + h * hd..q_dim + (h + 1) * hd], &kn);
                        let k = rope_ref(&kh, pos0 + t, theta, pairs);
                        let at = (pos0 + t) * kv_dim + h * hd;
                        want_k[at..at + hd].copy_from_slice(&k);
                        for d in 0..hd {
                            want_v[at + d] = f64::from(row[q_dim + kv_dim + h * hd + d]);
                        }
                    }
                }
                let src_buf = be.upload(&qkv).unwrap();
                let (mut q_out, mut kc, mut vc) = (
                    be.alloc(tokens * q_dim).unwrap(),
                    be.alloc(ctx * kv_dim).unwrap(),
                    be.alloc(ctx * kv_dim).unwrap(),
                );
                let dpos = be.upload(&[pos0 as i32]).unwrap();
                let pos = if on_device {
                    Position::Device { buf: &dpos, bound: ctx - tokens }
                } else {
                    Position::Value(pos0)
                };
                let at = |off: usize, width: usize| src_buf.at(off, (tokens - 1) * w + width).unwrap();
                let src =
                    QkvRows { q: (at(0, q_dim), w), k: (at(q_dim, kv_dim), w), v: (at(q_dim + kv_dim, kv_dim), w) };
                let norms = normed.then(|| QkNorm { q: dqn.all(), k: dkn.all(), eps: 1e-6 });
                let shape = RopeShape { tokens, heads, kv_heads, head_dim: hd, pos, theta, pairs, norms };
                let cache = KvCache { keys: kc.all_mut(), values: vc.all_mut() };
                be.rope_append(src, shape, q_out.all_mut(), cache).unwrap();
                let what = format!("hd {hd} {pairs:?} device position {on_device} normed {normed}");
                assert_close(&format!("q {what}"), &be.download(&q_out).unwrap(), &want_q, 1e-5);
                assert_close(&format!("k {what}"), &be.download(&kc).unwrap(), &want_k, 1e-5);
                assert_close(&format!("v {what}"), &be.download(&vc).unwrap(), &want_v, 0.0);
            }
        }
        // Norm weights of another length are refused.
        let short = be.upload(&qn[..hd - 2]).unwrap();
        let src_buf = be.upload(&qkv).unwrap();
        let at = |off: usize, width: usize| src_buf.at(off, (tokens - 1) * w + width).unwrap();
        let src = QkvRows { q: (at(0, q_dim), w), k: (at(q_dim, kv_dim), w), v: (at(q_dim + kv_dim, kv_dim), w) };
        let norms = Some(QkNorm { q: short.all(), k: dkn.all(), eps: 1e-6 });
        let pos = Position::Value(pos0);
        let shape = RopeShape { tokens, heads, kv_heads, head_dim: hd, pos, theta, pairs: RopePairs::Halves, norms };
        let (mut q_out, mut kc, mut vc) =
            (be.alloc(tokens * q_dim).unwrap(), be.alloc(ctx * kv_dim).unwrap(), be.alloc(ctx * kv_dim).unwrap());
        let cache = KvCache { keys: kc.all_mut(), values: vc.all_mut() };
        assert!(be.rope_append(src, shape, q_out.all_mut(), cache).is_err());
    }
}

/// Causal attention in f64: `tokens` queries from position `pos0` over
/// caches of `pos0 + tokens` rows.
#[allow(clippy::too_many_arguments, reason = "the attention's shape, spelled out")]
fn attention_ref(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    (tokens, heads, kv_heads, hd): (usize, usize, usize, usize),
    pos0: usize,
    window: usize,
    scale: f32,
) -> Vec<f64> {
    let (q_dim, kv_dim) = (heads * hd, kv_heads * hd);
    let mut want = vec![0f64; tokens * q_dim];
    for t in 0..tokens {
        let p = pos0 + t;
        let first = if window > 0 { (p + 1).saturating_sub(window) } else { 0 };
        for h in 0..heads {
            let kvh = h / (heads / kv_heads);
            let qv = &q[(t * heads + h) * hd..(t * heads + h + 1) * hd];
            let scores: Vec<f64> = (first..=p)
                .map(|j| {
                    let kr = &k[j * kv_dim + kvh * hd..j * kv_dim + (kvh + 1) * hd];
                    qv.iter().zip(kr).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum::<f64>() * f64::from(scale)
                })
                .collect();
            let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for (jj, j) in (first..=p).enumerate() {
                for d in 0..hd {
                    want[(t * heads + h) * hd + d] += e[jj] / z * f64::from(v[j * kv_dim + kvh * hd + d]);
                }
            }
        }
    }
    want
}

/// Both attention kernels: the prompt kernel (12 tokens; a head_dim of 80)
/// and the decode kernel (up to 8 tokens) with one block per head and with
/// its positions split across blocks (scratch; 700 and 1000 positions),
/// causal, grouped and windowed, with the position as a value and read
/// from the device inside a captured graph, replayed twice (the split
/// counters must be back at 0 after each launch).
#[test]
fn attention_is_causal_grouped_and_windowed() {
    let Some(be) = backend() else { return };
    let cases = [
        // (heads, kv_heads, hd, pos0, tokens)
        (6, 2, 64, 29, 4),
        (6, 2, 64, 29, 12),
        (4, 2, 80, 40, 3),
        (4, 1, 256, 700, 1),
        (4, 1, 256, 700, 3),
        (9, 3, 64, 1000, 1),
        (8, 8, 128, 5, 8),
    ];
    for (heads, kv_heads, hd, pos0, tokens) in cases {
        let (q_dim, kv_dim, end) = (heads * hd, kv_heads * hd, pos0 + tokens);
        let q = synthetic_acts(tokens * q_dim, 4);
        // Larger keys than synthetic_acts' make the softmax peaked, so that
        // a wrong merge of the splits' maxima shows.
        let k: Vec<f32> = synthetic_acts(end * kv_dim, 5).iter().map(|x| x * 8.0).collect();
        let v = synthetic_acts(end * kv_dim, 6);
        let scale = 1.0 / (hd as f32).sqrt();
        let (dq, dk, dv) = (be.upload(&q).unwrap(), be.upload(&k).unwrap(), be.upload(&v).unwrap());
        let mut scratch = be.attention_scratch(tokens, heads, hd).unwrap();
        for window in [0, 7, 300] {
            let want = attention_ref(&q, &k, &v, (tokens, heads, kv_heads, hd), pos0, window, scale);
            let what =
                format!("attention {heads}/{kv_heads} heads of {hd}, {tokens} tokens at {pos0}, window {window}");
            for split in [false, true] {
                let mut out = be.upload(&vec![f32::NAN; tokens * q_dim]).unwrap();
                let pos = Position::Value(pos0);
                let shape = AttentionShape { tokens, heads, kv_heads, head_dim: hd, pos, window, scale };
                let sc = split.then_some(&mut scratch);
                be.attention(dq.all(), dk.all(), dv.all(), shape, sc, out.all_mut()).unwrap();
                assert_close(&format!("{what}, split {split}"), &be.download(&out).unwrap(), &want, 1e-5);
            }
            // The same, the position read from the device inside a captured
            // graph, replayed twice.
            let mut dpos = be.upload(&[0i32]).unwrap();
            let mut out2 = be.upload(&vec![f32::NAN; tokens * q_dim]).unwrap();
            let pos = Position::Device { buf: &dpos, bound: pos0 };
            let shape = AttentionShape { tokens, heads, kv_heads, head_dim: hd, pos, window, scale };
            be.begin_capture().unwrap();
            be.attention(dq.all(), dk.all(), dv.all(), shape, Some(&mut scratch), out2.all_mut()).unwrap();
            let graph = be.end_capture().unwrap();
            be.write(dpos.all_mut(), &[pos0 as i32]).unwrap();
            for replay in 0..2 {
                be.write(out2.all_mut(), &vec![f32::NAN; tokens * q_dim]).unwrap();
                be.launch_graph(&graph).unwrap();
                let got = be.download(&out2).unwrap();
                assert_close(&format!("graph {what}, replay {replay}"), &got, &want, 1e-5);
            }
            // An earlier position through the same graph.
            if pos0 > 20 {
                let earlier = pos0 - 20;
                let want = attention_ref(&q, &k, &v, (tokens, heads, kv_heads, hd), earlier, window, scale);
                be.write(dpos.all_mut(), &[earlier as i32]).unwrap();
                be.launch_graph(&graph).unwrap();
                assert_close(&format!("graph {what} at {earlier}"), &be.download(&out2).unwrap(), &want, 1e-5);
            }
        }
    }
}

#[test]
fn gated_activations_add_and_fused_norm() {
    let Some(be) = backend() else { return };
    let (tokens, f) = (3, 1000);
    // gate and up as the two halves of stacked rows of 2f.
    let gu = synthetic_acts(tokens * 2 * f, 7);
    let gu4: Vec<f32> = gu.iter().map(|&x| x * 4.0).collect();
    let (mut silu, mut gelu) = (Vec::new(), Vec::new());
    for t in 0..tokens {
        for j in 0..f {
            let (x, u) = (f64::from(gu4[t * 2 * f + j]), f64::from(gu4[t * 2 * f + f + j]));
            silu.push(x / (1.0 + (-x).exp()) * u);
            gelu.push(0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh()) * u);
        }
    }
    let d = be.upload(&gu4).unwrap();
    let gate = (d.at(0, (tokens - 1) * 2 * f + f).unwrap(), 2 * f);
    let up = (d.at(f, (tokens - 1) * 2 * f + f).unwrap(), 2 * f);
    let mut out = be.upload(&vec![f32::NAN; tokens * f]).unwrap();
    be.swiglu(gate, up, f, tokens, out.all_mut()).unwrap();
    assert_close("swiglu", &be.download(&out).unwrap(), &silu, 1e-5);
    be.geglu(gate, up, f, tokens, out.all_mut()).unwrap();
    assert_close("geglu", &be.download(&out).unwrap(), &gelu, 1e-5);

    let (dim, n) = (576, 4);
    let (x, y, w) = (synthetic_acts(n * dim, 8), synthetic_acts(n * dim, 9), synthetic_acts(dim, 10));
    let sum: Vec<f64> = x.iter().zip(&y).map(|(&a, &b)| f64::from(a) + f64::from(b)).collect();
    let mut normed = Vec::new();
    for r in sum.chunks_exact(dim) {
        let s = 1.0 / (r.iter().map(|v| v * v).sum::<f64>() / dim as f64 + 1e-6).sqrt();
        normed.extend(r.iter().zip(&w).map(|(&v, &g)| v * s * f64::from(g)));
    }
    let (mut dx, dy, dw) = (be.upload(&x).unwrap(), be.upload(&y).unwrap(), be.upload(&w).unwrap());
    let mut dout = be.upload(&vec![f32::NAN; n * dim]).unwrap();
    be.add_rms_norm(dx.all_mut(), dy.all(), dw.all(), 1e-6, dout.all_mut()).unwrap();
    assert_close("add_rms_norm sum", &be.download(&dx).unwrap(), &sum, 1e-6);
    assert_close("add_rms_norm norm", &be.download(&dout).unwrap(), &normed, 1e-5);
    let mut dx = be.upload(&x).unwrap();
    be.add(dx.all_mut(), dy.all()).unwrap();
    assert_close("add", &be.download(&dx).unwrap(), &sum, 1e-6);

    // Gemma's post-norm before the add: x += y / rms(y) * wp.
    let wp = synthetic_acts(dim, 13);
    let mut sum = Vec::new();
    for (xr, yr) in x.chunks_exact(dim).zip(y.chunks_exact(dim)) {
        let s = 1.0 / (yr.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / dim as f64 + 1e-6).sqrt();
        sum.extend(xr.iter().zip(yr).zip(&wp).map(|((&a, &b), &g)| f64::from(a) + f64::from(b) * s * f64::from(g)));
    }
    let mut normed = Vec::new();
    for r in sum.chunks_exact(dim) {
        let s = 1.0 / (r.iter().map(|v| v * v).sum::<f64>() / dim as f64 + 1e-6).sqrt();
        normed.extend(r.iter().zip(&w).map(|(&v, &g)| v * s * f64::from(g)));
    }
    let (mut dx, dwp) = (be.upload(&x).unwrap(), be.upload(&wp).unwrap());
    let mut dout = be.upload(&vec![f32::NAN; n * dim]).unwrap();
    be.post_add_rms_norm(dx.all_mut(), dy.all(), dwp.all(), dw.all(), 1e-6, dout.all_mut()).unwrap();
    assert_close("post_add_rms_norm sum", &be.download(&dx).unwrap(), &sum, 1e-5);
    assert_close("post_add_rms_norm norm", &be.download(&dout).unwrap(), &normed, 1e-5);
    assert!(
        be.post_add_rms_norm(dx.all_mut(), dy.all(), dwp.at(0, dim - 1).unwrap(), dw.all(), 1e-6, dout.all_mut())
            .is_err()
    );
}

#[test]
fn embedding_rows_are_dequantised_and_scaled() {
    let Some(be) = backend() else { return };
    for (f, ty) in [
        (WeightFormat::Q8_0, GgmlType::Q8_0),
        (WeightFormat::Q4_K, GgmlType::Q4_K),
        (WeightFormat::Q6_K, GgmlType::Q6_K),
    ] {
        let (rows, cols) = (50, 512);
        let bytes = synthetic_matrix(f, rows, cols, 9).unwrap();
        let rb = f.row_bytes(cols).unwrap();
        let ids = [3u32, 49, 0, 3];
        let mut want = Vec::new();
        for &id in &ids {
            let mut row = vec![0f32; cols];
            dequantize_row(ty, &bytes[id as usize * rb..(id as usize + 1) * rb], &mut row).unwrap();
            want.extend(row.iter().map(|&v| f64::from(v) * 1.5));
        }
        let m = be.upload_matrix(f, rows, cols, &bytes).unwrap();
        let di = be.upload_rows(&ids, rows).unwrap();
        let mut out = be.upload(&vec![f32::NAN; ids.len() * cols]).unwrap();
        be.embed_rows(&m, &di, ids.len(), 1.5, out.all_mut()).unwrap();
        assert_close(&format!("embed {f}"), &be.download(&out).unwrap(), &want, 1e-6);
        assert!(be.upload_rows(&[50], rows).is_err());
    }
}

/// The host sampler's greedy rule: the first index of the largest value,
/// NaN never winning, 0 when nothing is above -inf.
fn argmax_ref(x: &[f32]) -> i32 {
    let mut best = (0usize, f32::NEG_INFINITY);
    for (i, &v) in x.iter().enumerate() {
        if v > best.1 {
            best = (i, v);
        }
    }
    best.0 as i32
}

#[test]
fn argmax_picks_the_first_largest_and_skips_nan() {
    let Some(be) = backend() else { return };
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng >> 40) as f32 / (1u64 << 24) as f32 * 20.0 - 10.0
    };
    let mut cases: Vec<(String, Vec<f32>)> = Vec::new();
    // One block, several, and the most blocks with long chunks.
    for n in [1usize, 31, 1000, 1025, 49_152, 262_144, 1_000_003] {
        let x: Vec<f32> = (0..n).map(|_| next()).collect();
        cases.push((format!("random {n}"), x.clone()));
        // Ties: the largest value again at a later and an earlier index
        // (the earliest wins), across threads and warps.
        let mut tie = x.clone();
        let m = argmax_ref(&x) as usize;
        tie[n - 1] = tie[m];
        tie[n / 2] = tie[m];
        cases.push((format!("ties {n}"), tie));
        let mut nan = x.clone();
        nan[n / 3] = f32::NAN;
        nan[0] = f32::NAN;
        cases.push((format!("nan {n}"), nan));
    }
    cases.push(("all -inf".into(), vec![f32::NEG_INFINITY; 5000]));
    cases.push(("all nan".into(), vec![f32::NAN; 3000]));
    cases.push(("-inf then a value".into(), [vec![f32::NEG_INFINITY; 2047], vec![-1e30]].concat()));
    cases
        .push(("+inf twice".into(), [vec![0.0; 700], vec![f32::INFINITY], vec![1.0; 9], vec![f32::INFINITY]].concat()));
    let mut out = be.upload(&vec![-7i32; ARGMAX_SCRATCH]).unwrap();
    for (what, x) in &cases {
        let dx = be.upload(x).unwrap();
        be.argmax(dx.all(), out.all_mut()).unwrap();
        assert_eq!(be.download(&out).unwrap()[0], argmax_ref(x), "{what}");
    }
    let empty = be.alloc::<f32>(1).unwrap();
    assert!(be.argmax(empty.at(0, 0).unwrap(), out.all_mut()).is_err());
    assert!(be.argmax(empty.all(), out.at_mut(0, ARGMAX_SCRATCH - 1).unwrap()).is_err());
}
