//! spinfer's generation loop over any [`DecodeSession`] (the CPU model's,
//! the GPU's): the prompt in one batch, then token after token, each
//! sampled by `spinfer-sampling`'s sampler under an optional constraint,
//! its text streamed as it becomes valid UTF-8, until an end-of-generation
//! token, a stop string, the token budget or a full context.
//!
//! With [`DraftParams`] on, a step also runs a draft of what follows, taken
//! from the context's own n-grams ([`Drafter`]), and keeps the part of it
//! the model chooses too.
//!
//! Invariant: drafts never change the output. Every token is chosen from
//! the logits of its own row, which equal a decode step's bit for bit
//! ([`DecodeSession::forward_rows`]); greedy, seeded and constrained
//! generations are the same with or without drafts (tested in
//! `tests/tests/speculative.rs`).

mod continuation;
mod draft;
mod params;
mod run;

pub use continuation::Continuation;
pub use draft::{DraftParams, DraftStats, Drafter};
pub use params::{GenerateParams, StopReason};
pub use run::{CpuSession, DecodeSession, Generation, Timings, decode, encode_prompt, generate, generate_with};
