//! Conversions between RuvLLM's types and spinfer's: generation
//! parameters, errors, model information.

use std::hash::{BuildHasher, RandomState};
use std::io::ErrorKind;
use std::time::Instant;

use ruvllm::{FinishReason, GenerateParams, ModelArchitecture, ModelInfo, Quantization, RuvLLMError};
use spinfer_engine::Engine;
use spinfer_engine::generate::{GenerateParams as SpinferParams, StopReason};
use spinfer_engine::model::Arch;
use spinfer_engine::sampling::SamplerParams;
use spinfer_kernels::GgmlType;

/// How many recent tokens the repetition penalty looks at (llama.cpp's
/// default; RuvLLM has no such parameter).
const REPEAT_LAST_N: usize = 64;

/// RuvLLM's sampling parameters as spinfer's. RuvLLM conventions kept:
/// `temperature` 0 is greedy, `top_k` 0 and `top_p` 0 or 1 are off,
/// `repetition_penalty` 1 (or 0) is off, `seed: None` draws a fresh seed;
/// `frequency_penalty` and `presence_penalty` are OpenAI's (over the
/// generated tokens, in [-2, 2]).
pub(crate) fn generate_params(p: &GenerateParams) -> ruvllm::Result<SpinferParams> {
    let sampler = SamplerParams {
        temperature: p.temperature,
        top_k: p.top_k,
        top_p: if p.top_p == 0.0 { 1.0 } else { p.top_p },
        min_p: 0.0,
        repeat_penalty: if p.repetition_penalty == 0.0 { 1.0 } else { p.repetition_penalty },
        repeat_last_n: REPEAT_LAST_N,
        frequency_penalty: p.frequency_penalty,
        presence_penalty: p.presence_penalty,
        logit_bias: Vec::new(),
        seed: p.seed.unwrap_or_else(|| RandomState::new().hash_one(Instant::now())),
    };
    sampler.validate().map_err(|e| RuvLLMError::Config(format!("spinfer: GenerateParams: {e}")))?;
    Ok(SpinferParams {
        max_tokens: p.max_tokens,
        sampler,
        stop: p.stop_sequences.clone(),
        add_bos: None,
        ..Default::default()
    })
}

/// Why a spinfer generation ended, in RuvLLM's terms.
pub(crate) fn finish_reason(r: StopReason) -> FinishReason {
    match r {
        StopReason::EndOfGeneration => FinishReason::EndOfSequence,
        StopReason::StopString => FinishReason::Stop,
        StopReason::MaxTokens | StopReason::ContextFull => FinishReason::Length,
        StopReason::Cancelled => FinishReason::Cancelled,
    }
}

/// An error of loading `model` (the id RuvLLM passed), in RuvLLM's error
/// hierarchy. spinfer's messages already name the file, tensor or key.
pub(crate) fn load_error(model: &str, e: spinfer_engine::Error) -> RuvLLMError {
    use spinfer_engine::Error as E;
    let msg = format!("spinfer: loading '{model}': {e}");
    match e {
        E::Io { source, .. } if source.kind() == ErrorKind::NotFound => RuvLLMError::NotFound(msg),
        E::Tokenizer(_) => RuvLLMError::Tokenization(msg),
        E::Sparsity { .. } | E::InvalidArgument(_) => RuvLLMError::Config(msg),
        E::Pack { .. } | E::Registry(_) | E::NoKernel { .. } | E::Kernel { .. } | E::Kernels(_) => {
            RuvLLMError::Backend(msg)
        }
        _ => RuvLLMError::Model(msg),
    }
}

/// An error of a request (generation, embedding, tokenization).
pub(crate) fn runtime_error(what: &str, e: spinfer_engine::Error) -> RuvLLMError {
    use spinfer_engine::Error as E;
    match e {
        E::Tokenizer(_) => RuvLLMError::Tokenization(format!("spinfer: {what}: {e}")),
        E::ContextOverflow { needed, ctx } => RuvLLMError::Generation(format!(
            "spinfer: {what}: {needed} tokens needed but the context holds {ctx} \
             (raise ModelConfig::max_sequence_length or shorten the input)"
        )),
        E::InvalidArgument(_) => RuvLLMError::InvalidOperation(format!("spinfer: {what}: {e}")),
        _ => RuvLLMError::Backend(format!("spinfer: {what}: {e}")),
    }
}

