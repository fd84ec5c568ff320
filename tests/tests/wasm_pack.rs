//! The reference WebAssembly kernel pack (`kernels-wasm/`) run through the
//! engine's `WasmPack`: its matmuls against the builtin scalar precise
//! kernel, weight residency, and SmolLM2 end to end with the pack's kernels
//! pinned.
//!
//! The module is built by the test itself (`kernels-wasm/build.sh` into a
//! temporary directory, once per test binary; cargo makes this a no-op when
//! the crate is up to date), so it always matches the source. It needs the
//! `wasm32-unknown-unknown` target, which `scripts/test.sh` installs.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};

use spinfer_engine::Engine;
use spinfer_engine::model::{ModelOptions, Precision};
use spinfer_engine::packs::{WasmLimits, WasmPack};
use spinfer_engine::registry::{KernelProvider, KernelRegistry};
use spinfer_kernels::GgmlType;
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::kernel::{ActType, MatmulCall, MatmulDesc, MatmulKernel};
use spinfer_kernels::matmul::candidates;
use spinfer_kernels::pool::ThreadPool;
use spinfer_registry::{TrustPolicy, VerifiedPack, sha256_hex, verify_pack};
use spinfer_tests::{smollm2, workspace};

/// `(manifest kernel name, weight type)` of the reference pack.
const KERNELS: [(&str, GgmlType); 3] =
    [("wasm_f32_f32", GgmlType::F32), ("wasm_q4_1_f32", GgmlType::Q4_1), ("wasm_q8_0_f32", GgmlType::Q8_0)];

/// The built module (see the file docs).
fn module() -> &'static Path {
    static MODULE: OnceLock<PathBuf> = OnceLock::new();
    MODULE.get_or_init(|| {
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("wasm-pack-test/spinfer_kernels_wasm.wasm");
        let status = Command::new("bash")
            .arg(workspace().join("kernels-wasm/build.sh"))
            .arg(&out)
            .status()
            .expect("running kernels-wasm/build.sh");
        assert!(status.success(), "kernels-wasm/build.sh failed (is the wasm32-unknown-unknown target installed?)");
        out
    })
}

/// An unsigned pack directory around the reference module, verified.
fn verified_pack() -> (tempfile::TempDir, VerifiedPack) {
    let wasm = std::fs::read(module()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("spinfer_kernels_wasm.wasm"), &wasm).unwrap();
    let mut manifest = format!(
        "name = \"kernels-wasm\"\nversion = \"0.1.0\"\nabi_version = 1\nkind = \"wasm\"\n\
         min_host_version = \"0.1.0\"\n\n[artefact]\nfile = \"spinfer_kernels_wasm.wasm\"\nsha256 = \"{}\"\n",
        sha256_hex(&wasm)
    );
    for (name, w) in KERNELS {
        manifest.push_str(&format!(
            "\n[[kernels]]\nname = \"{name}\"\nop = \"matmul\"\nweight = \"{}\"\nact = \"f32\"\n",
            w.name()
        ));
    }
    std::fs::write(dir.path().join("pack.toml"), manifest).unwrap();
    let vp = verify_pack(dir.path(), &TrustPolicy::new().with_unsigned_allowed(true)).unwrap();
    (dir, vp)
}

fn load_pack() -> Arc<WasmPack> {
    let (_dir, vp) = verified_pack();
    Arc::new(WasmPack::load(&vp, WasmLimits::default()).expect("reference pack loads"))
}

/// xorshift64*: deterministic test data without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in [-1, 1).
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// A positive normal f16 in [2^-7, 2^-6), as bits.
    fn f16_scale(&mut self) -> [u8; 2] {
        (0x2000u16 | (self.next() as u16 & 0x3ff)).to_le_bytes()
    }
}

/// Random weights of `rows x cols` elements of `wtype`.
fn weights(rng: &mut Rng, wtype: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let mut w = Vec::new();
    match wtype {
        GgmlType::F32 => {
            for _ in 0..rows * cols {
                w.extend_from_slice(&rng.f32().to_le_bytes());
            }
        }
        GgmlType::Q4_1 => {
            for _ in 0..rows * cols / 32 {
                w.extend_from_slice(&rng.f16_scale());
                let mut m = rng.f16_scale();
                m[1] |= 0x80 * (rng.next() & 1) as u8; // random sign of the offset
                w.extend_from_slice(&m);
                w.extend((0..16).map(|_| rng.next() as u8));
            }
        }
        GgmlType::Q8_0 => {
            for _ in 0..rows * cols / 32 {
                w.extend_from_slice(&rng.f16_scale());
                w.extend((0..32).map(|_| rng.next() as u8));
            }
        }
        _ => unreachable!(),
    }
    assert_eq!(w.len(), wtype.row_bytes(cols).unwrap() * rows);
    w
}

