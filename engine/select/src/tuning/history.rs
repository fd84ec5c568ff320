//! Benchmark history: every measurement ever taken, per host, kept on disk
//! in a `ruvector-core` vector store (redb).
//!
//! Each record's vector is a small scaled feature vector of the operation's
//! shape ([`shape_features`]) so that shapes never measured can borrow the
//! result of the nearest measured shape; the record itself is the entry's
//! metadata (serde_json). All records are read into memory on open, and
//! lookups (exact and nearest shape) scan them: histories hold thousands of
//! records, not millions, and the scan is exact where an HNSW search is
//! approximate.
//!
//! Records are loaded from the metadata table directly (redb), never
//! through ruvector's `get`, which decodes the stored vector with no length
//! limit: a corrupt file must not size an allocation.
//!
//! Concurrency: redb locks its file for one process at a time. Readers
//! (every engine started with a history) load the records and release the
//! file at once; a writer (`spinfer tune`) holds it while it records. Both
//! retry with jittered backoff while another process holds it (see
//! [`HistoryStore`]); within one process, a reader opened while a writer
//! holds the same file waits like one in another process. The configuration
//! stored in the file must match ours: [`HistoryStore::open`] checks the
//! stored dimensions.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ruvector_core::storage::VectorStorage;
use ruvector_core::types::{DbOptions, DistanceMetric, HnswConfig, VectorEntry};
use serde::{Deserialize, Serialize};
use spinfer_kernels::GgmlType;
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::kernel::{ActType, MatmulDesc};

use super::bench::{BenchOptions, Phase};
use crate::{Error, Result};

/// Length of [`shape_features`] vectors.
pub const DIM: usize = 16;

/// The machine measurements were taken on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Host {
    pub cpu_model: String,
    pub features: String,
    pub cores: usize,
}

impl Host {
    /// This machine: `/proc/cpuinfo` "model name", detected CPU features,
    /// available parallelism.
    pub fn detect() -> Self {
        let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_else(|| std::env::consts::ARCH.to_string());
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        Self { cpu_model, features: CpuFeatures::detect().describe(), cores }
    }

    /// The string records are keyed by.
    pub fn fingerprint(&self) -> String {
        format!("{} | {} | {} cores", self.cpu_model, self.features, self.cores)
    }
}

/// One measurement of one kernel on one operation shape.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// [`Host::fingerprint`].
    pub host: String,
    /// `"matmul"`.
    pub op: String,
    pub phase: Phase,
    /// Weight type name (`"q4_1"`).
    pub wtype: String,
    /// Activation type name (`"q8_1"`).
    pub act: String,
    pub rows: usize,
    pub cols: usize,
    pub n_tokens: usize,
    /// `"<provider>/<kernel name>"`.
    pub kernel_id: String,
    /// Median wall time of one run; `None` if the kernel was rejected.
    pub median_ns: Option<u64>,
    /// Why the kernel was rejected (disagreed with the reference, errored).
    #[serde(default)]
    pub rejected: Option<String>,
    /// Unix seconds.
    pub date: u64,
}

impl Record {
    /// Whether this record is about `desc` in `phase` on `host` (any shape
    /// if `shape` is false).
    pub fn matches(&self, host: &str, desc: &MatmulDesc, phase: Phase, shape: bool) -> bool {
        self.host == host
            && self.op == "matmul"
            && self.phase == phase
            && self.wtype == desc.wtype.name()
            && self.act == desc.act.name()
            && (!shape || (self.rows == desc.rows && self.cols == desc.cols))
    }
}

/// Current time in unix seconds.
pub fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Weight-type bucket of the one-hot part of [`shape_features`].
fn wtype_bucket(w: &str) -> usize {
    match w {
        "f32" => 0,
        "f16" => 1,
        "bf16" => 2,
        "q4_0" | "q4_1" => 3,
        "q5_0" | "q5_1" => 4,
        "q8_0" => 5,
        "q2_K" | "q3_K" => 6,
        "q4_K" | "q5_K" => 7,
        _ => 8,
    }
}

