//! Continuous batching: one thread owns the model's work buffers and a
//! fixed number of slots (each a [`KvCache`]). Each step it runs, as one
//! [`spinfer_engine::model::Model::forward_batch`], the next token of every decoding request and
//! a chunk of at most `prefill_chunk` prompt tokens of those still
//! reading their prompt; new requests take free slots between steps. A
//! request whose client is gone (its event receiver dropped) or whose
//! deadline passed is cancelled and its slot freed at the next step.
//!
//! Prompt cache: a finished request's slot keeps its prompt's keys and
//! values. A new request takes the free slot whose kept prompt shares the
//! longest prefix with its own and runs only the tokens after that prefix
//! (at least its last, whose logits choose the first token). A longer
//! prefix held by another slot (a kept prompt, or the prompt a running
//! request has read) is copied into the new request's slot instead of
//! read again; a request whose prompt shares at least [`WAIT_FOR_SHARE`]
//! more tokens with a prompt still being read waits for it (the `n`
//! choices of a request, requests with one long system prompt). Only
//! tokens read as a prompt are kept or copied, never generated ones: the
//! decode path rounds differently, and a reused prefix must give the bits
//! a fresh prompt gives (prompt chunks of any length do;
//! `tests/tests/batch_decode.rs`).

use std::collections::VecDeque;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::thread::JoinHandle;
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::mpsc::error::SendError;

mod step;

use crate::error::ApiError;
use crate::logprobs::TokenLogprob;
use crate::metrics::Metrics;
use spinfer_engine::Engine;
use spinfer_engine::generate::{Continuation, DraftParams, Drafter, GenerateParams, StopReason};
use spinfer_engine::model::{KvCache, Session};

/// What a request's handler hears from the scheduler.
#[derive(Debug)]
pub enum Event {
    /// Text that became final in a step, and the log-probability of the
    /// token that step chose (when asked for; `None` also after the last).
    Piece {
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// Log-probabilities of prompt tokens (`echo` with `logprobs`), in
    /// order from the prompt's second token, a chunk at a time.
    Prompt(Vec<TokenLogprob>),
    Done {
        reason: StopReason,
        prompt_tokens: usize,
        /// Prompt tokens whose keys and values came from the slot's cache.
        cached_tokens: usize,
        completion_tokens: usize,
        text: String,
    },
    Failed(ApiError),
}

/// Where a job's events go: its request's channel, tagged with the job's
/// choice index (a request for `n` choices runs `n` jobs on one channel,
/// so a client that leaves cancels them all).
#[derive(Clone)]
pub struct Events {
    tx: UnboundedSender<(usize, Event)>,
    index: usize,
}

impl Events {
    pub fn new(tx: UnboundedSender<(usize, Event)>, index: usize) -> Self {
        Self { tx, index }
    }

    pub fn send(&self, ev: Event) -> Result<(), SendError<(usize, Event)>> {
        self.tx.send((self.index, ev))
    }

    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

/// A request's job (one of its choices), tokenized and checked.
pub struct Job {
    pub prompt: Vec<u32>,
    /// Alternatives per token when log-probabilities are asked for.
    pub logprobs: Option<usize>,
    /// The prompt tokens' log-probabilities too (the prompt cache is not
    /// used: they need every prompt position's logits).
    pub prompt_logprobs: bool,
    pub params: GenerateParams,
    pub events: Events,
    pub received: Instant,
    pub deadline: Instant,
}

enum Msg {
    Job(Box<Job>),
    Shutdown,
}

/// The handle the HTTP side holds.
pub struct Scheduler {
    tx: Sender<Msg>,
    waiting: Arc<AtomicUsize>,
    queue: usize,
    thread: Option<JoinHandle<()>>,
}

impl Scheduler {
    /// Starts the scheduling thread with `slots` slots and room for
    /// `queue` waiting requests.
    pub fn start(
        engine: Arc<Engine>,
        slots: usize,
        queue: usize,
        prefill_chunk: usize,
        prompt_cache: bool,
        drafts: Drafts,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<Self> {
        let (tx, rx) = channel();
        let waiting = Arc::new(AtomicUsize::new(0));
        let w = waiting.clone();
        let thread = std::thread::Builder::new()
            .name("spinfer-scheduler".into())
            .spawn(move || Loop::new(&engine, slots, prefill_chunk, prompt_cache, drafts, w, metrics).run(rx))?;
        Ok(Self { tx, waiting, queue, thread: Some(thread) })
    }

    /// Queues a request's jobs (one per choice), all or none: a queue
    /// without room for all of them is a 429.
    pub fn submit(&self, jobs: Vec<Job>) -> Result<(), ApiError> {
        let (queue, n) = (self.queue, jobs.len());
        if self
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| (w + n <= queue).then_some(w + n))
            .is_err()
        {
            return Err(ApiError::queue_full(queue));
        }
        for job in jobs {
            self.tx.send(Msg::Job(Box::new(job))).map_err(|_| ApiError::unavailable("the scheduler has stopped"))?;
        }
        Ok(())
    }

