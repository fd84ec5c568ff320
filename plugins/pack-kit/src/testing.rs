//! The test harness of the CPU packs (feature `testing`): whatever way a
//! pack's root module was obtained (in process through the `rlib`, or by
//! dlopen of the `cdylib`), it must report the current ABI version and its
//! name, list exactly the kernels its [`CpuPack`] serves, compute bit for
//! bit what `spinfer-kernels`' own kernel of the same name computes, and
//! return errors as values of the right kinds. [`check_module`] checks all
//! of that; each pack's tests add their score and the kernels they expect.
//!
//! Test code: it panics on every failed check. [`dlopen_tests!`] defines
//! a pack's dlopen tests.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use spinfer_kernels::dot::ternary::i2s_row_bytes;
use spinfer_kernels::kernel::MatmulCall;
use spinfer_kernels::pool::ThreadPool;
use spinfer_plugin_api::abi_stable::library::lib_header_from_path;
use spinfer_plugin_api::abi_stable::std_types::{RSliceMut, RVec};
use spinfer_plugin_api::{
    ABI_VERSION, ActType, KernelBox, LoadErrorKind, NeuronId, Op, PackErrorKind, PackModuleRef, PredictorSpec,
    WeightType, check_abi, load_pack,
};

use spinfer_sparse_kernels::{AxpyIsa, NeuronMajor};

use crate::{COLUMN_AXPY_TYPES, CpuPack, ggml_type, isa_of, kernel_candidates, min_cols, offers_gathered_rows, op_for};

/// Weight types whose kernels [`check_module`] compares bit for bit.
pub const CHECKED_TYPES: [WeightType; 5] =
    [WeightType::Q4_1, WeightType::Q8_0, WeightType::TQ1_0, WeightType::TQ2_0, WeightType::I2_S];

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// `rows` random rows of `cols` weights of a [`CHECKED_TYPES`] type:
/// the kernels' generator (`spinfer_kernels::random`) for GGML types;
/// random codes with an f32 row scale for I2_S.
///
/// # Panics
///
/// For a type without a GGML block format other than I2_S.
pub fn random_weights(r: &mut StdRng, w: WeightType, rows: usize, cols: usize) -> Vec<u8> {
    if w == WeightType::I2_S {
        let rb = i2s_row_bytes(cols).unwrap();
        let mut v: Vec<u8> = (0..rb * rows).map(|_| r.random()).collect();
        for row in v.chunks_exact_mut(rb) {
            row[rb - 4..].copy_from_slice(&r.random_range(-0.05f32..0.05).to_le_bytes());
        }
        return v;
    }
    let ty = ggml_type(w).unwrap_or_else(|| panic!("random_weights: {w} has no GGML type"));
    spinfer_kernels::random::weights(r, ty, rows, cols)
}

/// `n` random activations in `-2..2`.
pub fn random_acts(r: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-2.0f32..2.0)).collect()
}

