//! GBNF, llama.cpp's grammar format, read as llama.cpp reads it
//! (`src/llama-grammar.cpp`) and written as an equivalent Lark grammar for
//! llguidance:
//!
//! - rules `name ::= alternatives`, `root` the start; names of letters,
//!   digits and `-`;
//! - literals `"..."` and classes `[a-z]`, `[^\n]` with llama.cpp's escapes
//!   (`\n \r \t \\ \" \[ \] \-`, `\xHH`, `\uHHHH`, `\UHHHHHHHH`), `.` any
//!   character;
//! - groups, `*`, `+`, `?`, `{m}`, `{m,}`, `{m,n}`, `{,n}` (counts above
//!   2000 as llama.cpp treats them);
//! - tokens `<[id]>`, `!<[id]>`, and `<name>` for a special token;
//! - `#` comments; newlines end a rule except inside parentheses and after
//!   `|`.
//!
//! Literals become Lark strings, classes regular expressions of one
//! character, and runs that lex unambiguously one regular expression
//! ([`write`]), so the language is the same. llguidance lexes greedily,
//! which only a grammar whose literal is a proper prefix of another's at the
//! same place can notice (`("a" | "ab") "b"` refuses "ab"), as in
//! llguidance's own Lark.

mod write;

use std::fmt::Write;

use write::Names;

/// Counts above this are unbounded (llama.cpp's `MAX_REPETITION_THRESHOLD`).
const MAX_REPETITION: u32 = 2000;
/// Most nested parentheses (a bound on the parser's recursion).
const MAX_DEPTH: usize = 128;

/// Whether `source` reads as GBNF rather than Lark: its first definition
/// (past comments and blank lines) is `name ::=`.
pub fn looks_like_gbnf(source: &str) -> bool {
    let first = source.lines().map(str::trim).find(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with("//"));
    first.is_some_and(|l| {
        let name_end = l.find(|c: char| !is_word_char(c)).unwrap_or(l.len());
        name_end > 0 && l[name_end..].trim_start().starts_with("::=")
    })
}

/// `source` (GBNF) as a Lark grammar; errors say where and what.
pub fn to_lark(source: &str) -> Result<String, String> {
    let rules = Parser { src: source, pos: 0, depth: 0 }.grammar()?;
    if !rules.iter().any(|(n, _)| n == "root") {
        return Err("GBNF: no `root` rule (the start of a grammar)".into());
    }
    let mut names = Names::default();
    let mut lark = String::new();
    for (name, _) in &rules {
        names.get(name);
    }
    let _ = writeln!(lark, "start: {}", names.get("root"));
    for (name, alts) in &rules {
        let mut body = String::new();
        write::alts(&mut body, alts, &mut names, true);
        let _ = writeln!(lark, "{}: {body}", names.get(name));
    }
    if let Some(undefined) = names.map.keys().find(|n| !rules.iter().any(|(r, _)| r == *n)) {
        return Err(format!("GBNF: the rule `{undefined}` is used but not defined"));
    }
    Ok(lark)
}

/// A rule's body: alternatives, each a sequence.
type Alts = Vec<Vec<Node>>;

/// A grammar's parts.
#[derive(Debug)]
enum Node {
    /// Characters in sequence (never empty).
    Text(String),
    /// One character in (or, negated, out of) the ranges.
    Class {
        negated: bool,
        ranges: Vec<(char, char)>,
    },
    /// Any one character.
    Any,
    Rule(String),
    /// `<[id]>`, `!<[id]>` or `<name>`, as Lark writes it.
    Token(String),
    Group(Alts),
    Repeat {
        node: Box<Node>,
        min: u32,
        max: Option<u32>,
    },
}

/// How many repetitions wrap `n` directly.
fn repeat_depth(mut n: &Node) -> usize {
    let mut d = 0;
    while let Node::Repeat { node, .. } = n {
        d += 1;
        n = node;
    }
    d
}

struct Parser<'a> {
    src: &'a str,
    pos: usize,
    depth: usize,
}

fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-'
}