    /// Cancels everything in flight and stops the thread.
    pub fn shutdown(&mut self) {
        let _ = self.tx.send(Msg::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A request holding a slot.
struct Active<'e> {
    events: Events,
    cont: Continuation<'e>,
    prompt: Vec<u32>,
    /// Prompt tokens already run or found in the slot's cache.
    prefilled: usize,
    /// Prompt tokens found in the slot's cache.
    cached: usize,
    logprobs: Option<usize>,
    prompt_logprobs: bool,
    /// The token to run next (decoding).
    next: Option<u32>,
    received: Instant,
    deadline: Instant,
    first_token: bool,
    /// Drafts of what follows the next token (`[speculative]`).
    drafter: Option<Drafter>,
}

/// One row group of a step: a slot and how many tokens it runs.
#[derive(Clone, Copy)]
struct Part {
    slot: usize,
    len: usize,
    /// The step's logits of its last token choose its next token.
    samples: bool,
    /// Prompt tokens of a prompt of several (`Model::forward_batch`).
    prompt: bool,
    /// A decoding request's token, then a draft of `len - 1` tokens: each
    /// row chooses a token.
    decode: bool,
}

impl Part {
    /// Rows whose logits choose tokens (the last ones).
    fn sampled(&self) -> usize {
        match (self.samples, self.decode) {
            (false, _) => 0,
            (true, false) => 1,
            (true, true) => self.len,
        }
    }
}

/// Speculative decoding in the scheduler (`[speculative]`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Drafts {
    pub params: DraftParams,
    /// No drafts in a step where more requests than this decode.
    pub max_batch: usize,
}

struct Loop<'e> {
    engine: &'e Engine,
    work: Session,
    kvs: Vec<KvCache>,
    /// Per slot: the prompt whose keys and values its cache keeps for
    /// the next request (empty: nothing kept, or `prompt_cache` off).
    kept: Vec<Vec<u32>>,
    /// Per slot: when it was last freed (`frees` then), so that a request
    /// sharing no prefix takes the least recently used.
    freed_at: Vec<u64>,
    frees: u64,
    prompt_cache: bool,
    active: Vec<Option<Active<'e>>>,
    queue: VecDeque<Job>,
    waiting: Arc<AtomicUsize>,
    prefill_chunk: usize,
    /// Drafts, and the most requests decoding in a step that has them.
    draft: DraftParams,
    draft_batch: usize,
    metrics: Arc<Metrics>,
    /// The sparse FFN's counters already reported.
    ffn_seen: (u64, u64),
}

impl<'e> Loop<'e> {
    fn new(
        engine: &'e Engine,
        slots: usize,
        prefill_chunk: usize,
        prompt_cache: bool,
        drafts: Drafts,
        waiting: Arc<AtomicUsize>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let model = &engine.model;
        Self {
            engine,
            work: model.new_session(),
            kvs: (0..slots).map(|_| model.new_kv_cache()).collect(),
            kept: vec![Vec::new(); slots],
            freed_at: vec![0; slots],
            frees: 0,
            prompt_cache,
            active: (0..slots).map(|_| None).collect(),
            queue: VecDeque::new(),
            waiting,
            prefill_chunk: prefill_chunk.min(model.max_batch_tokens()),
            draft: drafts.params,
            draft_batch: drafts.max_batch,
            metrics,
            ffn_seen: (0, 0),
        }
    }

    fn run(mut self, rx: Receiver<Msg>) {
        loop {
            // Idle: wait for a request; busy: take what arrived.
            if self.active.iter().all(Option::is_none) && self.queue.is_empty() {
                match rx.recv() {
                    Ok(Msg::Job(j)) => self.queue.push_back(*j),
                    Ok(Msg::Shutdown) | Err(_) => break,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(Msg::Job(j)) => self.queue.push_back(*j),
                    Ok(Msg::Shutdown) | Err(TryRecvError::Disconnected) => return self.cancel_all(),
                    Err(TryRecvError::Empty) => break,
                }
            }
            self.drop_abandoned();
            self.admit();
            self.step();
        }
        self.cancel_all();
    }

