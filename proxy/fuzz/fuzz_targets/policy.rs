//! A policy file: YAML a user writes (or a ConfigMap holds), with `${ENV}`
//! references, URL templates, durations, sizes, addresses and route
//! patterns. Whatever the text, loading gives a config or errors naming
//! where; it never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use portcullis::config::{Source, load_sources};

fuzz_target!(|bytes: &[u8]| {
    let Ok(text) = std::str::from_utf8(bytes) else {
        return;
    };
    let source = Source {
        name: "fuzz.yaml".into(),
        text: text.into(),
    };
    let env = |name: &str| match name {
        "SET" => Some("http://set:8080".to_owned()),
        "EMPTY" => Some(String::new()),
        _ => None,
    };
    if let Err(errors) = load_sources(&[source], &env) {
        assert!(!errors.0.is_empty(), "an error without errors");
        for e in &errors.0 {
            assert!(
                !e.message.is_empty(),
                "an error without a message at {:?}",
                e.pos
            );
        }
    }
});
