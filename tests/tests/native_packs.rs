//! Native kernel packs end to end: pack directory → sign → verify →
//! `NativePack::load` → registry → SmolLM2 logits through the pack's
//! kernels (the sparse FFN's gathered rows included), plus the refusals (tampered artefact, unsigned pack, a host the
//! pack does not run on).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use spinfer_engine::Engine;
use spinfer_engine::gguf::GgufFile;
use spinfer_engine::model::{ModelOptions, Precision};
use spinfer_engine::packs::{NativePack, host_info};
use spinfer_engine::registry::{KernelProvider, KernelRegistry};
use spinfer_engine::sparse::calibrate::{CalibrateOptions, calibrate};
use spinfer_engine::sparse::{CalibrationInfo, PredictorKind, SparsityOptions};
use spinfer_kernels::GgmlType;
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::kernel::ActType;
use spinfer_kernels::matmul::fast_act;
use spinfer_plugin_api::{CpuFeatureSet, HostInfo};
use spinfer_registry::{KeyPair, RegistryError, TrustPolicy, VerifiedPack, sha256_file, sign_pack, verify_pack};
use spinfer_tests::smollm2;

const PROMPT: &str = "The capital of France is";

/// The built library of pack `crate_stem` (`"cpu_simd"`).
fn lib(crate_stem: &str) -> PathBuf {
    let p = spinfer_tests::built_pack_libs().join(format!("libspinfer_pack_{crate_stem}.so"));
    assert!(p.exists(), "{} was not built", p.display());
    p
}

/// A pack directory `<root>/<name>` holding a copy of `library`, its
/// `pack.toml`, and `pack.sig` when `key` is given.
fn make_pack(root: &Path, name: &str, library: &Path, key: Option<&KeyPair>) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let file = format!("lib{}.so", name.replace('-', "_"));
    std::fs::copy(library, dir.join(&file)).unwrap();
    let sha = sha256_file(&dir.join(&file)).unwrap();
    let toml = format!(
        r#"name = "{name}"
version = "1.0.0"
abi_version = 1
kind = "native"
min_host_version = "0.1.0"
description = "test pack"

[artefact]
file = "{file}"
sha256 = "{sha}"

[[kernels]]
name = "q4_1_q8_1"
op = "matmul"
weight = "q4_1"
act = "q8_1"

[[kernels]]
name = "q8_0_q8_0"
op = "matmul"
weight = "q8_0"
act = "q8_0"
"#
    );
    std::fs::write(dir.join("pack.toml"), toml).unwrap();
    if let Some(key) = key {
        sign_pack(&dir, key).unwrap();
    }
    dir
}

/// A signed pack of `crate_stem`, verified against a policy trusting the key.
fn verified(root: &Path, name: &str, crate_stem: &str) -> VerifiedPack {
    let key = KeyPair::generate().unwrap();
    let dir = make_pack(root, name, &lib(crate_stem), Some(&key));
    verify_pack(&dir, &TrustPolicy::new().with_trusted(key.public_key())).unwrap()
}

/// The SIMD kernel prefix the cpu-simd pack offers first on this CPU.
fn simd_isa() -> Option<&'static str> {
    let f = CpuFeatures::detect();
    if f.has_avx512() {
        Some("avx512")
    } else if f.has_avx2() {
        Some("avx2")
    } else {
        None
    }
}

