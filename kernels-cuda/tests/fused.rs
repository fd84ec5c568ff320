//! The fused GEMVs (`gemv_fused`: the gated activation, or the residual add
//! and RMSNorm, inside the GEMV's staging) against the CPU reference in
//! f64, on random inputs, with outputs poisoned with NaN first: several
//! formats, a row shorter than a warp's items and one longer than a staging
//! chunk, token rows at a stride wider than the row, 1 to 8 tokens. Skipped,
//! saying why, without a device.

mod support;

use spinfer_kernels_cuda::{GluAct, Prologue, WeightFormat, synthetic_acts, synthetic_matrix};
use support::{backend, dequantize};

const FORMATS: [WeightFormat; 4] = [WeightFormat::Q4_0, WeightFormat::Q4_1, WeightFormat::Q8_0, WeightFormat::Q4_K];

/// `y[t][r] = W[r] · p[t]` in f64, and the sums of |w p|.
fn reference(w: &[f32], rows: usize, cols: usize, p: &[Vec<f64>]) -> (Vec<f64>, Vec<f64>) {
    let (mut want, mut mag) = (Vec::new(), Vec::new());
    for pt in p {
        for r in 0..rows {
            let wr = &w[r * cols..(r + 1) * cols];
            want.push(wr.iter().zip(pt).map(|(&a, &b)| f64::from(a) * b).sum());
            mag.push(wr.iter().zip(pt).map(|(&a, &b)| (f64::from(a) * b).abs()).sum());
        }
    }
    (want, mag)
}

/// Within f32 accumulation error (the staged activations add one rounding).
fn assert_close(what: &str, got: &[f32], want: &[f64], mag: &[f64]) {
    support::assert_close(what, got, want, mag, 3e-5);
}

