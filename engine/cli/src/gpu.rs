//! `generate --device cuda`: the whole model on GPU 0 (`spinfer-gpu`),
//! driven by the engine's generation loop.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::Path;

use anyhow::{Context, Result};
use spinfer_engine::generate::{GenerateParams, Generation, generate_with};
use spinfer_engine::gguf::GgufFile;
use spinfer_engine::tokenizer::Tokenizer;
use spinfer_gpu::{GpuDecode, GpuModel};

/// Generates with the GGUF model at `path` on GPU 0 in a session of `ctx`
/// positions, streaming text to stdout when `stream`.
pub fn generate(path: &Path, ctx: usize, prompt: &str, params: &GenerateParams, stream: bool) -> Result<Generation> {
    // No device, no point reading the model.
    spinfer_kernels_cuda::probe()?;
    let file = GgufFile::open(path).with_context(|| format!("--device cuda reads GGUF models: {}", path.display()))?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let model = GpuModel::load(&file, ctx)?;
    tracing::info!(device = %model.backend().device(), "model on the gpu");
    let mut session = model.new_session()?;
    let mut stdout = std::io::stdout().lock();
    let g = generate_with(&mut GpuDecode::new(&model, &mut session), &tokenizer, prompt, params, &mut |piece| {
        if stream {
            let _ = stdout.write_all(piece.as_bytes());
            let _ = stdout.flush();
        }
        ControlFlow::Continue(())
    })?;
    Ok(g)
}
