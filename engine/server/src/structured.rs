//! Structured outputs on the wire: OpenAI's `response_format`, llama-server's
//! `json_schema` and `grammar` (GBNF), vLLM's `guided_json` / `guided_regex` / `guided_choice` /
//! `guided_grammar` and `structured_outputs`. Each is read into a
//! [`Spec`] that the model's vocabulary compiles later (a 400 naming the
//! field when it does not).

use serde_json::{Map, Value, json};
use spinfer_engine::grammar::Spec;

use crate::error::ApiError;

/// The request fields read here.
pub const FIELDS: &[&str] = &[
    "response_format",
    "json_schema",
    "grammar",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
];

/// The constraint a request asks for, with the field that asked (errors
/// name it); at most one field may ask.
pub fn read(m: &Map<String, Value>) -> Result<Option<(&'static str, Spec)>, ApiError> {
    let mut found: Option<(&'static str, Spec)> = None;
    for &key in FIELDS {
        let Some(v) = m.get(key).filter(|v| !v.is_null()) else { continue };
        let Some(spec) = spec_of(key, v)? else { continue };
        if let Some((first, _)) = &found {
            return Err(ApiError::invalid(key, format!("give one output constraint: {first} and {key} are both set")));
        }
        found = Some((key, spec));
    }
    Ok(found)
}

fn spec_of(key: &str, v: &Value) -> Result<Option<Spec>, ApiError> {
    let bad = |what: &str| ApiError::invalid(key, format!("{key} must be {what}"));
    Ok(Some(match key {
        "response_format" => return response_format(v),
        "json_schema" | "guided_json" => Spec::JsonSchema(schema(key, v)?),
        // llama-server's clients send an empty grammar for none.
        "grammar" if v.as_str() == Some("") => return Ok(None),
        // GBNF or Lark, told apart by the first rule (llama-server sends
        // GBNF, vLLM either).
        "grammar" | "guided_grammar" => Spec::grammar(v.as_str().ok_or_else(|| bad("a string (a grammar)"))?.into()),
        "guided_regex" => Spec::Regex(v.as_str().ok_or_else(|| bad("a string"))?.to_string()),
        "guided_choice" => Spec::Choice(strings(v).ok_or_else(|| bad("an array of strings"))?),
        "structured_outputs" => return structured_outputs(v),
        _ => return Ok(None),
    }))
}

/// OpenAI's `{"type": "text" | "json_object" | "json_schema", ...}`;
/// llama-server's `json_object` may carry a `schema`.
fn response_format(v: &Value) -> Result<Option<Spec>, ApiError> {
    let bad = |m: &str| ApiError::invalid("response_format", m);
    let o = v.as_object().ok_or_else(|| bad("response_format must be an object with a type"))?;
    let only = |allowed: &[&str]| match o.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(ApiError::invalid(&format!("response_format.{k}"), format!("unrecognized field {k}"))),
        None => Ok(()),
    };
    match o.get("type").and_then(Value::as_str) {
        Some("text") => only(&["type"]).map(|_| None),
        Some("json_object") => {
            only(&["type", "schema"])?;
            Ok(Some(match o.get("schema") {
                Some(s) => Spec::JsonSchema(schema("response_format.schema", s)?),
                None => Spec::JsonObject,
            }))
        }
        Some("json_schema") => {
            only(&["type", "json_schema"])?;
            let js = o.get("json_schema").and_then(Value::as_object).ok_or_else(|| {
                ApiError::invalid("response_format.json_schema", "json_schema must be an object with a schema")
            })?;
            if let Some(k) = js.keys().find(|k| !["name", "description", "schema", "strict"].contains(&k.as_str())) {
                return Err(ApiError::invalid(&format!("response_format.json_schema.{k}"), "unrecognized field"));
            }
            // Without a schema any JSON value will do.
            let s = js.get("schema").cloned().unwrap_or_else(|| json!({}));
            Ok(Some(Spec::JsonSchema(schema("response_format.json_schema.schema", &s)?)))
        }
        _ => Err(bad("response_format.type must be text, json_object or json_schema")),
    }
}

/// vLLM's `structured_outputs`: one of `json`, `regex`, `choice`,
/// `grammar`.
fn structured_outputs(v: &Value) -> Result<Option<Spec>, ApiError> {
    let key = "structured_outputs";
    let o = v.as_object().ok_or_else(|| ApiError::invalid(key, "structured_outputs must be an object"))?;
    let mut spec = None;
    for (k, v) in o {
        let field = format!("{key}.{k}");
        let s = match k.as_str() {
            "json" => Spec::JsonSchema(schema(&field, v)?),
            "regex" => Spec::Regex(v.as_str().ok_or_else(|| ApiError::invalid(&field, "must be a string"))?.into()),
            "choice" => Spec::Choice(strings(v).ok_or_else(|| ApiError::invalid(&field, "must be strings"))?),
            "grammar" => Spec::grammar(v.as_str().ok_or_else(|| ApiError::invalid(&field, "must be a string"))?.into()),
            _ => return Err(ApiError::invalid(&field, format!("{field} is not supported"))),
        };
        if spec.replace(s).is_some() {
            return Err(ApiError::invalid(key, "give one of json, regex, choice, grammar"));
        }
    }
    Ok(spec)
}