fn scalar_reference(desc: &MatmulDesc) -> Box<dyn MatmulKernel> {
    let mut c = candidates(desc, &CpuFeatures::default());
    let k = c.pop().expect("the builtin scalar kernel serves the pair");
    assert!(k.name().starts_with("scalar/"), "{}", k.name());
    k
}

#[test]
fn reference_pack_matches_the_builtin_precise_kernel() {
    let pack = load_pack();
    let pool = ThreadPool::new(1);
    let mut rng = Rng(0x5eed_1234_abcd_ef01);
    let mut matrices = 0;
    for (name, wtype) in KERNELS {
        let shapes: &[(usize, usize)] =
            if wtype == GgmlType::F32 { &[(37, 256), (5, 100), (3, 7)] } else { &[(37, 256), (9, 96)] };
        for &(rows, cols) in shapes {
            let desc = MatmulDesc::dense(wtype, ActType::F32, rows, cols);
            let offered = pack.kernels_for(&desc);
            assert_eq!(offered.len(), 1, "{name} is offered for {rows}x{cols}");
            let k = &offered[0];
            assert_eq!(k.name(), name);
            let reference = scalar_reference(&desc);
            let w = weights(&mut rng, wtype, rows, cols);
            matrices += 1;
            for n_tokens in [1, 3, 4, 6] {
                let x: Vec<f32> = (0..n_tokens * cols).map(|_| rng.f32()).collect();
                let mut got = vec![0.0; n_tokens * rows];
                let mut want = vec![0.0; n_tokens * rows];
                k.run(&pool, MatmulCall::dense(&w, &x, n_tokens, &mut got, &mut Vec::new())).unwrap();
                reference.run(&pool, MatmulCall::dense(&w, &x, n_tokens, &mut want, &mut Vec::new())).unwrap();
                // Relative to the output's RMS where a dot product cancels to ~0.
                let rms = (want.iter().map(|v| v * v).sum::<f32>() / want.len() as f32).sqrt();
                for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                    let tol = 1e-4 * e.abs().max(rms);
                    assert!((g - e).abs() <= tol, "{name} {rows}x{cols} n={n_tokens} [{i}]: {g} vs {e}");
                }
            }
        }
    }
    assert_eq!(pack.weight_uploads(), matrices, "each weight matrix is copied into the module once");
    assert!(!pack.is_disabled());
}

#[test]
fn kernels_are_offered_only_for_served_pairs() {
    let pack = load_pack();
    let d = |wtype, act, cols| MatmulDesc::dense(wtype, act, 4, cols);
    assert!(pack.kernels_for(&d(GgmlType::Q4_1, ActType::Q8_1, 64)).is_empty());
    assert!(pack.kernels_for(&d(GgmlType::Q4_0, ActType::F32, 64)).is_empty());
    assert!(pack.kernels_for(&d(GgmlType::Q8_0, ActType::F32, 40)).is_empty(), "not whole blocks");
    assert_eq!(pack.kernel_names(), KERNELS.map(|(n, _)| n.to_string()));
}

#[test]
fn smollm2_with_wasm_kernels_pinned_matches_builtin() {
    let Some(path) = smollm2() else { return };
    let options = ModelOptions { precision: Precision::Precise, ctx: 64, threads: 2, ..ModelOptions::default() };
    let prompt = "The capital of France is";
    let logits = |e: &Engine| {
        let ids = e.tokenizer.encode(prompt, false).unwrap();
        let mut s = e.new_session();
        e.model.forward_last(&mut s, &ids).unwrap().to_vec()
    };
    let want = logits(&Engine::load(&path, options.clone()).unwrap());

    let pack = load_pack();
    let mut registry = KernelRegistry::builtin();
    registry.add_provider(pack.clone());
    registry.pin("q4_1*f32", "wasm_q4_1_f32");
    registry.pin("q8_0*f32", "wasm_q8_0_f32");
    let e = Engine::load_with(&path, options, &registry).unwrap();
    let got = logits(&e);
    assert!(pack.weight_uploads() > 0, "the pinned wasm kernels ran");
    let uploads = pack.weight_uploads();
    let _ = logits(&e);
    assert_eq!(pack.weight_uploads(), uploads, "a second forward pass copies no weights");
    assert_eq!(got.len(), want.len());
    let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    eprintln!("smollm2 via wasm pack: {uploads} weight matrices resident, max |Δlogit| {d:.6}");
    assert!(d <= 0.01, "max |Δlogit| {d} > 0.01");
    assert!(!pack.is_disabled());
}
