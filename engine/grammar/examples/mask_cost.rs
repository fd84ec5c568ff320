//! What a JSON schema costs per token: the vocabulary's tables, compiling
//! a schema, and each step's mask, for a real tokenizer (a GGUF file or a
//! `tokenizer.json`), over the tokens of one valid instance. With a grammar
//! file (GBNF or Lark) after it, the same instance under that grammar
//! instead (llama.cpp's `json.gbnf`, say).
//!
//!   cargo run --release -p spinfer-grammar --example mask_cost -- models/gemma-3-270m-Q4_K_M.gguf
//!   cargo run --release -p spinfer-grammar --example mask_cost -- MODEL tests/data/gbnf/json.gbnf

use spinfer_grammar::{Grammars, Spec};
use spinfer_sampling::TokenConstraint;
use std::time::Instant;
fn main() {
    let p = std::env::args().nth(1).expect("usage: mask_cost TOKENIZER.json|MODEL.gguf");
    let t = if p.ends_with(".gguf") {
        let g = spinfer_formats::gguf::GgufFile::open(std::path::Path::new(&p)).unwrap();
        spinfer_tokenizer::Tokenizer::from_gguf(&g).unwrap()
    } else {
        spinfer_tokenizer::Tokenizer::from_json_file(std::path::Path::new(&p)).unwrap()
    };
    let t0 = Instant::now();
    let gs = Grammars::new(&t, t.vocab_size()).unwrap();
    println!("{} tokens: vocabulary tables {:?}", t.vocab_size(), t0.elapsed());
    let schema: serde_json::Value = serde_json::from_str(r#"{"properties":{"name":{"type":"string"},"age":{"type":"integer"},"city":{"type":"string"},"hobbies":{"type":"array","items":{"type":"string"},"maxItems":4}},"required":["name","age","city","hobbies"],"type":"object","additionalProperties":false}"#).unwrap();
    let text = "{\n  \"name\": \"Jean Dupont\",\n  \"age\": 45,\n  \"city\": \"Lyon\",\n  \"hobbies\": [\"baking\", \"cycling\"]\n}";
    let ids = t.encode(text, false).unwrap();
    for round in 0..3 {
        let t0 = Instant::now();
        let spec = match std::env::args().nth(2) {
            Some(f) => Spec::grammar(std::fs::read_to_string(f).unwrap()),
            None => Spec::JsonSchema(schema.clone()),
        };
        let g = gs.compile(&spec).unwrap();
        let tc = t0.elapsed();
        let mut guide = g.guide();
        let mut logits = vec![0f32; t.vocab_size()];
        let mut times = Vec::new();
        for &id in &ids {
            logits.iter_mut().for_each(|l| *l = 0.0);
            let t1 = Instant::now();
            guide.mask(&mut logits).unwrap();
            times.push(t1.elapsed().as_secs_f64() * 1e6);
            assert!(logits[id as usize] == 0.0, "token {id} {:?} masked", t.decode(&[id]));
            guide.commit(id).unwrap();
        }
        let mut s = times.clone();
        s.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!(
            "round {round}: compile {:?}; {} masks: first {:.0} us, median {:.0} us, max {:.0} us, sum {:.1} ms",
            tc,
            times.len(),
            times[0],
            s[s.len() / 2],
            s[s.len() - 1],
            times.iter().sum::<f64>() / 1e3
        );
    }
}