    /// Cancels requests whose client left or whose time is up.
    fn drop_abandoned(&mut self) {
        let now = Instant::now();
        let before = self.queue.len();
        self.queue.retain(|j| {
            if now > j.deadline {
                let _ = j.events.send(Event::Failed(ApiError::timeout(timeout_of(j.received, j.deadline))));
            }
            !j.events.is_closed() && now <= j.deadline
        });
        let gone = before - self.queue.len();
        self.waiting.fetch_sub(gone, Ordering::AcqRel);
        self.metrics.cancelled.inc_by(gone as u64);
        for slot in 0..self.active.len() {
            let Some(a) = &self.active[slot] else { continue };
            if now > a.deadline {
                let _ = a.events.send(Event::Failed(ApiError::timeout(timeout_of(a.received, a.deadline))));
            }
            if a.events.is_closed() || now > a.deadline {
                self.metrics.cancelled.inc();
                self.free(slot);
            }
        }
        self.metrics.queue_depth.set(self.queue.len() as i64);
    }

    /// Moves waiting requests into free slots, in order.
    fn admit(&mut self) {
        while let Some((slot, reuse)) = self.queue.front().filter(|j| !self.waits(j)).and_then(|j| self.pick_slot(j)) {
            let Some(job) = self.queue.pop_front() else { break };
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            let mut cached = self.cut_to(slot, reuse);
            if let Some((donor, n)) = self.donor(&job, slot).filter(|&(_, n)| n > cached)
                && self.copy_prefix(donor, slot, n)
            {
                cached = n;
            }
            match Continuation::new(&self.engine.tokenizer, &job.params, &job.prompt) {
                Ok(cont) => {
                    self.metrics.cached_prompt_tokens.inc_by(cached as u64);
                    self.active[slot] = Some(Active {
                        events: job.events,
                        cont,
                        prompt: job.prompt,
                        prefilled: cached,
                        cached,
                        logprobs: job.logprobs,
                        prompt_logprobs: job.prompt_logprobs,
                        next: None,
                        received: job.received,
                        deadline: job.deadline,
                        first_token: false,
                        drafter: self.draft.enabled().then(|| Drafter::new(self.draft)),
                    });
                }
                Err(e) => {
                    let _ = job.events.send(Event::Failed(e.into()));
                }
            }
        }
        self.metrics.queue_depth.set(self.queue.len() as i64);
        self.metrics.active_slots.set(self.active.iter().flatten().count() as i64);
    }

    /// A free slot for `job` (none: all are busy): the one whose kept
    /// prompt shares the longest prefix with its prompt, else the least
    /// recently used; and how many of its tokens that slot's cache holds.
    fn pick_slot(&self, job: &Job) -> Option<(usize, usize)> {
        let reuse = |s: usize| if job.prompt_logprobs { 0 } else { reusable(&self.kept[s], &job.prompt) };
        (0..self.active.len())
            .filter(|&s| self.active[s].is_none())
            .map(|s| (s, reuse(s)))
            .max_by_key(|&(s, reuse)| (reuse, std::cmp::Reverse(self.freed_at[s])))
    }

    /// The prompt tokens whose keys and values slot `s` holds, read as a
    /// prompt: a running request's, as far as it has read them, or a free
    /// slot's kept prompt.
    fn held(&self, s: usize) -> &[u32] {
        match &self.active[s] {
            // A one-token prompt runs on the decode path: nothing to share.
            Some(a) if a.prompt.len() > 1 => &a.prompt[..a.prefilled.min(a.prompt.len())],
            Some(_) => &[],
            None => &self.kept[s],
        }
    }

    /// The slot other than `slot` holding the longest prefix of `job`'s
    /// prompt (that `job` may use), and that prefix's length.
    fn donor(&self, job: &Job, slot: usize) -> Option<(usize, usize)> {
        if !self.prompt_cache || job.prompt_logprobs {
            return None;
        }
        (0..self.kvs.len())
            .filter(|&d| d != slot)
            .map(|d| (d, reusable(self.held(d), &job.prompt)))
            .max_by_key(|&(_, n)| n)
            .filter(|&(_, n)| n > 0)
    }

    /// Whether `job` waits: a prompt still being read will hold at least
    /// [`WAIT_FOR_SHARE`] more of its prompt than any slot holds now.
    fn waits(&self, job: &Job) -> bool {
        if !self.prompt_cache || job.prompt_logprobs {
            return false;
        }
        let now = (0..self.kvs.len()).map(|d| reusable(self.held(d), &job.prompt)).max().unwrap_or(0);
        self.active
            .iter()
            .flatten()
            .filter(|a| a.prefilled < a.prompt.len())
            .any(|a| reusable(&a.prompt, &job.prompt) >= now + WAIT_FOR_SHARE)
    }

