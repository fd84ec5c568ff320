//! Shared helpers for spinfer's end-to-end tests: where the models and the
//! reference data are.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use serde::Deserialize;

/// The workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// `tests/data/<rel>`.
pub fn data(rel: &str) -> PathBuf {
    workspace().join("tests/data").join(rel)
}

/// The SmolLM2-135M-Instruct Q4_1 GGUF: `$SPINFER_MODEL` or
/// `models/SmolLM2-135M-Instruct.Q4_1.gguf`. `None` (the test should skip)
/// when absent outside CI; in CI (`CI` set) a missing model is a failure,
/// so a broken download can never turn the suite green.
pub fn smollm2() -> Option<PathBuf> {
    model_file("SPINFER_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// `$env` or `<workspace>/default` if that file exists; else `None` with a
/// message outside CI, a panic in CI.
fn model_file(env: &str, default: &str) -> Option<PathBuf> {
    let p = std::env::var_os(env).map(PathBuf::from).unwrap_or_else(|| workspace().join(default));
    if p.exists() {
        return Some(p);
    }
    if std::env::var_os("CI").is_some() {
        panic!("{} is missing in CI: scripts/fetch-models.sh should have fetched it", p.display());
    }
    eprintln!("skipping: {} not found (run scripts/fetch-models.sh)", p.display());
    None
}

/// The Gemma 3 270M Q4_K_M GGUF: `$SPINFER_GEMMA_MODEL` or
/// `models/gemma-3-270m-Q4_K_M.gguf`. `None` (the test should skip, saying
/// so) when absent outside CI; a failure in CI, as for [`smollm2`].
pub fn gemma3() -> Option<PathBuf> {
    model_file("SPINFER_GEMMA_MODEL", "models/gemma-3-270m-Q4_K_M.gguf")
}

/// The all-MiniLM-L6-v2 sentence-transformers directory:
/// `$SPINFER_EMBED_MODEL` or `models/all-MiniLM-L6-v2`. `None` (the test
/// should skip, saying so) when absent outside CI; a failure in CI, as for
/// [`smollm2`].
pub fn minilm() -> Option<PathBuf> {
    let p = std::env::var_os("SPINFER_EMBED_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("models/all-MiniLM-L6-v2"));
    if p.join("model.safetensors").exists() {
        return Some(p);
    }
    if std::env::var_os("CI").is_some() {
        panic!("{} is missing in CI: scripts/fetch-models.sh should have fetched it", p.display());
    }
    eprintln!("skipping: {} not found (run scripts/fetch-models.sh)", p.display());
    None
}

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

/// `target/<profile>`, from the running test executable's path
/// (`target/<profile>/deps/<test>-<hash>`).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    exe.parent().and_then(Path::parent).expect("test executable inside target/<profile>/deps").to_path_buf()
}

/// Builds the shipped native pack libraries (cpu-simd, cpu-portable,
/// loader-npy) for
/// the running test's profile and returns the profile directory holding
/// them. `cargo test` does not reliably leave an up-to-date cdylib there
/// (as plugins/cpu-portable/tests/dlopen.rs notes), so this runs `cargo
/// build`, a no-op when they are fresh; once per test binary.
pub fn built_pack_libs() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = profile_dir();
        let profile = match dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") => "dev".to_string(),
            Some(name) => name.to_string(),
            None => panic!("cannot tell the cargo profile from {}", dir.display()),
        };
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
        let status = Command::new(cargo)
            .args([
                "build",
                "-p",
                "spinfer-pack-cpu-simd",
                "-p",
                "spinfer-pack-cpu-portable",
                "-p",
                "spinfer-pack-loader-npy",
            ])
            .args(["--profile", &profile])
            .arg("--target-dir")
            .arg(dir.parent().expect("target dir"))
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("running cargo build");
        assert!(status.success(), "cargo build of the packs (profile {profile}) failed");
        dir
    })
}
