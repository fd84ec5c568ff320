//! `generate`'s sampling and drafting flags, llama.cpp's names and
//! defaults.

use anyhow::{Result, bail};
use clap::Args;
use spinfer_engine::generate::DraftParams;
use spinfer_engine::sampling::SamplerParams;

#[derive(Args)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temp: f32,
    /// Top-k sampling (0 = off).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Top-p (nucleus) sampling (1 = off).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Min-p sampling (0 = off).
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Repetition penalty (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Tokens the repetition penalty looks back over.
    #[arg(long, default_value_t = 64)]
    pub repeat_last_n: usize,
    /// OpenAI's frequency penalty, over the generated tokens (0 = off,
    /// -2 to 2).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// OpenAI's presence penalty, over the generated tokens (0 = off, -2
    /// to 2).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Add to a token's logit, as TOKEN_ID+BIAS or TOKEN_ID-BIAS (-100 to
    /// 100; `-inf` bans the token); repeatable. llama.cpp's `--logit-bias`.
    #[arg(short = 'l', long, value_name = "ID(+|-)BIAS")]
    pub logit_bias: Vec<String>,
    /// RNG seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl SamplingArgs {
    /// The sampler the flags describe, checked.
    pub fn params(&self) -> Result<SamplerParams> {
        let p = SamplerParams {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            logit_bias: self.logit_bias.iter().map(|b| bias(b)).collect::<Result<_>>()?,
            seed: self.seed,
        };
        p.validate()?;
        Ok(p)
    }
}

/// Speculative decoding from the context's own n-grams (prompt lookup).
#[derive(Args)]
pub struct DraftArgs {
    /// Draft up to N tokens a step from the context's own n-grams, checked
    /// with the next token in one step (0 = off; the output is the same
    /// either way, only faster where the text repeats the context).
    /// llama.cpp's --draft-max, vLLM's num_speculative_tokens. Default:
    /// the config's `[speculative]`, else 0.
    #[arg(long)]
    pub draft_max: Option<usize>,
    /// Longest n-gram looked up (vLLM's prompt_lookup_max).
    #[arg(long)]
    pub draft_ngram_max: Option<usize>,
    /// Shortest n-gram looked up (vLLM's prompt_lookup_min).
    #[arg(long)]
    pub draft_ngram_min: Option<usize>,
}

impl DraftArgs {
    /// The drafts the flags describe over `base` (the config's), checked.
    pub fn params(&self, base: DraftParams) -> Result<DraftParams> {
        let p = DraftParams {
            max_tokens: self.draft_max.unwrap_or(base.max_tokens),
            ngram_max: self.draft_ngram_max.unwrap_or(base.ngram_max),
            ngram_min: self.draft_ngram_min.unwrap_or(base.ngram_min),
        };
        p.validate()?;
        Ok(p)
    }
}

/// `ID+BIAS`, `ID-BIAS` or `ID-inf`.
fn bias(s: &str) -> Result<(u32, f32)> {
    let Some(at) = s.find(['+', '-']) else {
        bail!("--logit-bias {s}: expected TOKEN_ID+BIAS or TOKEN_ID-BIAS, e.g. 15043+1 or 2-inf");
    };
    let id =
        s[..at].parse::<u32>().map_err(|_| anyhow::anyhow!("--logit-bias {s}: {:?} is not a token id", &s[..at]))?;
    let b = match &s[at..] {
        "-inf" => f32::NEG_INFINITY,
        v => v.parse::<f32>().map_err(|_| anyhow::anyhow!("--logit-bias {s}: {v:?} is not a number"))?,
    };
    Ok((id, b))
}

#[cfg(test)]
mod tests {
    use super::bias;

    #[test]
    fn biases_read_as_llama_cpp_writes_them() {
        assert_eq!(bias("15043+1").unwrap(), (15043, 1.0));
        assert_eq!(bias("7-2.5").unwrap(), (7, -2.5));
        assert_eq!(bias("2-inf").unwrap(), (2, f32::NEG_INFINITY));
        for bad in ["15043", "x+1", "3+y", "+1", "1+"] {
            assert!(bias(bad).is_err(), "{bad}");
        }
    }
}
