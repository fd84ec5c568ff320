//! Shared helpers for spinfer's end-to-end tests: the reference data, and
//! (from `spinfer-test-support`) where the models are.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde::Deserialize;

pub use spinfer_test_support::{data, gemma3, minilm, profile_dir, smollm2, workspace};

#[derive(Deserialize)]
pub struct Reference {
    pub prompts: Vec<RefPrompt>,
    pub wikitext2_ppl: serde_json::Value,
}

#[derive(Deserialize)]
pub struct RefPrompt {
    pub text: String,
    pub input_ids: Vec<u32>,
    pub top20: Vec<(u32, f32)>,
    pub greedy_ids: Vec<u32>,
    pub greedy_text: String,
    pub last_logits_file: String,
}

impl RefPrompt {
    /// All last-position logits.
    pub fn last_logits(&self) -> Vec<f32> {
        let bytes = std::fs::read(data(&format!("reference/{}", self.last_logits_file))).expect("reference logits");
        bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
    }
}

/// The SmolLM2 reference outputs.
pub fn reference() -> Reference {
    let s = std::fs::read_to_string(data("reference/smollm2-135m-instruct.json")).expect("reference json");
    serde_json::from_str(&s).expect("reference json parses")
}

/// The Gemma 3 270M reference outputs (same prompt fields as SmolLM2's;
/// `input_ids` start with `<bos>`).
pub fn gemma3_reference() -> Reference {
    let s = std::fs::read_to_string(data("reference/gemma3-270m.json")).expect("gemma3 reference json");
    serde_json::from_str(&s).expect("gemma3 reference json parses")
}

/// The first 2,048 token ids of WikiText-2's test file (CRLF -> LF), tokenised
/// whole by the reference tokenizer with its one `<bos>` at the start.
pub fn gemma3_wikitext_ids_head() -> Vec<u32> {
    #[derive(Deserialize)]
    struct Head {
        ids_bos_first_2048: Vec<u32>,
    }
    let s = std::fs::read_to_string(data("reference/gemma3-270m.wikitext_ids_head.json")).expect("wikitext ids json");
    serde_json::from_str::<Head>(&s).expect("wikitext ids json parses").ids_bos_first_2048
}

/// Indices of the `k` largest values, best first.
pub fn top_k(x: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..x.len() as u32).collect();
    idx.sort_by(|&a, &b| x[b as usize].total_cmp(&x[a as usize]));
    idx.truncate(k);
    idx
}

/// Builds the shipped native pack libraries (cpu-simd, cpu-portable,
/// loader-npy) for the running test's profile and returns the profile
/// directory holding them; once per test binary.
pub fn built_pack_libs() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        spinfer_test_support::build_packages(&[
            "spinfer-pack-cpu-simd",
            "spinfer-pack-cpu-portable",
            "spinfer-pack-loader-npy",
        ])
    })
}
