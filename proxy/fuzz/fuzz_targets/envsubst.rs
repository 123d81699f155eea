//! `${NAME}`, `${NAME:-default}` and `${NAME:+word}` in a policy value:
//! any text a ConfigMap holds gives its expansion or an error, never a
//! panic, a hang or a stack overflow (defaults nest).
#![no_main]

use libfuzzer_sys::fuzz_target;
use portcullis::config::envsubst::expand;

fuzz_target!(|text: &str| {
    let env = |name: &str| match name {
        "SET" => Some("v".to_owned()),
        "EMPTY" => Some(String::new()),
        _ => None,
    };
    match expand(text, &env) {
        // Without a `$`, the text is its own expansion.
        Ok(out) if !text.contains('$') => assert_eq!(out, text),
        Ok(out) => {
            // Values ("v", "") and defaults come out of the text itself:
            // an expansion is never longer than the text plus one `v` per
            // reference.
            assert!(out.len() <= text.len() * 2, "{out:?}");
        }
        Err(message) => assert!(!message.is_empty()),
    }
});
