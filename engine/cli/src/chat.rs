//! `spinfer chat`: a conversation, as llama-cli's conversation mode. Each
//! line read is a user turn; the conversation so far is rendered with the
//! model's chat template (or `--chat-template-file`), and the answer streams
//! to stdout. The session keeps its cache between turns: a turn runs only
//! the tokens after the prefix it shares with the cache (the earlier turns,
//! unless the template rewrites them). A line ending in `\` continues on
//! the next; `/reset` starts again, `/exit` or the end of input ends.

use std::io::{BufRead, IsTerminal, Write};
use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use serde_json::json;
use spinfer_engine::Engine;
use spinfer_engine::generate::{
    Continuation, CpuSession, DraftStats, GenerateParams, StopReason, Timings, decode, encode_prompt,
};
use spinfer_engine::model::Session;
use spinfer_server::chat::{ChatTemplate, Message, add_bos};

use crate::commands::{CommonArgs, load_config};

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// A system message opening the conversation.
    #[arg(long, alias = "sys")]
    pub system: Option<String>,
    /// Tokens an answer may take at most.
    #[arg(short = 'n', long, default_value_t = 512)]
    pub n_predict: usize,
    #[command(flatten)]
    pub sampling: crate::sampling::SamplingArgs,
    /// Context size (default: the config's, else 2048): the whole
    /// conversation must fit.
    #[arg(short = 'c', long)]
    pub ctx: Option<usize>,
    /// A Jinja chat template to use instead of the model's own.
    #[arg(long, value_name = "FILE")]
    pub chat_template_file: Option<PathBuf>,
    #[command(flatten)]
    pub draft: crate::sampling::DraftArgs,
}

/// One answered turn.
struct Turn {
    text: String,
    reason: StopReason,
    prompt_tokens: usize,
    cached_tokens: usize,
    completion_tokens: usize,
    decode_tps: f64,
    draft: DraftStats,
}

/// The model, its session, and what the session's cache holds.
struct Conversation<'e> {
    engine: &'e Engine,
    template: ChatTemplate,
    params: GenerateParams,
    session: Session,
    /// The tokens whose keys and values the session holds, in order.
    cached: Vec<u32>,
    messages: Vec<Message>,
}

pub fn chat(a: ChatArgs) -> Result<()> {
    let config = a.common.config(a.ctx)?;
    let draft = a.draft.params(config.speculative.as_ref().map(|s| s.draft_params()).unwrap_or_default())?;
    let params =
        GenerateParams { max_tokens: a.n_predict, sampler: a.sampling.params()?, draft, ..GenerateParams::default() };
    let engine = load_config(&a.common, &config)?;
    let template = ChatTemplate::for_engine(&engine, a.chat_template_file.as_deref())?.with_context(
        || "the model has no chat template (tokenizer.chat_template): give one with --chat-template-file",
    )?;
    let mut conv = Conversation {
        engine: &engine,
        template,
        params,
        session: engine.model.new_session(),
        cached: Vec::new(),
        messages: Vec::new(),
    };
    conv.start(a.system.as_deref());
    let interactive = std::io::stdin().is_terminal();
    let (json, quiet) = (a.common.json, a.common.quiet);
    if interactive && !quiet && !json {
        eprintln!(
            "spinfer chat: a line is a turn (end it with \\ to go on); /reset starts again, /exit or Ctrl-D ends"
        );
    }
    let mut stdout = std::io::stdout().lock();
    let prompt = || {
        if interactive && !quiet && !json {
            eprint!("> ");
        }
    };
    prompt();
    let mut pending = String::new();
    for line in std::io::stdin().lock().lines() {
        let line = line.context("reading stdin")?;
        // A line ending in `\` goes on on the next one (llama-cli's way).
        if let Some(part) = line.strip_suffix('\\') {
            pending.push_str(part);
            pending.push('\n');
            continue;
        }
        let line = std::mem::take(&mut pending) + &line;
        match line.trim() {
            "/exit" => break,
            "" => {
                prompt();
                continue;
            }
            "/reset" => {
                conv.start(a.system.as_deref());
                prompt();
                continue;
            }
            _ => {}
        }
        let stream = !json;
        let turn = conv.answer(&line, &mut |piece| {
            if stream {
                let _ = stdout.write_all(piece.as_bytes());
                let _ = stdout.flush();
            }
            ControlFlow::Continue(())
        });
        let turn = match turn {
            Ok(t) => t,
            // At a terminal a turn that cannot run is reported and the
            // conversation goes on; from a pipe it is the command's error.
            Err(e) if interactive => {
                eprintln!("error: {e:#}");
                prompt();
                continue;
            }
            Err(e) => return Err(e),
        };
        if json {
            let v = json!({"user": line, "assistant": turn.text, "stop_reason": format!("{:?}", turn.reason),
                           "prompt_tokens": turn.prompt_tokens, "cached_tokens": turn.cached_tokens,
                           "completion_tokens": turn.completion_tokens, "decode_tokens_per_second": turn.decode_tps,
                           "draft": {"drafted": turn.draft.drafted, "accepted": turn.draft.accepted}});
            writeln!(stdout, "{v}")?;
        } else {
            writeln!(stdout)?;
            if !quiet {
                eprintln!(
                    "[{} prompt tokens, {} from the cache; {} tokens at {:.1} tok/s; {:?}]",
                    turn.prompt_tokens, turn.cached_tokens, turn.completion_tokens, turn.decode_tps, turn.reason
                );
            }
        }
        prompt();
    }
    Ok(())
}

