//! CUDA kernel packs through the engine's `CudaPack`: the load order's
//! refusals (kind, size, encoding, ABI, declared kernels) on any machine;
//! without a usable device, registration with score 0 and the reason; on a
//! device, the pack's products (the built-in kernels' source, as
//! `scripts/make-packs.sh` ships it) against the builtin precise kernel,
//! dense and gathered rows, decode and prompt batches, with weights
//! resident, re-uploaded when the bytes at an address change, and over a
//! budget of 0.

use spinfer_engine::packs::CudaPack;
use spinfer_engine::registry::KernelProvider;
use spinfer_kernels::GgmlType;
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::kernel::{ActType, Form, MatmulCall, MatmulDesc, Select};
use spinfer_kernels::matmul::candidates;
use spinfer_kernels::pool::ThreadPool;
use spinfer_kernels_cuda::{PACK_ABI_VERSION, WeightFormat, products_source, synthetic_acts, synthetic_matrix};
use spinfer_registry::{TrustPolicy, VerifiedPack, sha256_hex, verify_pack};

/// An unsigned pack directory of `kind` around `source`, verified.
fn pack(kind: &str, abi: u32, source: &[u8], kernels: &[(&str, &str)]) -> (tempfile::TempDir, VerifiedPack) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("kernels.cu"), source).unwrap();
    let mut manifest = format!(
        "name = \"kernels-cuda\"\nversion = \"0.1.0\"\nabi_version = {abi}\nkind = \"{kind}\"\n\
         min_host_version = \"0.1.0\"\n\n[artefact]\nfile = \"kernels.cu\"\nsha256 = \"{}\"\n",
        sha256_hex(source)
    );
    for (w, act) in kernels {
        manifest.push_str(&format!(
            "\n[[kernels]]\nname = \"cuda_{w}_{act}\"\nop = \"matmul\"\nweight = \"{w}\"\nact = \"{act}\"\n"
        ));
    }
    std::fs::write(dir.path().join("pack.toml"), manifest).unwrap();
    let vp = verify_pack(dir.path(), &TrustPolicy::new().with_unsigned_allowed(true)).unwrap();
    (dir, vp)
}

const KERNELS: [(&str, &str); 3] = [("q4_0", "f32"), ("q4_k", "f32"), ("q8_0", "f32")];

fn shipped(budget_mb: f64) -> CudaPack {
    let (_dir, vp) = pack("cuda", PACK_ABI_VERSION, products_source().as_bytes(), &KERNELS);
    CudaPack::load(&vp, budget_mb).expect("the shipped source loads")
}

#[test]
fn the_load_order_refuses_what_the_host_cannot_run() {
    let src = products_source();
    let err = |kind: &str, abi: u32, source: &[u8], kernels: &[(&str, &str)]| {
        let (_dir, vp) = pack(kind, abi, source, kernels);
        match CudaPack::load(&vp, 64.0) {
            Ok(_) => panic!("{kind} abi {abi} loaded"),
            Err(e) => e.to_string(),
        }
    };
    let e = err("cuda", PACK_ABI_VERSION + 1, src.as_bytes(), &KERNELS);
    assert!(
        e.contains(&format!("ABI {}", PACK_ABI_VERSION + 1)) && e.contains(&format!("ABI {PACK_ABI_VERSION}")),
        "{e}"
    );
    let e = err("cuda", PACK_ABI_VERSION, &[0xff, 0xfe, b'x'], &KERNELS);
    assert!(e.contains("not UTF-8"), "{e}");
    let big = vec![b' '; spinfer_engine::packs::MAX_CUDA_SOURCE_BYTES + 1];
    let e = err("cuda", PACK_ABI_VERSION, &big, &KERNELS);
    assert!(e.contains("at most"), "{e}");
    let e = err("cuda", PACK_ABI_VERSION, src.as_bytes(), &[("q4_0", "q8_0")]);
    assert!(e.contains("cuda_q4_0_q8_0") && e.contains("f32 activations"), "{e}");
    let e = err("cuda", PACK_ABI_VERSION, src.as_bytes(), &[("f16", "f32")]);
    assert!(e.contains("cuda_f16_f32"), "{e}");
    let e = err("wasm", 1, src.as_bytes(), &KERNELS);
    assert!(e.contains("not a cuda pack"), "{e}");
    let (_dir, vp) = pack("cuda", PACK_ABI_VERSION, src.as_bytes(), &KERNELS);
    assert!(CudaPack::load(&vp, -1.0).is_err());
}

