//! Every CUDA kernel against the CPU scalar reference (spinfer-kernels'
//! dequantisation, summed in f64) on random inputs: every format, every
//! activation type, token counts that split into several launches, dense and
//! gathered rows, and the gathered-row AXPY. Outputs are poisoned with NaN
//! first, so an unwritten element fails.
//!
//! Without a device every test prints why it was skipped (and fails when
//! `SPINFER_EXPECT_GPU=1` says this machine has one).

mod support;

use spinfer_kernels_cuda::{ActType, WeightFormat, synthetic_acts, synthetic_matrix};
use support::{backend, dequantize};

/// Within f32 accumulation error of the f64 sums.
fn assert_close(what: &str, got: &[f32], want: &[f64], mag: &[f64]) {
    support::assert_close(what, got, want, mag, 2e-5);
}

/// Dot products of `rows` (indices into `w`) with each token of `x`,
/// in f64, and the matching sums of |w x|.
fn reference_gemv(w: &[f32], cols: usize, x: &[f32], rows: &[usize]) -> (Vec<f64>, Vec<f64>) {
    let (mut want, mut mag) = (Vec::new(), Vec::new());
    for xt in x.chunks_exact(cols) {
        for &r in rows {
            let wr = &w[r * cols..(r + 1) * cols];
            want.push(wr.iter().zip(xt).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum());
            mag.push(wr.iter().zip(xt).map(|(&a, &b)| (f64::from(a) * f64::from(b)).abs()).sum());
        }
    }
    (want, mag)
}

fn cols_for(format: WeightFormat) -> [usize; 2] {
    // A short row (fewer items than lanes) and a long one (lanes stride).
    if format.block_elems() == 32 { [128, 1312] } else { [256, 1536] }
}

#[test]
fn dense_and_gathered_gemv_match_the_cpu_reference() {
    let Some(be) = backend() else { return };
    eprintln!("device: {}", be.device());
    for format in WeightFormat::ALL {
        for cols in cols_for(format) {
            let rows = 45;
            let bytes = synthetic_matrix(format, rows, cols, 7 + cols as u64).unwrap();
            let w = dequantize(format, &bytes, rows, cols);
            let dm = be.upload_matrix(format, rows, cols, &bytes).unwrap();
            // Gathered rows: out of order, with a repeat.
            let picked: Vec<usize> = vec![44, 3, 17, 3, 0, 29, 30, 8, 41];
            let idx: Vec<u32> = picked.iter().map(|&r| r as u32).collect();
            let drows = be.upload_rows(&idx, rows).unwrap();
            for act in ActType::ALL {
                // 11 and 70 tokens take the tiled kernel (70: two token tiles).
                for tokens in [1, 3, 8, 11, 70] {
                    let x = synthetic_acts(tokens * cols, tokens as u64 * 31 + cols as u64);
                    let xr: Vec<f32> = x.iter().map(|&v| act.round(v)).collect();
                    let dx = be.upload_acts(act, tokens, cols, &x).unwrap();
                    let what = format!("{format} {} x {cols}, {} acts, {tokens} tokens", rows, act.name());

                    let mut y = be.upload(&vec![f32::NAN; tokens * rows]).unwrap();
                    be.gemv(&dm, &dx, None, &mut y).unwrap();
                    let (want, mag) = reference_gemv(&w, cols, &xr, &(0..rows).collect::<Vec<_>>());
                    assert_close(&format!("dense {what}"), &be.download(&y).unwrap(), &want, &mag);

                    let mut y = be.upload(&vec![f32::NAN; tokens * picked.len()]).unwrap();
                    be.gemv(&dm, &dx, Some(&drows), &mut y).unwrap();
                    let (want, mag) = reference_gemv(&w, cols, &xr, &picked);
                    assert_close(&format!("gathered {what}"), &be.download(&y).unwrap(), &want, &mag);
                }
            }
        }
    }
}

#[test]
fn gathered_row_axpy_matches_the_cpu_reference() {
    let Some(be) = backend() else { return };
    for format in WeightFormat::ALL {
        let cols = cols_for(format)[1];
        let rows = 300; // neurons of a neuron-major down projection
        let bytes = synthetic_matrix(format, rows, cols, 99).unwrap();
        let w = dequantize(format, &bytes, rows, cols);
        let dm = be.upload_matrix(format, rows, cols, &bytes).unwrap();
        // 97 kept neurons, out of order (splits over several blocks).
        let kept: Vec<usize> = (0..97).map(|i| (i * 37 + 11) % rows).collect();
        let idx: Vec<u32> = kept.iter().map(|&r| r as u32).collect();
        let drows = be.upload_rows(&idx, rows).unwrap();
        for tokens in [1, 3, 6] {
            let a = synthetic_acts(tokens * kept.len(), 5 + tokens as u64);
            let da = be.upload(&a).unwrap();
            let mut y = be.upload(&vec![f32::NAN; tokens * cols]).unwrap();
            be.axpy_rows(&dm, &da, tokens, &drows, &mut y).unwrap();
            let (mut want, mut mag) = (vec![0f64; tokens * cols], vec![0f64; tokens * cols]);
            for t in 0..tokens {
                for (j, &r) in kept.iter().enumerate() {
                    let av = f64::from(a[t * kept.len() + j]);
                    for h in 0..cols {
                        let p = av * f64::from(w[r * cols + h]);
                        want[t * cols + h] += p;
                        mag[t * cols + h] += p.abs();
                    }
                }
            }
            assert_close(&format!("axpy {format} {tokens} tokens"), &be.download(&y).unwrap(), &want, &mag);
        }
    }
}

#[test]
fn bad_shapes_and_indices_are_errors_not_faults() {
    let Some(be) = backend() else { return };
    let f = WeightFormat::Q4_0;
    let bytes = synthetic_matrix(f, 8, 64, 1).unwrap();
    assert!(be.upload_matrix(f, 8, 64, &bytes[1..]).is_err());
    assert!(be.upload_matrix(f, 8, 48, &bytes).is_err());
    let m = be.upload_matrix(f, 8, 64, &bytes).unwrap();
    let err = be.upload_rows(&[1, 8], 8).err().unwrap().to_string();
    assert!(err.contains("index 1 is row 8"), "{err}");
    let wide = be.upload_rows(&[1, 9], 10).unwrap();
    let x = be.upload_acts(ActType::F32, 1, 64, &synthetic_acts(64, 2)).unwrap();
    let mut y = be.alloc::<f32>(8).unwrap();
    assert!(be.gemv(&m, &x, Some(&wide), &mut y).is_err(), "indices past the matrix");
    let short = be.upload_acts(ActType::F32, 1, 32, &synthetic_acts(32, 2)).unwrap();
    assert!(be.gemv(&m, &short, None, &mut y).is_err(), "activation length");
    let mut small = be.alloc::<f32>(7).unwrap();
    assert!(be.gemv(&m, &x, None, &mut small).is_err(), "output too small");
    be.synchronize().unwrap();
}
