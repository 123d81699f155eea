//! What the plugin host makes of a plugin's answer, whatever the plugin
//! (a user's, or a hostile one) returns: header edits applied to the
//! request, a path to send, and a local answer's status and body. Each
//! is taken or refused; the request's headers stay valid, with no field
//! that frames the message; nothing panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use portcullis::chain::{error_message, plugin_path};
use portcullis::plugin::{Header, HeaderEdits, apply_edits};

type Edits = (Vec<String>, Vec<(String, Vec<u8>)>, Vec<(String, Vec<u8>)>);

fuzz_target!(|input: (Edits, String, u16, Vec<u8>)| {
    let ((remove, set, add), path, status, body) = input;
    let header = |(name, value): (String, Vec<u8>)| Header { name, value };
    let edits = HeaderEdits {
        remove,
        set: set.into_iter().map(header).collect(),
        add: add.into_iter().map(header).collect(),
    };
    let mut headers = http::HeaderMap::new();
    headers.insert("x-kept", http::HeaderValue::from_static("1"));
    apply_edits(&mut headers, &edits, &"fuzz".into());
    // Whatever was set went through HeaderName and HeaderValue's checks.
    for (name, value) in &headers {
        assert!(!name.as_str().is_empty());
        assert!(!portcullis::framing::is_framing(name.as_str()), "{name}");
        assert!(
            !value
                .as_bytes()
                .iter()
                .any(|&b| b == b'\r' || b == b'\n' || b == 0)
        );
    }
    if let Some(pq) = plugin_path(&path) {
        assert!(pq.as_str().starts_with('/'), "{pq}");
    }
    if let Ok(status) = http::StatusCode::from_u16(status)
        && let Some(message) = error_message(status, &body)
    {
        assert!(status.is_client_error() || status.is_server_error());
        assert!(message.len() <= body.len().max(64));
    }
});
