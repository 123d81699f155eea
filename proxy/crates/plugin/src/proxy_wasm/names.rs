//! The header names a filter asked for, kept parsed for its next asks.

use http::HeaderName;

/// The header names a filter asked for last, parsed: a filter asks for
/// the same few on every request, and parsing one (`HeaderName::from_bytes`
/// and its match of the standard names) cost ~145 instructions a lookup,
/// more than the lookup (bench/instructions.sh, `/pw`).
#[derive(Default)]
pub(super) struct Names {
    kept: [Option<(Box<[u8]>, HeaderName)>; 4],
    /// Where the next name goes (the oldest is replaced).
    next: usize,
}

impl Names {
    /// `key` as a header name, if it is one.
    pub(super) fn parsed(&mut self, key: &[u8]) -> Option<HeaderName> {
        let known = self.kept.iter().flatten().find(|(k, _)| **k == *key);
        if let Some((_, name)) = known {
            return Some(name.clone());
        }
        let name = HeaderName::from_bytes(key).ok()?;
        self.kept[self.next] = Some((key.into(), name.clone()));
        self.next = (self.next + 1) % self.kept.len();
        Some(name)
    }
}
