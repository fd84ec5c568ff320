//! Ternary weights through a pack: a small Llama whose projections are
//! TQ2_0, written by this test, loaded with the cpu-portable pack linked
//! in. The host asks packs for `TERNARY_MAT_MUL` kernels for ternary
//! weights, so the pack's TQ2_0 kernel serves them and computes the
//! built-in kernel's numbers; its I2_S kernel serves them too, on an exact
//! repack of the TQ2_0 rows; and a matrix with no I2_S form (block scales
//! that differ along a row) falls back to the built-in kernel.

use std::sync::Arc;

use spinfer_engine::gguf::GgufFile;
use spinfer_engine::model::{Model, ModelOptions, Precision};
use spinfer_engine::packs::{NativePack, host_info};
use spinfer_engine::registry::KernelRegistry;
use spinfer_formats::fixtures::gguf::{Tensor, Value, build};
use spinfer_kernels::GgmlType;

const DIM: usize = 256;
const FFN: usize = 512;
const VOCAB: usize = 32;
const PROJECTIONS: [&str; 7] = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"];

/// A tiny deterministic generator (xorshift).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn f32(&mut self) -> f32 {
        (self.next() % 2001) as f32 / 1000.0 - 1.0
    }
}

/// `rows` TQ2_0 rows of `cols` weights: random codes in {0, 1, 2}; one
/// scale per row, or (`uneven`) one per block.
fn tq2_0(r: &mut Rng, rows: usize, cols: usize, uneven: bool) -> Vec<u8> {
    let mut out = Vec::new();
    for _ in 0..rows {
        let row_scale = 0.02 + 0.01 * r.f32().abs();
        for _ in 0..cols / 256 {
            for _ in 0..64 {
                out.push((0..4).fold(0u8, |b, i| b | (((r.next() % 3) as u8) << (2 * i))));
            }
            let d = if uneven { 0.02 + 0.01 * r.f32().abs() } else { row_scale };
            out.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
        }
    }
    out
}

fn f32s(r: &mut Rng, n: usize, scale: f32) -> Vec<u8> {
    (0..n).flat_map(|_| (r.f32() * scale).to_le_bytes()).collect()
}