#[test]
fn fused_gemv_matches_the_cpu_reference() {
    let Some(be) = backend() else { return };
    for format in FORMATS {
        let cols_list: [usize; 2] = if format.block_elems() == 32 { [128, 1312] } else { [256, 1536] };
        for cols in cols_list {
            let rows = 37;
            let bytes = synthetic_matrix(format, rows, cols, 3 + cols as u64).unwrap();
            let w = dequantize(format, &bytes, rows, cols);
            let m = be.upload_matrix(format, rows, cols, &bytes).unwrap();
            let stride = cols + 64;
            let nw: Vec<f32> = synthetic_acts(cols, 17).iter().map(|v| 1.0 + v).collect();
            let dnw = be.upload(&nw).unwrap();
            for tokens in [1, 3, 8] {
                let len = tokens * stride;
                let (x, aux) = (synthetic_acts(len, tokens as u64 + 1), synthetic_acts(len, tokens as u64 + 100));
                let (dx, daux) = (be.upload(&x).unwrap(), be.upload(&aux).unwrap());
                let what = format!("{format} {rows} x {cols}, {tokens} tokens at stride {stride}");
                for act in [GluAct::Silu, GluAct::GeluTanh] {
                    let p: Vec<Vec<f64>> = (0..tokens)
                        .map(|t| {
                            (0..cols)
                                .map(|i| {
                                    let (g, u) = (f64::from(x[t * stride + i]), f64::from(aux[t * stride + i]));
                                    let a = match act {
                                        GluAct::Silu => g / (1.0 + (-g).exp()),
                                        GluAct::GeluTanh => {
                                            0.5 * g * (1.0 + (0.797_884_6 * (g + 0.044_715 * g * g * g)).tanh())
                                        }
                                    };
                                    a * u
                                })
                                .collect()
                        })
                        .collect();
                    let mut y = be.upload(&vec![f32::NAN; tokens * rows]).unwrap();
                    let glu = Prologue::Glu { up: daux.at(0, len).unwrap(), act };
                    be.gemv_fused(&m, dx.at(0, len).unwrap(), stride, tokens, glu, y.all_mut()).unwrap();
                    let (want, mag) = reference(&w, rows, cols, &p);
                    assert_close(&format!("{act:?} {what}"), &be.download(&y).unwrap(), &want, &mag);
                }
                // Residual add and RMSNorm: the sum in f32 (as the device
                // adds), the rest in f64.
                let eps = 1e-5;
                let (mut p, mut sums) = (Vec::new(), vec![f32::NAN; len]);
                for t in 0..tokens {
                    let r: Vec<f32> = (0..cols).map(|i| x[t * stride + i] + aux[t * stride + i]).collect();
                    sums[t * stride..t * stride + cols].copy_from_slice(&r);
                    let ms = r.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / cols as f64;
                    let scale = 1.0 / (ms + eps).sqrt();
                    p.push(r.iter().zip(&nw).map(|(&v, &g)| f64::from(v) * scale * f64::from(g)).collect());
                }
                let mut y = be.upload(&vec![f32::NAN; tokens * rows]).unwrap();
                let mut out = be.upload(&vec![f32::NAN; len]).unwrap();
                let add_norm = Prologue::AddNorm {
                    delta: daux.at(0, len).unwrap(),
                    post: None,
                    weight: dnw.all(),
                    eps: eps as f32,
                    residual_out: out.at_mut(0, len).unwrap(),
                };
                be.gemv_fused(&m, dx.at(0, len).unwrap(), stride, tokens, add_norm, y.all_mut()).unwrap();
                let (want, mag) = reference(&w, rows, cols, &p);
                assert_close(&format!("add+norm {what}"), &be.download(&y).unwrap(), &want, &mag);
                // The new residual: exactly the f32 sums, the gaps between
                // rows untouched.
                let got = be.download(&out).unwrap();
                for (i, (g, s)) in got.iter().zip(&sums).enumerate() {
                    assert!(g.to_bits() == s.to_bits(), "add+norm {what}: residual {i} is {g}, want {s}");
                }
                // With a post-norm of delta first (Gemma): r = x + delta /
                // rms(delta) * pw, all in f64 here.
                let pw: Vec<f32> = synthetic_acts(cols, 19).iter().map(|v| 1.0 + v).collect();
                let dpw = be.upload(&pw).unwrap();
                let (mut p, mut sums) = (Vec::new(), vec![f64::NAN; len]);
                for t in 0..tokens {
                    let d = &aux[t * stride..t * stride + cols];
                    let ms = d.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / cols as f64;
                    let ps = 1.0 / (ms + eps).sqrt();
                    let r: Vec<f64> = (0..cols)
                        .map(|i| f64::from(x[t * stride + i]) + f64::from(d[i]) * ps * f64::from(pw[i]))
                        .collect();
                    sums[t * stride..t * stride + cols].copy_from_slice(&r);
                    let ms = r.iter().map(|v| v * v).sum::<f64>() / cols as f64;
                    let scale = 1.0 / (ms + eps).sqrt();
                    p.push(r.iter().zip(&nw).map(|(&v, &g)| v * scale * f64::from(g)).collect());
                }
                let mut out = be.upload(&vec![f32::NAN; len]).unwrap();
                let post_norm = Prologue::AddNorm {
                    delta: daux.at(0, len).unwrap(),
                    post: Some(dpw.all()),
                    weight: dnw.all(),
                    eps: eps as f32,
                    residual_out: out.at_mut(0, len).unwrap(),
                };
                be.gemv_fused(&m, dx.at(0, len).unwrap(), stride, tokens, post_norm, y.all_mut()).unwrap();
                let (want, mag) = reference(&w, rows, cols, &p);
                assert_close(&format!("post+add+norm {what}"), &be.download(&y).unwrap(), &want, &mag);
                let got = be.download(&out).unwrap();
                for (i, (&g, &s)) in got.iter().zip(&sums).enumerate() {
                    let ok = if s.is_nan() { g.is_nan() } else { (f64::from(g) - s).abs() <= 1e-5 * (1.0 + s.abs()) };
                    assert!(ok, "post+add+norm {what}: residual {i} is {g}, want {s}");
                }
            }
        }
    }
}

#[test]
fn fused_gemv_shapes_are_checked() {
    let Some(be) = backend() else { return };
    let f = WeightFormat::Q4_0;
    let m = be.upload_matrix(f, 8, 64, &synthetic_matrix(f, 8, 64, 1).unwrap()).unwrap();
    let x = be.upload(&synthetic_acts(9 * 64, 2)).unwrap();
    let mut y = be.alloc::<f32>(9 * 8).unwrap();
    let glu = |n| Prologue::Glu { up: x.at(0, n).unwrap(), act: GluAct::Silu };
    let err = |r: spinfer_kernels_cuda::Result<()>| r.expect_err("an error").to_string();
    assert!(err(be.gemv_fused(&m, x.all(), 64, 9, glu(9 * 64), y.all_mut())).contains("9 tokens"));
    assert!(err(be.gemv_fused(&m, x.all(), 32, 1, glu(64), y.all_mut())).contains("stride of 32"));
    assert!(err(be.gemv_fused(&m, x.all(), 64, 2, glu(100), y.all_mut())).contains("up holds 100"));
    let nw = be.alloc::<f32>(63).unwrap();
    let mut out = be.alloc::<f32>(64).unwrap();
    let bad = Prologue::AddNorm {
        delta: x.at(0, 64).unwrap(),
        post: None,
        weight: nw.all(),
        eps: 1e-5,
        residual_out: out.all_mut(),
    };
    assert!(err(be.gemv_fused(&m, x.at(0, 64).unwrap(), 64, 1, bad, y.all_mut())).contains("norm weight of 63"));
    be.synchronize().unwrap();
}
