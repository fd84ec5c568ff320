//! `generate --device cuda`: the whole model on GPU 0 (`spinfer-gpu`),
//! driven by the engine's generation loop.

use std::io::Write;
use std::ops::ControlFlow;

use anyhow::{Context, Result, bail};
use spinfer_engine::generate::{GenerateParams, Generation, generate_with};
use spinfer_engine::gguf::GgufFile;
use spinfer_engine::tokenizer::Tokenizer;
use spinfer_gpu::{GpuDecode, GpuModel};

use crate::commands::GenerateArgs;

/// Flags that `--device cuda` does not support yet, each refused by name.
fn refuse_cpu_only_flags(a: &GenerateArgs) -> Result<()> {
    let c = &a.common;
    let cpu_only = [
        ("--config", c.config.is_some()),
        ("--sparsity", c.sparsity.is_some()),
        ("--head-index", c.head_index.is_some()),
        ("--precise", c.precise),
        ("--int8", c.int8),
        ("--threads", c.threads.is_some()),
        ("--stats", a.stats),
    ];
    if let Some((flag, _)) = cpu_only.iter().find(|(_, set)| *set) {
        bail!(
            "{flag} is not supported with --device cuda yet (the GPU runs the whole model dense, with f32 activations)"
        );
    }
    Ok(())
}

/// Generates on the GPU, streaming text to stdout unless --json.
pub fn generate(a: &GenerateArgs, prompt: &str, params: &GenerateParams) -> Result<Generation> {
    refuse_cpu_only_flags(a)?;
    // No device, no point reading the model.
    spinfer_kernels_cuda::probe()?;
    let path = a.common.model.as_ref().context("--device cuda needs --model FILE.gguf")?;
    let file = GgufFile::open(path).with_context(|| format!("--device cuda reads GGUF models: {}", path.display()))?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let model = GpuModel::load(&file, a.ctx.unwrap_or(2048))?;
    tracing::info!(device = %model.backend().device(), "model on the gpu");
    let mut session = model.new_session()?;
    let stream = !a.common.json;
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
