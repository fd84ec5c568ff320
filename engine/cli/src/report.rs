//! What `generate` prints besides the text: the JSON object, the
//! statistics lines, and the sparsity and storage reports.

use std::io::Write;
use std::time::Duration;

use anyhow::Result;
use spinfer_engine::Engine;
use spinfer_engine::generate::StopReason;
use spinfer_engine::model::Session;

/// The weights streamed from storage under a memory budget (`null`
/// without one): totals, and bytes read per generated token.
pub fn storage_json(session: &Session, tokens: usize) -> serde_json::Value {
    let Some(st) = session.stream_stats() else { return serde_json::Value::Null };
    serde_json::json!({
        "bytes_read": st.bytes_read,
        "bytes_read_per_token": st.bytes_read / tokens.max(1) as u64,
        "prefetch_hits": st.prefetch_hits,
        "stalls": st.stalls,
        "stall_seconds": st.stall_time.as_secs_f64(),
        "resyncs": st.resyncs,
    })
}

/// `--stats`: the storage line under a memory budget.
pub fn print_storage_stats(session: &Session, tokens: usize) {
    if let Some(st) = session.stream_stats() {
        eprintln!(
            "[storage: {:.1} MB read ({:.1} MB per generated token) | {} read ahead in time, {} waited for ({:.2} s)]",
            st.bytes_read as f64 / 1e6,
            st.bytes_read as f64 / 1e6 / tokens.max(1) as f64,
            st.prefetch_hits,
            st.stalls,
            st.stall_time.as_secs_f64()
        );
    }
}

/// Prints a generation's end: the JSON object with --json (`sparsity` under
/// its key), else a line of statistics on stderr unless --quiet.
pub fn print_generation(
    out: Output,
    g: &spinfer_engine::generate::Generation,
    sparsity: serde_json::Value,
    storage: serde_json::Value,
) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    if out.json {
        let v = serde_json::json!({
            "text": g.text,
            "tokens": g.tokens,
            "prompt_tokens": g.prompt_tokens,
            "stop_reason": format!("{:?}", g.stop_reason),
            "peak_rss_bytes": peak_rss_bytes(),
            "prefill_tokens_per_second": g.prefill_tokens_per_second(),
            "decode_tokens_per_second": g.decode_tokens_per_second(),
            "timings_ms": {
                "tokenize": ms(g.timings.tokenize),
                "prefill": ms(g.timings.prefill),
                "decode": ms(g.timings.decode),
                "sample": ms(g.timings.sample),
            },
            "draft": {
                "drafts": g.draft.drafts,
                "drafted": g.draft.drafted,
                "accepted": g.draft.accepted,
            },
            "sparsity": sparsity,
            "storage": storage,
        });
        writeln!(stdout, "{v}")?;
    } else if !out.quiet {
        writeln!(stdout)?;
        let why = match g.stop_reason {
            StopReason::EndOfGeneration => "end of generation",
            StopReason::StopString => "stop string",
            StopReason::MaxTokens => "token limit",
            StopReason::ContextFull => "context full",
            StopReason::Cancelled => "cancelled",
        };
        eprintln!(
            "\n[{} prompt tokens: {:.1} tok/s prefill | {} generated: {:.1} tok/s decode | stopped: {why}]",
            g.prompt_tokens,
            g.prefill_tokens_per_second(),
            g.tokens.len(),
            g.decode_tokens_per_second()
        );
        let d = g.draft;
        if d.drafts > 0 {
            eprintln!(
                "[drafts: {} tokens in {} drafts, {} accepted ({:.0}%)]",
                d.drafted,
                d.drafts,
                d.accepted,
                100.0 * d.accepted as f64 / d.drafted as f64
            );
        }
    }
    Ok(())
}