/// The prompt's last logits (prefill: a batch, split by tokens in a pack),
/// then those of one decoded token (one token, or the fast mode's two
/// planes: split by rows).
/// The logits after the prompt and after one greedy token. The prompt is
/// fed a token at a time: a pack kernel has one path for every call (the
/// ABI carries no prompt flag), while the built-in kernels run a prompt of
/// several tokens on their prompt path (AMX tiles where granted), which
/// rounds differently.
fn last_logits(e: &Engine) -> Vec<f32> {
    let ids = e.tokenizer.encode(PROMPT, false).unwrap();
    let mut s = e.new_session();
    for &id in &ids[..ids.len() - 1] {
        e.model.forward(&mut s, &[id]).unwrap();
    }
    let mut out = e.model.forward_last(&mut s, &ids[ids.len() - 1..]).unwrap().to_vec();
    let next = out.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32;
    out.extend_from_slice(e.model.forward_last(&mut s, &[next]).unwrap());
    out
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn smollm2_through_each_pack_matches_builtin_kernels() {
    let Some(model) = smollm2() else { return };
    let root = tempfile::tempdir().unwrap();
    let mut packs: Vec<(Arc<NativePack>, &str)> = Vec::new();
    let portable = NativePack::load(&verified(root.path(), "cpu-portable", "cpu_portable"), &host_info()).unwrap();
    packs.push((Arc::new(portable), "scalar"));
    let simd = NativePack::load(&verified(root.path(), "cpu-simd", "cpu_simd"), &host_info());
    match simd_isa() {
        Some(isa) => packs.push((Arc::new(simd.unwrap()), isa)),
        None => eprintln!("skipping cpu-simd: {}", simd.err().expect("scores 0 without avx2")),
    }

    for precision in [Precision::Int8, Precision::Fast] {
        let options = ModelOptions { precision, ctx: 64, threads: 2, ..ModelOptions::default() };
        let default = last_logits(&Engine::load_with(&model, options.clone(), &KernelRegistry::builtin()).unwrap());
        for (pack, isa) in &packs {
            // The built-in provider pinned to the same kernels of
            // spinfer-kernels: the pack must compute what they compute.
            let mut same = KernelRegistry::builtin();
            same.pin("q4_1*q8_1", format!("{isa}/q4_1*q8_1"));
            same.pin("q8_0*q8_0", format!("{isa}/q8_0*q8_0"));
            let want = last_logits(&Engine::load_with(&model, options.clone(), &same).unwrap());
            let mut registry = KernelRegistry::builtin();
            let q41 = format!("{}:{isa}/q4_1*q8_1", pack.pack_name());
            let q80 = format!("{}:{isa}/q8_0*q8_0", pack.pack_name());
            registry.pin("q4_1*q8_1", q41.clone());
            registry.pin("q8_0*q8_0", q80.clone());
            let provider = pack.name().to_string();
            registry.add_provider(Arc::clone(pack) as Arc<dyn KernelProvider>);
            let e = Engine::load_with(&model, options.clone(), &registry).unwrap();
            let mut pinned = 0;
            for lin in e.model.linears() {
                let key = format!("{}*{}", lin.desc.wtype.name(), lin.desc.act.name());
                if key == "q4_1*q8_1" || key == "q8_0*q8_0" {
                    assert_eq!(lin.provider(), provider, "{}", lin.name);
                    assert!(lin.kernel_name() == q41 || lin.kernel_name() == q80, "{}", lin.kernel_name());
                    pinned += 1;
                }
            }
            assert!(pinned > 0, "no linear ran through {provider}");
            let got = last_logits(&e);
            let d = max_abs_diff(&got, &want);
            let d_default = max_abs_diff(&got, &default);
            eprintln!(
                "{provider} {precision:?}: {pinned} linears through the pack, max |Δlogit| {d:.5} vs built-in \
                 {isa} kernels, {d_default:.5} vs the built-in default"
            );
            assert!(d <= 0.3, "{provider} {precision:?}: max |Δlogit| {d} > 0.3 vs built-in {isa} kernels");
        }
    }
}

/// Fast mode feeds the built-in kernels the activation format
/// `fast_act` picks for the CPU (one 16-bit plane for the 32-element
/// formats without AVX-512 VNNI), but a pin on the 8-bit planes' operation
/// stands (as a pack chosen for it does: the test above).
#[test]
fn fast_mode_takes_fast_act_unless_a_pin_says_otherwise() {
    let Some(model) = smollm2() else { return };
    let options = ModelOptions { precision: Precision::Fast, ctx: 64, threads: 1, ..ModelOptions::default() };
    let features = CpuFeatures::detect();
    let e = Engine::load_with(&model, options.clone(), &KernelRegistry::builtin()).unwrap();
    let mut checked = 0;
    for lin in e.model.linears().filter(|l| matches!(l.desc.wtype, GgmlType::Q4_1 | GgmlType::Q8_0)) {
        assert_eq!(lin.desc.act, fast_act(&features, lin.desc.wtype), "{}", lin.name);
        checked += 1;
    }
    assert!(checked > 0);
    let mut pinned = KernelRegistry::builtin();
    pinned.pin("q4_1*q8_1", "scalar/q4_1*q8_1");
    let e = Engine::load_with(&model, options, &pinned).unwrap();
    for lin in e.model.linears().filter(|l| l.desc.wtype == GgmlType::Q4_1) {
        assert_eq!(lin.desc.act, ActType::Q8_1, "{}", lin.name);
        assert_eq!(lin.kernel_name(), "scalar/q4_1*q8_1");
    }
}

#[test]
fn provider_is_named_by_id_and_artefact_hash() {
    let root = tempfile::tempdir().unwrap();
    let v = verified(root.path(), "cpu-portable", "cpu_portable");
    let sha = v.manifest().artefact.sha256.clone();
    let pack = NativePack::load(&v, &host_info()).unwrap();
    let name = pack.name().to_string();
    assert_eq!(name, format!("cpu-portable@1.0.0#{}", &sha[..12]));
    assert_eq!(pack.score(), 1);
    assert!(pack.kernel_descs().any(|d| d.name.as_str() == "scalar/q4_1*q8_1"));
}

#[test]
fn simd_pack_scores_zero_without_avx2() {
    let root = tempfile::tempdir().unwrap();
    let v = verified(root.path(), "cpu-simd", "cpu_simd");
    let host = HostInfo { cpu_features: CpuFeatureSet::FMA.with(CpuFeatureSet::F16C), ..host_info() };
    let Err(e) = NativePack::load(&v, &host) else { panic!("loaded on a host without avx2") };
    let msg = e.to_string();
    assert!(msg.starts_with("pack cpu-simd@1.0.0: scores 0 on this host"), "{msg}");
    if simd_isa().is_some() {
        let pack = NativePack::load(&v, &host_info()).unwrap();
        assert!(pack.score() > 1);
    }
}

#[test]
fn tampered_artefact_is_refused_at_verify() {
    let root = tempfile::tempdir().unwrap();
    let key = KeyPair::generate().unwrap();
    let dir = make_pack(root.path(), "cpu-simd", &lib("cpu_simd"), Some(&key));
    let policy = TrustPolicy::new().with_trusted(key.public_key());
    verify_pack(&dir, &policy).unwrap();
    let so = dir.join("libcpu_simd.so");
    let mut bytes = std::fs::read(&so).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x01;
    std::fs::write(&so, bytes).unwrap();
    let e = verify_pack(&dir, &policy).unwrap_err();
    assert!(matches!(e, RegistryError::ArtefactHashMismatch { .. }), "{e}");
}

#[test]
fn unsigned_pack_is_refused_unless_allowed() {
    let root = tempfile::tempdir().unwrap();
    let dir = make_pack(root.path(), "cpu-portable", &lib("cpu_portable"), None);
    let trusted = KeyPair::generate().unwrap().public_key();
    let e = verify_pack(&dir, &TrustPolicy::new().with_trusted(trusted)).unwrap_err();
    assert!(matches!(e, RegistryError::Unsigned { .. }), "{e}");
    let v = verify_pack(&dir, &TrustPolicy::new().with_unsigned_allowed(true)).unwrap();
    assert!(v.is_unsigned());
    let pack = NativePack::load(&v, &host_info()).unwrap();
    assert_eq!(pack.id(), "cpu-portable@1.0.0");
}

#[test]
fn untrusted_signer_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let key = KeyPair::generate().unwrap();
    let dir = make_pack(root.path(), "cpu-portable", &lib("cpu_portable"), Some(&key));
    let other = KeyPair::generate().unwrap().public_key();
    let e = verify_pack(&dir, &TrustPolicy::new().with_trusted(other)).unwrap_err();
    assert!(matches!(e, RegistryError::UntrustedKey { .. }), "{e}");
}

