//! Several requests in one forward step (`Model::forward_batch`, what the
//! server's continuous batching runs): each request's logits and greedy
//! tokens are those it gets alone.

use std::path::Path;

use spinfer_engine::Engine;
use spinfer_engine::model::{ModelOptions, Precision};
use spinfer_tests::{gemma3, smollm2};

fn load(path: &Path, precision: Precision) -> Engine {
    Engine::load(path, ModelOptions { precision, ctx: 256, threads: 2, ..ModelOptions::default() }).unwrap()
}

fn argmax(x: &[f32]) -> u32 {
    x.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32
}

/// The last is longer than three of attention's query blocks (12 rows), so
/// its chunks cut those blocks differently from the prompt read whole.
const PROMPTS: [&str; 5] = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "Water boils at",
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable \
     metal type, oil-based inks and a wooden press adapted from those used to make wine, and",
];

/// Greedy decode of `steps` tokens for one prompt alone: the logits of
/// every step.
fn alone(e: &Engine, prompt: &str, steps: usize) -> Vec<Vec<f32>> {
    let ids = e.tokenize(prompt).unwrap();
    let mut s = e.model.new_session();
    e.model.forward(&mut s, &ids).unwrap();
    let mut out = vec![e.model.next_token_logits(&mut s).unwrap().to_vec()];
    for _ in 1..steps {
        let tok = argmax(out.last().unwrap());
        e.model.forward(&mut s, &[tok]).unwrap();
        out.push(e.model.next_token_logits(&mut s).unwrap().to_vec());
    }
    out
}

/// The same prompts decoded together: prompts join one by one, each read
/// in uneven chunks (3 tokens, then 1, then the rest) in the same steps as
/// the others' decode, as the server schedules them. Every chunk of a
/// prompt is marked a prompt's (the 1-token one too), as the server marks
/// them, so each takes the same kernel path as the prompt read whole.
fn together(e: &Engine, steps: usize) -> Vec<Vec<Vec<f32>>> {
    let vocab = e.model.config.vocab_size;
    let mut work = e.model.new_session();
    let mut kvs: Vec<_> = PROMPTS.iter().map(|_| e.model.new_kv_cache()).collect();
    let ids: Vec<Vec<u32>> = PROMPTS.iter().map(|p| e.tokenize(p).unwrap()).collect();
    let mut fed = vec![0usize; PROMPTS.len()];
    let mut chunks = vec![0usize; PROMPTS.len()];
    let mut out: Vec<Vec<Vec<f32>>> = vec![Vec::new(); PROMPTS.len()];
    while out.iter().any(|o| o.len() < steps) {
        // The running sequences' next tokens, then a chunk of the first
        // prompt not yet read.
        let (mut tokens, mut lens, mut prompt, mut who, mut samples) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for i in 0..PROMPTS.len() {
            if fed[i] == ids[i].len() && !out[i].is_empty() && out[i].len() < steps {
                tokens.push(argmax(out[i].last().unwrap()));
                lens.push(1);
                prompt.push(false);
                who.push(i);
                samples.push(true);
            } else if fed[i] < ids[i].len() && !who.iter().any(|&w| fed[w] < ids[w].len()) {
                let left = ids[i].len() - fed[i];
                let len = match chunks[i] {
                    0 => left.min(3),
                    1 => 1,
                    _ => left,
                };
                tokens.extend_from_slice(&ids[i][fed[i]..fed[i] + len]);
                lens.push(len);
                prompt.push(ids[i].len() > 1);
                who.push(i);
                samples.push(len == left);
                (fed[i], chunks[i]) = (fed[i] + len, chunks[i] + 1);
            }
        }
        let mut seqs: Vec<_> = kvs.iter_mut().enumerate().filter(|(i, _)| who.contains(i)).map(|(_, k)| k).collect();
        e.model.forward_batch(&mut work, &mut seqs, &tokens, &lens, &prompt).unwrap();
        let ends: Vec<usize> = lens
            .iter()
            .scan(0, |at, &n| {
                *at += n;
                Some(*at - 1)
            })
            .collect();
        let rows: Vec<usize> = ends.iter().zip(&samples).filter(|(_, s)| **s).map(|(&r, _)| r).collect();
        let sampling: Vec<usize> = who.iter().zip(&samples).filter(|(_, s)| **s).map(|(&i, _)| i).collect();
        let logits = e.model.logits_of_rows(&mut work, &rows).unwrap();
        for (k, &i) in sampling.iter().enumerate() {
            out[i].push(logits[k * vocab..(k + 1) * vocab].to_vec());
        }
    }
    out
}

fn batched_equals_alone(path: &Path) {
    for precision in [Precision::Fast, Precision::Precise, Precision::Int8] {
        let e = load(path, precision);
        let steps = 12;
        let got = together(&e, steps);
        for (i, p) in PROMPTS.iter().enumerate() {
            let want = alone(&e, p, steps);
            let greedy = |v: &[Vec<f32>]| v.iter().map(|l| argmax(l)).collect::<Vec<_>>();
            assert_eq!(greedy(&got[i]), greedy(&want), "{precision:?} {p:?}: greedy tokens differ");
            let diff =
                got[i].iter().flatten().zip(want.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            eprintln!("{precision:?} {p:?}: max |batched - alone| = {diff:e}");
            assert!(got[i] == want, "{precision:?} {p:?}: logits differ by up to {diff:e}");
        }
    }
}

#[test]
fn smollm2_batched_requests_equal_each_alone() {
    let Some(path) = smollm2() else { return };
    batched_equals_alone(&path);
}

#[test]
fn gemma3_batched_requests_equal_each_alone() {
    let Some(path) = gemma3() else { return };
    batched_equals_alone(&path);
}

/// Several tokens of one sequence run on the decode path in one step (a
/// speculative draft checked at once): every row's logits are those of
/// decoding the tokens one by one.
fn draft_rows_equal_one_by_one(path: &Path) {
    for precision in [Precision::Fast, Precision::Precise, Precision::Int8] {
        let e = load(path, precision);
        let vocab = e.model.config.vocab_size;
        let ids = e.tokenize(PROMPTS[4]).unwrap();
        let want = alone(&e, PROMPTS[4], 10);
        let greedy: Vec<u32> = want.iter().map(|l| argmax(l)).collect();
        // The prompt, then its first token alone, then 8 at once.
        let mut work = e.model.new_session();
        let mut kv = e.model.new_kv_cache();
        e.model.forward_batch(&mut work, &mut [&mut kv], &ids, &[ids.len()], &[true]).unwrap();
        e.model.forward_batch(&mut work, &mut [&mut kv], &greedy[..1], &[1], &[false]).unwrap();
        e.model.forward_batch(&mut work, &mut [&mut kv], &greedy[1..9], &[8], &[false]).unwrap();
        let rows: Vec<usize> = (0..8).collect();
        let got = e.model.logits_of_rows(&mut work, &rows).unwrap();
        for r in 0..8 {
            let g = &got[r * vocab..(r + 1) * vocab];
            let diff = g.iter().zip(&want[r + 2]).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(g == want[r + 2].as_slice(), "{precision:?}: row {r} differs by up to {diff:e}");
        }
    }
}

#[test]
fn smollm2_draft_rows_equal_one_by_one() {
    let Some(path) = smollm2() else { return };
    draft_rows_equal_one_by_one(&path);
}

#[test]
fn gemma3_draft_rows_equal_one_by_one() {
    let Some(path) = gemma3() else { return };
    draft_rows_equal_one_by_one(&path);
}
