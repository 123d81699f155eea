//! Rust bindings of the `portcullis:policy` world (wit/policy.wit).

wasmtime::component::bindgen!({
    path: "../../../wit",
    world: "policy",
});

pub use self::portcullis::policy::host::Level;
// The world's `use` brings the other shared types to this module's root.
pub use self::portcullis::policy::types::{
    Certificate, Forward, Header, LocalResponse, RequestHead, RouteInfo,
};