/// What `spinfer-kernels`' kernel named `name`, as `pack` chooses it,
/// computes, called directly (with a two-thread pool: the split over rows
/// must not change the result).
#[allow(clippy::too_many_arguments, reason = "one matmul's description")]
pub fn reference(
    pack: &CpuPack,
    name: &str,
    w: WeightType,
    a: ActType,
    rows: usize,
    cols: usize,
    wb: &[u8],
    x: &[f32],
) -> Vec<f32> {
    let n_tokens = x.len() / cols;
    let k = kernel_candidates(w, a, rows, cols, &(pack.features)())
        .into_iter()
        .find(|k| k.name() == name)
        .unwrap_or_else(|| panic!("spinfer-kernels has no {name}"));
    let mut out = vec![0.0; n_tokens * rows];
    k.run(&ThreadPool::new(2), MatmulCall::dense(wb, x, n_tokens, &mut out, &mut Vec::new())).unwrap();
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// Runs the pack's kernel `k` on random data and compares bit for bit with
/// `spinfer-kernels`.
pub fn check_bit_exact(pack: &CpuPack, k: &KernelBox, n_tokens: usize, seed: u64) {
    let d = k.describe();
    let (rows, cols) = (37, 512);
    let mut r = rng(seed);
    let wb = random_weights(&mut r, d.wtype, rows, cols);
    let x = random_acts(&mut r, n_tokens * cols);
    let want = reference(pack, &d.name, d.wtype, d.act, rows, cols, &wb, &x);

    k.prepare(wb.as_slice().into(), rows, cols).into_result().unwrap();
    let mut got = vec![f32::NAN; n_tokens * rows];
    k.run(wb.as_slice().into(), x.as_slice().into(), n_tokens, rows, cols, RSliceMut::from_mut_slice(&mut got))
        .into_result()
        .unwrap();
    assert!(want.iter().all(|v| v.is_finite()), "{}: reference has non-finite values", d.name);
    assert!(want.iter().any(|&v| v != 0.0), "{}: reference is all zeros", d.name);
    assert_eq!(bits(&got), bits(&want), "{} n_tokens={n_tokens}", d.name);
}

/// Runs the pack's gathered-row kernel `k` on random rows (unsorted, one
/// repeated) of random data and compares bit for bit with those rows of
/// the dense `spinfer-kernels` product.
pub fn check_gathered_rows(pack: &CpuPack, k: &KernelBox, n_tokens: usize, seed: u64) {
    let d = k.describe();
    let (rows, cols) = (37, 512);
    let mut r = rng(seed);
    let wb = random_weights(&mut r, d.wtype, rows, cols);
    let x = random_acts(&mut r, n_tokens * cols);
    let dense = reference(pack, &d.name, d.wtype, d.act, rows, cols, &wb, &x);
    let mut idx: Vec<u32> = (0..rows as u32).filter(|_| r.random_bool(0.4)).collect();
    idx.reverse();
    idx.push(idx[0]);
    let want: Vec<f32> =
        (0..n_tokens).flat_map(|t| idx.iter().map(|&i| dense[t * rows + i as usize]).collect::<Vec<_>>()).collect();
    let mut got = vec![f32::NAN; n_tokens * idx.len()];
    k.run_sparse(
        wb.as_slice().into(),
        x.as_slice().into(),
        n_tokens,
        rows,
        cols,
        idx.as_slice().into(),
        RSliceMut::from_mut_slice(&mut got),
    )
    .into_result()
    .unwrap();
    assert_eq!(bits(&got), bits(&want), "{} gathered rows, n_tokens={n_tokens}", d.name);
    // An index past the last row is refused, not read.
    let e = k.run_sparse(
        wb.as_slice().into(),
        x.as_slice().into(),
        n_tokens,
        rows,
        cols,
        [rows as u32].as_slice().into(),
        RSliceMut::from_mut_slice(&mut got[..n_tokens]),
    );
    assert_eq!(e.into_result().unwrap_err().kind, PackErrorKind::INVALID_ARGUMENT, "{}", d.name);
}

/// Runs the pack's gathered-column AXPY `k` on random columns of random
/// weights, the rows split in two ranges as the host splits them over
/// threads (each range prepared as a slice of its own), and compares bit
/// for bit with `NeuronMajor` over the whole matrix (the instruction set
/// of `k`'s name; the int8 arithmetic for activation type `Q8_0`). Also
/// checks its errors.
pub fn check_column_axpy(k: &KernelBox, n_tokens: usize, seed: u64) {
    let d = k.describe();
    assert_eq!(d.op, Op::GATHERED_COLUMN_AXPY, "{}", d.name);
    let (rows, cols, split) = (70, 256, 64);
    let mut r = rng(seed);
    let wb = random_weights(&mut r, d.wtype, rows, cols);
    let idx: Vec<u32> = (0..cols as u32).filter(|_| r.random_bool(0.4)).collect();
    let x = random_acts(&mut r, n_tokens * idx.len());
    let nm = NeuronMajor::from_weights(ggml_type(d.wtype).unwrap(), &wb, rows, cols).unwrap();
    let isa = match isa_of(&d.name) {
        "scalar" => AxpyIsa::Scalar,
        "avx2" => AxpyIsa::Avx2,
        _ => AxpyIsa::Avx512,
    };
    let mut want = vec![0.0; n_tokens * rows];
    for (c, o) in x.chunks_exact(idx.len()).zip(want.chunks_exact_mut(rows)) {
        match d.act {
            ActType::Q8_0 => nm.axpy_fast_scalar(&idx, c, o).unwrap(),
            _ => nm.axpy_with(&ThreadPool::new(2), isa, &idx, c, o).unwrap(),
        }
    }
    assert!(want.iter().any(|&v| v != 0.0), "{}: reference is all zeros", d.name);

    let rb = ggml_type(d.wtype).unwrap().row_bytes(cols).unwrap();
    let mut got = vec![f32::NAN; n_tokens * rows];
    for range in [0..split, split..rows] {
        let part = &wb[range.start * rb..range.end * rb];
        k.prepare(part.into(), range.len(), cols).into_result().unwrap();
        let mut o = vec![f32::NAN; n_tokens * range.len()];
        k.run_sparse(
            part.into(),
            x.as_slice().into(),
            n_tokens,
            range.len(),
            cols,
            idx.as_slice().into(),
            RSliceMut::from_mut_slice(&mut o),
        )
        .into_result()
        .unwrap();
        for t in 0..n_tokens {
            got[t * rows + range.start..t * rows + range.end].copy_from_slice(&o[t * range.len()..][..range.len()]);
        }
    }
    assert_eq!(bits(&got), bits(&want), "{} columns, n_tokens={n_tokens}", d.name);

    // Errors: columns out of order or out of range, a slice used with
    // another shape, the dense entry point.
    let mut o = vec![0.0; rows];
    let run = |idx: &[u32], x: &[f32], rows: usize, o: &mut [f32]| {
        k.run_sparse(wb.as_slice().into(), x.into(), 1, rows, cols, idx.into(), RSliceMut::from_mut_slice(o))
            .into_result()
            .map_err(|e| e.kind)
    };
    k.prepare(wb.as_slice().into(), rows, cols).into_result().unwrap();
    assert_eq!(run(&[3, 1], &[1.0, 1.0], rows, &mut o), Err(PackErrorKind::INVALID_ARGUMENT), "{}", d.name);
    assert_eq!(run(&[cols as u32], &[1.0], rows, &mut o), Err(PackErrorKind::INVALID_ARGUMENT), "{}", d.name);
    assert_eq!(run(&[1], &[1.0, 2.0], rows, &mut o), Err(PackErrorKind::INVALID_ARGUMENT), "{}", d.name);
    assert_eq!(run(&[1], &[1.0], rows - 1, &mut o[1..]), Err(PackErrorKind::INVALID_ARGUMENT), "{}", d.name);
    assert_eq!(run(&[], &[], rows, &mut o), Ok(()), "{}", d.name);
    assert!(o.iter().all(|&v| v == 0.0), "{}: no columns, no sum", d.name);
    let e = k.run(wb.as_slice().into(), [0.0; 256].as_slice().into(), 1, rows, cols, RSliceMut::from_mut_slice(&mut o));
    assert_eq!(e.into_result().unwrap_err().kind, PackErrorKind::UNSUPPORTED, "{}", d.name);
}

/// Every check common to the CPU packs; returns the kernels for the pack's
/// own checks. A pack without kernels on this CPU (`cpu-simd` without
/// AVX2) only gets the module-level checks.
pub fn check_module(module: PackModuleRef, pack: &CpuPack) -> RVec<KernelBox> {
    assert_eq!(module.abi_version(), ABI_VERSION);
    assert_eq!(check_abi(module), Ok(()));
    assert_eq!(module.name()().as_str(), pack.name);

    // No loaders; whatever predictors and cache policies the pack offers
    // answer the ABI's contract.
    assert!(module.loaders()().is_empty());
    let spec = PredictorSpec {
        arch: "llama".into(),
        model_dir: "/nonexistent".into(),
        n_layers: 2,
        hidden_dim: 64,
        ffn_dim: 256,
    };
    for p in module.predictors()(&spec) {
        let name = p.name();
        assert!(!name.is_empty());
        let hidden: Vec<f32> = random_acts(&mut rng(7), 64);
        let mut mask = vec![7u8; 256];
        let n = p.predict(1, hidden.as_slice().into(), RSliceMut::from_mut_slice(&mut mask)).into_result().unwrap();
        assert!(mask.iter().all(|&m| m <= 1), "predictor {name}: mask entries must be 0 or 1");
        assert_eq!(n, mask.iter().filter(|&&m| m == 1).count(), "predictor {name}: count disagrees with the mask");
        let e = p.predict(2, hidden.as_slice().into(), RSliceMut::from_mut_slice(&mut mask)).into_result();
        assert_eq!(e.unwrap_err().kind, PackErrorKind::INVALID_ARGUMENT, "predictor {name}: layer out of range");
    }
    for mut c in module.cache_policies()(1024) {
        let n = NeuronId { layer: 0, index: 3 };
        assert!(!c.name().is_empty());
        c.on_access(n);
        if c.admit(n) {
            assert_eq!(c.evict().into_option(), Some(n), "policy {}: the only resident neuron", c.name());
        }
    }

    // Kernels: one per (isa, pair) the pack serves, named as
    // spinfer-kernels names them.
    let all = module.kernels()();
    let (columns, all): (Vec<KernelBox>, Vec<KernelBox>) =
        all.into_iter().partition(|k| k.describe().op == Op::GATHERED_COLUMN_AXPY);
    let (gathered, kernels): (Vec<KernelBox>, Vec<KernelBox>) =
        all.into_iter().partition(|k| k.describe().op == Op::GATHERED_ROW_MAT_VEC);
    let kernels: RVec<KernelBox> = kernels.into();
    let listed: Vec<(String, WeightType, ActType)> = kernels
        .iter()
        .map(|k| {
            let d = k.describe();
            let (isa, pair) = d.name.split_once('/').unwrap();
            assert!(pack.isas.contains(&isa), "{}: not one of {:?}", d.name, pack.isas);
            assert_eq!(isa, isa_of(&d.name));
            assert_eq!(pair, format!("{}*{}", d.wtype, d.act));
            assert_eq!(d.op, op_for(d.wtype), "{}", d.name);
            assert_eq!(d.cols_multiple as usize, min_cols(d.wtype), "{}", d.name);
            assert_eq!(d.rows_multiple, 1);
            (isa.to_string(), d.wtype, d.act)
        })
        .collect();
    assert_eq!(listed, pack.supported_kernels());
    if kernels.is_empty() {
        return kernels;
    }

    // Every instruction set offered serves the ternary types with Q8_K.
    for (isa, _, _) in &listed {
        for w in [WeightType::TQ1_0, WeightType::TQ2_0, WeightType::I2_S] {
            let want = (isa.clone(), w, ActType::Q8_K);
            assert!(listed.contains(&want), "{isa}/{w}*q8_K missing");
        }
    }

    // Matvec (one token) and matmul (several) are bit-exact.
    for (i, k) in kernels.iter().enumerate() {
        if CHECKED_TYPES.contains(&k.describe().wtype) {
            for n_tokens in [1, 3, 8] {
                check_bit_exact(pack, k, n_tokens, i as u64 * 10 + n_tokens as u64);
            }
        }
    }

    // The gathered-row kernels: one per dense kernel whose type has them,
    // with its name, computing exactly the dense kernel's rows.
    let want: Vec<(String, WeightType, ActType)> = kernels
        .iter()
        .map(KernelBox::describe)
        .filter(|d| offers_gathered_rows(d.wtype))
        .map(|d| (d.name.to_string(), d.wtype, d.act))
        .collect();
    let got: Vec<(String, WeightType, ActType)> =
        gathered.iter().map(KernelBox::describe).map(|d| (d.name.to_string(), d.wtype, d.act)).collect();
    assert_eq!(got, want, "gathered-row kernels");
    for (i, k) in gathered.iter().enumerate() {
        if CHECKED_TYPES.contains(&k.describe().wtype) {
            for n_tokens in [1, 2, 5] {
                check_gathered_rows(pack, k, n_tokens, 1000 + i as u64 * 10 + n_tokens as u64);
            }
        }
    }

    // The gathered-column AXPYs: the pack's own list, each type of
    // COLUMN_AXPY_TYPES with f32 activations on each instruction set, all
    // bit-exact with NeuronMajor.
    let got: Vec<String> = columns.iter().map(|k| k.describe().name.to_string()).collect();
    let want: Vec<String> = pack.column_axpy_kernels().iter().map(|k| k.name().to_string()).collect();
    assert_eq!(got, want, "gathered-column kernels");
    for w in COLUMN_AXPY_TYPES {
        let f32_kernels = columns.iter().filter(|k| k.describe().wtype == w && k.describe().act == ActType::F32);
        assert!(f32_kernels.count() >= 1, "no {w}*f32 gathered-column kernel");
    }
    for (i, k) in columns.iter().enumerate() {
        for n_tokens in [1, 3] {
            check_column_axpy(k, n_tokens, 2000 + i as u64 * 10 + n_tokens as u64);
        }
    }

    // Errors come back as values with the right kinds.
    let k = kernels
        .iter()
        .find(|k| k.describe().wtype == WeightType::Q8_0 && k.describe().act == ActType::Q8_0)
        .expect("a q8_0*q8_0 kernel");
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
    let k = kernels.iter().find(|k| k.describe().wtype == WeightType::I2_S).expect("an i2_s kernel");
    let x = vec![0.0f32; 384];
    let e = k.run(w.as_slice().into(), x.as_slice().into(), 1, 1, 384, RSliceMut::from_mut_slice(&mut out[..1]));
    assert_eq!(e.into_result().unwrap_err().kind, PackErrorKind::UNSUPPORTED);
    let x = vec![0.0f32; 256];
    let e = k.run(w[..10].into(), x.as_slice().into(), 1, 1, 256, RSliceMut::from_mut_slice(&mut out[..1]));
    assert_eq!(e.into_result().unwrap_err().kind, PackErrorKind::INVALID_ARGUMENT);
    kernels
}

/// `package`'s library (`target/<profile>/<lib_file>`), built for the
/// running test's profile (`spinfer_test_support::build_packages`); once
/// per test binary (a test binary tests one pack).
pub fn pack_library(package: &str, lib_file: &str) -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let lib = spinfer_test_support::build_packages(&[package]).join(lib_file);
        assert!(lib.exists(), "{} was not built", lib.display());
        lib
    })
}

