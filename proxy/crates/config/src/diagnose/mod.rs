//! Every structural mistake in a policy file in one run (an unknown
//! field, a list written as a map, a missing field), each naming the field
//! at fault, what was found and what is expected.
//!
//! serde stops at a file's first error, and its YAML deserializer cannot
//! resume inside a value it failed on. So when a file does not parse, this
//! reports that error, finds the entry it is about in the file's outline
//! (`outline.rs`: where each node starts and ends, under which key, in
//! block and flow style alike), blanks that entry (every other line and
//! column keeps its place), and parses again, until the file parses or
//! nothing more can be blanked. A YAML syntax error ends the search: what
//! follows it cannot be read. Only a file that failed pays for this; the
//! text left once it parses is checked for mistakes in its values too,
//! and the file is left out of the configuration, as before.

use std::sync::Arc;

use serde_saphyr::Error as YamlError;
use serde_saphyr::{DefaultMessageFormatter, MessageFormatter};

use crate::{ConfigError, Pos};

mod outline;

use outline::{Kind, Outline};

/// More errors than this in one file are not worth listing one by one.
const MAX_ERRORS: usize = 100;

/// What a failed file's diagnosis found.
pub(crate) struct Diagnosis {
    /// Every structural error.
    pub errors: Vec<ConfigError>,
    /// The text with every entry at fault blanked, when that parses: the
    /// rest of the file, to check for mistakes in its values too.
    pub rest: Option<String>,
    /// The names (`name:`) of entries blanked (an upstream lacking a
    /// field, say): a reference to one is not unknown, only in error.
    pub lost: Vec<String>,
    /// The fields blanked: an error in the rest about one of them (an
    /// upstream now without `endpoints`) is a consequence, not reported.
    pub blanked: Vec<Blanked>,
}

/// A field blanked from a map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Blanked {
    /// Where the map starts and ends (line, 1-based column).
    pub from: (u64, u64),
    pub to: (u64, u64),
    pub key: String,
}

impl Blanked {
    /// Whether `e` is about this field of this map.
    pub fn explains(&self, e: &ConfigError) -> bool {
        let at = (e.pos.line, e.pos.column);
        self.from <= at && at <= self.to && e.message.contains(&format!("`{}`", self.key))
    }
}

/// The diagnosis of `text` (named `file`), which failed to parse; `parse`
/// is the file's own parser.
pub(crate) fn structural_errors(
    file: &Arc<str>,
    text: &str,
    parse: impl Fn(&str) -> Result<(), YamlError>,
) -> Diagnosis {
    let mut text = text.to_owned();
    let mut errors: Vec<ConfigError> = Vec::new();
    let mut lost: Vec<String> = Vec::new();
    // The fields blanked: a field then missing is only the consequence
    // of the blanking, not reported.
    let mut blanked: Vec<Blanked> = Vec::new();
    // The lines of keys whose value a blanking may have emptied: "found
    // nothing" there is a consequence too.
    let mut emptied: Vec<usize> = Vec::new();
    for _ in 0..MAX_ERRORS {
        let failed = match parse(&text) {
            Ok(()) => {
                return Diagnosis {
                    errors,
                    rest: Some(text),
                    lost,
                    blanked,
                };
            }
            Err(e) => e,
        };
        // The error itself, not the source excerpt it may come wrapped in.
        let e = failed.without_snippet();
        let outline = Outline::of(&text);
        let (Some(loc), false, Some(outline)) = (e.location(), syntax(e), outline) else {
            let (line, column) = e.location().map_or((0, 0), |l| (l.line(), l.column()));
            let message = DefaultMessageFormatter.format_message(e).into_owned();
            errors.push(error(file, line, column, message));
            break;
        };
        let (line, col) = (
            loc.line() as usize,
            (loc.column() as usize).saturating_sub(1),
        );
        let Some(fault) = at_fault(e, &outline, (line, col)) else {
            let message = DefaultMessageFormatter.format_message(e).into_owned();
            errors.push(error(file, line as u64, col as u64 + 1, message));
            break;
        };
        let consequence = match e {
            YamlError::SerdeMissingField { field, .. } => {
                let map = outline.node(fault.node).start;
                let map = (map.line as u64, map.col as u64 + 1);
                blanked.iter().any(|b| b.from == map && b.key == *field)
            }
            _ => fault.nothing && emptied.contains(&fault.at.0),
        };
        let (l, c) = fault.at;
        let repeated = errors
            .iter()
            .any(|x| x.pos.line == l as u64 && x.pos.column == c as u64 + 1);
        if !consequence && !repeated {
            errors.push(error(file, l as u64, c as u64 + 1, fault.message));
        }
        let node = outline.node(fault.node);
        let range = outline.entry_bytes(fault.node, &text);
        if !blank(&mut text, range) {
            break;
        }
        lost.extend(outline.names_within(fault.node).map(str::to_owned));
        if let Some(parent) = node.parent.map(|p| outline.node(p)) {
            let place = |a: outline::At| (a.line as u64, a.col as u64 + 1);
            let (from, to) = (place(parent.start), place(parent.end));
            let mut note = |key: &str| {
                let key = key.to_owned();
                blanked.push(Blanked { from, to, key });
            };
            if let Some((key, _)) = &node.key {
                note(key);
            }
            // An unknown field that is a misspelling of a known one: that
            // one is now missing, and saying so would repeat the error.
            if let YamlError::SerdeUnknownField {
                field, expected, ..
            } = e
                && let Some(meant) = closest(field, expected)
            {
                note(meant);
            }
            emptied.push(
                parent
                    .key
                    .as_ref()
                    .map_or(parent.start.line, |(_, k)| k.line),
            );
            emptied.push(parent.start.line);
        }
    }
    Diagnosis {
        errors,
        rest: None,
        lost,
        blanked,
    }
}