/// A one-layer Llama (hidden 256, 4 heads, FFN 512, vocabulary 32) with
/// TQ2_0 projections; `uneven`: `ffn_down`'s block scales differ along its
/// rows (two blocks each).
fn ternary_model(uneven: bool) -> (tempfile::TempDir, GgufFile) {
    let mut r = Rng(0x9e37_79b9_7f4a_7c15);
    let u = |x: usize| Value::U32(x as u32);
    let kv = [
        ("general.architecture", Value::Str("llama".into())),
        ("llama.block_count", u(1)),
        ("llama.context_length", u(64)),
        ("llama.embedding_length", u(DIM)),
        ("llama.feed_forward_length", u(FFN)),
        ("llama.attention.head_count", u(4)),
        ("llama.attention.head_count_kv", u(4)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.rope.freq_base", Value::F32(10_000.0)),
        ("llama.vocab_size", u(VOCAB)),
    ];
    let ones: Vec<u8> = (0..DIM).flat_map(|_| 1.0f32.to_le_bytes()).collect();
    let (d, v) = (DIM as u64, VOCAB as u64);
    let mut tensors = vec![Tensor::new("token_embd.weight", &[d, v], GgmlType::F32, f32s(&mut r, DIM * VOCAB, 1.0))];
    for norm in ["blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"] {
        tensors.push(Tensor::new(norm, &[d], GgmlType::F32, ones.clone()));
    }
    for p in PROJECTIONS {
        // (cols, rows) of each projection.
        let (cols, rows) = match p {
            "ffn_gate" | "ffn_up" => (DIM, FFN),
            "ffn_down" => (FFN, DIM),
            _ => (DIM, DIM),
        };
        let data = tq2_0(&mut r, rows, cols, uneven && p == "ffn_down");
        tensors.push(Tensor::new(format!("blk.0.{p}.weight"), &[cols as u64, rows as u64], GgmlType::TQ2_0, data));
    }
    tensors.push(Tensor::new("output.weight", &[d, v], GgmlType::F32, f32s(&mut r, DIM * VOCAB, 0.5)));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ternary.gguf");
    std::fs::write(&path, build(&kv, &tensors)).unwrap();
    let g = GgufFile::open(&path).unwrap();
    (dir, g)
}

fn logits(m: &Model) -> Vec<f32> {
    let mut s = m.new_session();
    m.forward_last(&mut s, &[1, 7, 3, 30, 12]).unwrap().to_vec()
}

/// The built-in provider plus the cpu-portable pack, linked in.
fn with_pack() -> KernelRegistry {
    let pack = NativePack::linked(spinfer_pack_cpu_portable::instantiate_root_module(), &host_info()).unwrap();
    let mut r = KernelRegistry::builtin();
    r.add_provider(Arc::new(pack));
    r
}

fn load(g: &GgufFile, registry: &KernelRegistry, precision: Precision) -> Model {
    Model::load(g, registry, ModelOptions { precision, ctx: 64, threads: 2, ..ModelOptions::default() }).unwrap()
}

fn kernels(m: &Model) -> Vec<String> {
    m.linears().filter(|l| l.desc.wtype == GgmlType::TQ2_0).map(|l| l.kernel_name().to_string()).collect()
}

#[test]
fn the_packs_ternary_kernels_serve_tq2_0_weights() {
    let (_dir, g) = ternary_model(false);
    for precision in [Precision::Int8, Precision::Fast] {
        // The pack's TQ2_0 kernel, asked for as TERNARY_MAT_MUL, computes
        // what the built-in scalar kernel computes.
        let mut scalar = KernelRegistry::builtin();
        scalar.pin("tq2_0*q8_K", "scalar/tq2_0*q8_K");
        let want = logits(&load(&g, &scalar, precision));
        let mut registry = with_pack();
        registry.pin("tq2_0*q8_K", "cpu-portable/scalar/tq2_0*q8_K");
        let m = load(&g, &registry, precision);
        assert!(kernels(&m).iter().all(|k| k == "cpu-portable:scalar/tq2_0*q8_K"), "{:?}", kernels(&m));
        let got = logits(&m);
        assert!(want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()), "{precision:?}");

        // Its I2_S kernel, on the exact repack: the same sums, the scale
        // applied once per row instead of once per block.
        let mut registry = with_pack();
        registry.pin("tq2_0*q8_K", "cpu-portable/scalar/i2_s*q8_K");
        let m = load(&g, &registry, precision);
        assert!(kernels(&m).iter().all(|k| k == "cpu-portable:scalar/i2_s*q8_K"), "{:?}", kernels(&m));
        let got = logits(&m);
        let tol = want.iter().fold(0f32, |t, v| t.max(v.abs())) * 1e-4;
        let diff = want.iter().zip(&got).fold(0f32, |t, (a, b)| t.max((a - b).abs()));
        assert!(diff <= tol, "{precision:?}: max |Δ| {diff} > {tol}");
        assert!(m.linears().all(|l| !l.fell_back()));
    }
}

#[test]
fn a_matrix_without_an_i2_s_form_falls_back_to_the_builtin_kernel() {
    let (_dir, g) = ternary_model(true);
    let want = logits(&load(&g, &KernelRegistry::builtin(), Precision::Int8));
    let mut registry = with_pack();
    registry.pin("tq2_0*q8_K", "cpu-portable/scalar/i2_s*q8_K");
    let m = load(&g, &registry, Precision::Int8);
    let got = logits(&m);
    let down = m.linears().find(|l| l.name == "blk.0.ffn_down.weight").unwrap();
    assert!(down.fell_back(), "ffn_down has uneven block scales: no I2_S form");
    assert!(m.linears().filter(|l| l.name != "blk.0.ffn_down.weight").all(|l| !l.fell_back()));
    let tol = want.iter().fold(0f32, |t, v| t.max(v.abs())) * 1e-4;
    assert!(want.iter().zip(&got).all(|(a, b)| (a - b).abs() <= tol));
}