/// The session's sparse-FFN statistics as JSON (`null` when dense).
pub fn sparsity_json(engine: &Engine, session: &Session) -> serde_json::Value {
    let Some(sp) = &engine.model.sparse else { return serde_json::Value::Null };
    let st = session.sparsity_stats();
    let layers: Vec<_> = st
        .layers
        .iter()
        .enumerate()
        .map(|(l, c)| {
            let attn = (c.attn_tokens > 0).then(|| c.attn_active as f64 / (c.attn_tokens as f64 * st.attn_dim as f64));
            serde_json::json!({"layer": l, "tokens": c.tokens, "active_fraction": st.active_fraction(l),
                "dense_tokens": c.dense, "attn_active_fraction": attn,
                "recall": st.recall(l), "precision": st.precision(l)})
        })
        .collect();
    let budget = sp.bundle.as_ref().map(|b| {
        let r = b.report();
        let counters = |c: &spinfer_engine::sparse::CacheCounters| {
            serde_json::json!({"hot": c.hot, "hits": c.hits, "misses": c.misses, "hit_rate": c.hit_rate(),
                "bytes_read": c.bytes_read, "reads": c.reads})
        };
        serde_json::json!({
            "file": b.path,
            "budget_bytes": r.budget,
            "fixed_bytes": r.fixed,
            "hot_bytes": r.hot,
            "hot_neurons": r.hot_neurons,
            "cache_bytes": r.cache,
            "cache_slots": r.cache_slots,
            "total_neurons": r.total_neurons,
            "record_bytes": r.record,
            "policy": r.policy,
            "session": counters(&st.cache),
            "engine": counters(&b.totals()),
        })
    });
    serde_json::json!({
        "sidecar": sp.path,
        "predictor": sp.predictor.kind().name(),
        "target_sparsity": sp.sidecar.target_sparsity,
        "active_fraction": st.mean_active_fraction(),
        "attn_sparsity": sp.sidecar.attn_sparsity,
        "attn_active_fraction": st.mean_attn_active_fraction(),
        "recall": st.mean_recall_precision().map(|r| r.0),
        "precision": st.mean_recall_precision().map(|r| r.1),
        "layers": layers,
        "budget": budget,
    })
}

/// Per-layer sparse-FFN statistics on stderr.
pub fn print_sparsity_stats(engine: &Engine, session: &Session) {
    let Some(sp) = &engine.model.sparse else {
        eprintln!("[dense FFN: no --sparsity sidecar]");
        return;
    };
    let st = session.sparsity_stats();
    eprintln!(
        "[sparse FFN: {} predictor, target sparsity {:.2}; kept {:.1}% of neurons on average]",
        sp.predictor.kind().name(),
        sp.sidecar.target_sparsity,
        100.0 * st.mean_active_fraction()
    );
    if let Some(a) = sp.sidecar.attn_sparsity {
        eprintln!(
            "[sparse attention output: target sparsity {a:.2}; kept {:.1}% of W_o's inputs on average]",
            100.0 * st.mean_attn_active_fraction()
        );
    }
    if let Some((recall, precision)) = st.mean_recall_precision() {
        eprintln!(
            "[against the full gate (|silu(gate)| above the sidecar's threshold, computed for --stats): \
             recall {:.1}%, precision {:.1}%]",
            100.0 * recall,
            100.0 * precision
        );
    }
    eprintln!("layer  tokens  kept%  dense-tokens  attn-kept%  recall%  precision%");
    let pct = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{:.1}", 100.0 * v));
    for (l, c) in st.layers.iter().enumerate() {
        let attn = if c.attn_tokens > 0 {
            format!("{:.1}", 100.0 * c.attn_active as f64 / (c.attn_tokens as f64 * st.attn_dim as f64))
        } else {
            "-".into()
        };
        eprintln!(
            "{l:>5}  {:>6}  {:>5.1}  {:>12}  {attn:>10}  {:>7}  {:>10}",
            c.tokens,
            100.0 * st.active_fraction(l),
            c.dense,
            pct(st.recall(l)),
            pct(st.precision(l))
        );
    }
    if let Some(b) = &sp.bundle {
        let r = b.report();
        let mb = |x: usize| x as f64 / 1e6;
        eprintln!(
            "[FFN budget {:.1} MB: {:.1} MB fixed (predictor, scales, maps), {:.1} MB hot ({} of {} neurons), \
             {:.1} MB cold cache ({} slots, {}); cold neurons from {}]",
            mb(r.budget),
            mb(r.fixed),
            mb(r.hot),
            r.hot_neurons,
            r.total_neurons,
            mb(r.cache),
            r.cache_slots,
            r.policy,
            b.path.display()
        );
        let c = &st.cache;
        eprintln!(
            "[records: {} hot, {} cache hits, {} misses (hit rate {:.1}%), {:.1} MB read in {} reads]",
            c.hot,
            c.hits,
            c.misses,
            100.0 * c.hit_rate(),
            c.bytes_read as f64 / 1e6,
            c.reads
        );
    }
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Peak resident set size of this process (Linux `VmHWM`).
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// How `generate` was asked to print.
#[derive(Clone, Copy)]
pub struct Output {
    pub json: bool,
    pub quiet: bool,
}