fn act_bucket(a: &str) -> usize {
    match a {
        "f32" => 0,
        "q8_0" => 1,
        "q8_1" => 2,
        _ => 3,
    }
}

/// The shape's feature vector: `[log2 rows, log2 cols, log2 n_tokens] / 16`
/// then a one-hot weight-type bucket (9) and a one-hot activation type (4).
/// Every component lies in [0, 1].
pub fn shape_features(wtype: &str, act: &str, rows: usize, cols: usize, n_tokens: usize) -> Vec<f32> {
    let l = |n: usize| ((n.max(1) as f32).log2() / 16.0).min(1.0);
    let mut v = vec![0.0; DIM];
    v[0] = l(rows);
    v[1] = l(cols);
    v[2] = l(n_tokens);
    v[3 + wtype_bucket(wtype)] = 1.0;
    v[12 + act_bucket(act)] = 1.0;
    v
}

fn record_features(r: &Record) -> Vec<f32> {
    shape_features(&r.wtype, &r.act, r.rows, r.cols, r.n_tokens)
}

fn dist2(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum()
}

/// How long [`HistoryStore::open`] waits for another process to release
/// the store before it goes on without history.
pub const READ_WAIT: Duration = Duration::from_secs(5);
/// How long [`HistoryStore::record`] (a writer: `spinfer tune`) waits for
/// the store before it fails.
pub const WRITE_WAIT: Duration = Duration::from_secs(10);

/// Measurement history persisted at one path.
///
/// The file (redb) can be held by one process at a time, so readers load
/// every record and release it at once: any number of processes can start
/// against one history. A writer takes the store on its first
/// [`HistoryStore::record`] and holds it until dropped. Both wait for a
/// store another process holds, with jittered exponential backoff, for at
/// most [`READ_WAIT`] / [`WRITE_WAIT`].
pub struct HistoryStore {
    /// The open store, held by a writer only.
    db: Option<VectorStorage>,
    path: PathBuf,
    /// Every record, ordered by (date, id).
    records: Vec<(String, Record)>,
    /// False when the store stayed locked by another process past
    /// [`READ_WAIT`]: this process runs without its records.
    loaded: bool,
}

impl std::fmt::Debug for HistoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HistoryStore").field("path", &self.path).field("records", &self.records.len()).finish()
    }
}

fn db_err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::io(path, std::io::Error::other(format!("history store: {e}")))
}

/// Whether `e` says another process holds the store's file lock.
fn is_locked(e: &ruvector_core::RuvectorError) -> bool {
    e.to_string().contains("already open")
}

/// The options the store is created with (and that an existing store
/// must match in dimensions).
fn db_options(path: &Path) -> DbOptions {
    DbOptions {
        dimensions: DIM,
        distance_metric: DistanceMetric::Euclidean,
        storage_path: path.to_string_lossy().into_owned(),
        hnsw_config: Some(HnswConfig { m: 16, ef_construction: 100, ef_search: 64, max_elements: 100_000 }),
        quantization: None,
    }
}

/// What one attempt to take the store's file lock gave.
enum Attempt<T> {
    Got(T),
    /// Another process holds the file.
    Locked,
}

/// Runs `attempt` until it gets the file, retrying while another process
/// holds it (jittered exponential backoff, 5 ms doubling to 250 ms) for at
/// most `wait`. `Ok(None)`: still locked after `wait`.
fn with_backoff<T>(wait: Duration, mut attempt: impl FnMut() -> Result<Attempt<T>>) -> Result<Option<T>> {
    let start = Instant::now();
    let mut delay = Duration::from_millis(5);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    let mut seed = (u64::from(std::process::id()) << 32) ^ nanos ^ 0x9e37_79b9_7f4a_7c15;
    loop {
        if let Attempt::Got(t) = attempt()? {
            return Ok(Some(t));
        }
        let elapsed = start.elapsed();
        if elapsed >= wait {
            return Ok(None);
        }
        // xorshift jitter: the delay times 0.5..1.5, so processes started
        // together do not retry in lockstep.
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let jittered = delay.mul_f64(0.5 + (seed % 1000) as f64 / 1000.0);
        std::thread::sleep(jittered.min(wait - elapsed));
        delay = (delay * 2).min(Duration::from_millis(250));
    }
}