/// A gate-threshold sidecar (50%, and 40% of the attention output's
/// inputs) for `model` from a short calibration, written under `dir`, with
/// no dense fallback.
fn gt50_sidecar(model: &Path, dir: &Path) -> SparsityOptions {
    let builtin = Engine::load_with(
        model,
        ModelOptions { precision: Precision::Fast, ctx: 128, threads: 2, ..ModelOptions::default() },
        &KernelRegistry::builtin(),
    )
    .unwrap();
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(40);
    let mut tokens = builtin.tokenizer.encode(&text, false).unwrap();
    tokens.truncate(256);
    let opts = CalibrateOptions {
        target_sparsity: 0.5,
        predictor: PredictorKind::GateThreshold,
        window: 128,
        info: CalibrationInfo::default(),
        rank: 0,
        recall_target: 0.95,
        attn_sparsity: 0.4,
    };
    let sidecar =
        calibrate(&builtin.model, &GgufFile::open(model).unwrap(), &tokens, &opts, &mut |_, _, _| {}).unwrap();
    let path = dir.join("gt50.spinfer");
    sidecar.write(&path).unwrap();
    let mut so = SparsityOptions::new(&path);
    so.dense_above = 1.0;
    so
}

/// Who serves each layer's sparse down projection.
fn down_providers(e: &Engine) -> Vec<String> {
    let sparse = e.model.sparse.as_ref().expect("a sparse model");
    sparse.layers.iter().map(|l| l.down.provider().to_string()).collect()
}

