//! A parsed GBNF grammar written as Lark.
//!
//! llguidance lexes greedily: a terminal that can end and also go on
//! always goes on. Written one character class at a time the language is
//! exactly GBNF's, but each token's mask then steps the parser through
//! every character (tens of milliseconds per token inside a JSON string
//! over a 49k vocabulary). So a run of rule-free parts of a sequence is
//! written as one regular expression when no word of that run is a proper
//! prefix of another (greedy lexing then never has a choice, and the
//! language is unchanged); otherwise each part is its own terminal.
//! [`Shape`] decides, from first characters and "can go on" characters
//! (an over-approximation: it may split what could merge, never merge
//! what must split).

use std::collections::HashMap;
use std::fmt::Write;

use super::Node;

/// Most parts of a sequence written as one regular expression.
const MAX_RUN: usize = 64;

/// GBNF names mapped to Lark rule names (`[a-z][a-z0-9_-]*`, and not
/// `start`).
#[derive(Default)]
pub(super) struct Names {
    pub(super) map: HashMap<String, String>,
}

impl Names {
    pub(super) fn get(&mut self, gbnf: &str) -> String {
        let n = self.map.len();
        self.map
            .entry(gbnf.to_string())
            .or_insert_with(|| {
                let plain = gbnf.starts_with(|c: char| c.is_ascii_lowercase())
                    && gbnf.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
                match plain && gbnf != "start" {
                    true => gbnf.to_string(),
                    // A name Lark would not take, made unique by its index.
                    false => format!("r{n}_{}", gbnf.to_ascii_lowercase()),
                }
            })
            .clone()
    }
}

/// Alternatives in Lark; an empty alternative makes the rest optional.
/// `top`: a rule's whole body (no parentheses needed).
pub(super) fn alts(out: &mut String, alts: &[Vec<Node>], names: &mut Names, top: bool) {
    let filled: Vec<&Vec<Node>> = alts.iter().filter(|s| !s.is_empty()).collect();
    if filled.is_empty() {
        // Only the empty text: a pattern that matches nothing but "".
        out.push_str("/(?:)/");
        return;
    }
    let optional = filled.len() < alts.len();
    let wrap = optional || !top;
    if wrap {
        out.push('(');
    }
    for (i, seq) in filled.iter().enumerate() {
        if i > 0 {
            out.push_str(" | ");
        }
        sequence(out, seq, names);
    }
    if wrap {
        out.push(')');
    }
    if optional {
        out.push('?');
    }
}

/// A sequence: runs of rule-free parts that lex unambiguously as one
/// regular expression, the other parts one by one.
fn sequence(out: &mut String, seq: &[Node], names: &mut Names) {
    let shapes: Vec<Option<Shape>> = seq.iter().map(Shape::of).collect();
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < seq.len() {
        // The longest run of rule-free parts from here that lexes alone (a
        // lone part only if it is a group or a repetition), among the next
        // MAX_RUN: a long sequence is scanned in linear time.
        let mut shape = Shape::empty();
        let mut take = 0;
        for (j, (n, s)) in seq[i..].iter().zip(&shapes[i..]).take(MAX_RUN).enumerate() {
            let Some(s) = s else { break };
            shape = shape.then(s);
            if shape.lexes_alone() && (j > 0 || matches!(n, Node::Group(_) | Node::Repeat { .. })) {
                take = j + 1;
            }
            if shape.goes_on == Chars::all() {
                break;
            }
        }
        if take > 0 {
            let mut rx = String::new();
            seq[i..i + take].iter().for_each(|n| regex(&mut rx, n));
            parts.push(format!("/{rx}/"));
            i += take;
        } else {
            let mut one = String::new();
            node(&mut one, &seq[i], names);
            parts.push(one);
            i += 1;
        }
    }
    out.push_str(&parts.join(" "));
}

fn node(out: &mut String, node: &Node, names: &mut Names) {
    match node {
        Node::Text(t) => {
            // Lark strings are JSON strings without raw control characters.
            let quoted = serde_json::to_string(t).unwrap_or_default();
            out.push_str(&quoted.replace('\u{7f}', "\\u007f"));
        }
        Node::Class { .. } | Node::Any => {
            out.push('/');
            regex(out, node);
            out.push('/');
        }
        Node::Rule(name) => out.push_str(&names.get(name)),
        Node::Token(token) => out.push_str(token),
        Node::Group(a) => alts(out, a, names, false),
        Node::Repeat { node: inner, min, max } => {
            if *max == Some(0) {
                out.push_str("/(?:)/");
                return;
            }
            out.push('(');
            sequence(out, std::slice::from_ref(inner), names);
            out.push(')');
            repeat_suffix(out, *min, *max);
        }
    }
}

fn repeat_suffix(out: &mut String, min: u32, max: Option<u32>) {
    match (min, max) {
        (0, None) => out.push('*'),
        (1, None) => out.push('+'),
        (0, Some(1)) => out.push('?'),
        (m, None) => {
            let _ = write!(out, "{{{m},}}");
        }
        (m, Some(n)) => {
            let _ = write!(out, "{{{m},{n}}}");
        }
    }
}