impl Conversation<'_> {
    /// A new conversation, opened by `system` when given (the cache is
    /// kept: a new conversation shares the template's opening with it).
    fn start(&mut self, system: Option<&str>) {
        self.messages = system.map(|s| Message { role: "system".into(), content: s.into() }).into_iter().collect();
    }

    /// The user's `line`, answered; the answer's text goes to `on_text` as
    /// it comes.
    fn answer(&mut self, line: &str, on_text: &mut dyn FnMut(&str) -> ControlFlow<()>) -> Result<Turn> {
        let (model, tokenizer) = (&self.engine.model, &self.engine.tokenizer);
        let mut shown = self.messages.clone();
        shown.push(Message { role: "user".into(), content: line.into() });
        let prompt = self.template.render(&shown).map_err(|e| anyhow::anyhow!("{}", e.message))?;
        let ctx = self.session.ctx();
        let ids = encode_prompt(tokenizer, &prompt, Some(add_bos(tokenizer, &prompt)), ctx - 1)
            .context("the conversation no longer fits the context: /reset to start again")?;
        // Keep the cache's prefix in common with this prompt, short of the
        // prompt's last token (which must run for its logits).
        let keep = self.cached.iter().zip(&ids).take_while(|(a, b)| a == b).count().min(ids.len() - 1);
        self.session.truncate(keep)?;
        self.cached.truncate(keep);
        let mut cont = Continuation::new(tokenizer, &self.params, &ids)?;
        let start = std::time::Instant::now();
        model.forward(&mut self.session, &ids[keep..])?;
        let mut timings = Timings { prefill: start.elapsed(), ..Timings::default() };
        let mut session = CpuSession::new(model, &mut self.session);
        let draft = decode(&mut session, &mut cont, self.params.draft, &mut timings, on_text)?;
        // The cache holds the prompt and what was generated, short of the
        // last token chosen.
        self.cached = cont.history()[..self.session.pos()].to_vec();
        tracing::debug!(prefill_s = timings.prefill.as_secs_f64(), "chat turn");
        let (text, tokens, reason) = cont.finish(on_text);
        let decode_s = timings.decode.as_secs_f64();
        self.messages = shown;
        self.messages.push(Message { role: "assistant".into(), content: text.clone() });
        Ok(Turn {
            text,
            reason,
            prompt_tokens: ids.len(),
            cached_tokens: keep,
            completion_tokens: tokens.len(),
            decode_tps: if decode_s > 0.0 { tokens.len().saturating_sub(1) as f64 / decode_s } else { 0.0 },
            draft,
        })
    }
}
