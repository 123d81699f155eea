//! The fields read from a certificate's DER by Portcullis' own reader: a
//! client certificate's subject and alternative names (mutual TLS; webpki
//! has accepted the certificate, but a CA signs what it is asked to) and
//! a served certificate's expiry. Any bytes must give an answer or none,
//! never a panic or a hang.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let _ = portcullis::cert_expiry::not_after(bytes);
    if let Some(id) = portcullis::cert_identity::read(bytes) {
        // Every name came out of the input (a byte that is not UTF-8
        // becomes U+FFFD, three bytes): none can be longer than that.
        let names = id.dns_names.iter().chain(&id.uris).chain(&id.emails);
        for name in names {
            assert!(name.len() <= bytes.len() * 3, "{name:?}");
        }
        assert!(id.ip_addresses.len() <= bytes.len() / 6);
    }
});
