//! Minimal WASM packs made in memory, for tests in this and other crates
//! (features `fixtures` and `wasm`; never in a release build).

use spinfer_registry::{TrustPolicy, VerifiedPack, sha256_hex, verify_pack};

/// A minimal module implementing the ABI with one F32 kernel whose body
/// is `body` (must leave an i32 status on the stack).
pub fn wat_module(abi: u32, body: &str) -> Vec<u8> {
    let text = format!(
        r#"(module
  (memory (export "memory") 1)
  (global $next (mut i32) (i32.const 1024))
  (func (export "spinfer_abi_version") (result i32) (i32.const {abi}))
  (func (export "spinfer_kernel_count") (result i32) (i32.const 1))
  (func (export "spinfer_kernel_wtype") (param i32) (result i32) (i32.const 0))
  (func (export "alloc") (param $n i32) (result i32)
(local $p i32) (local $end i32)
(local.set $p (global.get $next))
(local.set $end (i32.add (local.get $p) (local.get $n)))
(if (i32.gt_u (local.get $end) (i32.mul (memory.size) (i32.const 65536)))
  (then
    (if (i32.eq (memory.grow (i32.sub (i32.add (i32.shr_u (local.get $end) (i32.const 16)) (i32.const 1))
                                      (memory.size)))
                (i32.const -1))
      (then (return (i32.const 0))))))
(global.set $next (local.get $end))
(local.get $p))
  (func (export "matmul_f32_f32") (param i32 i32 i32 i32 i32 i32) (result i32)
{body}))"#
    );
    wat::parse_str(text).expect("test module parses")
}

/// Writes an unsigned pack around `wasm` and verifies it.
pub fn pack(name: &str, abi: u32, wasm: &[u8]) -> (tempfile::TempDir, VerifiedPack) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("kernels.wasm"), wasm).unwrap();
    let kname = name.replace('-', "_");
    let manifest = format!(
        r#"name = "{name}"
version = "0.1.0"
abi_version = {abi}
kind = "wasm"
min_host_version = "0.1.0"

[artefact]
file = "kernels.wasm"
sha256 = "{}"

[[kernels]]
name = "{kname}_f32"
op = "matmul"
weight = "f32"
act = "f32"
"#,
        sha256_hex(wasm)
    );
    std::fs::write(dir.path().join("pack.toml"), manifest).unwrap();
    let verified = verify_pack(dir.path(), &TrustPolicy::new().with_unsigned_allowed(true)).unwrap();
    (dir, verified)
}

/// The body of a one-kernel module (for [`wat_module`]) computing an f32
/// matvec that traps (`unreachable`) when asked for more than one token.
pub const MATVEC_TRAPS_ON_BATCH: &str = r#"
(if (i32.gt_u (local.get 4) (i32.const 1)) (then unreachable))
(local.set $r (i32.const 0))
(block $done (loop $rows
  (br_if $done (i32.ge_u (local.get $r) (local.get 1)))
  (local.set $acc (f32.const 0))
  (local.set $c (i32.const 0))
  (block $cd (loop $cols
    (br_if $cd (i32.ge_u (local.get $c) (local.get 2)))
    (local.set $acc (f32.add (local.get $acc) (f32.mul
      (f32.load (i32.add (local.get 0)
        (i32.shl (i32.add (i32.mul (local.get $r) (local.get 2)) (local.get $c)) (i32.const 2))))
      (f32.load (i32.add (local.get 3) (i32.shl (local.get $c) (i32.const 2)))))))
    (local.set $c (i32.add (local.get $c) (i32.const 1)))
    (br $cols)))
  (f32.store (i32.add (local.get 5) (i32.shl (local.get $r) (i32.const 2))) (local.get $acc))
  (local.set $r (i32.add (local.get $r) (i32.const 1)))
  (br $rows)))
(i32.const 0)"#;
