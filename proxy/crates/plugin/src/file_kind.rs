//! Why a plugin file does not compile, said on one line: `portcullis
//! check` prints `file:line:column: message`, and wasmparser's own words
//! for the two usual mistakes (a file that is not WebAssembly at all, a
//! core module where a component belongs) are a multi-line dump of the
//! header bytes.

/// The preamble every WebAssembly binary starts with.
const MAGIC: &[u8; 4] = b"\0asm";
/// The version and layer words after it: a core module's and a
/// component's (component-model binary format, layer 1).
const CORE_MODULE: [u8; 4] = [1, 0, 0, 0];
const COMPONENT_LAYER: [u8; 2] = [1, 0];

/// What is wrong with `bytes`, which wasmtime refused with `error`.
pub fn explain(bytes: &[u8], error: &wasmtime::Error) -> String {
    if bytes.len() < 8 || &bytes[..4] != MAGIC {
        let start: Vec<String> = bytes.iter().take(4).map(|b| format!("{b:02x}")).collect();
        return format!(
            "not a WebAssembly file (it starts with [{}], not \\0asm)",
            start.join(" ")
        );
    }
    if bytes[4..8] == CORE_MODULE {
        return "a core WebAssembly module, not a component: build the plugin for \
                wasm32-wasip2 (plugins/build.sh does), or wrap it with \
                `wasm-tools component new`"
            .to_string();
    }
    if bytes[6..8] != COMPONENT_LAYER {
        return format!(
            "not a component of a format this proxy reads (version {:02x} {:02x}, layer {:02x} {:02x})",
            bytes[4], bytes[5], bytes[6], bytes[7]
        );
    }
    // Anything else: wasmtime's own chain of causes, on one line.
    format!("invalid component: {error:#}")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// Whether `bytes` are a core WebAssembly module (not a component).
pub fn is_core_module(bytes: &[u8]) -> bool {
    bytes.len() >= 8 && &bytes[..4] == MAGIC && bytes[4..8] == CORE_MODULE
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(bytes: &[u8]) -> String {
        let engine = wasmtime::Engine::default();
        let error =
            wasmtime::component::Component::new(&engine, bytes).expect_err("not a valid component");
        explain(bytes, &error)
    }

    #[test]
    fn a_file_that_is_not_webassembly_is_named_as_such() {
        assert_eq!(
            refused(b"garbage\n"),
            "not a WebAssembly file (it starts with [67 61 72 62], not \\0asm)"
        );
        assert_eq!(
            refused(b"\0a"),
            "not a WebAssembly file (it starts with [00 61], not \\0asm)"
        );
    }

    #[test]
    fn a_core_module_is_told_apart_from_a_component() {
        let msg = refused(b"\0asm\x01\0\0\0");
        assert!(
            msg.starts_with("a core WebAssembly module, not a component"),
            "{msg}"
        );
    }

    #[test]
    fn a_broken_component_gets_wasmtimes_reason_on_one_line() {
        // A component header followed by a section that ends early.
        let msg = refused(b"\0asm\x0d\0\x01\0\x01\x09");
        assert!(msg.starts_with("invalid component: "), "{msg}");
        assert!(!msg.contains('\n'), "{msg}");
        let msg = refused(b"\0asm\x0d\0\x07\0");
        assert!(msg.starts_with("not a component of a format"), "{msg}");
    }
}