/// The node an error is about, where to report it and what to say.
struct Fault {
    node: usize,
    /// Line and column (0-based) to report.
    at: (usize, usize),
    message: String,
    /// Whether what was found is nothing (a null).
    nothing: bool,
}

/// The node of `outline` that error `e`, at `place`, is about.
fn at_fault(e: &YamlError, outline: &Outline, place: (usize, usize)) -> Option<Fault> {
    let (line, col) = place;
    match e {
        YamlError::SerdeUnknownField {
            field, expected, ..
        } => {
            let node = outline.entry_at(line, col)?;
            let hint = closest(field, expected)
                .map(|c| format!(" (did you mean `{c}`?)"))
                .unwrap_or_default();
            let known: Vec<String> = expected.iter().map(|f| format!("`{f}`")).collect();
            let message = format!(
                "unknown field `{field}`{hint}; the fields here are {}",
                known.join(", ")
            );
            let nothing = false;
            Some(Fault {
                node,
                at: place,
                message,
                nothing,
            })
        }
        YamlError::SerdeMissingField { field, .. } => {
            let node = outline.lacking(field, line, col)?;
            let map = outline.node(node);
            let (at, message) = match &map.key {
                Some((key, k)) => (
                    (k.line, k.col),
                    format!("`{key}`: missing field `{field}`, which this map needs"),
                ),
                None => (
                    (map.start.line, map.start.col),
                    format!("missing field `{field}`, which this entry needs"),
                ),
            };
            let nothing = false;
            Some(Fault {
                node,
                at,
                message,
                nothing,
            })
        }
        _ => {
            let node = outline
                .value_at(line, col)
                .or_else(|| outline.entry_at(line, col))?;
            let n = outline.node(node);
            let (found, nothing) = found(n);
            let expected = match e {
                YamlError::SerdeInvalidType { expected, .. } => Some(shape(expected)),
                YamlError::Unexpected { expected, .. } => Some(shape(expected)),
                _ => None,
            };
            let what = match expected {
                Some(expected) => format!("expected {expected}, found {found}"),
                None => DefaultMessageFormatter.format_message(e).into_owned(),
            };
            // A block map or list starts on the line under its key: the
            // key is where a reader looks.
            let at = match &n.key {
                Some((_, k)) if !n.flow && n.kind != Kind::Value => (k.line, k.col),
                _ => place,
            };
            let message = match &n.key {
                Some((key, _)) => format!("`{key}`: {what}"),
                None => what,
            };
            Some(Fault {
                node,
                at,
                message,
                nothing,
            })
        }
    }
}

