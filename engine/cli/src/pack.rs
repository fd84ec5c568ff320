//! `spinfer pack keygen | sign | verify | inspect`: the pack author's and
//! operator's tools around `spinfer-registry`.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use spinfer_engine::config::Config;
use spinfer_registry::{
    KeyPair, Manifest, PackSignature, PublicKey, TrustPolicy, TrustedKey, sign_pack, verify_pack_with,
};

#[derive(Args)]
pub struct PackArgs {
    #[command(subcommand)]
    command: PackCommand,
}

#[derive(Subcommand)]
enum PackCommand {
    /// Generate a signing key pair: NAME.key (secret, mode 0600) and NAME.pub.
    Keygen {
        /// Base name of the key files.
        #[arg(long)]
        name: String,
        /// Directory to write them to.
        #[arg(long, default_value = ".")]
        dir: PathBuf,
    },
    /// Sign a pack directory (writes pack.sig over pack.toml).
    Sign {
        /// The secret key file written by `keygen`.
        #[arg(long)]
        key: PathBuf,
        /// The pack directory.
        pack: PathBuf,
    },
    /// Verify a pack's signature and artefact hash against a trust policy.
    Verify {
        /// The pack directory.
        pack: PathBuf,
        /// Trusted public key (`ed25519:...`) or a .pub file; repeatable.
        #[arg(long)]
        trust: Vec<String>,
        /// Take trusted/revoked keys and allow_unsigned from an operator config.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Accept a pack without pack.sig.
        #[arg(long)]
        allow_unsigned: bool,
    },
    /// Show a pack's manifest, who signed it, and whether the current trust
    /// policy (--trust / --config) accepts that signer for the pack's name.
    Inspect {
        /// The pack directory.
        pack: PathBuf,
        /// Trusted public key (`ed25519:...`) or a .pub file; repeatable.
        #[arg(long)]
        trust: Vec<String>,
        /// Take trusted/revoked keys from an operator config.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(a: PackArgs) -> Result<()> {
    match a.command {
        PackCommand::Keygen { name, dir } => {
            let key = KeyPair::generate()?;
            let files = key.save(&dir, &name)?;
            eprintln!("wrote {} and {}", files.secret.display(), files.public.display());
            println!("{}", key.public_key());
        }
        PackCommand::Sign { key, pack } => {
            let key = KeyPair::load(&key)?;
            sign_pack(&pack, &key)?;
            eprintln!("signed {} with {}", pack.display(), key.public_key());
        }
        PackCommand::Verify { pack, trust, config, allow_unsigned } => {
            let (mut policy, limits) = policy_from(config.as_ref(), &trust)?;
            policy.allow_unsigned |= allow_unsigned;
            let v = verify_pack_with(&pack, &policy, &limits)?;
            match v.signer() {
                Some(k) => println!("ok: {} signed by {k}", v.id()),
                None => println!("ok: {} (unsigned, allowed by policy)", v.id()),
            }
        }
        PackCommand::Inspect { pack, trust, config, json } => {
            let (policy, _) = policy_from(config.as_ref(), &trust)?;
            // Inspection shows an unverified manifest (that is its purpose),
            // read with the same size caps and symlink refusal as verification.
            let (m, bytes) = Manifest::read(&pack)?;
            let sig = PackSignature::read(&pack, &m.id())?;
            let signer = sig.as_ref().map(|s| (*s.key(), s.verifies(&bytes)));
            let trusted = signer.as_ref().map(|(k, _)| policy.allows(k, &m.name));
            let policy_given = config.is_some() || !trust.is_empty();
            if json {
                let v = serde_json::json!({
                    "manifest": m,
                    "signer": signer.as_ref().map(|s| s.0.to_string()),
                    "signature_valid": signer.as_ref().map(|s| s.1),
                    "signer_trusted": trusted,
                });
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                print!("{}", m.to_toml_string());
                let whose =
                    if policy_given { "the given policy" } else { "the current policy (no --trust or --config)" };
                match (signer, trusted) {
                    (Some((k, true)), Some(true)) => {
                        println!(
                            "# signed by {k}: signature valid over pack.toml, key trusted for {} by {whose}",
                            m.name
                        )
                    }
                    (Some((k, true)), _) => println!(
                        "# signed by {k}: signature valid over pack.toml, but the key is NOT trusted for {} by {whose}",
                        m.name
                    ),
                    (Some((k, false)), _) => println!("# signed by {k}: SIGNATURE DOES NOT MATCH pack.toml"),
                    (None, _) => println!("# unsigned"),
                }
            }
        }
    }
    Ok(())
}

/// The trust policy of `--config` (if any) plus the `--trust` keys (trusted
/// for any pack name), and the artefact size limits of that config.
fn policy_from(config: Option<&PathBuf>, trust: &[String]) -> Result<(TrustPolicy, spinfer_registry::VerifyLimits)> {
    let (mut policy, mut limits) = (TrustPolicy::new(), spinfer_registry::VerifyLimits::default());
    if let Some(c) = config {
        let c = Config::load(c)?;
        policy = c.trust_policy()?;
        limits.max_wasm_bytes = c.wasm.max_module_mb.saturating_mul(1 << 20);
    }
    for t in trust {
        policy.trusted.push(TrustedKey::any(parse_key(t)?));
    }
    Ok((policy, limits))
}

/// A key given inline (`ed25519:...`) or as a `.pub` file.
fn parse_key(s: &str) -> Result<PublicKey> {
    if s.starts_with("ed25519:") {
        return s.parse().with_context(|| format!("bad public key '{s}'"));
    }
    let p = PathBuf::from(s);
    if !p.exists() {
        bail!("--trust {s}: neither an 'ed25519:' key nor an existing .pub file");
    }
    Ok(PublicKey::load(&p)?)
}
