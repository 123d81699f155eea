//! Comparing a field's bytes with a fixed lowercase word ignoring the
//! case of its letters, eight bytes at a time. `eq_ignore_ascii_case`
//! lowers both sides byte by byte: ~80 instructions for ten bytes, and
//! the response head reader compares `Connection: keep-alive` that way
//! twice a response. The answer is exactly `eq_ignore_ascii_case`'s: only
//! the word's letters have their case bit ignored, any other byte must
//! match as it is.

/// A lowercase word of 8 to 16 bytes, as two overlapping 8-byte halves
/// and the case bits of their letters.
pub(super) struct Caseless {
    len: usize,
    head: (u64, u64),
    tail: (u64, u64),
}

impl Caseless {
    /// `word`, lowercase, 8 to 16 bytes (checked when the constant is
    /// built).
    pub(super) const fn new(word: &[u8]) -> Caseless {
        assert!(word.len() >= 8 && word.len() <= 16, "8 to 16 bytes");
        Caseless {
            len: word.len(),
            head: half(word, 0),
            tail: half(word, word.len() - 8),
        }
    }

    /// Whether `s` is the word in any case.
    #[inline]
    pub(super) fn matches(&self, s: &[u8]) -> bool {
        if s.len() != self.len {
            return false;
        }
        let load = |at: usize| u64::from_le_bytes(s[at..at + 8].try_into().expect("8 bytes"));
        load(0) | self.head.1 == self.head.0 && load(self.len - 8) | self.tail.1 == self.tail.0
    }
}

/// The 8 bytes of `word` from `at`, and a mask of the case bit of each
/// letter among them.
const fn half(word: &[u8], at: usize) -> (u64, u64) {
    let (mut bytes, mut case) = (0u64, 0u64);
    let mut i = 0;
    while i < 8 {
        let b = word[at + i];
        assert!(!b.is_ascii_uppercase(), "a lowercase word");
        bytes |= (b as u64) << (8 * i);
        if b.is_ascii_lowercase() {
            case |= 0x20 << (8 * i);
        }
        i += 1;
    }
    (bytes, case)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same answer as `eq_ignore_ascii_case` for every spelling of
    /// the word's case, every one-byte change (the case bit of a hyphen
    /// included: `\r` for `-`), and other lengths.
    #[test]
    fn it_answers_as_eq_ignore_ascii_case() {
        for word in [
            &b"keep-alive"[..],
            b"connection",
            b"transfer-encoding"[..16].as_ref(),
        ] {
            let c = Caseless::new(word);
            let mut tried = 0;
            for mask in 0u32..(1 << word.len()) {
                let s: Vec<u8> = (word.iter().enumerate())
                    .map(|(i, &b)| {
                        if mask >> i & 1 == 1 {
                            b.to_ascii_uppercase()
                        } else {
                            b
                        }
                    })
                    .collect();
                assert!(c.matches(&s), "{}", String::from_utf8_lossy(&s));
                tried += 1;
            }
            assert_eq!(tried, 1 << word.len());
            for i in 0..word.len() {
                for b in 0..=255u8 {
                    let mut s = word.to_vec();
                    s[i] = b;
                    assert_eq!(c.matches(&s), s.eq_ignore_ascii_case(word), "{s:?}");
                }
            }
            assert!(!c.matches(&word[1..]));
            assert!(!c.matches(&[word, b"x"].concat()));
        }
    }
}
