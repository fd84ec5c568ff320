//! The kernel-benchmark history (a ruvector-core database: redb tables of
//! bincode vectors and JSON metadata, plus a stored JSON configuration).
//!
//! The input is `config SEP (id SEP vector SEP metadata)*`: the target writes
//! those rows into a fresh redb file with the tables ruvector-core uses
//! (`config` holds `config` under its key unless empty; `vectors` the raw
//! vector bytes; `metadata` the metadata text), then opens it as a
//! [`HistoryStore`], reads every record, searches it, appends a record and
//! reopens it. An input that starts with redb's magic number is written as
//! the database file itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use redb::{Database, TableDefinition};
use spinfer_engine::tuning::history::make_record;
use spinfer_engine::tuning::{HistoryStore, Phase};
use spinfer_fuzz::{SEP, ok, scratch};
use spinfer_kernels::GgmlType;
use spinfer_kernels::kernel::{ActType, MatmulDesc};

const VECTORS: TableDefinition<&str, &[u8]> = TableDefinition::new("vectors");
const METADATA: TableDefinition<&str, &str> = TableDefinition::new("metadata");
const CONFIG: TableDefinition<&str, &str> = TableDefinition::new("config");
const CONFIG_KEY: &str = "__ruvector_db_config__";
const REDB_MAGIC: &[u8] = b"redb";

fn split_all(data: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut rest = data;
    while let Some(i) = rest.windows(SEP.len()).position(|w| w == SEP) {
        out.push(&rest[..i]);
        rest = &rest[i + SEP.len()..];
    }
    out.push(rest);
    out
}

fn write_db(path: &std::path::Path, data: &[u8]) -> Result<(), redb::Error> {
    let p = split_all(data);
    // 1 MiB regions instead of redb's 4 GiB: the file keeps its layout when
    // ruvector-core reopens it, and the allocator bitmaps of full-size
    // regions cost ~150 ms an input under coverage instrumentation.
    // (`set_region_size` exists under `--cfg fuzzing`, as scripts/fuzz.sh builds.)
    let mut builder = Database::builder();
    #[cfg(fuzzing)]
    builder.set_region_size(1 << 20);
    let db = builder.create(path)?;
    let tx = db.begin_write()?;
    {
        if !p[0].is_empty() {
            let mut t = tx.open_table(CONFIG)?;
            t.insert(CONFIG_KEY, String::from_utf8_lossy(p[0]).as_ref())?;
        }
        let mut v = tx.open_table(VECTORS)?;
        let mut m = tx.open_table(METADATA)?;
        for row in p[1..].chunks(3) {
            let id = String::from_utf8_lossy(row[0]);
            v.insert(id.as_ref(), row.get(1).copied().unwrap_or_default())?;
            if let Some(meta) = row.get(2) {
                m.insert(id.as_ref(), String::from_utf8_lossy(meta).as_ref())?;
            }
        }
    }
    tx.commit()?;
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let path = scratch().join("history.redb");
    let _ = std::fs::remove_file(&path);
    if data.starts_with(REDB_MAGIC) {
        std::fs::write(&path, data).expect("write scratch file");
    } else if ok("redb", write_db(&path, data)).is_none() {
        return;
    }
    let Some(mut h) = ok("history", HistoryStore::open(&path)) else { return };
    let n = h.records().count();
    assert_eq!(n, h.len());
    let desc = MatmulDesc::dense(GgmlType::Q4_1, ActType::Q8_1, 576, 576);
    let host = h.records().next().map(|r| r.host.clone()).unwrap_or_default();
    let _ = h.nearest(&host, &desc, Phase::Decode, 4);
    let _ = h.records_for(&host, &desc, Phase::Prefill);
    let r = make_record(&host, &desc, Phase::Decode, 1, "cpu/fuzz", Some(1000), None, 1);
    if h.record(&r).is_ok() {
        drop(h);
        let again = HistoryStore::open(&path).expect("reopen a history just written");
        assert!(again.len() > n, "an appended record was lost");
    }
});
