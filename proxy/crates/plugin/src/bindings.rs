//! Rust bindings of the `portcullis:policy` world: 0.3 (wit/policy.wit),
//! the contract, and 0.2 (wit/v0.2/), which components built against it
//! still load under (`contract_v0_2.rs`).

wasmtime::component::bindgen!({
    path: "../../../wit",
    world: "policy",
});

pub use self::portcullis::policy::host::Level;
// The world's `use` brings the other shared types to this module's root.
pub use self::portcullis::policy::types::{
    Callout, CalloutResponse, Certificate, Forward, Header, HeaderEdits, LocalResponse,
    RequestHead, RouteInfo,
};

/// The 0.2 contract (0.2.0 and 0.2.1).
pub mod v0_2 {
    wasmtime::component::bindgen!({
        path: "../../../wit/v0.2",
        world: "policy",
    });
}
