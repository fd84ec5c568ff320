//! The sparsity sidecar (`model.spinfer`, safetensors with JSON metadata):
//! the input is the file; `Sidecar::read` validates it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use spinfer_engine::sparse::sidecar::Sidecar;
use spinfer_fuzz::{ok, scratch};

fuzz_target!(|data: &[u8]| {
    let path = scratch().join("model.spinfer");
    std::fs::write(&path, data).expect("write scratch file");
    if let Some(s) = ok("sidecar", Sidecar::read(&path)) {
        // A sidecar that reads must write back and read again.
        let again = scratch().join("again.spinfer");
        s.write(&again).expect("write a sidecar that was read");
        Sidecar::read(&again).expect("read back a sidecar just written");
    }
});