    /// Copies `donor`'s first `n` cached tokens into `slot`'s cache; false
    /// (and `slot` unchanged) where a local layer's ring no longer holds
    /// them.
    fn copy_prefix(&mut self, donor: usize, slot: usize, n: usize) -> bool {
        let (dst, src) = if slot < donor {
            let (a, b) = self.kvs.split_at_mut(donor);
            (&mut a[slot], &b[0])
        } else {
            let (a, b) = self.kvs.split_at_mut(slot);
            (&mut b[0], &a[donor])
        };
        dst.copy_prefix_from(src, n).map_err(|e| tracing::debug!(error = %e, "prefix not copied")).is_ok()
    }

    /// Cuts `slot`'s cache back to its first `reuse` tokens, or empties it
    /// where a local layer's ring no longer holds what that needs; the
    /// tokens kept.
    fn cut_to(&mut self, slot: usize, reuse: usize) -> usize {
        self.kept[slot].clear();
        if reuse == 0 || self.kvs[slot].truncate(reuse).is_err() {
            self.kvs[slot].reset();
            return 0;
        }
        reuse
    }

    /// A request is over: its final event, and its slot freed, keeping
    /// its prompt's keys and values with `prompt_cache` on.
    fn finish(&mut self, slot: usize) {
        let Some(a) = self.active[slot].take() else { return self.free(slot) };
        let events = a.events.clone();
        let mut on_text = |piece: &str| {
            let _ = events.send(Event::Piece { text: piece.to_string(), logprob: None });
            ControlFlow::Continue(())
        };
        let (prompt_tokens, cached_tokens) = (a.prompt.len(), a.cached);
        let (text, tokens, reason) = a.cont.finish(&mut on_text);
        let completion_tokens = tokens.len();
        let _ = a.events.send(Event::Done { reason, prompt_tokens, cached_tokens, completion_tokens, text });
        // A one-token prompt ran on the decode path: nothing to keep.
        let keep = if self.prompt_cache && a.prompt.len() > 1 { a.prompt } else { Vec::new() };
        self.vacate(slot, keep);
    }

    /// Empties a slot; its cache's memory goes back to the system.
    fn free(&mut self, slot: usize) {
        self.vacate(slot, Vec::new());
    }

    /// Empties a slot whose cache keeps the keys and values of `kept`
    /// (the memory of the positions used goes back to the system when
    /// that is empty).
    fn vacate(&mut self, slot: usize, kept: Vec<u32>) {
        self.active[slot] = None;
        if kept.is_empty() {
            self.kvs[slot].release();
        }
        self.kept[slot] = kept;
        self.frees += 1;
        self.freed_at[slot] = self.frees;
        self.metrics.active_slots.set(self.active.iter().flatten().count() as i64);
    }

    fn cancel_all(&mut self) {
        let e = ApiError::unavailable("the server is shutting down");
        for j in self.queue.drain(..) {
            let _ = j.events.send(Event::Failed(e.clone()));
        }
        for slot in 0..self.active.len() {
            if let Some(a) = &self.active[slot] {
                let _ = a.events.send(Event::Failed(e.clone()));
            }
            self.free(slot);
        }
    }
}

/// Fewest prompt tokens a request waits for another slot to read (then
/// copies), rather than reading them itself beside it.
pub const WAIT_FOR_SHARE: usize = 32;

/// How many of `prompt`'s tokens a slot keeping `kept` can skip: their
/// common prefix, short of `prompt`'s last token, which must run for its
/// logits. A one-token prompt runs on the decode path and reuses nothing.
fn reusable(kept: &[u32], prompt: &[u32]) -> usize {
    let common = kept.iter().zip(prompt).take_while(|(a, b)| a == b).count();
    if prompt.len() > 1 { common.min(prompt.len() - 1) } else { 0 }
}

fn timeout_of(received: Instant, deadline: Instant) -> u64 {
    deadline.saturating_duration_since(received).as_secs()
}

#[cfg(test)]
mod tests {
    use super::reusable;

    #[test]
    fn a_prompt_reuses_its_common_prefix_short_of_its_last_token() {
        assert_eq!(reusable(&[1, 2, 3, 4], &[1, 2, 3, 9, 9]), 3);
        assert_eq!(reusable(&[1, 2, 3], &[1, 2, 3]), 2, "the last token runs for its logits");
        assert_eq!(reusable(&[1, 2, 3], &[1, 2, 3, 4, 5]), 3);
        assert_eq!(reusable(&[1, 2, 3, 4, 5], &[1, 2]), 1);
        assert_eq!(reusable(&[7, 2], &[1, 2]), 0);
        assert_eq!(reusable(&[], &[1, 2]), 0);
        assert_eq!(reusable(&[1, 2], &[1]), 0, "a one-token prompt runs on the decode path");
    }
}
