//! safetensors + config.json + tokenizer.json: the input is
//! `config.json SEP tokenizer.json SEP modules.json SEP 1_Pooling/config.json
//! SEP model.safetensors` (see `spinfer_fuzz::SEP`; an empty modules or
//! pooling part is left out), written into one checkpoint directory, then
//! loaded as a Llama-family model (Engine) and as a sentence-transformers
//! (BERT) embedder.
#![no_main]

use libfuzzer_sys::fuzz_target;
use spinfer_engine::Engine;
use spinfer_engine::embed::{Embedder, EmbedderOptions};
use spinfer_engine::generate::GenerateParams;
use spinfer_engine::loader::Loader;
use spinfer_engine::registry::KernelRegistry;
use spinfer_engine::safetensors::SafetensorsModel;
use spinfer_engine::tokenizer::Tokenizer;
use spinfer_fuzz::{TEXT, fresh_dir, ok, parts, small_options};

thread_local! {
    static REGISTRY: &'static KernelRegistry = Box::leak(Box::new(KernelRegistry::builtin()));
}

fuzz_target!(|data: &[u8]| {
    let p = parts(data, 5);
    let dir = fresh_dir("checkpoint");
    std::fs::write(dir.join("config.json"), p[0]).expect("write");
    std::fs::write(dir.join("tokenizer.json"), p[1]).expect("write");
    if !p[2].is_empty() {
        std::fs::write(dir.join("modules.json"), p[2]).expect("write");
    }
    if !p[3].is_empty() {
        std::fs::create_dir(dir.join("1_Pooling")).expect("mkdir");
        std::fs::write(dir.join("1_Pooling/config.json"), p[3]).expect("write");
    }
    std::fs::write(dir.join("model.safetensors"), p[4]).expect("write");

    if let Some(tok) = ok("tokenizer", Tokenizer::from_json_file(&dir.join("tokenizer.json"))) {
        if let Ok(ids) = tok.encode(TEXT, true) {
            let _ = tok.decode(&ids);
        }
    }
    if let Some(st) = ok("safetensors", SafetensorsModel::open(&dir)) {
        for name in st.tensor_names() {
            let _ = st.tensor(&name);
        }
        ok("config", st.config());
    }
    REGISTRY.with(|r| {
        if let Some(engine) = ok("engine", Engine::load_with(&dir, small_options(), r)) {
            let params = GenerateParams { max_tokens: 2, ..GenerateParams::default() };
            ok("generate", engine.generate("Hi", &params));
        }
        let options = EmbedderOptions { threads: 1, batch_size: 2, sparsity: None, reduced_precision: false };
        if let Some(e) = ok("embedder", Embedder::load_with_registry(&dir, r, options)) {
            ok("embed", e.embed(TEXT));
        }
    });
});
