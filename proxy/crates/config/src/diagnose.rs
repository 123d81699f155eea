//! Every structural mistake in a policy file in one run (an unknown
//! field, a list written as a map, a missing field), each naming the field,
//! what was found and what is expected.
//!
//! serde stops at a file's first error, and its YAML deserializer cannot
//! resume inside a value it failed on. So when a file does not parse, this
//! reports that error, blanks the entry it points at (the line and the
//! lines nested under it, so every other line keeps its number), and
//! parses again, until the file parses or nothing more can be blanked. A
//! YAML syntax error ends the search: what follows it cannot be read.
//! Only a file that failed pays for this; its errors are reported and the
//! file is left out of the configuration, as before.

use std::sync::Arc;

use serde_saphyr::Error as YamlError;
use serde_saphyr::{DefaultMessageFormatter, MessageFormatter};

use crate::{ConfigError, Pos};

/// More errors than this in one file are not worth listing one by one.
const MAX_ERRORS: usize = 100;

/// The errors of `text` (named `file`), every structural one; `parse` is
/// the file's own parser.
pub(crate) fn structural_errors(
    file: &Arc<str>,
    text: &str,
    parse: impl Fn(&str) -> Result<(), YamlError>,
) -> Vec<ConfigError> {
    let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
    let mut errors: Vec<ConfigError> = Vec::new();
    // Keys blanked (line, key), and the lines whose value a blanking
    // emptied: an error that is only the consequence of a blanking (a
    // list now empty, a field now missing) is not reported.
    let mut blanked: Vec<(Option<usize>, String)> = Vec::new();
    let mut parents: Vec<usize> = Vec::new();
    for _ in 0..MAX_ERRORS {
        let failed = match parse(&lines.join("\n")) {
            Ok(()) => break,
            Err(e) => e,
        };
        // The error itself, not the source excerpt it may come wrapped in.
        let e = failed.without_snippet();
        let Some(loc) = e.location() else {
            errors.push(error(file, 0, 0, message(e, &lines, 0)));
            break;
        };
        let (mut line, mut column) = (loc.line(), loc.column());
        let index = (line as usize).saturating_sub(1);
        // serde finds a field missing where the entry ends: point at its
        // start, where a reader looks for it.
        if let (YamlError::SerdeMissingField { .. }, Some(start)) = (e, item_start(&lines, index)) {
            line = start as u64 + 1;
            column = (dash_of(&lines[start]) + 3) as u64;
        }
        let consequence = match e {
            YamlError::SerdeInvalidType { unexpected, .. }
                if unexpected.contains("unit") || unexpected.contains("null") =>
            {
                parents.contains(&index)
            }
            YamlError::Unexpected { .. } => parents.contains(&index),
            YamlError::SerdeMissingField { field, .. } => {
                let item = item_start(&lines, index);
                blanked
                    .iter()
                    .any(|(at, key)| key == field && item.is_some() && *at == item)
            }
            _ => false,
        };
        let repeated = errors
            .iter()
            .any(|x| x.pos.line == line && x.pos.column == column);
        if !consequence && !repeated {
            errors.push(error(file, line, column, message(e, &lines, index)));
        }
        if syntax(e) || index >= lines.len() {
            break;
        }
        let item = item_start(&lines, index);
        // A missing field is the whole entry's: blank the list item (or
        // the entry) it belongs to.
        let (at, from) = match (e, item) {
            (YamlError::SerdeMissingField { .. }, Some(start)) => (start, dash_of(&lines[start])),
            _ => (index, blank_from(&lines[index], column as usize, e)),
        };
        let Some(key) = blank(&mut lines, at, from) else {
            break;
        };
        if let Some(parent) = parent_of(&lines, at, from) {
            parents.push(parent);
        }
        // An unknown field that is a misspelling of a known one: that one
        // is now missing, and saying so would repeat the error.
        if let YamlError::SerdeUnknownField {
            field, expected, ..
        } = e
            && let Some(meant) = closest(field, expected)
        {
            blanked.push((item, meant.to_owned()));
        }
        blanked.push((item, key));
    }
    errors
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

/// The message for `e`, whose location is on line `index`.
fn message(e: &YamlError, lines: &[String], index: usize) -> String {
    let line = lines.get(index).map_or("", String::as_str);
    let key = key_of(line);
    let named = |what: String| match key {
        Some(k) => format!("`{k}`: {what}"),
        None => what,
    };
    match e {
        YamlError::SerdeUnknownField {
            field, expected, ..
        } => {
            let hint = closest(field, expected)
                .map(|c| format!(" (did you mean `{c}`?)"))
                .unwrap_or_default();
            let known: Vec<String> = expected.iter().map(|f| format!("`{f}`")).collect();
            format!(
                "unknown field `{field}`{hint}; the fields here are {}",
                known.join(", ")
            )
        }
        YamlError::SerdeInvalidType {
            unexpected,
            expected,
            ..
        } => named(format!(
            "expected {}, found {}",
            shape(expected),
            shape(unexpected)
        )),
        YamlError::Unexpected { expected, .. } => named(format!(
            "expected {}, found {}",
            shape(expected),
            found(lines, index)
        )),
        YamlError::SerdeMissingField { field, .. } => {
            format!("missing field `{field}`, which this entry needs")
        }
        e => DefaultMessageFormatter.format_message(e).into_owned(),
    }
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

/// What stands at line `index` after its key: a list, a map or a value.
fn found(lines: &[String], index: usize) -> String {
    let line = lines.get(index).map_or("", String::as_str);
    let value = line
        .split_once(": ")
        .map_or("", |(_, v)| v)
        .split(" #")
        .next()
        .unwrap_or("")
        .trim();
    if value.starts_with('[') {
        return "a list".into();
    }
    if value.starts_with('{') {
        return "a map".into();
    }
    if !value.is_empty() {
        let shown: String = value.chars().take(40).collect();
        return format!("the value `{shown}`");
    }
    let next = lines
        .get(index + 1..)
        .unwrap_or_default()
        .iter()
        .map(|l| l.trim_start())
        .find(|l| !l.is_empty() && !l.starts_with('#'));
    match next {
        Some(l) if l.starts_with("- ") || l == "-" => "a list".into(),
        Some(_) => "a map".into(),
        None => "nothing".into(),
    }
}

/// The key a line sets (`  - name: a` sets `name`).
fn key_of(line: &str) -> Option<&str> {
    let rest = line.trim_start().trim_start_matches("- ").trim_start();
    let (key, _) = rest.split_once(':')?;
    let plain = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    plain.then_some(key)
}

/// The column (0-based) from which line `line` is blanked for `e`: the
/// whole list item for a missing field or an item written in flow style,
/// else the entry (key) the error is on.
fn blank_from(line: &str, column: usize, e: &YamlError) -> usize {
    let indent = line.len() - line.trim_start().len();
    let mut entry = indent;
    let mut dash = None;
    while line[entry..].starts_with("- ") || &line[entry..] == "-" {
        dash.get_or_insert(entry);
        entry += 1;
        entry += line[entry..].len() - line[entry..].trim_start().len();
    }
    let flow = line[entry..].starts_with('{') || line[entry..].starts_with('[');
    let whole_item = matches!(e, YamlError::SerdeMissingField { .. })
        || flow
        || column.saturating_sub(1) < entry;
    match (whole_item, dash) {
        (true, Some(d)) => d,
        _ => entry,
    }
}

/// Blanks line `index` from column `from`, and the lines nested under it;
/// returns the key blanked (empty when none), or `None` when nothing
/// changed.
fn blank(lines: &mut [String], index: usize, from: usize) -> Option<String> {
    let line = &lines[index];
    if from >= line.len() || line[from..].trim().is_empty() {
        return None;
    }
    let key = key_of(&line[from..]).unwrap_or_default().to_owned();
    lines[index] = format!("{}{}", &line[..from], " ".repeat(line.len() - from));
    for l in lines.iter_mut().skip(index + 1) {
        let indent = l.len() - l.trim_start().len();
        let nested = l.trim().is_empty() || l.trim_start().starts_with('#') || indent > from;
        if !nested {
            break;
        }
        *l = " ".repeat(l.len());
    }
    Some(key)
}

/// The line of the list item that line `index` belongs to (the line
/// itself when it starts one), if it is in one.
fn item_start(lines: &[String], index: usize) -> Option<usize> {
    let line = lines.get(index)?;
    let indent = line.len() - line.trim_start().len();
    if line.trim_start().starts_with("- ") {
        return Some(index);
    }
    for i in (0..index).rev() {
        let l = &lines[i];
        let t = l.trim_start();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        let at = l.len() - t.len();
        if at < indent {
            return (t.starts_with("- ") || t == "-").then_some(i);
        }
    }
    None
}

/// Where the dash of a list item's line is.
fn dash_of(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

/// The line of the key whose value holds the entry at `from` on line
/// `index`: the nearest line above it that is indented less.
fn parent_of(lines: &[String], index: usize, from: usize) -> Option<usize> {
    (0..index).rev().find(|&i| {
        let l = &lines[i];
        !l.trim().is_empty()
            && !l.trim_start().starts_with('#')
            && l.len() - l.trim_start().len() < from
    })
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
