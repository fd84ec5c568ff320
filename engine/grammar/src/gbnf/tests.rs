//! GBNF read as llama.cpp reads it: each construct accepts and refuses the
//! strings llama.cpp's would, llama.cpp's own grammar files compile and
//! hold random logits to their language, and malformed grammars are
//! errors that say where.

use std::path::Path;

use super::*;
use crate::tests::{grammars, tokenizer, walk};
use crate::{Grammar, Spec};

fn compile(gbnf: &str) -> Grammar {
    grammars().compile(&Spec::Gbnf(gbnf.into())).unwrap_or_else(|e| panic!("{gbnf}\n{}: {e}", to_lark(gbnf).unwrap()))
}

/// Whether the grammar takes `text` whole (its tokens consumed, the
/// parser in an accepting state).
fn accepts(g: &Grammar, text: &str) -> bool {
    let ids = tokenizer().encode(text, false).unwrap();
    let mut guide = g.guide();
    ids.iter().all(|&id| guide.m.consume_token(id).is_ok()) && guide.m.is_accepting().unwrap_or(false)
}

fn check(gbnf: &str, pass: &[&str], fail: &[&str]) {
    let g = compile(gbnf);
    for s in pass {
        assert!(accepts(&g, s), "{gbnf}\nshould take {s:?}\nlark:\n{}", to_lark(gbnf).unwrap());
    }
    for s in fail {
        assert!(!accepts(&g, s), "{gbnf}\nshould refuse {s:?}\nlark:\n{}", to_lark(gbnf).unwrap());
    }
}

