//! The field names of the last HTTP/1.1 head read on a connection, as the
//! peer spelled them and as parsed. A peer sends the same fields in the
//! same order on every message (an upstream's answers, a client's
//! requests), so a name found at its place is taken from here instead of
//! parsed again (`HeaderName::from_bytes` lowers and matches every name,
//! and allocates a name it does not know: ~100-150 instructions a field).
//! Bounded: a connection keeps at most [`NAMES_KEPT`], a few hundred
//! bytes.

use http::header::{HeaderName, InvalidHeaderName};

/// The names kept for a connection's heads.
#[derive(Debug, Default)]
pub struct FieldNames(Vec<(Box<[u8]>, HeaderName)>);

/// The most field names a connection keeps.
const NAMES_KEPT: usize = 16;

impl FieldNames {
    /// The parsed name of the head's field `i`, spelled `raw`.
    pub fn name(&mut self, i: usize, raw: &[u8]) -> Result<HeaderName, InvalidHeaderName> {
        if let Some((spelled, name)) = self.0.get(i)
            && same(spelled, raw)
        {
            return Ok(name.clone());
        }
        let name = HeaderName::from_bytes(raw)?;
        let kept = self.0.len();
        if i < kept {
            self.0[i] = (raw.into(), name.clone());
        } else if i == kept && i < NAMES_KEPT {
            self.0.push((raw.into(), name.clone()));
        }
        Ok(name)
    }
}

/// `a == b` for field names, most of which are 4 to 16 bytes: compared
/// as two overlapping words each, no call (`memcmp` was ~18 instructions
/// a name, and a head's names are all compared).
#[inline]
fn same(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    match n {
        8..=16 => {
            let w = |s: &[u8], at: usize| u64::from_ne_bytes(s[at..at + 8].try_into().expect("8"));
            w(a, 0) == w(b, 0) && w(a, n - 8) == w(b, n - 8)
        }
        4..8 => {
            let w = |s: &[u8], at: usize| u32::from_ne_bytes(s[at..at + 4].try_into().expect("4"));
            w(a, 0) == w(b, 0) && w(a, n - 4) == w(b, n - 4)
        }
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Word by word, the same answer as `==`: for every length up to past
    /// two words, the same bytes, and each byte changed in turn.
    #[test]
    fn names_compare_as_slices_do() {
        for n in 0..=20usize {
            let a: Vec<u8> = (0..n).map(|i| b'a' + i as u8).collect();
            assert!(same(&a, &a.clone()), "{n}");
            for i in 0..n {
                let mut b = a.clone();
                b[i] ^= 0x20;
                assert!(!same(&a, &b), "{n}: byte {i}");
            }
            assert!(!same(&a, &[a.as_slice(), b"x"].concat()), "{n}");
        }
    }

    /// A name is taken from its place when spelled as before, parsed again
    /// when not.
    #[test]
    fn a_name_is_reused_only_as_spelled() {
        let mut names = FieldNames::default();
        assert_eq!(names.name(0, b"Content-Type").unwrap(), "content-type");
        assert_eq!(names.name(0, b"Content-Type").unwrap(), "content-type");
        assert_eq!(names.name(0, b"Content-Typf").unwrap(), "content-typf");
        assert_eq!(names.name(0, b"X-A").unwrap(), "x-a");
    }
}
