//! How close the sparse head comes to the dense one, measured over every
//! scored position of a perplexity run (the reference protocol's windows):
//! for each number of probed clusters, how often its greedy choice equals
//! the dense argmax, and the total-variation distance between the
//! distributions the two heads sample from at temperature 1 and top-p 0.95
//! (the sampler's rule, applied to each head's logit vector), and the
//! perplexity of the text under each head's full softmax (the sparse
//! head's: its exact rows and stand-ins, as sampled at temperature 1).
//!
//! Both heads are evaluated on the same hidden states: the dense logits
//! are computed once per position, the sparse head's exact rows are those
//! same logits (its gathered-row kernel computes the dense product's
//! rows), and its ranking and stand-ins come from the cluster scores of
//! its Q8_0 means, as at decode.

use crate::{Error, Result};
use spinfer_models::head::SparseHead;
use spinfer_models::model::{Model, Session};

/// The quality of one probe count.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadQuality {
    pub probes: usize,
    /// Mean fraction of the vocabulary's rows computed exactly.
    pub row_fraction: f64,
    /// Positions whose sparse greedy token is the dense argmax.
    pub argmax_agree: usize,
    /// Total-variation distance per position (temperature 1, top-p 0.95).
    pub tv: Vec<f32>,
    /// Negative log-likelihood of each position's next token, summed over
    /// positions (nats): under the sparse head's softmax, and the dense's.
    pub nll: f64,
    pub dense_nll: f64,
}

impl HeadQuality {
    pub fn agreement(&self) -> f64 {
        self.argmax_agree as f64 / self.tv.len().max(1) as f64
    }

    pub fn mean_tv(&self) -> f64 {
        self.tv.iter().map(|&t| t as f64).sum::<f64>() / self.tv.len().max(1) as f64
    }

    /// Perplexity of the text under the sparse head's distribution.
    pub fn ppl(&self) -> f64 {
        (self.nll / self.tv.len().max(1) as f64).exp()
    }

    /// Perplexity of the same positions under the dense head's.
    pub fn dense_ppl(&self) -> f64 {
        (self.dense_nll / self.tv.len().max(1) as f64).exp()
    }

    /// The `q`-quantile (0..=1) of the per-position distances.
    pub fn tv_quantile(&self, q: f64) -> f32 {
        let mut v = self.tv.clone();
        v.sort_by(f32::total_cmp);
        v.get(((v.len().saturating_sub(1)) as f64 * q).round() as usize).copied().unwrap_or(0.0)
    }
}

const TOP_P: f32 = 0.95;
/// Positions whose dense logits are computed at once.
const GROUP: usize = 64;

/// Reused per-position buffers.
struct Buffers {
    sparse: Vec<f32>,
    acc: Vec<f32>,
    dense_p: Vec<(u32, f32)>,
    sparse_p: Vec<(u32, f32)>,
    order: Vec<u32>,
    /// Per row: 1 + the position that last computed it exactly.
    mark: Vec<u64>,
    /// Stand-ins held below the best exact logit, with their values.
    held: Vec<(u32, f32)>,
    position: u64,
}

/// `-log softmax(logits)[target]`.
fn nll(logits: &[f32], target: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let z: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    z.ln() - (logits[target] - max) as f64
}