/// Takes the store at `path` for writing through ruvector-core (created with
/// our configuration if new), waiting at most `wait` for another process to
/// release it. `Ok(None)`: still locked after `wait`.
fn acquire(path: &Path, wait: Duration) -> Result<Option<VectorStorage>> {
    with_backoff(wait, || match VectorStorage::new(path, DIM) {
        Ok(db) => {
            // The stored configuration must be ours: refuse a foreign
            // database; record ours in a new one.
            match db.load_config().map_err(|e| db_err(path, e))? {
                Some(o) => check_dims(path, o.dimensions)?,
                None => db.save_config(&db_options(path)).map_err(|e| db_err(path, e))?,
            }
            Ok(Attempt::Got(db))
        }
        Err(e) if is_locked(&e) => Ok(Attempt::Locked),
        Err(e) => Err(db_err(path, e)),
    })
}

fn check_dims(path: &Path, dimensions: usize) -> Result<()> {
    if dimensions != DIM {
        return Err(db_err(path, format!("holds {dimensions}-d vectors, expected {DIM}")));
    }
    Ok(())
}

// The tables ruvector-core 2.4's `VectorStorage` keeps (storage.rs), read
// directly so that loading a history never decodes a stored vector:
// ruvector's `get` bincode-decodes it with no length limit, so a corrupt
// entry could size any allocation. Records need only their metadata; the
// vector is recomputed from it. `round_trip_across_reopen` (below) pins
// these names to the ruvector-core version in Cargo.lock.
const VECTORS_TABLE: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("vectors");
const METADATA_TABLE: redb::TableDefinition<&str, &str> = redb::TableDefinition::new("metadata");
const CONFIG_TABLE: redb::TableDefinition<&str, &str> = redb::TableDefinition::new("config");
const CONFIG_KEY: &str = "__ruvector_db_config__";

/// Longest metadata entry read: a record's JSON is about 300 bytes, and its
/// host fingerprint (CPU model and feature list) is the only open-ended part.
const MAX_RECORD_BYTES: usize = 16 * 1024;

/// The records in a store file, read without taking it for writing.
struct Snapshot {
    /// Every record, ordered by (date, id).
    records: Vec<(String, Record)>,
    /// Entries in the vectors table (one per record ruvector inserted).
    vectors: u64,
}

