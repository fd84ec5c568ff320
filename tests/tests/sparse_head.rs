//! The sparse output head on real models: an index built from the head's
//! rows (and a hot set from WikiText-2 text past the evaluation windows)
//! gives the dense head's greedy continuations of the reference prompts,
//! exact logits on the rows it computes and finite stand-ins below the
//! best of them elsewhere; an index of another model or a damaged one is
//! refused with a clear error.

use std::ops::ControlFlow;
use std::path::Path;

use spinfer_engine::Engine;
use spinfer_engine::generate::{GenerateParams, generate};
use spinfer_engine::head::{HeadBuildOptions, HeadCalibration, HeadIndex};
use spinfer_engine::model::{ModelOptions, Precision};
use spinfer_engine::registry::KernelRegistry;
use spinfer_engine::sampling::SamplerParams;
use spinfer_tests::{Reference, data, gemma3, gemma3_reference, reference, smollm2};

fn engine(path: &Path) -> Engine {
    Engine::load(path, ModelOptions { precision: Precision::Fast, ctx: 512, threads: 2, ..ModelOptions::default() })
        .unwrap()
}

/// An index of `e`'s head from WikiText-2's test split from byte 300,000
/// on (the reference prompts and perplexity windows lie before it): its
/// `hot` most frequent tokens as hot rows, the others in clusters of
/// `cluster_rows` in the metric of its first `positions` positions. With
/// 16,384 positions and 6 rounds, what `spinfer calibrate-head --text
/// wiki.test.raw --offset 300000` builds.
fn index(e: &Engine, (cluster_rows, hot, positions, iters): (usize, usize, usize, usize)) -> HeadIndex {
    let bytes = std::fs::read(data("wikitext-2-raw/wiki.test.raw")).unwrap();
    let calib = String::from_utf8_lossy(&bytes[300_000..]).replace("\r\n", "\n");
    let tokens = e.tokenizer.encode(&calib, false).unwrap();
    let mut s = e.new_session();
    let calib = HeadCalibration::from_tokens(&e.model, &mut s, &tokens, hot, positions).unwrap();
    let o = HeadBuildOptions { cluster_rows, iters, ..HeadBuildOptions::default() };
    HeadIndex::build(&e.model, s.pool(), &o, &calib, &mut |_, _| {}).unwrap()
}

/// A quickly built index (its quality is not what the test is about).
fn small_index(e: &Engine) -> HeadIndex {
    index(e, (16, 2048, 1024, 2))
}

fn greedy(e: &Engine, prompt: &str, n: usize, add_bos: bool) -> Vec<u32> {
    let params = GenerateParams {
        max_tokens: n,
        sampler: SamplerParams::greedy(),
        stop: vec![],
        add_bos: Some(add_bos),
        ..Default::default()
    };
    let mut s = e.new_session();
    generate(&e.model, &e.tokenizer, &mut s, prompt, &params, &mut |_| ControlFlow::Continue(())).unwrap().tokens
}

/// Greedy continuations with the sparse head equal the dense head's, and
/// the logits it hands the sampler are exact where computed, below the
/// best computed one elsewhere, and finite everywhere.
fn sparse_head_keeps_greedy(
    model: &Path,
    r: &Reference,
    add_bos: bool,
    (cluster_rows, hot, probes): (usize, usize, usize),
) {
    let mut e = engine(model);
    let dense: Vec<Vec<u32>> = r.prompts.iter().map(|p| greedy(&e, &p.text, p.greedy_ids.len(), add_bos)).collect();
    let idx = index(&e, (cluster_rows, hot, 16384, 6));
    e.model.set_sparse_head(Some(idx), probes, &KernelRegistry::builtin()).unwrap();
    for (p, want) in r.prompts.iter().zip(&dense) {
        assert_eq!(&greedy(&e, &p.text, p.greedy_ids.len(), add_bos), want, "{:?}", p.text);
        let ids = e.tokenizer.encode(&p.text, add_bos).unwrap();
        let mut s = e.new_session();
        e.model.forward(&mut s, &ids).unwrap();
        let full = e.model.logits(&mut s, ids.len() - 1..ids.len()).unwrap().to_vec();
        let sparse = e.model.next_token_logits(&mut s).unwrap().to_vec();
        let exact: Vec<usize> = (0..full.len()).filter(|&i| sparse[i] == full[i]).collect();
        let best = exact.iter().map(|&i| full[i]).fold(f32::NEG_INFINITY, f32::max);
        assert!(exact.len() >= r.prompts.len(), "too few exact rows");
        assert!(sparse.iter().all(|l| l.is_finite()));
        let above = (0..full.len()).filter(|&i| sparse[i] > best).count();
        assert_eq!(above, 0, "{:?}: {above} stand-ins above the best exact logit", p.text);
        assert_eq!(s.head_stats().tokens, 1);
    }
}