/// Without a usable device the pack registers with score 0, says why, and
/// offers nothing; with one it scores 1 (chosen by pin or benchmark).
#[test]
fn the_score_follows_the_device() {
    let pack = shipped(64.0);
    let (score, why) = spinfer_kernels_cuda::score();
    assert_eq!(pack.reason(), why);
    assert_eq!(pack.detail(), why);
    assert_eq!(pack.kernel_names(), ["cuda_q4_0_f32", "cuda_q4_k_f32", "cuda_q8_0_f32"]);
    let desc = MatmulDesc::dense(GgmlType::Q4_0, ActType::F32, 64, 256);
    if score == 0 {
        assert!(std::env::var("SPINFER_EXPECT_GPU").as_deref() != Ok("1"), "SPINFER_EXPECT_GPU=1 but: {why}");
        eprintln!("skipped the device checks: {why}");
        assert_eq!(pack.score(), 0);
        assert!(pack.kernels_for(&desc).is_empty());
        return;
    }
    assert_eq!(pack.score(), 1);
    assert_eq!(pack.kernels_for(&desc).len(), 1);
    // Fast-mode activations, other formats and the column AXPY: not offered.
    assert!(pack.kernels_for(&MatmulDesc::dense(GgmlType::Q4_0, ActType::Q8_0, 64, 256)).is_empty());
    assert!(pack.kernels_for(&MatmulDesc::dense(GgmlType::Q6_K, ActType::F32, 64, 256)).is_empty());
    assert!(pack.kernels_for(&desc.with_form(Form::GatheredColumns)).is_empty());
}

fn reference(desc: &MatmulDesc, w: &[u8], select: Select<'_>, x: &[f32], n: usize, width: usize) -> Vec<f32> {
    let k = candidates(desc, &CpuFeatures::default()).pop().expect("the scalar kernel");
    let mut out = vec![0f32; n * width];
    let call = MatmulCall { w, select, x, n_tokens: n, out: &mut out, scratch: &mut Vec::new(), prefill: false };
    k.run(&ThreadPool::new(1), call).unwrap();
    out
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    let scale = (want.iter().map(|v| v * v).sum::<f32>() / want.len() as f32).sqrt();
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 1e-4 * (scale + w.abs()), "{what}[{i}]: {g} vs {w}");
    }
}

#[test]
fn products_match_the_builtin_precise_kernel_on_a_device() {
    if spinfer_kernels_cuda::score().0 == 0 {
        eprintln!("skipped: {}", spinfer_kernels_cuda::score().1);
        return;
    }
    for budget in [64.0, 0.0] {
        let pack = shipped(budget);
        let pool = ThreadPool::new(1);
        for (wtype, format) in [(GgmlType::Q4_0, WeightFormat::Q4_0), (GgmlType::Q4_K, WeightFormat::Q4_K)] {
            let (rows, cols) = (300, 512);
            let mut w = synthetic_matrix(format, rows, cols, 7).unwrap();
            let desc = MatmulDesc::dense(wtype, ActType::F32, rows, cols);
            let k = pack.kernels_for(&desc).pop().expect("offered");
            let rows_k = pack.kernels_for(&desc.with_form(Form::GatheredRows)).pop().expect("offered");
            let idx: Vec<u32> = (0..rows as u32).filter(|r| r % 3 != 1).rev().collect();
            for n in [1, 3, 17] {
                let x = synthetic_acts(n * cols, n as u64);
                let what = format!("{wtype} {n} tokens, budget {budget}");
                let want = reference(&desc, &w, Select::All, &x, n, rows);
                for round in 0..2 {
                    let before = pack.transferred_bytes();
                    let mut out = vec![f32::NAN; n * rows];
                    k.run(&pool, MatmulCall::dense(&w, &x, n, &mut out, &mut Vec::new())).unwrap();
                    assert_close(&format!("{what} round {round}"), &out, &want);
                    let moved = pack.transferred_bytes() - before;
                    // Resident from the second call on, within the budget.
                    if round == 1 && budget > 0.0 {
                        assert!(moved < w.len() as u64, "{what}: {moved} bytes moved for resident weights");
                    }
                }
                let want = reference(&desc, &w, Select::Rows(&idx), &x, n, idx.len());
                let mut out = vec![f32::NAN; n * idx.len()];
                let call = MatmulCall {
                    w: &w,
                    select: Select::Rows(&idx),
                    x: &x,
                    n_tokens: n,
                    out: &mut out,
                    scratch: &mut Vec::new(),
                    prefill: false,
                };
                rows_k.run(&pool, call).unwrap();
                assert_close(&format!("{what} gathered"), &out, &want);
            }
            // The same bytes at the same address read as another shape (as
            // `spinfer tune` reuses its buffers): another matrix.
            let desc2 = MatmulDesc::dense(wtype, ActType::F32, rows * 2, cols / 2);
            let k2 = pack.kernels_for(&desc2).pop().expect("offered");
            let x = synthetic_acts(cols / 2, 5);
            let want = reference(&desc2, &w, Select::All, &x, 1, rows * 2);
            let mut out = vec![f32::NAN; rows * 2];
            k2.run(&pool, MatmulCall::dense(&w, &x, 1, &mut out, &mut Vec::new())).unwrap();
            assert_close(&format!("{wtype} read as {}x{}", rows * 2, cols / 2), &out, &want);
            // Other bytes at the same address: the fingerprint sees them.
            let other = synthetic_matrix(format, rows, cols, 8).unwrap();
            w.copy_from_slice(&other);
            let x = synthetic_acts(cols, 99);
            let want = reference(&desc, &w, Select::All, &x, 1, rows);
            let mut out = vec![f32::NAN; rows];
            k.run(&pool, MatmulCall::dense(&w, &x, 1, &mut out, &mut Vec::new())).unwrap();
            assert_close(&format!("{wtype} rewritten weights"), &out, &want);
        }
    }
}
