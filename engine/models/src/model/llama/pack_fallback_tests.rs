//! A WASM pack's kernel serving a model's matrices, then trapping mid-pass.

use std::sync::Arc;

use spinfer_formats::fixtures::safetensors as st;
use spinfer_formats::safetensors::SafetensorsModel;
use spinfer_packs::fixtures::{MATVEC_TRAPS_ON_BATCH, pack, wat_module};
use spinfer_packs::{WasmFault, WasmLimits, WasmPack};

use crate::model::llama::Linear;
use crate::model::{Model, ModelOptions, Precision, Session};
use spinfer_kernel_select::registry::KernelRegistry;

/// A pack kernel that traps in the middle of a model's forward pass:
/// the error is typed, the pack disables itself, every matrix it served
/// moves to the built-in kernels, and the model keeps answering with
/// the built-in kernels' numbers.
#[test]
fn trapping_kernel_mid_model_falls_back_to_builtin() {
    let body = format!("(local $r i32) (local $c i32) (local $acc f32) {MATVEC_TRAPS_ON_BATCH}");
    let wasm = wat_module(1, &body);
    let (_d, vp) = pack("test-trap", 1, &wasm);
    let limits = WasmLimits { max_memory_bytes: 16 << 20, timeout_ms: 5_000, fuel: None, ..WasmLimits::default() };
    let p = Arc::new(WasmPack::load(&vp, limits).unwrap());

    let dir = st::write_dir(&st::config("llama"), &[("model.safetensors", st::st_bytes(&st::tiny(true, false)))]);
    let loader = SafetensorsModel::open(dir.path()).unwrap();
    let options = ModelOptions { precision: Precision::Precise, ctx: 16, threads: 1, ..ModelOptions::default() };
    let builtin = Model::load(&loader, &KernelRegistry::builtin(), options.clone()).unwrap();
    let mut registry = KernelRegistry::builtin();
    registry.add_provider(p.clone());
    registry.pin("matmul.f32", "test-trap/test_trap_f32");
    let model = Model::load(&loader, &registry, options).unwrap();
    assert!(model.linears().any(|l| l.kernel_name() == "test_trap_f32"));

    let logits = |m: &Model, s: &mut Session, toks: &[u32]| m.forward_last(s, toks).unwrap().to_vec();
    let (mut s_ref, mut s) = (builtin.new_session(), model.new_session());
    // One token: the pack's kernels serve and agree with the built-ins.
    let (want, got) = (logits(&builtin, &mut s_ref, &[3]), logits(&model, &mut s, &[3]));
    let tol = want.iter().fold(0.0f32, |m, v| m.max(v.abs())) * 1e-5;
    assert!(want.iter().zip(&got).all(|(a, b)| (a - b).abs() <= tol), "{want:?} vs {got:?}");
    assert!(model.linears().all(|l| !l.fell_back()));
    assert!(p.weight_uploads() >= 5, "the pack served q, k, v, o, down and the output");
    // A batch: the pack traps; the built-ins take over mid-pass.
    let (want, got) = (logits(&builtin, &mut s_ref, &[1, 2]), logits(&model, &mut s, &[1, 2]));
    assert!(matches!(p.fault(), Some(WasmFault::Trap(_))), "{:?}", p.fault());
    assert!(p.is_disabled());
    assert!(model.linears().filter(|l| l.kernel_name() == "test_trap_f32").all(Linear::fell_back));
    assert!(want.iter().zip(&got).all(|(a, b)| (a - b).abs() <= tol), "{want:?} vs {got:?}");
    // And the model keeps working.
    let (want, got) = (logits(&builtin, &mut s_ref, &[4]), logits(&model, &mut s, &[4]));
    assert!(want.iter().zip(&got).all(|(a, b)| (a - b).abs() <= tol), "{want:?} vs {got:?}");
}
