//! Decode under one memory budget (`ModelOptions::mem_budget`,
//! `--mem-budget-mb`): placement changes where weights live, never the
//! result; a budget too small is a clear error; a storage failure is an
//! error, not a panic.

use std::path::Path;

use spinfer_engine::Engine;
use spinfer_engine::generate::GenerateParams;
use spinfer_engine::head::{HeadBuildOptions, HeadCalibration, HeadIndex};
use spinfer_engine::model::{ModelOptions, Precision, Session};
use spinfer_engine::registry::KernelRegistry;
use spinfer_tests::{data, gemma3, reference, smollm2};

fn load(path: &Path, precision: Precision, mem_budget: Option<u64>) -> Engine {
    Engine::load(path, ModelOptions { precision, ctx: 128, threads: 2, mem_budget, ..ModelOptions::default() }).unwrap()
}

/// The prompt's last logits and 12 greedy tokens after it.
fn run(e: &Engine, prompt: &[u32]) -> (Vec<f32>, Vec<u32>) {
    let mut s = e.model.new_session();
    let logits = e.model.forward_last(&mut s, prompt).unwrap().to_vec();
    let mut tok = argmax(&logits);
    let mut greedy = vec![tok];
    for _ in 0..11 {
        e.model.forward(&mut s, &[tok]).unwrap();
        tok = argmax(e.model.next_token_logits(&mut s).unwrap());
        greedy.push(tok);
    }
    let st = s.stream_stats();
    if e.model.memory.as_ref().is_some_and(|m| m.placement.streams()) {
        let st = st.expect("a streaming session has stream counters");
        assert!(st.bytes_read > 0 && st.prefetch_hits + st.stalls > 0, "{st:?}");
    }
    (logits, greedy)
}

/// Whether this process holds CAP_IPC_LOCK (bit 14 of the effective set),
/// so `mlock` is not bounded by RLIMIT_MEMLOCK.
fn may_lock_any() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let caps = status.lines().find_map(|l| l.strip_prefix("CapEff:")).map(str::trim).unwrap_or("0");
    u64::from_str_radix(caps, 16).is_ok_and(|c| c & (1 << 14) != 0)
}

fn argmax(x: &[f32]) -> u32 {
    x.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32
}

/// Budgets that stream part of the model (and, the smallest, most of it):
/// the logits and greedy tokens are those of the unbudgeted engine, bit for
/// bit, in each precision.
fn identical_under_budgets(path: &Path, prompt: &[u32], budgets_mb: &[u64]) {
    for precision in [Precision::Fast, Precision::Precise, Precision::Int8] {
        let want = run(&load(path, precision, None), prompt);
        for &mb in budgets_mb {
            let e = load(path, precision, Some(mb * 1_000_000));
            let memory = e.model.memory.as_ref().expect("a memory plan");
            let plan = &memory.placement;
            assert!(plan.streams(), "{mb} MB: nothing streamed, the test checks nothing");
            // Resident weights are locked in memory where the process may
            // lock any amount (CAP_IPC_LOCK); elsewhere RLIMIT_MEMLOCK
            // bounds it, shared with the tests running beside this one.
            if may_lock_any() {
                assert_eq!(memory.pinned_bytes, plan.resident_bytes, "{mb} MB: resident weights not all locked");
            } else {
                eprintln!("memory_budget: no CAP_IPC_LOCK, so mlock of resident weights is not checked");
            }
            let got = run(&e, prompt);
            assert_eq!(got.1, want.1, "{precision:?}, {mb} MB: greedy tokens differ");
            assert!(got.0 == want.0, "{precision:?}, {mb} MB: logits differ from the unbudgeted engine's");
        }
    }
}

#[test]
fn smollm2_under_a_budget_gives_the_unbudgeted_logits_and_text() {
    let Some(path) = smollm2() else { return };
    let prompt = &reference().prompts[0].input_ids;
    identical_under_budgets(&path, prompt, &[70, 30]);
}

#[test]
fn gemma3_under_a_budget_gives_the_unbudgeted_logits_and_text() {
    let Some(path) = gemma3() else { return };
    let prompt = &spinfer_tests::gemma3_reference().prompts[0].input_ids;
    identical_under_budgets(&path, prompt, &[120]);
}

