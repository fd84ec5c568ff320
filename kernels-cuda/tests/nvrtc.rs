//! Every format's kernel source compiles through NVRTC, without a device:
//! a syntax or type error in `src/cu/` fails here, on CI machines with no
//! GPU (scripts/test.sh fetches `libnvrtc` from the nvidia-cuda-nvrtc-cu12
//! wheel and sets `SPINFER_EXPECT_NVRTC=1`).

use spinfer_kernels_cuda::{CudaError, WeightFormat, compile_check};

#[test]
fn every_kernel_source_compiles() {
    let expect = std::env::var("SPINFER_EXPECT_NVRTC").as_deref() == Ok("1");
    // compute_75 is the oldest architecture current NVRTC targets; 90 is
    // Hopper. The two compile side by side (NVRTC calls on separate
    // programs are thread-safe): a minute each on a 2-core CI machine.
    let archs = ["compute_75", "compute_90"];
    let results: Vec<_> = std::thread::scope(|s| {
        let jobs: Vec<_> = archs.map(|arch| s.spawn(move || compile_check(arch))).into();
        jobs.into_iter().map(|j| j.join().expect("the compile thread panicked")).collect()
    });
    for (arch, result) in archs.into_iter().zip(results) {
        match result {
            Ok(sizes) => {
                assert_eq!(sizes.len(), WeightFormat::ALL.len() + 1, "one module per format and the ops");
                for (f, len) in sizes {
                    eprintln!("{arch} {f}: {len} bytes of ptx");
                    assert!(len > 1000, "{f}: {len} bytes of ptx");
                }
            }
            Err(e @ (CudaError::NoNvrtc | CudaError::Unavailable(_))) => {
                assert!(!expect, "SPINFER_EXPECT_NVRTC=1 but: {e}");
                eprintln!("skipped: {e}");
                return;
            }
            Err(e) => panic!("{arch}: {e}"),
        }
    }
}