/// A JSON schema given as an object, a boolean, or a string holding one.
fn schema(key: &str, v: &Value) -> Result<Value, ApiError> {
    match v {
        Value::Object(_) | Value::Bool(_) => Ok(v.clone()),
        Value::String(s) => match serde_json::from_str::<Value>(s) {
            Ok(v @ (Value::Object(_) | Value::Bool(_))) => Ok(v),
            _ => Err(ApiError::invalid(key, format!("{key} must be a JSON schema (an object)"))),
        },
        _ => Err(ApiError::invalid(key, format!("{key} must be a JSON schema (an object)"))),
    }
}

fn strings(v: &Value) -> Option<Vec<String>> {
    v.as_array()?.iter().map(|s| s.as_str().map(str::to_string)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(v: Value) -> Result<Option<(&'static str, Spec)>, ApiError> {
        read(v.as_object().unwrap())
    }

    fn param(r: Result<Option<(&'static str, Spec)>, ApiError>) -> String {
        r.unwrap_err().param.unwrap_or_default()
    }

    #[test]
    fn each_shape_reads_to_its_spec() {
        let s = json!({"type": "object"});
        let cases = [
            (json!({"response_format": {"type": "text"}}), None),
            (json!({"response_format": {"type": "json_object"}}), Some(("response_format", Spec::JsonObject))),
            (
                json!({"response_format": {"type": "json_object", "schema": s}}),
                Some(("response_format", Spec::JsonSchema(s.clone()))),
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": true, "schema": s}}}),
                Some(("response_format", Spec::JsonSchema(s.clone()))),
            ),
            (json!({"json_schema": s}), Some(("json_schema", Spec::JsonSchema(s.clone())))),
            (json!({"guided_json": "{\"type\": \"object\"}"}), Some(("guided_json", Spec::JsonSchema(s.clone())))),
            (json!({"guided_regex": "[a-z]+"}), Some(("guided_regex", Spec::Regex("[a-z]+".into())))),
            (json!({"guided_choice": ["a", "b"]}), Some(("guided_choice", Spec::Choice(vec!["a".into(), "b".into()])))),
            (json!({"guided_grammar": "start: \"x\""}), Some(("guided_grammar", Spec::Lark("start: \"x\"".into())))),
            (json!({"grammar": "root ::= \"x\""}), Some(("grammar", Spec::Gbnf("root ::= \"x\"".into())))),
            (
                json!({"guided_grammar": "root ::= \"x\""}),
                Some(("guided_grammar", Spec::Gbnf("root ::= \"x\"".into()))),
            ),
            (
                json!({"structured_outputs": {"choice": ["a"]}}),
                Some(("structured_outputs", Spec::Choice(vec!["a".into()]))),
            ),
            (json!({"guided_regex": null}), None),
            (json!({"grammar": ""}), None),
        ];
        for (body, want) in cases {
            assert_eq!(req(body.clone()).unwrap(), want, "{body}");
        }
    }

    #[test]
    fn bad_shapes_name_their_field() {
        let cases = [
            (json!({"response_format": {"type": "yaml"}}), "response_format"),
            (json!({"response_format": "json"}), "response_format"),
            (json!({"response_format": {"type": "json_schema"}}), "response_format.json_schema"),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}),
                "response_format.json_schema.schema",
            ),
            (json!({"response_format": {"type": "text", "x": 1}}), "response_format.x"),
            (json!({"guided_json": "not json"}), "guided_json"),
            (json!({"guided_choice": ["a", 1]}), "guided_choice"),
            (json!({"guided_regex": 5}), "guided_regex"),
            (json!({"grammar": 5}), "grammar"),
            (json!({"structured_outputs": {"json": {}, "regex": "a"}}), "structured_outputs"),
            (json!({"structured_outputs": {"xml": "a"}}), "structured_outputs.xml"),
            (json!({"guided_regex": "a", "guided_choice": ["a"]}), "guided_choice"),
            (json!({"response_format": {"type": "json_object"}, "json_schema": {}}), "json_schema"),
        ];
        for (body, field) in cases {
            assert_eq!(param(req(body.clone())), field, "{body}");
        }
    }
}
