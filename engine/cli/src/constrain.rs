//! `generate`'s output constraints: llama.cpp's `--json-schema`,
//! `--json-schema-file`, `--grammar` and `--grammar-file` (GBNF, as
//! llama.cpp reads it, or llguidance's Lark dialect, told apart by the
//! first rule), and `--regex`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use spinfer_engine::grammar::Spec;

/// Grammars and schemas are read whole; larger ones are refused.
const MAX_SPEC_BYTES: u64 = 4 << 20;

#[derive(Args, Default)]
pub struct ConstraintArgs {
    /// Constrain the output to a JSON value valid under this JSON schema
    /// (inline JSON; `{}` for any JSON value).
    #[arg(short = 'j', long, value_name = "SCHEMA")]
    pub json_schema: Option<String>,
    /// As --json-schema, from a file.
    #[arg(long, value_name = "FILE")]
    pub json_schema_file: Option<PathBuf>,
    /// Constrain the output to a grammar: GBNF (llama.cpp's, `root ::=
    /// ...`) or llguidance's Lark (`start: ...`).
    #[arg(long, value_name = "GRAMMAR")]
    pub grammar: Option<String>,
    /// As --grammar, from a file.
    #[arg(long, value_name = "FILE")]
    pub grammar_file: Option<PathBuf>,
    /// Constrain the output to match this regular expression in full.
    #[arg(long, value_name = "REGEX")]
    pub regex: Option<String>,
}

impl ConstraintArgs {
    /// The spec the flags give (at most one of them), checked for syntax
    /// that needs no model: JSON parses, files are read.
    pub fn spec(&self) -> Result<Option<Spec>> {
        let given = [
            ("--json-schema", self.json_schema.is_some()),
            ("--json-schema-file", self.json_schema_file.is_some()),
            ("--grammar", self.grammar.is_some()),
            ("--grammar-file", self.grammar_file.is_some()),
            ("--regex", self.regex.is_some()),
        ];
        let set: Vec<&str> = given.iter().filter(|(_, on)| *on).map(|(f, _)| *f).collect();
        if set.len() > 1 {
            bail!("give one output constraint, not {}", set.join(" and "));
        }
        let schema = |text: &str, what: &str| -> Result<Spec> {
            let v = serde_json::from_str(text).with_context(|| format!("{what} is not valid JSON"))?;
            Ok(Spec::JsonSchema(v))
        };
        Ok(Some(match self {
            Self { json_schema: Some(s), .. } => schema(s, "--json-schema")?,
            Self { json_schema_file: Some(f), .. } => {
                schema(&read(f, "--json-schema-file")?, &format!("--json-schema-file {}", f.display()))?
            }
            Self { grammar: Some(g), .. } => Spec::grammar(g.clone()),
            Self { grammar_file: Some(f), .. } => Spec::grammar(read(f, "--grammar-file")?),
            Self { regex: Some(r), .. } => Spec::Regex(r.clone()),
            _ => return Ok(None),
        }))
    }
}

/// The file, read once and at most [`MAX_SPEC_BYTES`] of it.
fn read(path: &Path, flag: &str) -> Result<String> {
    spinfer_formats::bounded::read_text(path, MAX_SPEC_BYTES, "a grammar or schema").with_context(|| flag.to_string())
}