/// One position: the dense `logits`, the head's cluster `scores`, the
/// `target` (next) token; adds to each probe count's quality in `q`.
fn measure(
    (logits, scores, target): (&[f32], &[f32], usize),
    q: &mut [HeadQuality],
    max_p: usize,
    b: &mut Buffers,
    head: &SparseHead,
) {
    let (vocab, k) = (logits.len(), scores.len());
    let dense_nll = nll(logits, target);
    let best = (0..vocab).max_by(|&x, &y| logits[x].total_cmp(&logits[y]).then(y.cmp(&x))).unwrap_or(0);
    top_p_distribution(logits, &mut b.dense_p);
    let key = |c: u32| head.rule.rank_key(c as usize, scores[c as usize]);
    b.order.clear();
    b.order.extend(0..k as u32);
    b.order.sort_unstable_by(|&x, &y| key(y).total_cmp(&key(x)).then(x.cmp(&y)));
    // Probed prefix by prefix: the running best exact row, and the sparse
    // logit vector (stand-ins, then the exact rows).
    for (c, &s) in scores.iter().enumerate() {
        let v = head.rule.stand_in(c, s);
        head.rule.index.members(c).iter().for_each(|&r| b.sparse[r as usize] = v);
    }
    b.position += 1;
    let (mut top, mut rows) = ((f32::NEG_INFINITY, 0u32), 0usize);
    // Row r computed exactly: its logit into the sparse vector, counted
    // once, and the running best.
    let exact = |r: u32, b: &mut Buffers, top: &mut (f32, u32), rows: &mut usize| {
        let l = logits[r as usize];
        b.sparse[r as usize] = l;
        b.mark[r as usize] = b.position;
        *rows += 1;
        if l > top.0 || (l == top.0 && r < top.1) {
            *top = (l, r);
        }
    };
    for &r in head.rule.index.hot() {
        exact(r, b, &mut top, &mut rows);
    }
    for i in 0..max_p {
        let c = b.order[i] as usize;
        for &r in head.rule.index.members(c) {
            exact(r, b, &mut top, &mut rows);
        }
        for qp in q.iter_mut().filter(|qp| qp.probes == i + 1) {
            qp.argmax_agree += usize::from(top.1 as usize == best);
            qp.row_fraction += rows as f64 / vocab as f64;
            // Stand-ins held below the best exact logit, as the head does
            // (and put back for the next probe count).
            let ceiling = top.0.next_down();
            b.held.clear();
            for r in 0..vocab {
                if b.mark[r] != b.position && b.sparse[r] > ceiling {
                    b.held.push((r as u32, b.sparse[r]));
                    b.sparse[r] = ceiling;
                }
            }
            top_p_distribution(&b.sparse, &mut b.sparse_p);
            qp.tv.push(tv_distance(&b.dense_p, &b.sparse_p, &mut b.acc));
            qp.nll += nll(&b.sparse, target);
            qp.dense_nll += dense_nll;
            b.held.iter().for_each(|&(r, v)| b.sparse[r as usize] = v);
        }
    }
}

/// The sampler's distribution at temperature 1 and top-p [`TOP_P`] over
/// `logits`, as (row, probability) pairs of the kept rows. Rows whose
/// probability is below `0.01 / vocab` can never be kept (together they
/// hold under 1% of the mass), so only the others are sorted.
fn top_p_distribution(logits: &[f32], out: &mut Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let z: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let floor = 0.01 / logits.len() as f64;
    out.clear();
    out.extend(logits.iter().enumerate().filter_map(|(i, &l)| {
        let p = ((l - max) as f64).exp() / z;
        (p >= floor).then_some((i as u32, p as f32))
    }));
    out.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let (mut cum, mut keep) = (0f32, out.len());
    for (i, &(_, p)) in out.iter().enumerate() {
        cum += p;
        if cum >= TOP_P {
            keep = i + 1;
            break;
        }
    }
    out.truncate(keep.max(1));
    let kept: f32 = out.iter().map(|p| p.1).sum();
    out.iter_mut().for_each(|p| p.1 /= kept);
}

/// Total-variation distance of two sparse distributions (`b` sorted by row
/// in `scratch`).
fn tv_distance(a: &[(u32, f32)], b: &[(u32, f32)], dense: &mut [f32]) -> f32 {
    for &(r, p) in a {
        dense[r as usize] += p;
    }
    for &(r, p) in b {
        dense[r as usize] -= p;
    }
    let mut tv = 0.0;
    for &(r, _) in a.iter().chain(b) {
        tv += dense[r as usize].abs();
        dense[r as usize] = 0.0;
    }
    tv / 2.0
}