/// The root module of the library at `lib`, loaded as `abi_stable` loads
/// it (dlopen, header, version and layout checks), without `load_pack`'s
/// own checks.
pub fn root_module_from_cdylib(lib: &Path) -> PackModuleRef {
    lib_header_from_path(lib).unwrap().init_root_module::<PackModuleRef>().unwrap()
}

/// The root module of the library at `lib` through the host's
/// [`load_pack`] (all its checks).
pub fn load_checked(lib: &Path) -> PackModuleRef {
    load_pack(lib).unwrap()
}

/// Defines a pack's dlopen tests: `dlopen_tests!("package-name",
/// "libfile.so", check)` builds the package's cdylib for the test's
/// profile ([`pack_library`]), loads it with `abi_stable` alone
/// (`root_module_from_cdylib`) and with the host's `load_pack`
/// (`load_pack_checks_and_loads`), runs `check(module)` on each, and checks
/// the one-line error for a missing library.
#[macro_export]
macro_rules! dlopen_tests {
    ($package:literal, $lib_file:literal, $check:path) => {
        /// The pack library, freshly built for this test's profile.
        fn library() -> &'static ::std::path::Path {
            $crate::testing::pack_library($package, $lib_file)
        }

        #[test]
        fn root_module_from_cdylib() {
            $check($crate::testing::root_module_from_cdylib(library()));
        }

        #[test]
        fn load_pack_checks_and_loads() {
            $check($crate::testing::load_checked(library()));
        }

        #[test]
        fn load_pack_reports_missing_files_in_one_line() {
            $crate::testing::check_missing_library_error();
        }
    };
}

/// `load_pack` of a missing file fails with a one-line `Open` error.
pub fn check_missing_library_error() {
    let Err(e) = load_pack(Path::new("/nonexistent/libnothing.so")) else { panic!("loaded a missing file") };
    assert_eq!(e.kind(), LoadErrorKind::Open);
    let msg = e.to_string();
    assert!(msg.starts_with("cannot load pack /nonexistent/libnothing.so: "), "{msg}");
    assert!(!msg.contains('\n'), "{msg}");
}