/// Who serves each layer's input-sparse attention output (`W_o`).
fn attn_output_providers(e: &Engine) -> Vec<String> {
    let sparse = e.model.sparse.as_ref().expect("a sparse model");
    sparse.layers.iter().map(|l| l.attn_o.as_ref().expect("W_o thresholds").w.provider().to_string()).collect()
}

/// The sparse FFN's gate and up rows run through the pack's gathered-row
/// kernel (`GATHERED_ROW_MAT_VEC`, the ABI's `run_sparse`) when the dense
/// product is the pack's, and give what the same built-in kernel gives.
#[test]
fn sparse_gate_and_up_rows_run_through_the_pack() {
    let Some(model) = smollm2() else { return };
    let root = tempfile::tempdir().unwrap();
    let options = |sparsity| ModelOptions {
        precision: Precision::Fast,
        ctx: 64,
        threads: 2,
        sparsity,
        ..ModelOptions::default()
    };
    let so = gt50_sidecar(&model, root.path());

    // The scalar kernels, built in and from cpu-portable.
    let mut same = KernelRegistry::builtin();
    same.pin("q4_1*q8_1", "scalar/q4_1*q8_1");
    let want = Engine::load_with(&model, options(Some(so.clone())), &same).unwrap();
    let pack =
        Arc::new(NativePack::load(&verified(root.path(), "cpu-portable", "cpu_portable"), &host_info()).unwrap());
    let mut registry = KernelRegistry::builtin();
    registry.pin("q4_1*q8_1", "cpu-portable:scalar/q4_1*q8_1");
    registry.add_provider(Arc::clone(&pack) as Arc<dyn KernelProvider>);
    let got = Engine::load_with(&model, options(Some(so)), &registry).unwrap();
    let mut through_pack = 0;
    for lin in got.model.linears().filter(|l| l.name.contains("ffn_gate") || l.name.contains("ffn_up")) {
        assert_eq!(lin.rows_provider(), pack.name(), "{}", lin.name);
        through_pack += 1;
    }
    assert_eq!(through_pack, 2 * got.model.config.n_layers);
    for lin in want.model.linears().filter(|l| l.name.contains("ffn_up")) {
        assert_eq!(lin.rows_provider(), "cpu-builtin", "{}", lin.name);
    }
    // The down projection follows the dense product to the pack: its
    // scalar int8 AXPY.
    assert!(down_providers(&got).iter().all(|p| p == pack.name()));
    assert!(down_providers(&want).iter().all(|p| p == "cpu-builtin"));
    // The same scalar code on both sides, rows independent of how they
    // are split over threads: the same bits. (The built-in int8 AXPY is
    // the scalar one's bits where the CPU has AVX-512 VNNI and VBMI.)
    let (a, b) = (last_logits(&want), last_logits(&got));
    if spinfer_sparse_kernels::NeuronMajor::axpy_fast_is_int8() {
        assert_eq!(max_abs_diff(&a, &b), 0.0, "sparse logits through cpu-portable differ from the built-in kernels");
    } else {
        // Elsewhere the built-in AXPY uses exact f32 coefficients, the
        // pack int8 ones; at 50% sparsity the gate threshold then keeps
        // other neurons in later layers, and the prompt's last logits move
        // by several units (3.8 on an AVX2 EPYC, where sparse and dense
        // differ by 6.7). What must hold: the two sparse paths are closer
        // to each other than sparsity itself moves the logits.
        let dense = last_logits(&Engine::load_with(&model, options(None), &same).unwrap());
        let v = want.model.config.vocab_size;
        let (d, sparsity) = (max_abs_diff(&a[..v], &b[..v]), max_abs_diff(&a[..v], &dense[..v]));
        assert!(
            a.iter().chain(&b).all(|x| x.is_finite()) && d < sparsity,
            "sparse logits through cpu-portable differ from the built-in kernels by {d}, more than sparsity moves them ({sparsity})"
        );
    }
}