#[test]
fn literals_classes_and_escapes() {
    check(
        r#"root ::= "a\"b\\c\n" [x-z] [^0-9\]] "\x41\u00e9\U0001F600""#,
        &["a\"b\\c\nx!Aé😀", "a\"b\\c\nz-Aé😀"],
        &["a\"b\\c\nw!Aé😀", "a\"b\\c\nx5Aé😀", "a\"b\\c\nx]Aé😀"],
    );
    // `-` is a range between two characters, itself first or last.
    check(r#"root ::= [-a] [a-c-] [,-.]"#, &["-a-", "aa,", "ab-", "-c."], &["ba-", "-d-", "-a/"]);
    check(r#"root ::= . "!""#, &["x!", "\n!", "é!"], &["xy!", "!"]);
    check(r#"root ::= [\x00-\x7F]+"#, &["plain ascii"], &["café"]);
}

#[test]
fn repetition_in_every_form() {
    let g = r#"root ::= "a"{2} "b"{1,} "c"{0,2} "d"{,1} ("e" "f"){1,2} "g"* "h"+ "i"?"#;
    check(g, &["aabefh", "aabbbccdefefgggh", "aabcefhhi"], &["abefh", "aabccceefh", "aabefefefh", "aabdd efh"]);
    // Above 2000 a maximum is unbounded, as in llama.cpp.
    check(r#"root ::= "x"{1,5000}"#, &["x", &"x".repeat(2100)], &[""]);
    assert!(to_lark(r#"root ::= "x"{2001}"#).unwrap_err().contains("2000"));
    check(r#"root ::= "a" "b"{0} "c""#, &["ac"], &["abc"]);
}

#[test]
fn rules_groups_alternatives_and_newlines() {
    // Newlines end a rule except inside parentheses and after `|`;
    // comments run to the end of the line; an empty alternative is "".
    let g = "# a comment\nroot ::= greeting ( \" \" \n  name )? # trailing\ngreeting ::= \"hi\" |\n  \"hello\"\n\
             name ::= | Upper-Case\nUpper-Case ::= [A-Z] [a-z]*\n";
    check(g, &["hi", "hello Bob", "hi ", "hello"], &["hey", "hi bob", "hi Bob "]);
    // A rule defined twice is its last definition (llama.cpp's reading).
    check("root ::= x\nx ::= \"1\"\nx ::= \"2\"\n", &["2"], &["1"]);
    // Names Lark would not take, and `start`, are renamed consistently.
    check("root ::= start 9lives\nstart ::= \"s\"\n9lives ::= \"9\"\n", &["s9"], &["9s"]);
}

#[test]
fn tokens_by_id_and_special_name() {
    let t = tokenizer();
    let end = t.encode("<|im_end|>", false).unwrap();
    assert_eq!(end.len(), 1, "<|im_end|> is one token");
    let g = compile(&format!("root ::= \"ok\" <[{}]>", end[0]));
    let mut guide = g.guide();
    let ok = t.encode("ok", false).unwrap();
    assert!(ok.iter().all(|&id| guide.m.consume_token(id).is_ok()));
    assert!(guide.m.consume_token(end[0]).is_ok() && guide.m.is_accepting().unwrap());
    compile("root ::= \"a\" <|im_end|>");
    compile("root ::= \"a\" !<[5]>");
}

#[test]
fn malformed_grammars_say_where() {
    for (g, what) in [
        ("root ::= \"open", "unexpected end"),
        ("root ::= [a-", "unexpected end"),
        ("root ::= (\"a\"", "expecting ')'"),
        ("root = \"a\"", "expecting ::="),
        ("root ::= \"\\q\"", "unknown escape"),
        ("root ::= \"\\u12\"", "hex digits"),
        ("root ::= \"a\"{3,1}", "below its minimum"),
        ("root ::= * \"a\"", "something to repeat"),
        ("root ::= \"a\" ) \"b\"", "a newline or the end"),
        ("root ::= other", "`other` is used but not defined"),
        ("item ::= \"a\"", "no `root` rule"),
        ("root ::= !<think>", "by id"),
    ] {
        let e = to_lark(g).unwrap_err();
        assert!(e.contains(what), "{g}: {e}");
    }
    assert!(to_lark("root ::= \"a\"\n  \"b\"").unwrap_err().contains("line 2, column 3"));
    let deep = format!("root ::= {}\"a\"{}", "(".repeat(200), ")".repeat(200));
    assert!(to_lark(&deep).unwrap_err().contains("nested groups"));
    let stacked = format!("root ::= \"a\"{}", "*".repeat(100_000));
    assert!(to_lark(&stacked).unwrap_err().contains("repetitions of one part"));
}

#[test]
fn the_format_is_told_by_the_first_rule() {
    assert!(looks_like_gbnf("# c\n\nroot ::= \"a\""));
    assert!(looks_like_gbnf("my-rule::= x"));
    assert!(!looks_like_gbnf("// lark\nstart: \"a\" | b\nb: \"::=\""));
    assert!(!looks_like_gbnf("%import common.WS\nstart: x"));
    assert_eq!(Spec::grammar("root ::= \"a\"".into()), Spec::Gbnf("root ::= \"a\"".into()));
    assert_eq!(Spec::grammar("start: \"a\"".into()), Spec::Lark("start: \"a\"".into()));
}

fn llama_cpp_grammar(name: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/gbnf").join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// llama.cpp's example grammars, unchanged: each compiles, takes and
/// refuses what it should, and random logits stay in its language.
#[test]
fn llama_cpp_grammar_files_are_taken_as_they_are() {
    let cases: &[(&str, &[&str], &[&str])] = &[
        ("arithmetic.gbnf", &["1 +y = x\n", "(a*2)= 3\n"], &["x = 1 +\n", "X = 1\n"]),
        (
            "chess.gbnf",
            &["1. e4 e5\n2. Nf3 Nc6\n", "1. d4 d5\n2. O-O-O Qxd8+\n"],
            &["1. e4 e5\n", "1. e9 e5\n2. a3 a4\n"],
        ),
        (
            "json.gbnf",
            &[r#"{"a": [1, -2.5e3, "x\n\u00e9"], "b": {"c": null}}"#, "{}"],
            &[r#"{"a": 01}"#, "[1]", r#"{"a": "é"#],
        ),
        ("json_arr.gbnf", &["[\n{\"a\": 1},\n\"x\"]", "[\n]"], &["{}", "[\n1,]"]),
        ("list.gbnf", &["- milk\n- eggs\n"], &["- milk", "* milk\n"]),
        ("english.gbnf", &["Hello, world! 42"], &["Hello  world", "héllo"]),
        ("japanese.gbnf", &["こんにちは、世界"], &["hello"]),
        ("c.gbnf", &["int main(){return 0;}", "int f(int x){while(x>0){x = x-1;}}"], &["int main( {"]),
    ];
    for (name, pass, fail) in cases {
        let g = llama_cpp_grammar(name);
        check(&g, pass, fail);
        for seed in 1..=2 {
            // Any text random logits reach is a prefix the grammar allows
            // (walk checks each step has an allowed token); json's end in
            // text serde reads.
            let (text, done) = walk(&Spec::Gbnf(g.clone()), seed * 2 + 1, 80);
            if done && *name == "json.gbnf" {
                serde_json::from_str::<serde_json::Value>(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            }
        }
    }
}

/// Runs that lex alone become one terminal; runs that could go on stay a
/// terminal per part, and the language is the same either way.
#[test]
fn unambiguous_runs_are_one_terminal() {
    let lark = to_lark(r#"root ::= "\"" ( [^"\\] | "\\" ["n] )* "\"" [0-9]+ "x" [0-9]+"#).unwrap();
    let body = lark.lines().nth(1).unwrap();
    // The string, the digits and "x" lex alone; the last digits could go
    // on, so they stay a class per character.
    assert_eq!(body.matches('/').count(), 2 + 2, "{body}");
    assert!(body.starts_with(r"root: /\x{22}(?:(?:[^"), "{body}");
    check(r#"root ::= "\"" ( [^"\\] | "\\" ["n] )* "\"" [0-9]+ "x" [0-9]+"#, &[r#""a\"b\n"12x3"#], &[r#""a"b"1x2"#]);
    // A digit run followed by a digit: per part, so "11" splits 1|1.
    check(r#"root ::= [0-9]+ [0-9]"#, &["11", "123"], &["1"]);
    check(r#"root ::= ("a" | "ab") "c""#, &["ac", "abc"], &["abbc"]);
}