#[test]
fn smollm2_sparse_head_keeps_greedy() {
    let Some(m) = smollm2() else { return };
    sparse_head_keeps_greedy(&m, &reference(), false, (16, 2048, 644));
}

#[test]
fn gemma3_sparse_head_keeps_greedy() {
    let Some(m) = gemma3() else { return };
    sparse_head_keeps_greedy(&m, &gemma3_reference(), true, (64, 4096, 378));
}

#[test]
fn head_index_round_trips_and_bad_ones_are_refused() {
    let Some(m) = smollm2() else { return };
    let e = engine(&m);
    let idx = small_index(&e);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("smol.spinfer-head");
    idx.save(&path).unwrap();
    let want = HeadIndex::model_of(&e.model);
    let back = HeadIndex::load(&path, &want).unwrap();
    assert_eq!((back.clusters(), back.hot()), (idx.clusters(), idx.hot()));
    assert!((0..idx.clusters()).all(|c| back.members(c) == idx.members(c)));

    // Another model's head: refused naming both.
    if let Some(g) = gemma3() {
        let gemma = engine(&g);
        let err = HeadIndex::load(&path, &HeadIndex::model_of(&gemma.model)).err().unwrap().to_string();
        assert!(err.contains("llama") && err.contains("gemma3") && err.contains("49152"), "{err}");
    }
    // Damaged files: clear errors naming the file, never a panic.
    let bytes = std::fs::read(&path).unwrap();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("bad magic", [b"NOTAHEAD".as_slice(), &bytes[8..]].concat()),
        ("the first format", [b"SPHEAD01".as_slice(), &bytes[8..]].concat()),
        ("truncated", bytes[..bytes.len() - 7].to_vec()),
        ("empty", Vec::new()),
        ("huge header", [&bytes[..8], &u32::MAX.to_le_bytes()[..], &bytes[12..]].concat()),
    ];
    for (what, b) in cases {
        std::fs::write(&path, &b).unwrap();
        let err = HeadIndex::load(&path, &want).err().unwrap_or_else(|| panic!("{what}: accepted"));
        assert!(err.to_string().contains("smol.spinfer-head"), "{what}: {err}");
    }
    std::fs::write(&path, [b"SPHEAD01".as_slice(), &bytes[8..]].concat()).unwrap();
    let err = HeadIndex::load(&path, &want).err().unwrap().to_string();
    assert!(err.contains("earlier spinfer") && err.contains("calibrate-head"), "{err}");
    // A member listed twice (the second cluster's first row repeats the first's).
    let hlen = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
    let members = 12 + hlen + 4 * (idx.clusters() + 1);
    let mut dup = bytes.clone();
    let first = dup[members..members + 4].to_vec();
    dup[members + 4..members + 8].copy_from_slice(&first);
    std::fs::write(&path, &dup).unwrap();
    let err = HeadIndex::load(&path, &want).err().unwrap().to_string();
    assert!(err.contains("listed twice"), "{err}");
}

/// The cluster-ordered copy of the head gives the same logits as reading
/// the rows in place; a copy that is not the one the index names is
/// refused.
#[test]
fn cluster_ordered_rows_give_the_in_place_logits() {
    let Some(m) = smollm2() else { return };
    let mut e = engine(&m);
    let mut built = small_index(&e);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("smol.spinfer-head");
    built.write_rows(&e.model, &path).unwrap();
    built.save(&path).unwrap();
    let want = HeadIndex::model_of(&e.model);
    let ids = e.tokenizer.encode("The capital of France is", false).unwrap();
    let mut logits = Vec::new();
    for with_rows in [false, true] {
        let loaded = HeadIndex::load(&path, &want).unwrap();
        assert!(loaded.has_rows());
        let idx = if with_rows { loaded } else { small_index(&e) };
        e.model.set_sparse_head(Some(idx), 500, &KernelRegistry::builtin()).unwrap();
        assert_eq!(e.model.head.as_ref().unwrap().rows.is_some(), with_rows);
        let mut s = e.new_session();
        e.model.forward(&mut s, &ids).unwrap();
        logits.push(e.model.next_token_logits(&mut s).unwrap().to_vec());
    }
    assert_eq!(logits[0], logits[1]);
    // A copy changed after the index was written.
    let rows = spinfer_engine::head::rows_path(&path);
    let mut b = std::fs::read(&rows).unwrap();
    b[1000] ^= 1;
    std::fs::write(&rows, &b).unwrap();
    let err = HeadIndex::load(&path, &want).err().unwrap().to_string();
    assert!(err.contains("sha256") && err.contains(".rows"), "{err}");
    std::fs::remove_file(&rows).unwrap();
    assert!(HeadIndex::load(&path, &want).is_err());
}