/// A rule-free node as a regular expression (inside Lark's `/.../`: every
/// character not a letter or digit written `\x{..}`, so `/` never shows).
fn regex(out: &mut String, n: &Node) {
    let ch = |out: &mut String, c: char| {
        if c.is_ascii_alphanumeric() {
            out.push(c);
        } else {
            let _ = write!(out, "\\x{{{:x}}}", c as u32);
        }
    };
    match n {
        Node::Text(t) => t.chars().for_each(|c| ch(out, c)),
        Node::Class { negated, ranges } => {
            out.push_str(if *negated { "[^" } else { "[" });
            for &(lo, hi) in ranges {
                ch(out, lo);
                if hi != lo {
                    out.push('-');
                    ch(out, hi);
                }
            }
            out.push(']');
        }
        Node::Any => out.push_str("(?s:.)"),
        Node::Group(alts) => {
            out.push_str("(?:");
            for (i, seq) in alts.iter().enumerate() {
                if i > 0 {
                    out.push('|');
                }
                seq.iter().for_each(|n| regex(out, n));
            }
            out.push(')');
        }
        Node::Repeat { node, min, max } => {
            out.push_str("(?:");
            regex(out, node);
            out.push(')');
            match max {
                Some(0) => out.push_str("{0}"),
                _ => repeat_suffix(out, *min, *max),
            }
        }
        Node::Rule(_) | Node::Token(_) => unreachable!("only rule-free nodes are written as regexes"),
    }
}

/// Sets of characters as sorted, disjoint, inclusive ranges.
#[derive(Clone, Debug, Default, PartialEq)]
struct Chars(Vec<(u32, u32)>);

impl Chars {
    fn all() -> Self {
        Chars(vec![(0, char::MAX as u32)])
    }

    fn of(ranges: impl IntoIterator<Item = (u32, u32)>) -> Self {
        let mut r: Vec<(u32, u32)> = ranges.into_iter().map(|(a, b)| (a.min(b), a.max(b))).collect();
        r.sort_unstable();
        let mut out: Vec<(u32, u32)> = Vec::with_capacity(r.len());
        for (lo, hi) in r {
            match out.last_mut() {
                Some(last) if lo <= last.1.saturating_add(1) => last.1 = last.1.max(hi),
                _ => out.push((lo, hi)),
            }
        }
        Chars(out)
    }

    fn complement(&self) -> Self {
        let mut out = Vec::new();
        let mut next = 0u32;
        for &(lo, hi) in &self.0 {
            if lo > next {
                out.push((next, lo - 1));
            }
            next = hi.saturating_add(1);
        }
        if next <= char::MAX as u32 {
            out.push((next, char::MAX as u32));
        }
        Chars(out)
    }

    fn union(&self, o: &Chars) -> Self {
        Chars::of(self.0.iter().chain(&o.0).copied())
    }

    fn meets(&self, o: &Chars) -> bool {
        self.0.iter().any(|&(a, b)| o.0.iter().any(|&(c, d)| a <= d && c <= b))
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// What greedy lexing needs to know of a rule-free node's language.
#[derive(Clone, Debug)]
struct Shape {
    nullable: bool,
    /// Characters its words start with.
    first: Chars,
    /// Characters that can follow a whole word and still be in the
    /// language (an over-approximation); empty: no word is a proper
    /// prefix of another.
    goes_on: Chars,
}

impl Shape {
    fn empty() -> Self {
        Shape { nullable: true, first: Chars::default(), goes_on: Chars::default() }
    }

    /// One regular expression for it lexes exactly its language.
    fn lexes_alone(&self) -> bool {
        !self.nullable && self.goes_on.is_empty()
    }

    /// `None` for a node with a rule or a token in it.
    fn of(n: &Node) -> Option<Shape> {
        let one = |first: Chars| Shape { nullable: false, first, goes_on: Chars::default() };
        Some(match n {
            Node::Text(t) => one(Chars::of(t.chars().next().map(|c| (c as u32, c as u32)))),
            Node::Class { negated, ranges } => {
                let set = Chars::of(ranges.iter().map(|&(a, b)| (a as u32, b as u32)));
                one(if *negated { set.complement() } else { set })
            }
            Node::Any => one(Chars::all()),
            Node::Rule(_) | Node::Token(_) => return None,
            Node::Group(alts) => {
                let mut shapes = alts.iter().map(|s| Shape::of_seq(s));
                let first = shapes.next()??;
                shapes.try_fold(first, |acc, s| Some(acc.or(&s?)))?
            }
            Node::Repeat { node, min, max } => {
                if *max == Some(0) {
                    return Some(Shape::empty());
                }
                let x = Shape::of(node)?;
                // X{m} is X X ... (stable after two), then X* if more may come.
                let mut s = Shape::empty();
                for _ in 0..(*min).min(2) {
                    s = s.then(&x);
                }
                if *max != Some(*min) { s.then(&x.star()) } else { s }
            }
        })
    }

    fn of_seq(seq: &[Node]) -> Option<Shape> {
        seq.iter().try_fold(Shape::empty(), |acc, n| Some(acc.then(&Shape::of(n)?)))
    }

    /// This, then `b`.
    fn then(&self, b: &Shape) -> Shape {
        let first = if self.nullable { self.first.union(&b.first) } else { self.first.clone() };
        // Where this can go on with what `b` starts with, the split is
        // ambiguous: anything may follow.
        let goes_on = if self.goes_on.meets(&b.first) {
            Chars::all()
        } else if b.nullable {
            b.goes_on.union(&self.goes_on)
        } else {
            b.goes_on.clone()
        };
        Shape { nullable: self.nullable && b.nullable, first, goes_on }
    }

    /// This or `b`.
    fn or(&self, b: &Shape) -> Shape {
        let goes_on = if self.first.meets(&b.first) {
            Chars::all()
        } else {
            let mut g = self.goes_on.union(&b.goes_on);
            if self.nullable {
                g = g.union(&b.first);
            }
            if b.nullable {
                g = g.union(&self.first);
            }
            g
        };
        Shape { nullable: self.nullable || b.nullable, first: self.first.union(&b.first), goes_on }
    }

    /// Any number of this.
    fn star(&self) -> Shape {
        let goes_on = if self.goes_on.meets(&self.first) { Chars::all() } else { self.goes_on.union(&self.first) };
        Shape { nullable: true, first: self.first.clone(), goes_on }
    }
}
