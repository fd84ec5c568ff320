//! The Llama-family model (Llama, SmolLM, Mistral, Qwen2, Gemma 3): load,
//! forward, sessions.
pub mod llama;
pub mod math;
mod precision;

pub use config::{Arch, FfnAct, ModelConfig, RopeStyle, SlidingWindow};
pub use llama::{KvCache, KvType, Model, ModelOptions, Precision, Session};

pub use spinfer_formats::config;
pub use spinfer_formats::loader::{check_dims, load_vector};
pub use spinfer_formats::requant::Requant;

/// `x += y`, element-wise (residual connections).
pub fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Memory this process can still allocate, in bytes: `MemAvailable` from
/// `/proc/meminfo`, lowered to the cgroup's remaining allowance
/// (`memory.max - memory.current`, cgroup v2) when one is set. `None` where
/// neither can be read (sizes are then only checked for overflow).
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
        line.split_whitespace().nth(1)?.parse::<u64>().ok()?.checked_mul(1024)
    });
    let read = |f: &str| std::fs::read_to_string(format!("/sys/fs/cgroup/{f}")).ok()?.trim().parse::<u64>().ok();
    let cgroup = read("memory.max").map(|max| max.saturating_sub(read("memory.current").unwrap_or(0)));
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `1.5 GB`-style rendering of a byte count (10^3 units).
pub fn human_bytes(b: u64) -> String {
    let units = ["bytes", "kB", "MB", "GB", "TB", "PB", "EB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1000.0 && i + 1 < units.len() {
        v /= 1000.0;
        i += 1;
    }
    if i == 0 { format!("{b} bytes") } else { format!("{v:.1} {}", units[i]) }
}
