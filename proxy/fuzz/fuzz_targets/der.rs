//! The DER reader under the client-certificate fields and the expiry of
//! served certificates (`portcullis::der`): any bytes give elements that
//! lie inside the input, an iteration that ends, and no panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use portcullis::der;

/// Whether `part` lies within `whole`.
fn inside(part: &[u8], whole: &[u8]) -> bool {
    let (start, end) = (
        whole.as_ptr() as usize,
        whole.as_ptr() as usize + whole.len(),
    );
    let p = part.as_ptr() as usize;
    part.is_empty() || (p >= start && p + part.len() <= end)
}

fuzz_target!(|bytes: &[u8]| {
    if let Some((value, rest)) = der::any_element(bytes) {
        assert!(inside(value, bytes) && inside(rest, bytes));
        assert!(value.len() + rest.len() < bytes.len().max(1));
    }
    for tag in [0x02, 0x04, 0x06, 0x30, 0xa0, 0xa3] {
        if let Some((value, rest)) = der::element(bytes, tag) {
            assert!(inside(value, bytes) && inside(rest, bytes));
        }
    }
    // Each element takes at least its tag and length bytes: the
    // iteration ends within the input's length.
    let mut n = 0;
    for (_, value, _) in der::elements(bytes) {
        assert!(inside(value, bytes));
        n += 1;
        assert!(n <= bytes.len(), "more elements than bytes");
    }
    if let Some(fields) = der::tbs_fields(bytes) {
        assert!(inside(fields, bytes));
    }
    if let Some(oid) = der::oid_string(bytes) {
        assert!(
            oid.bytes().all(|b| b.is_ascii_digit() || b == b'.'),
            "{oid}"
        );
    }
});