/// What RuvLLM reports about a loaded model.
pub(crate) fn model_info(name: &str, engine: &Engine) -> ModelInfo {
    let model = &engine.model;
    let c = &model.config;
    let architecture = match c.arch {
        Arch::Qwen2 => ModelArchitecture::Qwen,
        // RuvLLM 2.5 names Gemma and Gemma-2; Gemma 3 shares Gemma-2's
        // local/global attention.
        Arch::Gemma3 => ModelArchitecture::Gemma2,
        Arch::Llama => match ModelArchitecture::detect_from_model_id(name) {
            Some(ModelArchitecture::Mistral) => ModelArchitecture::Mistral,
            _ => ModelArchitecture::Llama,
        },
    };
    let sparse_bytes = model.sparse.as_ref().map_or(0, |s| s.resident_bytes());
    ModelInfo {
        name: name.to_string(),
        architecture,
        num_parameters: parameter_count(c),
        vocab_size: c.vocab_size,
        hidden_size: c.dim,
        num_layers: c.n_layers,
        max_context_length: model.options.ctx,
        // The FFN matrices hold most of the weights.
        quantization: model.weights.layers.first().and_then(|l| quantization(l.w_gate.desc.wtype)),
        memory_usage: engine.file_size() + sparse_bytes,
    }
}

/// Parameters of a Llama-family model of configuration `c`.
fn parameter_count(c: &spinfer_engine::model::ModelConfig) -> usize {
    let (dim, q_dim, kv_dim) = (c.dim, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
    let attention = 2 * dim * q_dim + 2 * dim * kv_dim + if c.qkv_bias { q_dim + 2 * kv_dim } else { 0 };
    let ffn = 3 * dim * c.ffn_dim;
    let layer = attention + ffn + 2 * dim;
    let embeddings = c.vocab_size * dim * if c.tied_embeddings { 1 } else { 2 };
    embeddings + c.n_layers * layer + dim
}

/// The nearest of RuvLLM's quantization labels; `None` where it has none
/// (Q3_K, Q5_*, Q6_K, ternary types).
fn quantization(t: GgmlType) -> Option<Quantization> {
    match t {
        GgmlType::F32 => Some(Quantization::None),
        GgmlType::F16 => Some(Quantization::F16),
        GgmlType::BF16 => Some(Quantization::Bf16),
        GgmlType::Q8_0 | GgmlType::Q8_1 | GgmlType::Q8_K => Some(Quantization::Q8),
        GgmlType::Q4_K => Some(Quantization::Q4K),
        GgmlType::Q4_0 | GgmlType::Q4_1 => Some(Quantization::Q4),
        GgmlType::Q2_K => Some(Quantization::Q2K),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ruvllm_defaults_map_to_a_valid_sampler() {
        let p = generate_params(&GenerateParams::default()).unwrap();
        assert_eq!(p.max_tokens, 256);
        assert_eq!(p.sampler.temperature, 0.7);
        assert_eq!(p.sampler.top_k, 40);
        assert_eq!(p.sampler.repeat_penalty, 1.1);
        assert_eq!(p.sampler.min_p, 0.0);
    }

    #[test]
    fn greedy_seeded_and_off_values() {
        let p = generate_params(
            &GenerateParams::default().with_temperature(0.0).with_top_p(0.0).with_repetition_penalty(0.0).with_seed(7),
        )
        .unwrap();
        assert_eq!((p.sampler.temperature, p.sampler.top_p, p.sampler.repeat_penalty), (0.0, 1.0, 1.0));
        assert_eq!(p.sampler.seed, 7);
    }

    #[test]
    fn penalties_carry_over_and_invalid_values_are_errors() {
        let p =
            generate_params(&GenerateParams { frequency_penalty: 0.5, presence_penalty: -0.25, ..Default::default() })
                .unwrap();
        assert_eq!((p.sampler.frequency_penalty, p.sampler.presence_penalty), (0.5, -0.25));
        let p = GenerateParams { frequency_penalty: 3.0, ..Default::default() };
        assert!(matches!(generate_params(&p), Err(RuvLLMError::Config(m)) if m.contains("frequency penalty")));
        let p = GenerateParams::default().with_temperature(-1.0);
        assert!(matches!(generate_params(&p), Err(RuvLLMError::Config(m)) if m.contains("temperature")));
        let p = GenerateParams::default().with_top_p(1.5);
        assert!(matches!(generate_params(&p), Err(RuvLLMError::Config(m)) if m.contains("top-p")));
    }

    #[test]
    fn stop_reasons() {
        assert_eq!(finish_reason(StopReason::EndOfGeneration), FinishReason::EndOfSequence);
        assert_eq!(finish_reason(StopReason::ContextFull), FinishReason::Length);
        assert_eq!(finish_reason(StopReason::Cancelled), FinishReason::Cancelled);
    }
}
