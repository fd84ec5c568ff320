//! GBNF grammars (llama.cpp's format, from a request's `grammar` field or
//! `--grammar-file`): read and written as Lark, then compiled by llguidance
//! against SmolLM2's vocabulary and stepped once, as a request would.
#![no_main]

use std::path::Path;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use spinfer_engine::grammar::{Grammars, Spec, gbnf};
use spinfer_engine::sampling::TokenConstraint;
use spinfer_engine::tokenizer::Tokenizer;
use spinfer_fuzz::ok;

fn grammars() -> &'static Grammars {
    static G: OnceLock<Grammars> = OnceLock::new();
    G.get_or_init(|| {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/smollm2-135m-instruct/tokenizer.json");
        let t = Tokenizer::from_json_file(&p).expect("SmolLM2's tokenizer.json (tests/data)");
        Grammars::new(&t, t.vocab_size()).expect("the vocabulary takes grammars")
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let _ = gbnf::looks_like_gbnf(text);
    if ok("to_lark", gbnf::to_lark(text)).is_none() {
        return;
    }
    let Some(g) = ok("compile", grammars().compile(&Spec::Gbnf(text.to_string()))) else { return };
    let mut guide = g.guide();
    let mut logits = vec![0.0f32; 49152];
    if ok("mask", guide.mask(&mut logits)).is_some()
        && let Some(first) = logits.iter().position(|l| l.is_finite())
    {
        ok("commit", guide.commit(first as u32));
    }
});