/// The sparse down projection and the input-sparse attention output run
/// through the pack's gathered-column AXPY (`GATHERED_COLUMN_AXPY`) when
/// the dense product is the pack's, in each precision, and give the
/// built-in AXPY's bits (cpu-simd's kernels are the built-in ones for the
/// best instruction set of this CPU).
#[test]
fn sparse_down_projection_runs_through_the_pack() {
    let Some(model) = smollm2() else { return };
    let Some(isa) = simd_isa() else { return };
    let root = tempfile::tempdir().unwrap();
    let so = gt50_sidecar(&model, root.path());
    let pack = Arc::new(NativePack::load(&verified(root.path(), "cpu-simd", "cpu_simd"), &host_info()).unwrap());
    let mut registry = KernelRegistry::builtin();
    registry.add_provider(Arc::clone(&pack) as Arc<dyn KernelProvider>);
    // The built-in kernels the pack wraps, pinned: without the pin, fast
    // mode would feed one 16-bit plane where that pays (`fast_act`).
    let mut builtin = KernelRegistry::builtin();
    builtin.pin("q4_1*q8_1", format!("{isa}/q4_1*q8_1"));
    builtin.pin("q8_0*q8_0", format!("{isa}/q8_0*q8_0"));
    for precision in [Precision::Precise, Precision::Fast] {
        let options = ModelOptions {
            precision,
            ctx: 64,
            threads: 2,
            sparsity: Some(so.clone()),
            mem_budget: None,
            ..ModelOptions::default()
        };
        let want = Engine::load_with(&model, options.clone(), &builtin).unwrap();
        let got = Engine::load_with(&model, options, &registry).unwrap();
        assert!(got.model.linears().all(|l| l.provider() == pack.name()), "{precision:?}: dense kernels from the pack");
        let int8_offered = spinfer_sparse_kernels::NeuronMajor::axpy_fast_is_int8();
        let from_pack = precision == Precision::Precise || int8_offered;
        let provider = if from_pack { pack.name() } else { "cpu-builtin" };
        assert!(down_providers(&got).iter().all(|p| p == provider), "{precision:?}: {:?}", down_providers(&got));
        let wo = attn_output_providers(&got);
        assert!(wo.iter().all(|p| p == provider), "{precision:?}: W_o from {wo:?}");
        assert!(attn_output_providers(&want).iter().all(|p| p == "cpu-builtin"));
        let (a, b) = (last_logits(&want), last_logits(&got));
        assert_eq!(max_abs_diff(&a, &b), 0.0, "{precision:?}: sparse logits through cpu-simd differ");
    }
}
