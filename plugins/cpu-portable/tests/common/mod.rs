//! Checks shared by the in-process and the dlopen tests: whatever way the
//! root module was obtained, it must report the current ABI version, list
//! the scalar kernels, and compute exactly what `spinfer-kernels`' scalar
//! kernel computes.
#![allow(dead_code, reason = "each test binary uses a subset")]

use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use spinfer_kernels::GgmlType;
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::kernel::{self as sk, MatmulDesc};
use spinfer_kernels::pool::ThreadPool;
use spinfer_pack_cpu_portable::{PACK_NAME, supported_pairs};
use spinfer_plugin_api::abi_stable::std_types::RSliceMut;
use spinfer_plugin_api::{
    ABI_VERSION, ActType, HostInfo, KernelBox, Op, PackErrorKind, PackModuleRef, PredictorSpec, WeightType, check_abi,
};

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// `rows` random rows of `cols` Q4_1 or Q8_0 elements: random quant bytes
/// with finite f16 scales (and minimums).
pub fn random_weights(r: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let scale_fields: &[usize] = match ty {
        GgmlType::Q4_1 => &[0, 2],
        GgmlType::Q8_0 => &[0],
        _ => panic!("random_weights: {ty} not handled"),
    };
    let mut w: Vec<u8> = (0..ty.row_bytes(cols).unwrap() * rows).map(|_| r.random()).collect();
    for blk in w.chunks_exact_mut(ty.type_size()) {
        for &off in scale_fields {
            let s = f16::from_f32(r.random_range(-0.05f32..0.05));
            blk[off..off + 2].copy_from_slice(&s.to_le_bytes());
        }
    }
    w
}

pub fn random_acts(r: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-2.0f32..2.0)).collect()
}

/// What `spinfer-kernels`' scalar kernel computes, called directly.
pub fn reference(ty: GgmlType, act: sk::ActType, rows: usize, cols: usize, w: &[u8], x: &[f32]) -> Vec<f32> {
    let n_tokens = x.len() / cols;
    let desc = MatmulDesc { wtype: ty, act, rows, cols };
    let k = sk::candidates(&desc, &CpuFeatures::default()).pop().expect("a scalar kernel");
    assert!(k.name().starts_with("scalar/"), "{}", k.name());
    let mut out = vec![0.0; n_tokens * rows];
    k.run(&ThreadPool::new(1), w, x, n_tokens, &mut out, &mut Vec::new()).unwrap();
    out
}

/// The pack's kernel for `(w, a)`.
pub fn find_kernel(kernels: &[KernelBox], w: WeightType, a: ActType) -> &KernelBox {
    kernels
        .iter()
        .find(|k| {
            let d = k.describe();
            d.wtype == w && d.act == a
        })
        .unwrap_or_else(|| panic!("no kernel for {w}*{a}"))
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// Runs `(w, a)` through the pack on random data and compares bit for bit.
fn check_bit_exact(kernels: &[KernelBox], w: WeightType, a: ActType, n_tokens: usize, seed: u64) {
    let (rows, cols) = (37, 256);
    let ty = spinfer_pack_cpu_portable::ggml_type(w).unwrap();
    let act = spinfer_pack_cpu_portable::kernel_act(a).unwrap();
    let mut r = rng(seed);
    let wb = random_weights(&mut r, ty, rows, cols);
    let x = random_acts(&mut r, n_tokens * cols);
    let want = reference(ty, act, rows, cols, &wb, &x);

    let k = find_kernel(kernels, w, a);
    k.prepare(wb.as_slice().into(), rows, cols).into_result().unwrap();
    let mut got = vec![f32::NAN; n_tokens * rows];
    k.run(wb.as_slice().into(), x.as_slice().into(), n_tokens, rows, cols, RSliceMut::from_mut_slice(&mut got))
        .into_result()
        .unwrap();
    assert!(want.iter().all(|v| v.is_finite()), "reference has non-finite values");
    assert_eq!(bits(&got), bits(&want), "{w}*{a} n_tokens={n_tokens}");
}

/// Every check of a loaded root module.
pub fn check_module(module: PackModuleRef) {
    assert_eq!(module.abi_version(), ABI_VERSION);
    assert_eq!(check_abi(module), Ok(()));
    assert_eq!(module.name()().as_str(), PACK_NAME);
    assert_eq!(module.score()(&HostInfo::detect("spinfer-test")), 1);

    // Kernels: one per supported pair, each a scalar MatMul kernel.
    let kernels = module.kernels()();
    let listed: Vec<(WeightType, ActType)> = kernels
        .iter()
        .map(|k| {
            let d = k.describe();
            assert_eq!(d.op, Op::MAT_MUL);
            assert!(d.name.starts_with("scalar/"), "{}", d.name);
            assert!(d.cols_multiple >= 1 && d.rows_multiple == 1);
            (d.wtype, d.act)
        })
        .collect();
    assert_eq!(listed, supported_pairs());
    for pair in [
        (WeightType::Q4_1, ActType::Q8_1),
        (WeightType::Q4_1, ActType::F32),
        (WeightType::Q8_0, ActType::Q8_0),
        (WeightType::Q4_K, ActType::Q8_K),
        (WeightType::F16, ActType::F32),
    ] {
        assert!(listed.contains(&pair), "{}*{} missing", pair.0, pair.1);
    }
    assert!(!listed.iter().any(|(w, _)| *w == WeightType::I2_S), "no ternary kernels in spinfer-kernels yet");

    // Matvec (one token) and matmul (several) are bit-exact.
    for n_tokens in [1, 3] {
        check_bit_exact(&kernels, WeightType::Q4_1, ActType::Q8_1, n_tokens, 1);
        check_bit_exact(&kernels, WeightType::Q4_1, ActType::F32, n_tokens, 2);
        check_bit_exact(&kernels, WeightType::Q8_0, ActType::Q8_0, n_tokens, 3);
    }

    // Errors come back as values with the right kinds.
    let k = find_kernel(&kernels, WeightType::Q8_0, ActType::Q8_0);
    let w = vec![0u8; 34 * 2];
    let x = vec![0.0f32; 32];
    let mut out = vec![0.0f32; 2];
    let e = k.run(w[..10].into(), x.as_slice().into(), 1, 2, 32, RSliceMut::from_mut_slice(&mut out));
    assert_eq!(e.into_result().unwrap_err().kind, PackErrorKind::INVALID_ARGUMENT);
    let e = k.run(w.as_slice().into(), x[..30].into(), 1, 2, 30, RSliceMut::from_mut_slice(&mut out));
    assert_eq!(e.into_result().unwrap_err().kind, PackErrorKind::UNSUPPORTED);
    let e = k.run_sparse(
        w.as_slice().into(),
        x.as_slice().into(),
        1,
        2,
        32,
        [0u32].as_slice().into(),
        RSliceMut::from_mut_slice(&mut out),
    );
    assert_eq!(e.into_result().unwrap_err().kind, PackErrorKind::UNSUPPORTED);

    // The pack offers nothing but kernels.
    assert!(module.loaders()().is_empty());
    let spec = PredictorSpec {
        arch: "llama".into(),
        model_dir: "/nonexistent".into(),
        n_layers: 2,
        hidden_dim: 64,
        ffn_dim: 256,
    };
    assert!(module.predictors()(&spec).is_empty());
    assert!(module.cache_policies()(1024).is_empty());
}