/// Reads every record of the store at `path` (a missing file holds none),
/// waiting at most `wait` while another process holds the file.
/// `Ok(None)`: still locked after `wait`. Entries whose metadata is missing,
/// oversized or not a record are skipped with a warning; a foreign
/// configuration or an unreadable file is an error.
fn read_snapshot(path: &Path, wait: Duration) -> Result<Option<Snapshot>> {
    use redb::{ReadableTable, ReadableTableMetadata, TableError};
    let err = |e: redb::Error| db_err(path, e);
    let Some(db) = with_backoff(wait, || match redb::Database::open(path) {
        Ok(db) => Ok(Attempt::Got(Some(db))),
        Err(redb::DatabaseError::DatabaseAlreadyOpen) => Ok(Attempt::Locked),
        Err(redb::DatabaseError::Storage(redb::StorageError::Io(e))) if e.kind() == std::io::ErrorKind::NotFound => {
            Ok(Attempt::Got(None))
        }
        Err(e) => Err(err(e.into())),
    })?
    else {
        return Ok(None);
    };
    let Some(db) = db else { return Ok(Some(Snapshot { records: Vec::new(), vectors: 0 })) };
    let tx = db.begin_read().map_err(|e| err(e.into()))?;
    // A table ruvector has not created yet holds nothing.
    let missing = |e: &TableError| matches!(e, TableError::TableDoesNotExist(_));
    match tx.open_table(CONFIG_TABLE) {
        Ok(t) => {
            if let Some(v) = t.get(CONFIG_KEY).map_err(|e| err(e.into()))? {
                let o: DbOptions =
                    serde_json::from_str(v.value()).map_err(|e| db_err(path, format!("stored configuration: {e}")))?;
                check_dims(path, o.dimensions)?;
            }
        }
        Err(e) if missing(&e) => {}
        Err(e) => return Err(err(e.into())),
    }
    let vectors = match tx.open_table(VECTORS_TABLE) {
        Ok(t) => t.len().map_err(|e| err(e.into()))?,
        Err(e) if missing(&e) => 0,
        Err(e) => return Err(err(e.into())),
    };
    let mut records = Vec::new();
    let table = match tx.open_table(METADATA_TABLE) {
        Ok(t) => t,
        Err(e) if missing(&e) => return Ok(Some(Snapshot { records, vectors })),
        Err(e) => return Err(err(e.into())),
    };
    for entry in table.iter().map_err(|e| err(e.into()))? {
        let (id, meta) = entry.map_err(|e| err(e.into()))?;
        let (id, meta) = (id.value(), meta.value());
        if meta.len() > MAX_RECORD_BYTES {
            tracing::warn!("{}: skipping history entry '{id}': {} bytes of metadata", path.display(), meta.len());
            continue;
        }
        match serde_json::from_str::<Record>(meta) {
            Ok(r) => records.push((id.to_string(), r)),
            Err(e) => tracing::warn!("{}: skipping history entry '{id}': {e}", path.display()),
        }
    }
    records.sort_by(|a, b| (a.1.date, &a.0).cmp(&(b.1.date, &b.0)));
    Ok(Some(Snapshot { records, vectors }))
}

