//! The block readers of `src/cu/formats.cuh`, compiled for the host with the
//! system C++ compiler, against the CPU scalar reference on random blocks of
//! every format: the same source the GPU runs, checked on any machine (the
//! device tests need a GPU). Skipped, saying so, without a C++ compiler.

use std::path::Path;
use std::process::Command;

mod support;

use spinfer_kernels_cuda::{WeightFormat, synthetic_matrix};
use support::dequantize;

/// Host shims for what NVRTC provides, then the readers, then a driver that
/// dequantises a matrix file item by item.
const HARNESS: &str = r#"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#define SPINFER_HOST 1
#define __device__
#define __forceinline__ inline
struct uint4 { unsigned x, y, z, w; };
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float h2f(unsigned short h) {
    unsigned s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023, bits;
    if (e == 0) {
        if (m == 0) { bits = s << 31; }
        else { e = 113; while (!(m & 1024)) { m <<= 1; --e; } m &= 1023; bits = (s << 31) | (e << 23) | (m << 13); }
    } else if (e == 31) { bits = (s << 31) | (255u << 23) | (m << 13); }
    else { bits = (s << 31) | ((e + 112) << 23) | (m << 13); }
    return __uint_as_float(bits);
}
#include "common.cuh"
#include "formats.cuh"

template <typename F>
static void run(const std::vector<unsigned char>& w, int rows, int cols, std::vector<float>& out) {
    const size_t row_bytes = w.size() / rows;
    for (int r = 0; r < rows; ++r) {
        const unsigned char* row = w.data() + r * row_bytes;
        const float rs = F::row_scale(row, cols);
        for (int it = 0; it < cols / 32; ++it) {
            float v[32];
            F::dequant(row + (size_t)(it / F::ITEMS) * F::BLOCK_BYTES, it % F::ITEMS, rs, v);
            std::memcpy(&out[(size_t)r * cols + 32 * it], v, sizeof v);
        }
    }
}

int main(int argc, char** argv) {
    if (argc != 6) return 2;
    const std::string fmt = argv[1];
    const int rows = std::atoi(argv[2]), cols = std::atoi(argv[3]);
    FILE* f = std::fopen(argv[4], "rb");
    if (!f) return 3;
    std::vector<unsigned char> w;
    unsigned char buf[65536];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) w.insert(w.end(), buf, buf + n);
    std::fclose(f);
    std::vector<float> out((size_t)rows * cols);
#define CASE(NAME, F) if (fmt == NAME) run<F>(w, rows, cols, out); else
    CASE("q4_0", FmtQ4_0) CASE("q4_1", FmtQ4_1) CASE("q5_0", FmtQ5_0) CASE("q5_1", FmtQ5_1)
    CASE("q8_0", FmtQ8_0) CASE("q4_K", FmtQ4_K) CASE("q5_K", FmtQ5_K) CASE("q6_K", FmtQ6_K)
    CASE("tq1_0", FmtTQ1_0) CASE("tq2_0", FmtTQ2_0) CASE("i2_s", FmtI2_S) return 4;
    FILE* o = std::fopen(argv[5], "wb");
    if (!o) return 5;
    std::fwrite(out.data(), sizeof(float), out.size(), o);
    std::fclose(o);
    return 0;
}
"#;

#[test]
fn every_block_reader_matches_the_cpu_reference() {
    let dir = tempfile::tempdir().unwrap();
    let cu = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cu");
    let src = dir.path().join("harness.cpp");
    std::fs::write(&src, HARNESS).unwrap();
    let exe = dir.path().join("harness");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let built = Command::new(&cxx)
        .args(["-O1", "-std=c++17", "-fno-strict-aliasing", "-I"])
        .arg(&cu)
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output();
    let built = match built {
        Ok(o) => o,
        Err(e) => {
            eprintln!("skipped: no C++ compiler ({cxx}: {e})");
            return;
        }
    };
    assert!(
        built.status.success(),
        "the host build of formats.cuh failed:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    for format in WeightFormat::ALL {
        let (rows, cols) = (7, 2 * 256);
        let bytes = synthetic_matrix(format, rows, cols, 11).unwrap();
        let (input, output) = (dir.path().join("w.bin"), dir.path().join("out.bin"));
        std::fs::write(&input, &bytes).unwrap();
        let status = Command::new(&exe)
            .args([format.name(), &rows.to_string(), &cols.to_string()])
            .arg(&input)
            .arg(&output)
            .status()
            .unwrap();
        assert!(status.success(), "{format}: harness exit {status}");
        let got: Vec<f32> = std::fs::read(&output)
            .unwrap()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let want = dequantize(format, &bytes, rows, cols);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // The same products in f32: equal, or within one rounding.
            assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{format} element {i}: {g} vs {w}");
        }
    }
}
