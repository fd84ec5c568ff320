//! `score()` and `probe()` never panic; without a usable GPU (or without
//! the `cuda` feature) the score is 0 with a reason.

use spinfer_kernels_cuda::{CudaUnavailable, SCORE_CUDA, probe, score};

#[test]
fn score_is_zero_with_a_reason_or_describes_the_device() {
    let (s, why) = score();
    eprintln!("cuda score {s}: {why}");
    assert!(!why.is_empty());
    match probe() {
        Ok(dev) => {
            assert_eq!(s, SCORE_CUDA);
            assert!(!dev.name.is_empty() && dev.total_memory > 0 && dev.device_count >= 1, "{dev:?}");
            assert!(why.contains(&dev.name), "{why}");
        }
        Err(e) => {
            assert_eq!(s, 0);
            assert_eq!(why, e.to_string());
            if cfg!(not(feature = "cuda")) {
                assert_eq!(e, CudaUnavailable::NotCompiled { feature: "cuda" });
            } else {
                assert_ne!(e, CudaUnavailable::NotCompiled { feature: "cuda" });
            }
        }
    }
}

/// What the test machine is expected to have, when it says so
/// (`SPINFER_EXPECT_GPU=1` on a GPU runner, `0` to insist on none).
#[test]
fn matches_the_expected_machine() {
    match std::env::var("SPINFER_EXPECT_GPU").as_deref() {
        Ok("1") if cfg!(feature = "cuda") => assert!(probe().is_ok(), "{:?}", probe()),
        Ok("0") => assert_eq!(score().0, 0),
        _ => {}
    }
}
