//! The transformer steps (ops.cu) against f64 references written out here
//! on random inputs: RMSNorm (rows and in place), RoPE (both pairings),
//! causal attention with GQA and a window, SwiGLU, GeGLU, the residual add
//! and the embedding lookup. Skipped, saying why, without a device.

use std::sync::OnceLock;

use spinfer_kernels::GgmlType;
use spinfer_kernels::dequant::dequantize_row;
use spinfer_kernels_cuda::{AttentionShape, CudaBackend, RopePairs, WeightFormat, synthetic_acts, synthetic_matrix};

fn backend() -> Option<&'static CudaBackend> {
    static B: OnceLock<Result<CudaBackend, String>> = OnceLock::new();
    match B.get_or_init(|| CudaBackend::new().map_err(|e| e.to_string())) {
        Ok(b) => Some(b),
        Err(why) => {
            assert!(std::env::var("SPINFER_EXPECT_GPU").as_deref() != Ok("1"), "SPINFER_EXPECT_GPU=1 but: {why}");
            eprintln!("skipped: {why}");
            None
        }
    }
}

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

#[test]
fn rope_rotates_both_pairings() {
    let Some(be) = backend() else { return };
    let (tokens, heads, hd, pos0, theta) = (3, 4, 64, 37, 10000.0f32);
    let stride = heads * hd + 8; // rows with a gap, as k inside a wider row
    let x = synthetic_acts(tokens * stride, 3);
    for pairs in [RopePairs::Adjacent, RopePairs::Halves] {
        let mut want: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
        for t in 0..tokens {
            for h in 0..heads {
                let base = t * stride + h * hd;
                for i in 0..hd / 2 {
                    let inv = 1.0 / theta.powf((2 * i) as f32 / hd as f32);
                    let a = (pos0 + t) as f64 * f64::from(inv);
                    let (j0, j1) = if pairs == RopePairs::Halves { (i, i + hd / 2) } else { (2 * i, 2 * i + 1) };
                    let (x0, x1) = (want[base + j0], want[base + j1]);
                    want[base + j0] = x0 * a.cos() - x1 * a.sin();
                    want[base + j1] = x0 * a.sin() + x1 * a.cos();
                }
            }
        }
        let mut dx = be.upload(&x).unwrap();
        be.rope(dx.all_mut(), tokens, heads, hd, stride, pos0, theta, pairs).unwrap();
        assert_close(&format!("rope {pairs:?}"), &be.download(&dx).unwrap(), &want, 1e-5);
    }
}

#[test]
fn attention_is_causal_grouped_and_windowed() {
    let Some(be) = backend() else { return };
    let (heads, kv_heads, hd) = (6, 2, 64);
    let (pos0, tokens) = (29, 4);
    let (q_dim, kv_dim, end) = (heads * hd, kv_heads * hd, pos0 + tokens);
    let q = synthetic_acts(tokens * q_dim, 4);
    let k = synthetic_acts(end * kv_dim, 5);
    let v = synthetic_acts(end * kv_dim, 6);
    let scale = 1.0 / (hd as f32).sqrt();
    for window in [0, 7] {
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
        let (dq, dk, dv) = (be.upload(&q).unwrap(), be.upload(&k).unwrap(), be.upload(&v).unwrap());
        let mut out = be.upload(&vec![f32::NAN; tokens * q_dim]).unwrap();
        let shape = AttentionShape { tokens, heads, kv_heads, head_dim: hd, pos0, window, scale };
        be.attention(dq.all(), dk.all(), dv.all(), shape, out.all_mut()).unwrap();
        assert_close(&format!("attention window {window}"), &be.download(&out).unwrap(), &want, 1e-5);
    }
}

#[test]
fn gated_activations_and_add() {
    let Some(be) = backend() else { return };
    let n = 3000;
    let (g, u) = (synthetic_acts(n, 7), synthetic_acts(n, 8));
    let gd: Vec<f64> = g.iter().map(|&x| f64::from(x) * 4.0).collect();
    let g4: Vec<f32> = g.iter().map(|&x| x * 4.0).collect();
    let silu: Vec<f64> = gd.iter().zip(&u).map(|(&x, &y)| x / (1.0 + (-x).exp()) * f64::from(y)).collect();
    let gelu: Vec<f64> = gd
        .iter()
        .zip(&u)
        .map(|(&x, &y)| 0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh()) * f64::from(y))
        .collect();
    let du = be.upload(&u).unwrap();
    let mut dg = be.upload(&g4).unwrap();
    be.swiglu(dg.all_mut(), du.all()).unwrap();
    assert_close("swiglu", &be.download(&dg).unwrap(), &silu, 1e-5);
    let mut dg = be.upload(&g4).unwrap();
    be.geglu(dg.all_mut(), du.all()).unwrap();
    assert_close("geglu", &be.download(&dg).unwrap(), &gelu, 1e-5);
    let mut dx = be.upload(&g).unwrap();
    be.add(dx.all_mut(), du.all()).unwrap();
    let sum: Vec<f64> = g.iter().zip(&u).map(|(&a, &b)| f64::from(a) + f64::from(b)).collect();
    assert_close("add", &be.download(&dx).unwrap(), &sum, 1e-6);
}

#[test]
fn embedding_rows_are_dequantised_and_scaled() {
    let Some(be) = backend() else { return };
    for (f, ty) in [(WeightFormat::Q8_0, GgmlType::Q8_0), (WeightFormat::Q4_K, GgmlType::Q4_K), (WeightFormat::Q6_K, GgmlType::Q6_K)] {
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
        be.embed_rows(&m, &di, 1.5, out.all_mut()).unwrap();
        assert_close(&format!("embed {f}"), &be.download(&out).unwrap(), &want, 1e-6);
        assert!(be.upload_rows(&[50], rows).is_err());
    }
}