impl Parser<'_> {
    fn rest(&self) -> &str {
        &self.src[self.pos..]
    }

    fn peek(&self) -> Option<char> {
        self.rest().chars().next()
    }

    fn error(&self, what: &str) -> String {
        let before = &self.src[..self.pos];
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        let near: String = self.rest().chars().take(24).collect();
        format!("GBNF line {line}, column {column}: {what} at {near:?}")
    }

    /// Spaces, tabs and comments; newlines too where `newline_ok`.
    fn space(&mut self, newline_ok: bool) {
        while let Some(c) = self.peek() {
            match c {
                ' ' | '\t' => self.pos += 1,
                '\r' | '\n' if newline_ok => self.pos += 1,
                '#' => self.pos += self.rest().find(['\r', '\n']).unwrap_or(self.rest().len()),
                _ => break,
            }
        }
    }

    fn name(&mut self) -> Result<String, String> {
        let n = self.rest().find(|c: char| !is_word_char(c)).unwrap_or(self.rest().len());
        if n == 0 {
            return Err(self.error("expecting a rule name"));
        }
        let name = self.rest()[..n].to_string();
        self.pos += n;
        Ok(name)
    }

    fn grammar(mut self) -> Result<Vec<(String, Alts)>, String> {
        let mut rules: Vec<(String, Alts)> = Vec::new();
        self.space(true);
        while self.pos < self.src.len() {
            let name = self.name()?;
            self.space(false);
            if !self.rest().starts_with("::=") {
                return Err(self.error("expecting ::="));
            }
            self.pos += 3;
            self.space(true);
            let alts = self.alternates(false)?;
            match self.peek() {
                None | Some('\r' | '\n') => {}
                Some(_) => return Err(self.error("expecting a newline or the end")),
            }
            self.space(true);
            // As llama.cpp: a rule defined again is its last definition.
            match rules.iter_mut().find(|(n, _)| *n == name) {
                Some(r) => r.1 = alts,
                None => rules.push((name, alts)),
            }
        }
        Ok(rules)
    }

    fn alternates(&mut self, nested: bool) -> Result<Alts, String> {
        let mut alts = vec![self.sequence(nested)?];
        while self.peek() == Some('|') {
            self.pos += 1;
            self.space(true);
            alts.push(self.sequence(nested)?);
        }
        Ok(alts)
    }

    fn sequence(&mut self, nested: bool) -> Result<Vec<Node>, String> {
        let mut seq: Vec<Node> = Vec::new();
        while let Some(c) = self.peek() {
            let node = match c {
                '"' => {
                    self.pos += 1;
                    let mut text = String::new();
                    while self.peek() != Some('"') {
                        text.push(self.char()?);
                    }
                    self.pos += 1;
                    if text.is_empty() {
                        self.space(nested);
                        continue;
                    }
                    Node::Text(text)
                }
                '[' => self.class()?,
                '<' | '!' => self.token()?,
                '(' => {
                    self.depth += 1;
                    if self.depth > MAX_DEPTH {
                        return Err(self.error(&format!("more than {MAX_DEPTH} nested groups")));
                    }
                    self.pos += 1;
                    self.space(true);
                    let alts = self.alternates(true)?;
                    if self.peek() != Some(')') {
                        return Err(self.error("expecting ')'"));
                    }
                    self.pos += 1;
                    self.depth -= 1;
                    Node::Group(alts)
                }
                '.' => {
                    self.pos += 1;
                    Node::Any
                }
                '*' | '+' | '?' | '{' => {
                    let at = self.pos;
                    let (min, max) = self.repetition(nested)?;
                    let Some(last) = seq.pop() else {
                        return Err(self.error("expecting something to repeat before it"));
                    };
                    // Repetitions of repetitions nest: bounded as groups are.
                    if repeat_depth(&last) >= MAX_DEPTH {
                        self.pos = at;
                        return Err(self.error(&format!("more than {MAX_DEPTH} repetitions of one part")));
                    }
                    seq.push(Node::Repeat { node: Box::new(last), min, max });
                    continue;
                }
                c if is_word_char(c) => Node::Rule(self.name()?),
                _ => break,
            };
            seq.push(node);
            self.space(nested);
        }
        Ok(seq)
    }

    /// `*`, `+`, `?` or `{m}`, `{m,}`, `{m,n}`, `{,n}`: (min, max).
    fn repetition(&mut self, nested: bool) -> Result<(u32, Option<u32>), String> {
        let c = self.peek();
        self.pos += 1;
        self.space(nested);
        let counts = match c {
            Some('*') => (0, None),
            Some('+') => (1, None),
            Some('?') => (0, Some(1)),
            _ => {
                let min = self.int()?.unwrap_or(0);
                let max = match self.peek() {
                    Some('}') => Some(min),
                    Some(',') => {
                        self.pos += 1;
                        self.space(nested);
                        self.int()?
                    }
                    _ => return Err(self.error("expecting ',' or '}'")),
                };
                if self.peek() != Some('}') {
                    return Err(self.error("expecting '}'"));
                }
                self.pos += 1;
                self.space(nested);
                if min > MAX_REPETITION {
                    return Err(self.error(&format!("a repetition count above {MAX_REPETITION}")));
                }
                (min, max.filter(|&m| m <= MAX_REPETITION))
            }
        };
        if counts.1.is_some_and(|max| max < counts.0) {
            return Err(self.error("a repetition's maximum is below its minimum"));
        }
        Ok(counts)
    }

    fn int(&mut self) -> Result<Option<u32>, String> {
        let n = self.rest().find(|c: char| !c.is_ascii_digit()).unwrap_or(self.rest().len());
        if n == 0 {
            return Ok(None);
        }
        let v = self.rest()[..n].parse::<u64>().map_err(|_| self.error("expecting an integer"))?;
        self.pos += n;
        self.space(false);
        Ok(Some(v.min(u64::from(u32::MAX)) as u32))
    }

    /// One character of a literal or class, escapes read.
    fn char(&mut self) -> Result<char, String> {
        let Some(c) = self.peek() else { return Err(self.error("unexpected end of input")) };
        if c != '\\' {
            self.pos += c.len_utf8();
            return Ok(c);
        }
        let esc = self.rest()[1..].chars().next();
        let hex = |p: &mut Self, n: usize| -> Result<char, String> {
            let digits = p.rest().get(2..2 + n).filter(|d| d.chars().all(|c| c.is_ascii_hexdigit()));
            let code = digits.and_then(|d| u32::from_str_radix(d, 16).ok());
            let c = code.and_then(char::from_u32).ok_or_else(|| p.error(&format!("expecting {n} hex digits")))?;
            p.pos += 2 + n;
            Ok(c)
        };
        let simple = match esc {
            Some('x') => return hex(self, 2),
            Some('u') => return hex(self, 4),
            Some('U') => return hex(self, 8),
            Some('t') => '\t',
            Some('r') => '\r',
            Some('n') => '\n',
            Some(c @ ('\\' | '"' | '[' | ']' | '-')) => c,
            _ => return Err(self.error("unknown escape")),
        };
        self.pos += 2;
        Ok(simple)
    }

    fn class(&mut self) -> Result<Node, String> {
        self.pos += 1;
        let negated = self.rest().starts_with('^');
        if negated {
            self.pos += 1;
        }
        let mut ranges = Vec::new();
        while self.peek() != Some(']') {
            let lo = self.char()?;
            let rest = self.rest();
            let hi = if rest.starts_with('-') && !rest[1..].starts_with(']') {
                self.pos += 1;
                self.char()?
            } else {
                lo
            };
            ranges.push((lo, hi));
        }
        self.pos += 1;
        Ok(Node::Class { negated, ranges })
    }

    /// `<[id]>`, `<name>`, each negated by a leading `!`.
    fn token(&mut self) -> Result<Node, String> {
        let negated = self.peek() == Some('!');
        if negated {
            self.pos += 1;
        }
        if !self.rest().starts_with('<') {
            return Err(self.error("expecting '<' (a token)"));
        }
        let Some(end) = self.rest().find('>') else { return Err(self.error("expecting '>'")) };
        let inner = &self.rest()[1..end];
        let token = match inner.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
            Some(id) if !id.is_empty() && id.chars().all(|c| c.is_ascii_digit()) && id.parse::<u32>().is_ok() => {
                format!("<[{}{id}]>", if negated { "^" } else { "" })
            }
            Some(_) => return Err(self.error("expecting a token id in <[...]>")),
            None if negated => return Err(self.error("a negated token is written by id here: !<[id]>")),
            None if inner.is_empty() || inner.contains(char::is_whitespace) || inner.contains('<') => {
                return Err(self.error("expecting a token's text in <...>"));
            }
            None => format!("<{inner}>"),
        };
        self.pos += end + 1;
        Ok(Node::Token(token))
    }
}

#[cfg(test)]
mod tests;
