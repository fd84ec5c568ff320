//! The operator TOML (`spinfer.toml`): parse and validate, then derive what
//! the engine derives from it (trust policy, model options).
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use spinfer_engine::config::Config;
use spinfer_fuzz::ok;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Some(c) = ok("config", Config::parse(text, Path::new("spinfer.toml"))) else { return };
    ok("trust_policy", c.trust_policy());
    let _ = c.model_options();
});