impl HistoryStore {
    /// Loads the history at `path` (a redb file, created if missing) and
    /// releases the file at once, so that any number of processes can read
    /// one history. While another process holds it (a `spinfer tune`
    /// writing), waits up to [`READ_WAIT`]; if it is still held, warns once
    /// and returns an empty store: this process runs without history. Any
    /// other failure (a foreign or corrupt file) is an error.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_waiting(path, READ_WAIT)
    }

    /// [`HistoryStore::open`] waiting at most `wait` for the lock.
    pub fn open_waiting(path: impl AsRef<Path>, wait: Duration) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let Some(snapshot) = read_snapshot(&path, wait)? else {
            tracing::warn!(
                "history store {} is held by another process (waited {:.1} s): running without kernel history",
                path.display(),
                wait.as_secs_f64()
            );
            return Ok(Self { db: None, path, records: Vec::new(), loaded: false });
        };
        Ok(Self { db: None, path, records: snapshot.records, loaded: true })
    }

    /// Opens the history at `path` for writing: takes the file (waiting up
    /// to [`WRITE_WAIT`] for another process to release it, else an error
    /// naming the path) and holds it until dropped.
    pub fn open_writer(path: impl AsRef<Path>) -> Result<Self> {
        let mut h = Self { db: None, path: path.as_ref().to_path_buf(), records: Vec::new(), loaded: false };
        h.take_lock()?;
        Ok(h)
    }

    /// Takes the file for writing (if not held yet) and reloads the
    /// records, which other processes may have added since.
    fn take_lock(&mut self) -> Result<&VectorStorage> {
        let held = |path: &Path| {
            db_err(
                path,
                format!(
                    "held by another process for more than {} s (another `spinfer tune` writing?); try again",
                    WRITE_WAIT.as_secs()
                ),
            )
        };
        let deadline = Instant::now() + WRITE_WAIT;
        while self.db.is_none() {
            // The records are read from the file before ruvector takes it
            // (one process holds a redb file at a time); a writer that got
            // in between shows as more vectors than were read: read again.
            let left = deadline.saturating_duration_since(Instant::now());
            let Some(snapshot) = read_snapshot(&self.path, left)? else { return Err(held(&self.path)) };
            let Some(db) = acquire(&self.path, left)? else { return Err(held(&self.path)) };
            if db.len().map_err(|e| db_err(&self.path, e))? as u64 == snapshot.vectors {
                self.records = snapshot.records;
                self.loaded = true;
                self.db = Some(db);
            } else if Instant::now() >= deadline {
                return Err(held(&self.path));
            }
        }
        Ok(self.db.as_ref().expect("held"))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// False when the store was held by another process for longer than
    /// [`READ_WAIT`] and this one runs without its records.
    pub fn is_loaded(&self) -> bool {
        self.loaded
    }

    pub fn len(&self) -> usize {
        self.records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Every record, oldest first.
    pub fn records(&self) -> impl Iterator<Item = &Record> {
        self.records.iter().map(|(_, r)| r)
    }

    /// Appends `r` (committed to disk before returning). The first call
    /// takes the file for writing (see [`HistoryStore::open_writer`]).
    pub fn record(&mut self, r: &Record) -> Result<()> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let id = format!("{:010}-{nanos}-{}-{}", r.date, std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
        let serde_json::Value::Object(obj) = serde_json::to_value(r).map_err(|e| db_err(&self.path, e))? else {
            unreachable!("a struct serialises to an object")
        };
        let metadata: HashMap<String, serde_json::Value> = obj.into_iter().collect();
        let entry = VectorEntry { id: Some(id.clone()), vector: record_features(r), metadata: Some(metadata) };
        let db = self.take_lock()?;
        db.insert(&entry).map_err(|e| db_err(&self.path, e))?;
        self.records.push((id, r.clone()));
        Ok(())
    }

    /// Records of exactly `desc`'s shape in `phase` on `host`, oldest first.
    pub fn records_for(&self, host: &str, desc: &MatmulDesc, phase: Phase) -> Vec<Record> {
        self.records().filter(|r| r.matches(host, desc, phase, true)).cloned().collect()
    }

    /// Up to `k` records of the same host, op, phase, weight and activation
    /// type whose shapes are nearest to `desc` (Euclidean distance of the
    /// [`shape_features`]; an exact scan of the records in memory), nearest
    /// first; ties ordered by (rows, cols, date, kernel id).
    pub fn nearest(&self, host: &str, desc: &MatmulDesc, phase: Phase, k: usize) -> Vec<Record> {
        let (w, a) = (desc.wtype.name(), desc.act.name());
        // Records of one phase share (nearly) one token count: a constant
        // offset that does not change the ranking.
        let query = shape_features(w, a, desc.rows, desc.cols, BenchOptions::default().tokens(phase, desc.act));
        let key = |r: &Record| dist2(&record_features(r), &query);
        let mut found: Vec<(f32, &Record)> =
            self.records().filter(|r| r.matches(host, desc, phase, false)).map(|r| (key(r), r)).collect();
        found.sort_by(|(dx, x), (dy, y)| {
            dx.total_cmp(dy)
                .then_with(|| (x.rows, x.cols, x.date, &x.kernel_id).cmp(&(y.rows, y.cols, y.date, &y.kernel_id)))
        });
        found.into_iter().take(k).map(|(_, r)| r.clone()).collect()
    }
}

/// A record for `kernel_id` measured on `desc` (helper for callers/tests).
#[allow(clippy::too_many_arguments, reason = "flat constructor")]
pub fn make_record(
    host: &str,
    desc: &MatmulDesc,
    phase: Phase,
    n_tokens: usize,
    kernel_id: &str,
    median_ns: Option<u64>,
    rejected: Option<String>,
    date: u64,
) -> Record {
    Record {
        host: host.to_string(),
        op: "matmul".to_string(),
        phase,
        wtype: desc.wtype.name().to_string(),
        act: desc.act.name().to_string(),
        rows: desc.rows,
        cols: desc.cols,
        n_tokens,
        kernel_id: kernel_id.to_string(),
        median_ns,
        rejected,
        date,
    }
}

/// Parses a weight type name as stored in records.
pub fn wtype_from_name(name: &str) -> Option<GgmlType> {
    GgmlType::ALL.into_iter().find(|t| t.name() == name)
}

/// Parses an activation type name as stored in records.
pub fn act_from_name(name: &str) -> Option<ActType> {
    [ActType::F32, ActType::Q8_0, ActType::Q8_1, ActType::Q8_K, ActType::Q16].into_iter().find(|a| a.name() == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(rows: usize, cols: usize) -> MatmulDesc {
        MatmulDesc::dense(GgmlType::Q4_1, ActType::Q8_1, rows, cols)
    }

    #[test]
    fn round_trip_across_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("history.redb");
        let host = Host::detect().fingerprint();
        let mut written = Vec::new();
        {
            let mut h = HistoryStore::open(&path).unwrap();
            assert!(h.is_empty());
            for (i, (r, c)) in [(64, 64), (256, 256), (64, 256)].into_iter().enumerate() {
                let rec = make_record(
                    &host,
                    &desc(r, c),
                    Phase::Decode,
                    1,
                    "cpu-builtin/avx2/q4_1*q8_1",
                    Some(100 + i as u64),
                    None,
                    1000 + i as u64,
                );
                h.record(&rec).unwrap();
                written.push(rec);
            }
            let rej =
                make_record(&host, &desc(64, 64), Phase::Prefill, 64, "p@1#ab/k", None, Some("wrong".into()), 2000);
            h.record(&rej).unwrap();
            written.push(rej);
            assert_eq!(h.len(), 4);
        }
        let h = HistoryStore::open(&path).unwrap();
        let back: Vec<Record> = h.records().cloned().collect();
        assert_eq!(back, written);
        assert_eq!(h.records_for(&host, &desc(256, 256), Phase::Decode), vec![written[1].clone()]);
        assert_eq!(h.records_for(&host, &desc(64, 64), Phase::Prefill), vec![written[3].clone()]);
        assert!(h.records_for("other host", &desc(256, 256), Phase::Decode).is_empty());
        // The rebuilt HNSW index answers searches after reopen.
        let near = h.nearest(&host, &desc(250, 250), Phase::Decode, 1);
        assert_eq!(near.len(), 1);
        assert_eq!((near[0].rows, near[0].cols), (256, 256));
        drop(h);
        // Writes after a reopen persist too.
        {
            let mut h = HistoryStore::open(&path).unwrap();
            h.record(&written[0]).unwrap();
        }
        assert_eq!(HistoryStore::open(&path).unwrap().len(), 5);
    }

    /// Environment variable that turns [`killed_mid_write_keeps_committed_records`]
    /// into the writer child: its value is the store path.
    const CHILD_ENV: &str = "SPINFER_HISTORY_CHILD";

    /// A process killed (SIGKILL) while writing leaves a store that reopens,
    /// keeps every record whose `record()` had returned, and takes new
    /// writes. The test re-runs its own binary as the writer child.
    #[test]
    fn killed_mid_write_keeps_committed_records() {
        use std::io::{BufRead, BufReader, Write};
        use std::process::{Command, Stdio};

        let host = "crash-host";
        let rec = |i: u64| {
            make_record(host, &desc(64 + (i as usize % 7) * 32, 256), Phase::Decode, 1, "x/k", Some(i), None, i)
        };

        if let Ok(path) = std::env::var(CHILD_ENV) {
            // Child: write forever (bounded, in case the parent died), one
            // line per committed record.
            let mut h = HistoryStore::open(&path).unwrap();
            let start = std::time::Instant::now();
            let mut out = std::io::stdout().lock();
            let mut i = 0u64;
            while start.elapsed() < std::time::Duration::from_secs(60) {
                h.record(&rec(i)).unwrap();
                writeln!(out, "committed {i}").unwrap();
                out.flush().unwrap();
                i += 1;
            }
            return;
        }

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("history.redb");
        // Name of this test as libtest knows it (module path minus crate).
        let module = module_path!().split_once("::").map_or(module_path!(), |(_, m)| m);
        let name = format!("{module}::killed_mid_write_keeps_committed_records");
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", &name, "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, &path)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut committed = Vec::new();
        while committed.len() < 25 {
            let Some(line) = lines.next() else { break };
            if let Some(n) = line.unwrap().strip_prefix("committed ") {
                committed.push(n.trim().parse::<u64>().unwrap());
            }
        }
        // The child keeps writing between our read and the kill: it dies
        // mid-write (or between writes) at an arbitrary point.
        child.kill().unwrap();
        let status = child.wait().unwrap();
        assert!(!status.success(), "child exited on its own: {status}");
        assert_eq!(committed.len(), 25, "child reported {} commits before exiting", committed.len());
        drop(lines);

        let mut h = HistoryStore::open(&path).expect("store reopens after a crash");
        assert!(h.len() >= committed.len(), "{} records on disk, {} committed", h.len(), committed.len());
        let on_disk: Vec<u64> = h.records().map(|r| r.median_ns.unwrap()).collect();
        for i in &committed {
            assert!(on_disk.contains(i), "committed record {i} lost");
            assert_eq!(h.records().find(|r| r.median_ns == Some(*i)), Some(&rec(*i)));
        }
        // Every entry on disk deserialised (open skips entries that do not).
        assert_eq!(h.take_lock().unwrap().len().unwrap(), h.len());
        // New writes work and persist; searches work on the reopened index.
        let before = h.len();
        h.record(&rec(1_000_000)).unwrap();
        assert!(!h.nearest(host, &desc(64, 256), Phase::Decode, 1).is_empty());
        drop(h);
        let h = HistoryStore::open(&path).unwrap();
        assert_eq!(h.len(), before + 1);
        assert!(h.records().any(|r| r.median_ns == Some(1_000_000)));
    }

    /// Environment variable that turns [`writers_wait_for_each_other`] into
    /// the first writer: its value is the store path.
    const HOLDER_ENV: &str = "SPINFER_HISTORY_HOLDER";

    /// A writer in another process holds the store (redb's file lock; in
    /// one process ruvector shares the handle): a second writer waits with
    /// backoff and records once it is released; a reader that cannot get it
    /// within its wait gets an empty store marked not loaded.
    #[test]
    fn writers_wait_for_each_other() {
        use std::io::{BufRead, BufReader};
        use std::process::{Command, Stdio};

        let rec = |i: u64| make_record("h", &desc(64, 64), Phase::Decode, 1, "x/k", Some(i), None, i);
        if let Ok(path) = std::env::var(HOLDER_ENV) {
            // Child: take the store, record, say so, hold it 1 s.
            let mut h = HistoryStore::open_writer(&path).unwrap();
            h.record(&rec(1)).unwrap();
            println!("holding");
            std::thread::sleep(Duration::from_secs(1));
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("history.redb");
        let module = module_path!().split_once("::").map_or(module_path!(), |(_, m)| m);
        let name = format!("{module}::writers_wait_for_each_other");
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", &name, "--nocapture", "--test-threads=1"])
            .env(HOLDER_ENV, &path)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        assert!(lines.any(|l| l.unwrap().contains("holding")), "the holder never took the store");
        let t = Instant::now();
        // A reader with a short wait gives up: empty, not loaded.
        let r = HistoryStore::open_waiting(&path, Duration::from_millis(100)).unwrap();
        assert!(!r.is_loaded() && r.is_empty());
        // A writer waits for the holder, then sees its record and adds one.
        let mut w = HistoryStore::open_writer(&path).unwrap();
        let waited = t.elapsed();
        assert!(waited >= Duration::from_millis(500), "the writer did not wait: {waited:?}");
        assert!(w.is_loaded() && w.len() == 1);
        w.record(&rec(2)).unwrap();
        drop(w);
        assert!(child.wait().unwrap().success());
        let h = HistoryStore::open(&path).unwrap();
        assert!(h.is_loaded());
        assert_eq!(h.records().map(|r| r.median_ns.unwrap()).collect::<Vec<_>>(), vec![1, 2]);
    }

    /// A stored vector whose bincode length prefix claims 2^62 floats (a
    /// corrupt or hostile file; found by the `history` fuzz target) is never
    /// decoded: readers and writers load the records from their metadata,
    /// and a reader of a missing file creates nothing.
    #[test]
    fn corrupt_vector_is_never_decoded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("history.redb");
        let missing = HistoryStore::open(&path).unwrap();
        assert!(missing.is_loaded() && missing.is_empty() && !path.exists());
        let rec = |i: u64| make_record("h", &desc(64, 64), Phase::Decode, 1, "x/k", Some(i), None, i);
        HistoryStore::open_writer(&path).unwrap().record(&rec(1)).unwrap();
        {
            let db = redb::Database::open(&path).unwrap();
            let tx = db.begin_write().unwrap();
            {
                // bincode varint: 0xfd, then a little-endian u64.
                let mut huge = vec![0xfd];
                huge.extend_from_slice(&(1u64 << 62).to_le_bytes());
                tx.open_table(VECTORS_TABLE).unwrap().insert("evil", huge.as_slice()).unwrap();
                let meta = serde_json::to_string(&rec(2)).unwrap();
                tx.open_table(METADATA_TABLE).unwrap().insert("evil", meta.as_str()).unwrap();
            }
            tx.commit().unwrap();
        }
        let h = HistoryStore::open(&path).unwrap();
        assert_eq!(h.records().map(|r| r.median_ns.unwrap()).collect::<Vec<_>>(), vec![1, 2]);
        let mut w = HistoryStore::open_writer(&path).unwrap();
        assert_eq!(w.len(), 2);
        w.record(&rec(3)).unwrap();
        drop(w);
        assert_eq!(HistoryStore::open(&path).unwrap().len(), 3);
    }

    #[test]
    fn nearest_picks_closest_shape_of_same_type() {
        let dir = tempfile::tempdir().unwrap();
        let mut h = HistoryStore::open(dir.path().join("h.redb")).unwrap();
        let host = "host-a";
        for (r, c) in [(64, 64), (256, 256), (1024, 1024), (4096, 1024)] {
            h.record(&make_record(host, &desc(r, c), Phase::Decode, 1, "x/k", Some(1), None, 1)).unwrap();
        }
        // Same shape, different type or host: must be filtered out.
        let q8 = MatmulDesc::dense(GgmlType::Q8_0, ActType::Q8_0, 2048, 1024);
        h.record(&make_record(host, &q8, Phase::Decode, 1, "x/k", Some(1), None, 1)).unwrap();
        h.record(&make_record("host-b", &desc(2048, 1024), Phase::Decode, 1, "x/k", Some(1), None, 1)).unwrap();
        let near = h.nearest(host, &desc(2048, 1024), Phase::Decode, 2);
        let shapes: Vec<_> = near.iter().map(|r| (r.rows, r.cols)).collect();
        // log2 distance: 4096x1024 and 1024x1024 are both one octave away;
        // ties break by (rows, cols).
        assert_eq!(shapes, vec![(1024, 1024), (4096, 1024)]);
        let near = h.nearest(host, &desc(300, 200), Phase::Decode, 1);
        assert_eq!((near[0].rows, near[0].cols), (256, 256));
        assert!(h.nearest(host, &desc(300, 200), Phase::Prefill, 3).is_empty());
        assert_eq!(wtype_from_name("q4_K"), Some(GgmlType::Q4_K));
        assert_eq!(act_from_name("q8_K"), Some(ActType::Q8_K));
    }
}
