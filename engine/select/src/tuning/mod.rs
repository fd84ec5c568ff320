//! Benchmark-driven kernel tuning: measure every candidate kernel on the
//! model's real operation shapes ([`mod@bench`]), keep the results per host in a
//! vector-indexed history ([`history`]), and pick per operation from that
//! history ([`mod@select`]).

pub mod bench;
pub mod history;
pub mod select;
pub mod tune;

pub use bench::{BenchOptions, Measurement, Outcome, Phase, benchmark, kernel_id, verify};
pub use history::{HistoryStore, Host, Record};
pub use select::{Reason, Selection, select, synthetic_descs};
pub use tune::{tune, tune_with};
