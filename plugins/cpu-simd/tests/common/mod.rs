//! Checks shared by the in-process and the dlopen tests: whatever way the
//! root module was obtained, it must report the current ABI version, score
//! as ggml's CPU variants do, list the SIMD kernels of this CPU, and compute
//! exactly what `spinfer-kernels`' own SIMD kernel computes.
#![allow(dead_code, reason = "each test binary uses a subset")]

use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use spinfer_kernels::GgmlType;
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::kernel::{self as sk, MatmulDesc};
use spinfer_kernels::pool::ThreadPool;
use spinfer_pack_cpu_simd::{PACK_NAME, SCORE_AVX2, SCORE_AVX512, supported_kernels};
use spinfer_plugin_api::abi_stable::std_types::RSliceMut;
use spinfer_plugin_api::{
    ABI_VERSION, ActType, CpuFeatureSet, HostInfo, KernelBox, Op, PackErrorKind, PackModuleRef, PredictorSpec,
    WeightType, check_abi,
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

/// What `spinfer-kernels`' own kernel named `name` computes, called
/// directly (with a two-thread pool: the split over rows must not change
/// the result).
pub fn reference(
    name: &str,
    ty: GgmlType,
    act: sk::ActType,
    rows: usize,
    cols: usize,
    w: &[u8],
    x: &[f32],
) -> Vec<f32> {
    let n_tokens = x.len() / cols;
    let desc = MatmulDesc { wtype: ty, act, rows, cols };
    let k = sk::candidates(&desc, &CpuFeatures::detect())
        .into_iter()
        .find(|k| k.name() == name)
        .unwrap_or_else(|| panic!("spinfer-kernels has no {name}"));
    let mut out = vec![0.0; n_tokens * rows];
    k.run(&ThreadPool::new(2), w, x, n_tokens, &mut out, &mut Vec::new()).unwrap();
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// Runs kernel `k` on random data and compares bit for bit with
/// `spinfer-kernels`.
fn check_bit_exact(k: &KernelBox, n_tokens: usize, seed: u64) {
    let d = k.describe();
    let (rows, cols) = (37, 512);
    let ty = spinfer_pack_cpu_simd::ggml_type(d.wtype).unwrap();
    let act = spinfer_pack_cpu_simd::kernel_act(d.act).unwrap();
    let mut r = rng(seed);
    let wb = random_weights(&mut r, ty, rows, cols);
    let x = random_acts(&mut r, n_tokens * cols);
    let want = reference(&d.name, ty, act, rows, cols, &wb, &x);

    k.prepare(wb.as_slice().into(), rows, cols).into_result().unwrap();
    let mut got = vec![f32::NAN; n_tokens * rows];
    k.run(wb.as_slice().into(), x.as_slice().into(), n_tokens, rows, cols, RSliceMut::from_mut_slice(&mut got))
        .into_result()
        .unwrap();
    assert!(want.iter().all(|v| v.is_finite()), "reference has non-finite values");
    assert_eq!(bits(&got), bits(&want), "{} n_tokens={n_tokens}", d.name);
}

fn host(features: CpuFeatureSet) -> HostInfo {
    HostInfo { host_version: "spinfer-test".into(), cpu_features: features, n_cores: 2 }
}

/// Every check of a loaded root module.
pub fn check_module(module: PackModuleRef) {
    assert_eq!(module.abi_version(), ABI_VERSION);
    assert_eq!(check_abi(module), Ok(()));
    assert_eq!(module.name()().as_str(), PACK_NAME);

    // Scores: 0 without AVX2 + FMA + F16C, more with AVX-512, always > 1.
    let score = module.score();
    assert_eq!(score(&host(CpuFeatureSet::empty())), 0);
    assert_eq!(score(&host(CpuFeatureSet::FMA.with(CpuFeatureSet::F16C))), 0, "no avx2");
    let avx2 = CpuFeatureSet::AVX2.with(CpuFeatureSet::FMA).with(CpuFeatureSet::F16C);
    assert_eq!(score(&host(avx2)), SCORE_AVX2);
    let avx512 = avx2
        .with(CpuFeatureSet::AVX512F)
        .with(CpuFeatureSet::AVX512BW)
        .with(CpuFeatureSet::AVX512VL)
        .with(CpuFeatureSet::AVX512VNNI);
    assert_eq!(score(&host(avx512)), SCORE_AVX2 + SCORE_AVX512);
    assert!(score(&host(avx2)) > 1);

    let features = CpuFeatures::detect();
    let kernels = module.kernels()();
    if !features.has_avx2() {
        assert!(kernels.is_empty(), "no SIMD kernels on a cpu without avx2");
        assert_eq!(score(&HostInfo::detect("spinfer-test")), 0);
        eprintln!("skipping kernel checks: this cpu lacks avx2/fma/f16c");
        return;
    }
    assert!(score(&HostInfo::detect("spinfer-test")) >= SCORE_AVX2);

    // Kernels: one per (isa, pair), each a SIMD MatMul kernel named as
    // spinfer-kernels names it.
    let listed: Vec<(String, WeightType, ActType)> = kernels
        .iter()
        .map(|k| {
            let d = k.describe();
            assert_eq!(d.op, Op::MAT_MUL);
            let (isa, pair) = d.name.split_once('/').unwrap();
            assert!(isa == "avx2" || isa == "avx512", "{}", d.name);
            assert_eq!(pair, format!("{}*{}", d.wtype, d.act));
            assert!(d.cols_multiple >= 1 && d.rows_multiple == 1);
            (isa.to_string(), d.wtype, d.act)
        })
        .collect();
    assert_eq!(listed, supported_kernels());
    let names: Vec<String> = kernels.iter().map(|k| k.describe().name.to_string()).collect();
    let mut want = vec!["avx2/q4_1*q8_1", "avx2/q8_0*q8_0"];
    if features.has_avx512() {
        want.extend(["avx512/q4_1*q8_1", "avx512/q8_0*q8_0"]);
    }
    for n in want {
        assert!(names.iter().any(|m| m == n), "{n} missing from {names:?}");
    }

    // Matvec (one token) and matmul (several) are bit-exact, for every
    // Q4_1 and Q8_0 kernel.
    for (i, k) in kernels.iter().enumerate() {
        let w = k.describe().wtype;
        if w == WeightType::Q4_1 || w == WeightType::Q8_0 {
            for n_tokens in [1, 3, 8] {
                check_bit_exact(k, n_tokens, i as u64 * 10 + n_tokens as u64);
            }
        }
    }

    // Errors come back as values with the right kinds.
    let k = kernels.iter().find(|k| k.describe().name.as_str() == "avx2/q8_0*q8_0").unwrap();
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
