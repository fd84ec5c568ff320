//! One kernel history shared by concurrent processes: readers load the
//! records and release the store at once, so processes started together
//! all succeed; a writer holding the store makes readers wait (bounded),
//! and a reader that cannot get it runs without history and says so once.
//! (Writers waiting for each other: `tuning::history`'s unit tests.)

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use spinfer_engine::tuning::history::{HistoryStore, Host, READ_WAIT, make_record};
use spinfer_engine::tuning::{Phase, Record};
use spinfer_kernels::GgmlType;
use spinfer_kernels::kernel::{ActType, MatmulDesc};

const LOCK_MESSAGES: [&str; 2] = ["already open", "Cannot acquire lock"];
const SKIPPED: &str = "running without kernel history";

fn records(n: usize) -> Vec<Record> {
    let host = Host::detect().fingerprint();
    (0..n)
        .map(|i| {
            let desc = MatmulDesc::dense(GgmlType::Q4_1, ActType::Q8_1, 64 + 32 * i, 576);
            make_record(&host, &desc, Phase::Decode, 1, "cpu-builtin/x", Some(1000 + i as u64), None, 1 + i as u64)
        })
        .collect()
}

/// A history with `n` records, written and released.
fn seeded_history(dir: &Path, n: usize) -> std::path::PathBuf {
    let path = dir.join("history.redb");
    let mut h = HistoryStore::open_writer(&path).unwrap();
    for r in records(n) {
        h.record(&r).unwrap();
    }
    path
}

fn spawn(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_spinfer"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// `spinfer kernels` (model load, kernel choice from the history) against
/// `history`, started `n` at once.
fn readers(model: &Path, history: &Path, n: usize) -> Vec<Child> {
    (0..n).map(|_| spawn(&["kernels", "-m", model.to_str().unwrap(), "--history", history.to_str().unwrap()])).collect()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn eight_processes_started_at_once_all_succeed() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let dir = tempfile::tempdir().unwrap();
    let history = seeded_history(dir.path(), 50);
    // 8 readers through `kernels --history`, and 8 generations whose config
    // names the history, all started together.
    let config = dir.path().join("spinfer.toml");
    std::fs::write(&config, format!("[model]\npath = {:?}\nctx = 64\n\n[packs]\nhistory = {:?}\n", model, history))
        .unwrap();
    let mut children = readers(&model, &history, 8);
    let c = config.to_str().unwrap();
    children.extend((0..8).map(|_| spawn(&["generate", "--config", c, "-p", "Hello", "-n", "2", "--temp", "0"])));
    for child in children {
        let out = child.wait_with_output().unwrap();
        let e = stderr(&out);
        assert!(out.status.success(), "a process failed: {e}");
        for m in LOCK_MESSAGES.iter().chain([&SKIPPED]) {
            assert!(!e.contains(m), "a process did not get the history: {e}");
        }
    }
    // The readers left the records in place.
    assert_eq!(HistoryStore::open(&history).unwrap().len(), 50);
}

#[test]
fn readers_wait_for_a_writer_then_all_succeed() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let dir = tempfile::tempdir().unwrap();
    let history = seeded_history(dir.path(), 10);
    // A writer holds the store for 1 s while 8 readers start: they wait for
    // it (jittered backoff) and all succeed with the history.
    let mut writer = HistoryStore::open_writer(&history).unwrap();
    let children = readers(&model, &history, 8);
    std::thread::sleep(Duration::from_secs(1));
    writer.record(&records(11)[10]).unwrap();
    drop(writer);
    for child in children {
        let out = child.wait_with_output().unwrap();
        let e = stderr(&out);
        assert!(out.status.success(), "{e}");
        assert!(!e.contains(SKIPPED) && !LOCK_MESSAGES.iter().any(|m| e.contains(m)), "{e}");
    }
    assert_eq!(HistoryStore::open(&history).unwrap().len(), 11);
}

#[test]
fn a_reader_that_cannot_get_the_store_runs_without_history_and_says_so_once() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let dir = tempfile::tempdir().unwrap();
    let history = seeded_history(dir.path(), 10);
    let writer = HistoryStore::open_writer(&history).unwrap();
    let t = Instant::now();
    let out = spawn(&["kernels", "-m", model.to_str().unwrap(), "--history", history.to_str().unwrap()])
        .wait_with_output()
        .unwrap();
    let e = stderr(&out);
    assert!(out.status.success(), "{e}");
    assert_eq!(e.matches(SKIPPED).count(), 1, "{e}");
    assert!(!LOCK_MESSAGES.iter().any(|m| e.contains(m)), "{e}");
    assert!(t.elapsed() >= READ_WAIT, "gave up after {:?}", t.elapsed());
    drop(writer);
}
