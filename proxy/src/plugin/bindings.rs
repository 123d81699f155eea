//! Rust bindings of the `portcullis:policy` world (wit/policy.wit).

wasmtime::component::bindgen!({
    path: "../wit",
    world: "policy",
    // Exports are called with `call_async`: WASI's host side (linked for
    // plugins whose toolchain imports it) is async, and an async call never
    // blocks the worker's runtime.
    exports: { default: async },
});

pub use self::portcullis::policy::host::Level;
// The world's `use` brings the other shared types to this module's root.
pub use self::portcullis::policy::types::{Forward, Header, LocalResponse};