fn error(file: &Arc<str>, line: u64, column: u64, message: String) -> ConfigError {
    ConfigError {
        pos: Pos {
            file: file.clone(),
            line,
            column,
        },
        message,
    }
}

/// Errors after which the rest of the file cannot be read.
fn syntax(e: &YamlError) -> bool {
    !matches!(
        e,
        YamlError::Message { .. }
            | YamlError::Unexpected { .. }
            | YamlError::SerdeInvalidType { .. }
            | YamlError::SerdeInvalidValue { .. }
            | YamlError::SerdeInvalidLength { .. }
            | YamlError::SerdeUnknownVariant { .. }
            | YamlError::SerdeUnknownField { .. }
            | YamlError::SerdeMissingField { .. }
            | YamlError::NullIntoString { .. }
    )
}

/// A shape in serde's or the YAML parser's words, in a policy writer's.
fn shape(s: &str) -> String {
    let s = s.trim();
    if s.contains("sequence") {
        "a list (`- item` lines, or `[a, b]`)".into()
    } else if s.contains("map") || s.starts_with("struct") {
        "a map (`key: value` lines, or `{ key: value }`)".into()
    } else if s.contains("scalar") || s.starts_with("a string") {
        "a value (text, a number or true/false)".into()
    } else if s.contains("unit") || s.contains("null") {
        "nothing".into()
    } else {
        s.to_owned()
    }
}

/// What node `n` is, in a policy writer's words; and whether it is
/// nothing (a null).
fn found(n: &outline::Node) -> (String, bool) {
    match n.kind {
        Kind::Map => ("a map".into(), false),
        Kind::List => ("a list".into(), false),
        Kind::Value => {
            let v = n.value.as_deref().unwrap_or("");
            if v.is_empty() || v == "~" || v == "null" {
                ("nothing".into(), true)
            } else {
                let shown: String = v.chars().take(40).collect();
                (format!("the value `{shown}`"), false)
            }
        }
    }
}

/// Blanks `range` of `text` (each character a space; line breaks kept,
/// so every other line and column stays where it was); whether anything
/// changed.
fn blank(text: &mut String, range: std::ops::Range<usize>) -> bool {
    let Some(part) = text.get(range.clone()) else {
        return false;
    };
    if part.trim().is_empty() {
        return false;
    }
    let spaces: String = part
        .chars()
        .map(|c| if c == '\n' || c == '\r' { c } else { ' ' })
        .collect();
    text.replace_range(range, &spaces);
    true
}

/// The known name nearest to `name`, when it is one or two edits away.
fn closest<'a>(name: &str, known: &[&'a str]) -> Option<&'a str> {
    known
        .iter()
        .map(|k| (edits(name, k), *k))
        .filter(|(d, _)| *d <= 2)
        .min()
        .map(|(_, k)| k)
}

/// Levenshtein distance, for a hint on a misspelt field.
fn edits(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errors(text: &str) -> Vec<String> {
        let file: Arc<str> = "p.yaml".into();
        structural_errors(&file, text, |t| {
            serde_saphyr::from_str::<crate::raw::PolicyFile>(t).map(|_| ())
        })
        .errors
        .into_iter()
        .map(|e| format!("{}:{}: {}", e.pos.line, e.pos.column, e.message))
        .collect()
    }

    #[test]
    fn a_syntax_error_ends_the_search_and_odd_input_does_not_panic() {
        let found = errors("routes: [ { name: a\nlisteners: - x\n");
        assert_eq!(found.len(), 1, "{found:?}");
        for odd in [
            "",
            "-",
            "- - -",
            ":",
            "routes:\n  -",
            "\u{3000}routes: x",
            "a: b\n\t- c",
        ] {
            let _ = errors(odd);
        }
    }

    #[test]
    fn a_misspelt_field_is_named_with_the_one_meant_and_not_reported_missing() {
        let found = errors("listeners:\n  - name: a\n    bnd: x\n");
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].starts_with("3:5: unknown field `bnd` (did you mean `bind`?)"),
            "{found:?}"
        );
    }
}
