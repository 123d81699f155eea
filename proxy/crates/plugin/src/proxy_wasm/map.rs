//! The proxy-wasm ABI's serialized header map: a count, then each pair's
//! name and value lengths, then each name and value followed by a NUL
//! (all lengths little-endian u32), as proxy-wasm-cpp-host lays it out.

/// `pairs` serialized.
pub fn serialize<'a>(pairs: impl Iterator<Item = (&'a [u8], &'a [u8])> + Clone) -> Vec<u8> {
    let n = pairs.clone().count();
    let size: usize = 4 + pairs
        .clone()
        .map(|(k, v)| 8 + k.len() + v.len() + 2)
        .sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&(n as u32).to_le_bytes());
    for (k, v) in pairs.clone() {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k);
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
    out
}

/// The pairs of a serialized map; `None` when it is malformed (the ABI's
/// `SerializationFailure`).
pub fn deserialize(bytes: &[u8]) -> Option<Vec<(&[u8], &[u8])>> {
    let word = |at: usize| -> Option<usize> {
        let b = bytes.get(at..at + 4)?;
        Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    };
    let n = word(0)?;
    let mut sizes = Vec::with_capacity(n.min(1024));
    for i in 0..n {
        sizes.push((word(4 + i * 8)?, word(8 + i * 8)?));
    }
    let mut at = 4 + n * 8;
    let mut pairs = Vec::with_capacity(sizes.len());
    for (k, v) in sizes {
        let key = bytes.get(at..at + k)?;
        at += k + 1;
        let value = bytes.get(at..at + v)?;
        at += v + 1;
        pairs.push((key, value));
    }
    Some(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_map_survives_the_round_trip() {
        let pairs: Vec<(&[u8], &[u8])> = vec![(b":path", b"/a?b"), (b"x-empty", b""), (b"k", b"v")];
        let bytes = serialize(pairs.iter().copied());
        // 4 + 3 * 8 + (5+4+2) + (7+0+2) + (1+1+2)
        assert_eq!(bytes.len(), 4 + 24 + 11 + 9 + 4);
        assert_eq!(deserialize(&bytes).unwrap(), pairs);
    }

    #[test]
    fn a_short_map_is_refused() {
        let bytes = serialize([(&b"name"[..], &b"value"[..])].into_iter());
        assert!(deserialize(&bytes[..bytes.len() - 3]).is_none());
        assert!(deserialize(&[2, 0, 0, 0]).is_none());
    }
}
