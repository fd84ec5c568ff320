//! GGUF parser + model load: the input is a `.gguf` file. If it parses, its
//! tensors, config and tokenizer (encode, decode) are read, and the model is
//! loaded with the built-in kernels and asked for two tokens. (`inspect` is
//! left out: it is open + tokenizer + config again, and building a BPE
//! tokenizer's regex twice would halve the executions per second.)
#![no_main]

use libfuzzer_sys::fuzz_target;
use spinfer_engine::Engine;
use spinfer_engine::generate::GenerateParams;
use spinfer_engine::gguf::GgufFile;
use spinfer_engine::loader::Loader;
use spinfer_engine::registry::KernelRegistry;
use spinfer_engine::tokenizer::Tokenizer;
use spinfer_fuzz::{TEXT, ok, scratch, small_options};

thread_local! {
    static REGISTRY: &'static KernelRegistry = Box::leak(Box::new(KernelRegistry::builtin()));
}

fuzz_target!(|data: &[u8]| {
    // GgufFile::open maps a path: there is no in-memory entry point.
    let path = scratch().join("model.gguf");
    std::fs::write(&path, data).expect("write scratch file");
    let Some(g) = ok("gguf", GgufFile::open(&path)) else { return };
    for name in g.tensor_names() {
        let _ = g.tensor(&name);
    }
    ok("config", g.config());
    if let Some(tok) = ok("tokenizer", Tokenizer::from_gguf(&g)) {
        if let Ok(ids) = tok.encode(TEXT, true) {
            let _ = tok.decode(&ids);
        }
    }
    drop(g);
    let Some(engine) = ok("engine", REGISTRY.with(|r| Engine::load_with(&path, small_options(), r))) else { return };
    let params = GenerateParams { max_tokens: 2, ..GenerateParams::default() };
    ok("generate", engine.generate("Hi", &params));
});
