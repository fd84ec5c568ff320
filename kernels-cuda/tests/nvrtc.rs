//! Every format's kernel source compiles through NVRTC, without a device:
//! a syntax or type error in `src/cu/` fails here, on CI machines with no
//! GPU (scripts/test.sh fetches `libnvrtc` from the nvidia-cuda-nvrtc-cu12
//! wheel and sets `SPINFER_EXPECT_NVRTC=1`).

use spinfer_kernels_cuda::{CudaError, WeightFormat, compile_check};

#[test]
fn every_kernel_source_compiles() {
    let expect = std::env::var("SPINFER_EXPECT_NVRTC").as_deref() == Ok("1");
    // compute_75 is the oldest architecture current NVRTC targets; 90 is Hopper.
    for arch in ["compute_75", "compute_90"] {
        match compile_check(arch) {
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
            Err(e) => panic!("{e}"),
        }
    }
}
