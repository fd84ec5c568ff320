//! Several sequences in one forward step (continuous batching): each
//! request keeps only its [`KvCache`]; one [`Session`] lends its buffers
//! to the step, so every weight matrix is read once for all the requests'
//! tokens while each row attends to its own sequence's cache.

use spinfer_sparsity::Predictor;

use super::{BUDGET_STEP, KvCache, Model, Session, UBATCH, grow};
use crate::{Error, Result};

impl Model {
    /// An empty KV cache of the model's context size, for one sequence of
    /// [`Model::forward_batch`].
    pub fn new_kv_cache(&self) -> KvCache {
        KvCache::new(self, self.options.ctx)
    }

    /// Most tokens one [`Model::forward_batch`] takes (all sequences
    /// together): a memory budget sizes its buffers for [`BUDGET_STEP`]
    /// tokens; otherwise one step of [`UBATCH`], which also bounds what a
    /// local attention layer's ring holds.
    pub fn max_batch_tokens(&self) -> usize {
        if self.memory.is_some() { BUDGET_STEP } else { UBATCH }
    }

    /// Runs the tokens of several sequences as one step: the first
    /// `lens[0]` of `tokens` continue `seqs[0]`, the next `lens[1]`
    /// continue `seqs[1]`, and so on. `work`'s buffers serve the step (its
    /// own cache is untouched); afterwards the final-normed hidden states
    /// of all `tokens` are rows of `work`, in order, for
    /// [`Model::logits_of_rows`].
    ///
    /// `prompt[i]` says whether sequence `i`'s tokens are (part of) its
    /// prompt: those may run on the kernels' prompt path (AMX tiles, for
    /// example), which rounds differently from the decode path. Each
    /// sequence's result is bit for bit that of [`Model::forward`] of its
    /// tokens alone when the flags match what `forward` assumes: a prompt
    /// of several tokens `true` (however it is split into steps), a single
    /// token (a decode step, or a one-token prompt) `false`.
    pub fn forward_batch(
        &self,
        work: &mut Session,
        seqs: &mut [&mut KvCache],
        tokens: &[u32],
        lens: &[usize],
        prompt: &[bool],
    ) -> Result<()> {
        let n = tokens.len();
        if seqs.len() != lens.len() || lens.iter().sum::<usize>() != n || lens.contains(&0) {
            return Err(Error::InvalidArgument(format!(
                "a batch of {} sequences needs one non-zero token count each summing to its {n} tokens, got {lens:?}",
                seqs.len()
            )));
        }
        if prompt.len() != seqs.len() {
            return Err(Error::InvalidArgument(format!(
                "a batch of {} sequences needs one prompt flag each, got {}",
                seqs.len(),
                prompt.len()
            )));
        }
        if n > self.max_batch_tokens() {
            return Err(Error::InvalidArgument(format!(
                "a batch step takes at most {} tokens, got {n}",
                self.max_batch_tokens()
            )));
        }
        if self.sparse.as_ref().is_some_and(|sp| matches!(sp.predictor, Predictor::Sentence)) && seqs.len() > 1 {
            return Err(Error::InvalidArgument(
                "the sentence-level predictor chooses neurons per request: it cannot batch requests".into(),
            ));
        }
        for (kv, &len) in seqs.iter().zip(lens) {
            if kv.pos() + len > kv.ctx() {
                return Err(Error::ContextOverflow { needed: kv.pos() + len, ctx: kv.ctx() });
            }
            if kv.ctx() > work.ctx {
                return Err(Error::InvalidArgument(format!(
                    "a sequence of {} positions cannot run in a session of {}",
                    kv.ctx(),
                    work.ctx
                )));
            }
        }
        self.check_tokens(tokens)?;
        grow(&mut work.hidden, n * self.config.dim);
        work.last_tokens = n;
        let result = self.forward_step(work, seqs, tokens, lens, prompt, 0);
        work.scratch.roles.clear();
        result
    }

    /// Runs `tokens` at the session's next positions on the decode path:
    /// each row bit for bit what running the tokens one at a time gives
    /// (a speculative draft checked in one step; [`Model::logits_of_rows`]
    /// then gives every row's next-token logits). At most
    /// [`Model::max_batch_tokens`] tokens.
    pub fn forward_decode_rows(&self, s: &mut Session, tokens: &[u32]) -> Result<()> {
        let mut kv = std::mem::take(&mut s.kv);
        let result = self.forward_batch(s, &mut [&mut kv], tokens, &[tokens.len()], &[false]);
        s.kv = kv;
        result
    }

    /// Next-token logits (`rows.len() x vocab`, row-major) of `rows` of the
    /// last forward call (indices into its tokens), from the sparse head
    /// when one is set, as [`Model::next_token_logits`] gives for one.
    pub fn logits_of_rows<'s>(&self, s: &'s mut Session, rows: &[usize]) -> Result<&'s [f32]> {
        let (dim, vocab) = (self.config.dim, self.config.vocab_size);
        if let Some(&r) = rows.iter().find(|&&r| r >= s.last_tokens) {
            return Err(Error::InvalidArgument(format!(
                "row {r} is past the last forward call's {} tokens",
                s.last_tokens
            )));
        }
        let k = rows.len();
        grow(&mut s.logits, k * vocab);
        let Session { pool, hidden, xn, logits, scratch, head: head_scratch, .. } = s;
        if let Some(head) = &self.head {
            for (i, &r) in rows.iter().enumerate() {
                let x = &hidden[r * dim..(r + 1) * dim];
                let out = &mut logits[i * vocab..(i + 1) * vocab];
                head.logits(&self.weights.output, pool, x, out, head_scratch, scratch)?;
            }
        } else {
            // The rows side by side, then one product with the head.
            grow(xn, k * dim);
            for (i, &r) in rows.iter().enumerate() {
                xn[i * dim..(i + 1) * dim].copy_from_slice(&hidden[r * dim..(r + 1) * dim]);
            }
            self.weights.output.forward(pool, xn, k, logits, scratch)?;
        }
        Ok(&s.logits[..k * vocab])
    }
}