/// Runs windows of `ctx` tokens of `tokens` (at most `windows`) as the
/// perplexity protocol does and measures `head` at each probe count in
/// `probes` on every scored position. `progress(done, total)`.
#[allow(clippy::too_many_arguments, reason = "a measurement run: model, head, session, text and its settings")]
pub fn evaluate(
    model: &Model,
    head: &SparseHead,
    session: &mut Session,
    tokens: &[u32],
    ctx: usize,
    windows: usize,
    probes: &[usize],
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<HeadQuality>> {
    let (vocab, k) = (model.config.vocab_size, head.rule.index.clusters());
    if let Some(&p) = probes.iter().find(|&&p| p == 0 || p > k) {
        return Err(Error::InvalidArgument(format!("probe counts must be in 1..={k}, got {p}")));
    }
    let windows = windows.min(tokens.len() / ctx.max(1));
    if ctx < 2 || windows == 0 {
        return Err(Error::InvalidArgument(format!("need at least one window of {ctx} >= 2 tokens")));
    }
    let max_p = probes.iter().copied().max().unwrap_or(1);
    let mut q: Vec<HeadQuality> = probes
        .iter()
        .map(|&p| HeadQuality {
            probes: p,
            row_fraction: 0.0,
            argmax_agree: 0,
            tv: Vec::new(),
            nll: 0.0,
            dense_nll: 0.0,
        })
        .collect();
    let mut scores = Vec::new();
    let mut bufs = Buffers {
        sparse: vec![0f32; vocab],
        acc: vec![0f32; vocab],
        dense_p: Vec::new(),
        sparse_p: Vec::new(),
        order: Vec::with_capacity(k),
        mark: vec![0; vocab],
        held: Vec::new(),
        position: 0,
    };
    for w in 0..windows {
        session.reset();
        let win = &tokens[w * ctx..(w + 1) * ctx];
        model.forward(session, win)?;
        // Positions in groups (the dense head streams its weights once per group).
        let mut start = 0;
        while start < ctx - 1 {
            let end = (start + GROUP).min(ctx - 1);
            let n = end - start;
            let h = model.hidden_states(session, start..end).to_vec();
            scores.resize(n * k, 0.0);
            head.cluster_scores(session.pool(), &h, n, &mut scores)?;
            let all = model.logits(session, start..end)?.to_vec();
            let targets = win[start + 1..=end].iter();
            for ((logits, scores), &t) in all.chunks_exact(vocab).zip(scores.chunks_exact(k)).zip(targets) {
                if t as usize >= vocab {
                    return Err(Error::InvalidArgument(format!("token {t} is outside the vocabulary of {vocab}")));
                }
                measure((logits, scores, t as usize), &mut q, max_p, &mut bufs, head);
            }
            start = end;
        }
        progress(w + 1, windows);
    }
    for qp in &mut q {
        qp.row_fraction /= qp.tv.len().max(1) as f64;
    }
    Ok(q)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_p() {
        let logits = [3.0f32, 1.0, 2.0, -5.0];
        let mut d = Vec::new();
        top_p_distribution(&logits, &mut d);
        // Probabilities ~0.665, 0.245, 0.090, 0.0002: the first three reach 0.95.
        assert_eq!(d.iter().map(|p| p.0).collect::<Vec<_>>(), vec![0, 2, 1]);
        assert!((d.iter().map(|p| p.1).sum::<f32>() - 1.0).abs() < 1e-6);
        let mut acc = vec![0f32; 4];
        assert_eq!(tv_distance(&d, &d, &mut acc), 0.0);
        let other = [(3u32, 1.0f32)];
        assert!((tv_distance(&d, &other, &mut acc) - 1.0).abs() < 1e-6);
        assert!(acc.iter().all(|&x| x == 0.0));
    }

    #[test]
    fn nll_is_minus_the_log_softmax() {
        let logits = [1.0f32, 2.0, 3.0];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        assert!((nll(&logits, 0) - (z.ln() - 1.0)).abs() < 1e-9);
        // Shifting every logit changes nothing.
        assert!((nll(&[101.0, 102.0, 103.0], 2) - nll(&logits, 2)).abs() < 1e-9);
    }
}