/// With the sparse output head, the dense head leaves the streamed cycle;
/// next-token logits and greedy tokens are still the unbudgeted engine's
/// (with the same sparse head).
#[test]
fn the_sparse_head_under_a_budget_gives_the_unbudgeted_logits() {
    let Some(path) = smollm2() else { return };
    let mut plain = load(&path, Precision::Fast, None);
    let text = String::from_utf8_lossy(&std::fs::read(data("wikitext-2-raw/wiki.test.raw")).unwrap()[300_000..])
        .replace("\r\n", "\n");
    let tokens = plain.tokenizer.encode(&text, false).unwrap();
    let mut s = plain.new_session();
    let calib = HeadCalibration::from_tokens(&plain.model, &mut s, &tokens, 2048, 1024).unwrap();
    let o = HeadBuildOptions { cluster_rows: 16, iters: 2, ..HeadBuildOptions::default() };
    let idx = HeadIndex::build(&plain.model, s.pool(), &o, &calib, &mut |_, _| {}).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("smol.spinfer-head");
    idx.save(&file).unwrap();
    let want_model = HeadIndex::model_of(&plain.model);
    let registry = KernelRegistry::builtin();
    plain.model.set_sparse_head(Some(idx), 64, &registry).unwrap();
    let prompt = &reference().prompts[0].input_ids;
    let next = |e: &Engine, s: &mut Session| -> spinfer_engine::Result<Vec<f32>> {
        e.model.forward(s, prompt)?;
        Ok(e.model.next_token_logits(s)?.to_vec())
    };
    let want_logits = next(&plain, &mut plain.model.new_session()).unwrap();
    let want = run(&plain, prompt);
    // 30 MB: most of the model streams, with the dense head or without;
    // 90 MB: what the dense head leaves is room for all the rest; 150 MB:
    // all of it fits, and the dense head's resident copy, which also served
    // the tied token embedding, is given up (embedding rows are then read
    // from the file).
    for budget in [30_000_000, 90_000_000, 150_000_000] {
        let mut budgeted = load(&path, Precision::Fast, Some(budget));
        let plan = |e: &Engine| e.model.memory.as_ref().unwrap().placement.clone();
        let before = plan(&budgeted);
        let mut opened_before = budgeted.model.new_session();
        budgeted.model.set_sparse_head(Some(HeadIndex::load(&file, &want_model).unwrap()), 64, &registry).unwrap();
        let after = plan(&budgeted);
        if budget == 150_000_000 {
            let head = budgeted.model.weights.output.weight_bytes() as u64;
            assert_eq!((before.streamed_bytes, after.streamed_bytes), (0, 0));
            assert_eq!(after.resident_bytes, before.resident_bytes - head, "the dense head's copy is freed");
        } else {
            assert!(
                after.streamed_bytes < before.streamed_bytes,
                "the dense head is no longer streamed: {} -> {} bytes per step",
                before.streamed_bytes,
                after.streamed_bytes
            );
        }
        let f = after.fixed;
        assert!(f.session + f.work + after.ring_bytes + after.resident_bytes <= budget, "{after:?}");
        if budget >= 90_000_000 {
            assert_eq!((after.streamed_bytes, after.ring_bytes, after.streams()), (0, 0, false), "{after:?}");
        }
        assert_eq!(run(&budgeted, prompt).1, want.1, "greedy tokens differ at {budget}");
        let got = next(&budgeted, &mut budgeted.model.new_session()).unwrap();
        assert!(got == want_logits, "sparse-head logits differ under a budget of {budget}");
        // A session opened before the plan changed reads the right bytes
        // or says why it cannot.
        match next(&budgeted, &mut opened_before) {
            Ok(l) => assert!(l == want_logits, "a session opened before the change gives other logits"),
            Err(e) => assert!(e.to_string().contains("memory plan changed"), "{e}"),
        }
    }
}

/// The engine's metrics sum what its requests read from storage.
#[test]
fn engine_metrics_count_what_requests_read_from_storage() {
    let Some(path) = smollm2() else { return };
    let unbudgeted = load(&path, Precision::Fast, None);
    let params = GenerateParams { max_tokens: 6, ..GenerateParams::default() };
    unbudgeted.generate("The capital of France is", &params).unwrap();
    assert!(unbudgeted.metrics().storage.is_none(), "nothing is streamed without a budget");
    let e = load(&path, Precision::Fast, Some(30_000_000));
    let out = e.generate("The capital of France is", &params).unwrap();
    let per_step = e.model.memory.as_ref().unwrap().streamed_bytes();
    let st = e.metrics().storage.expect("storage counters under a streaming budget");
    // Every forward step reads the streamed matrices once (the prompt is
    // one step of up to 64 tokens, then one per generated token but the
    // last): at least that, and not more than one ring's read-ahead above.
    let steps = out.tokens.len() as u64;
    assert!(st.bytes_read >= per_step * steps, "{st:?}, {per_step} per step, {steps} steps");
    assert!(st.bytes_read <= per_step * (steps + 1) + 8_000_000, "{st:?}, {per_step} per step, {steps} steps");
}

#[test]
fn a_budget_below_the_least_names_both_figures() {
    let Some(path) = smollm2() else { return };
    let options = ModelOptions { ctx: 128, threads: 2, mem_budget: Some(1_000_000), ..ModelOptions::default() };
    let Err(e) = Engine::load(&path, options) else { panic!("1 MB is too small") };
    let e = e.to_string();
    assert!(e.contains("--mem-budget-mb") && e.contains("1.0 MB") && e.contains("need at least"), "{e}");
}

/// The model file is truncated under a loaded, streaming engine: the next
/// step's read fails with an error naming the tensor, the process goes on.
#[test]
fn a_model_file_truncated_underneath_is_an_error() {
    let Some(path) = smollm2() else { return };
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("model.gguf");
    std::fs::copy(&path, &copy).unwrap();
    let e = load(&copy, Precision::Fast, Some(30_000_000));
    let mut s = e.model.new_session();
    e.model.forward(&mut s, &[1, 2, 3]).unwrap();
    let len = std::fs::metadata(&copy).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&copy).unwrap().set_len(len / 4).unwrap();
    let mut err = None;
    for _ in 0..4 {
        match e.model.forward(&mut s, &[4]).and_then(|()| e.model.next_token_logits(&mut s).map(drop)) {
            Ok(()) => {}
            Err(x) => {
                err = Some(x.to_string());
                break;
            }
        }
    }
    let err = err.expect("reading past the end of the truncated file fails");
    assert!(err.contains("reading") && err.contains(".weight"), "{err}");
}
