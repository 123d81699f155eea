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
            && **spelled == *raw
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
